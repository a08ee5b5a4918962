"""Fake tensors and the env stream used to compile kernels once per config, GPU or not.

Compiling against fake tensors with ``--enable-tvm-ffi`` yields a callable that takes any DLPack
tensor (Paddle or torch) and launches on the caller's current stream (TVM-FFI env stream). TVM-FFI
validates dtype, static extents, strides and alignment of every argument before the launch.
"""

from __future__ import annotations

from typing import Sequence

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

#: Options every launcher compiles with.
COMPILE_OPTIONS = "--enable-tvm-ffi"


def sym(divisibility: int = 1):
    """A dynamic extent (one compile serves every value), optionally known divisible."""
    return cute.sym_int(divisibility=divisibility) if divisibility > 1 else cute.sym_int()


def fake_tensor(dtype, shape: Sequence, *, align_bytes: int = 16, stride_order=None, stride32: bool = False):
    """A compact fake global-memory tensor, ROW-MAJOR (last mode stride 1) unless ``stride_order``
    says otherwise, matching how Paddle and torch lay out contiguous tensors.

    Note: cutlass' own default is column-major (first mode fastest); a fake tensor compiled that way
    makes TVM-FFI reject every contiguous framework tensor ("strides[0] expected to be 1").
    ``stride_order[i]`` is mode i's rank from fastest (0) to slowest (ndim - 1).
    ``shape`` entries are ints (static) or ``sym()`` extents. ``align_bytes`` is the base-pointer
    alignment the kernel may assume; TVM-FFI checks it on every call. ``stride32``: the dynamic strides
    are 32-bit (index math in 32 bits: for a tensor known to hold fewer than 2^31 elements).
    """
    ndim = len(shape)
    order = tuple(stride_order) if stride_order is not None else tuple(range(ndim - 1, -1, -1))
    return make_fake_compact_tensor(dtype, tuple(shape), stride_order=order, assumed_align=align_bytes,
                                    use_32bit_stride=stride32)


def fake_stream():
    """The TVM-FFI env stream: the kernel runs on whatever stream the caller's framework has current."""
    return make_fake_stream(use_tvm_ffi_env_stream=True)


def compile_options(extra: str = "") -> str:
    """``COMPILE_OPTIONS`` plus ``extra`` plus ``$CUTE_KERNELS_EXTRA_OPTS`` (check.py adds ptxas remarks)."""
    import os

    parts = [COMPILE_OPTIONS, extra, os.environ.get("CUTE_KERNELS_EXTRA_OPTS", "")]
    return " ".join(p for p in parts if p)


def arch_options(arch: int) -> str:
    """``compile_options`` targeting kernel family ``arch`` (``--gpu-arch sm_90a`` / ``sm_100a``)."""
    from cute_kernels.arch import arch_name

    return compile_options(f"--gpu-arch {arch_name(arch)}")


__all__ = ["COMPILE_OPTIONS", "cutlass", "fake_tensor", "fake_stream", "sym", "compile_options", "arch_options"]
