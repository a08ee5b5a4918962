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
    """Kernel family of a compute capability: 90 for 9.0 and 100 for 10.0, else the arch itself.

    The kernels compile for ``sm_90a`` / ``sm_100a``: arch-specific targets, whose binaries load only
    on exactly CC 9.0 / 10.0. Any other part (10.3 = B300/GB300, 11.x, 12.x consumer Blackwell, < 9.0)
    maps to itself, which no kernel supports, so ``backend="auto"`` falls back to the reference
    with ``unsupported_reason`` saying why (see ``arch_reason``) instead of a failed launch.
    """
    return arch


def arch_reason(arch: int) -> str | None:
    """Why no CuTe kernel runs on compute capability ``arch`` (None for 9.0 and 10.0)."""
    if arch in SUPPORTED_ARCHS:
        return None
    cc = f"{arch // 10}.{arch % 10}"
    if arch == 103:
        return (f"compute capability {cc} (B300 / GB300): the kernels are built for sm_100a, whose "
                f"binaries load only on 10.0, and no sm_103a build exists yet")
    if 100 <= arch < 130:
        return (f"compute capability {cc}: the Blackwell kernels are built for sm_100a (CC 10.0 only; "
                f"tcgen05 is not on consumer Blackwell 12.x)")
    return f"no CuTe kernels for compute capability {cc} (need 9.0 or 10.0)"


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
