"""Target architectures.

The arch and SM count are always passed in; nothing here queries the driver at import time, so
every kernel compiles on a machine with no GPU (see ``docs/design.md``, compile-only mode).
"""

from __future__ import annotations

import functools
import os

#: Architectures we ship kernels for, as integer compute capability ``major * 10 + minor``.
SUPPORTED_ARCHS = (90, 100)

#: SMs per GPU, used by persistent schedulers when compiling without a device.
SM_COUNT_DEFAULT = {90: 132, 100: 148}

#: Dynamic shared memory a block may request (bytes), sm_90a and sm_100a alike.
SMEM_BYTES_MAX = {90: 232_448, 100: 232_448}


def parse_arch(arch: str | int) -> int:
    """``"sm_90a"``/``"sm_100a"``/``"90"``/``90`` -> ``90``/``100``."""
    if isinstance(arch, int):
        return arch
    text = arch.strip().lower().removeprefix("sm_").removeprefix("sm").rstrip("af")
    if not text.isdigit():
        raise ValueError(f"unknown arch {arch!r}; expected e.g. 'sm_90a' or 'sm_100a'")
    return int(text)


def arch_name(arch: int) -> str:
    """``90`` -> ``"sm_90a"`` (the arch-specific target wgmma/tcgen05 need)."""
    return f"sm_{arch}a"


def family(arch: int) -> int:
    """Kernel family for a compute capability: 9.x -> 90, 10.x/11.x -> 100, else the arch itself."""
    if 90 <= arch < 100:
        return 90
    if 100 <= arch < 120:
        return 100
    return arch


def compile_only() -> bool:
    """True when ``CUTE_KERNELS_COMPILE_ONLY=1``: build artifacts but never load them on a device."""
    return os.environ.get("CUTE_KERNELS_COMPILE_ONLY", "0") == "1"


def _device_attrs(device_index: int, *names: str) -> tuple | None:
    """Driver attributes ``CU_DEVICE_ATTRIBUTE_<name>`` of one CUDA device, or None without a GPU."""
    try:
        from cuda.bindings import driver
    except ImportError:  # pragma: no cover - cuda-python ships with cutlass-dsl
        return None
    ok = driver.CUresult.CUDA_SUCCESS
    try:
        (err,) = driver.cuInit(0)
    except Exception:  # no driver library at all (CPU-only machine): cuda-python raises, not returns
        return None
    if err != ok:
        return None
    err, dev = driver.cuDeviceGet(device_index)
    if err != ok:
        return None
    values = []
    for name in names:
        err, value = driver.cuDeviceGetAttribute(getattr(driver.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}"), dev)
        if err != ok:
            return None
        values.append(value)
    return tuple(values)


@functools.lru_cache(maxsize=None)
def device_arch(device_index: int = 0) -> int | None:
    """Compute capability of CUDA device ``device_index`` (e.g. 90), or None without a GPU.

    Only called when a kernel is about to run on real tensors, never at import.
    """
    cc = _device_attrs(device_index, "COMPUTE_CAPABILITY_MAJOR", "COMPUTE_CAPABILITY_MINOR")
    return None if cc is None else cc[0] * 10 + cc[1]


@functools.lru_cache(maxsize=None)
def device_sm_count(device_index: int = 0) -> int | None:
    """Number of SMs of CUDA device ``device_index``, or None without a GPU."""
    n = _device_attrs(device_index, "MULTIPROCESSOR_COUNT")
    return None if n is None else n[0]


def kernel_arch(arch: int | None = None) -> int:
    """Kernel family to build for: ``arch`` if given, else that of CUDA device 0.

    Launchers call this with the caller's arch (the Paddle layer passes the tensors' device arch);
    without one and without a GPU there is nothing to launch on, which is an error.
    """
    if arch is None:
        arch = device_arch()
        if arch is None:
            raise RuntimeError("no CUDA device found: pass arch=90/100 or run on a GPU")
    return family(arch)
