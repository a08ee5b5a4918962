"""Paddle tensors -> compiled CuTe launchers.

The launchers in ``cute_kernels`` are compiled with ``--enable-tvm-ffi`` and take Paddle tensors
directly (DLPack C exchange API, Paddle's current stream). This module holds the little that is
Paddle-specific: detaching, contiguity/alignment checks done *before* a launch, and the arch.
"""

from __future__ import annotations

from ._validate import is_empty
from .backend import tensor_arch


def kernel_arg(t):
    """A view the kernel may read/write: detached (no autograd edge), same storage."""
    return None if t is None else t.detach()


def as_contiguous(t):
    """``t`` if contiguous, else a contiguous copy.

    Never ``t.contiguous()``: in Paddle 3.3 that re-lays-out the caller's tensor *in place*.
    """
    return t if t is None or t.is_contiguous() else t.clone()


def require_contiguous(op: str, name: str, t) -> None:
    if t is not None and not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous for the CuTe backend (pass a contiguous tensor, e.g. x.clone())")


def require_aligned(op: str, name: str, t, nbytes: int = 16) -> None:
    if t is not None and not is_empty(t) and t.data_ptr() % nbytes != 0:
        raise ValueError(f"{op}: {name} must be {nbytes}-byte aligned for the CuTe backend")


def arch_of(t) -> int:
    from cute_kernels.arch import family

    arch = tensor_arch(t)
    if arch is None:
        raise RuntimeError("CuTe launch requested for a tensor that is not on a CUDA place")
    return family(arch)
