"""Backend resolution: ``"auto" | "cute" | "reference"``.

``auto`` picks the CuTe kernels when the inputs live on a CUDA place whose compute capability we
build for (9.0 -> sm_90a, 10.0 -> sm_100a, 10.3 -> sm_103a: ``cute_kernels.arch.TARGETS``) and the
op's kernel supports the case, otherwise the pure-Paddle reference, and says so once per
(op, reason). ``cute`` raises ``NotImplementedError`` naming the reason when no kernel applies.
``reference`` always runs the reference (CPU or GPU place).
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable, Literal, Optional

Backend = Literal["auto", "cute", "reference"]
BACKENDS = ("auto", "cute", "reference")

_warned: set = set()


def _is_gpu_place(tensor) -> bool:
    place = tensor.place
    return bool(getattr(place, "is_gpu_place", lambda: False)())


@functools.lru_cache(maxsize=None)
def _capability(device_id: int) -> int | None:
    import paddle

    if not paddle.is_compiled_with_cuda():  # the CPU build segfaults on some CUDA queries
        return None
    major, minor = paddle.device.cuda.get_device_capability(device_id)
    return major * 10 + minor


def tensor_arch(tensor) -> int | None:
    """Compute capability (e.g. 90) of the GPU holding ``tensor``, None for a CPU tensor."""
    if not _is_gpu_place(tensor):
        return None
    return _capability(tensor.place.gpu_device_id())


def resolve_backend(op: str, backend: str, tensor, unsupported_reason: Callable[[int], Optional[str]],
                    stacklevel: int = 4, auto_reason: Optional[Callable[[int], Optional[str]]] = None) -> str:
    """Return ``"cute"`` or ``"reference"`` for ``op`` given its first input tensor.

    ``unsupported_reason(arch)`` returns None when the CuTe kernel handles this call on ``arch``
    (the exact compute capability, 90, 100 or 103: the glue builds its compile key from it) or a
    short reason why not; it is called only for the CCs in ``cute_kernels.arch.TARGETS``. ``stacklevel`` of the fallback warning
    counts from this function (3: the public op's caller when the op calls this directly).
    ``auto_reason(arch)``, heeded by ``auto`` only: a kernel that takes the case but has not yet run on a
    GPU of that arch's family where one was available to test it (``auto`` then takes the reference and
    says why; ``cute`` runs the kernel).
    """
    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "reference":
        return "reference"
    from cute_kernels import arch as _arch

    arch = tensor_arch(tensor)
    if arch is None:
        reason = f"inputs are on {tensor.place}, CuTe kernels need a CUDA place"
    else:
        reason = _arch.arch_reason(arch) or unsupported_reason(arch)
    if reason is None and (backend == "cute" or auto_reason is None):
        return "cute"
    if backend == "cute":
        raise NotImplementedError(f"{op}: backend='cute' is not available: {reason}")
    if reason is None:
        reason = auto_reason(arch)
        if reason is None:
            return "cute"
    key = (op, reason)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"{op}: using the reference backend ({reason})", stacklevel=stacklevel)
    return "reference"
