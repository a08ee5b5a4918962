"""Paddle tensors -> compiled CuTe launchers.

The launchers in ``cute_kernels`` are compiled with ``--enable-tvm-ffi`` and take Paddle tensors
directly (DLPack C exchange API, Paddle's current stream). This module holds the little that is
Paddle-specific: detaching, compact copies of strided inputs and staging of strided out-parameters
(:func:`kernel_input`, :func:`stage_output`/:func:`commit_output`), checks done *before* a launch,
and the arch.
"""

from __future__ import annotations

from ._validate import is_empty
from .backend import _capability, tensor_arch


def kernel_arg(t):
    """A view the kernel may read/write with no autograd edge, same storage: ``t`` itself when it records
    none (``stop_gradient``, the inference case: no new Tensor object per call), else ``t.detach()``
    (also any tensor without ``stop_gradient``, e.g. torch's in tests/gpu)."""
    return t if t is None or getattr(t, "stop_gradient", False) else t.detach()


def as_contiguous(t):
    """``t`` if contiguous, else a contiguous copy.

    Never ``t.contiguous()``: in Paddle 3.3 that re-lays-out the caller's tensor *in place*.
    """
    return t if t is None or t.is_contiguous() else _compact_copy(t)


def _compact_copy(t):
    """A contiguous copy of ``t``. Paddle's ``clone`` is always contiguous; torch's keeps a permuted
    layout (tests/gpu drive this glue with torch tensors), so a still-strided clone -- our own
    tensor, never the caller's -- is made contiguous."""
    c = t.clone()
    return c if c.is_contiguous() else c.contiguous()


def empty(shape, dtype, like, place=None):
    """``paddle.empty(shape, dtype, device=like.place)``: the glue's one allocator of kernel buffers
    (one seam, so tests/gpu can drive the glue with torch tensors). ``place``: ``like.place`` when the
    caller already holds it (each ``Tensor.place`` builds a new Place object, about 0.5 us).

    In dynamic mode (every glue call: the ops are ``dynamic_only``) it calls the eager op
    ``paddle._C_ops.empty`` that ``paddle.empty`` ends in, without the wrapper's argument conversions
    (about 3 us of Python per buffer); same tensor, ``stop_gradient`` True."""
    import paddle

    if paddle.in_dynamic_mode():
        return paddle._C_ops.empty(list(shape), getattr(paddle, dtype) if isinstance(dtype, str) else dtype,
                                   like.place if place is None else place)
    return paddle.empty(list(shape), dtype=dtype, device=like.place if place is None else place)


def _compact(t, nbytes: int) -> bool:
    """Whether the kernels can take ``t`` as it is: contiguous (row-major) and ``nbytes``-aligned (an empty
    tensor's pointer does not matter; its shape is read only when the pointer is misaligned)."""
    return t.is_contiguous() and (t.data_ptr() % nbytes == 0 or is_empty(t))


def kernel_input(t, nbytes: int = 16):
    """``t`` when contiguous and ``nbytes``-aligned, else a contiguous copy (a fresh, aligned
    allocation). The caller's tensor is never modified; the kernels stay compiled for compact
    row-major layouts (strides are not part of any compile key)."""
    return t if t is None or _compact(t, nbytes) else _compact_copy(t)


def stage_output(t, nbytes: int = 16, keep_values: bool = False):
    """A buffer the kernel may write in place of the caller's out-parameter ``t``: ``t`` itself
    when contiguous and aligned, else a contiguous temporary (a copy of ``t`` when the kernel
    also reads it, ``keep_values``). Pass the result to :func:`commit_output` after the launch."""
    if t is None or _compact(t, nbytes):
        return t
    if keep_values:
        return _compact_copy(t)
    return empty(t.shape, t.dtype, t)


def commit_output(t, buf) -> None:
    """Copy a staged temporary back into the caller's strided out-parameter (stream-ordered)."""
    if buf is not t and t is not None:
        t.copy_(buf.detach(), False)


def require_contiguous(op: str, name: str, t) -> None:
    if t is not None and not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous for the CuTe backend (pass a contiguous tensor, e.g. x.clone())")


def require_aligned(op: str, name: str, t, nbytes: int = 16) -> None:
    if t is not None and not is_empty(t) and t.data_ptr() % nbytes != 0:
        raise ValueError(f"{op}: {name} must be {nbytes}-byte aligned for the CuTe backend")


def device_of(t) -> tuple:
    """``(compute capability, CUDA device index, place)`` of ``t``'s GPU with one place query: the launch
    key's arch, the device whose SM count a launcher's grid or split heuristic reads, and the place to
    allocate on (:func:`empty`'s ``place``)."""
    place = t.place
    if not place.is_gpu_place():
        raise RuntimeError("CuTe launch requested for a tensor that is not on a CUDA place")
    index = place.gpu_device_id()
    return _capability(index), index, place


def arch_of(t) -> int:
    """Exact compute capability of ``t``'s GPU (e.g. 103): the launchers' compile-key arch."""
    arch = tensor_arch(t)
    if arch is None:
        raise RuntimeError("CuTe launch requested for a tensor that is not on a CUDA place")
    return arch
