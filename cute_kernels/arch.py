"""Target architectures: the dispatch table from compute capability to compile target.

A config's ``arch`` field is the exact compute capability its binary is built for (90, 100, 103):
it alone decides the target string (``arch_name``: ``--gpu-arch`` and ``CUTE_DSL_ARCH``), and it is
part of every compile key. Kernels pick their class and check support by ``family(arch)`` (90 or
100). Arch-specific targets (the ``a`` suffix, needed for wgmma / tcgen05) load only on their exact
CC, so each CC we ship gets its own build; anything else gets ``arch_reason`` and, under
``backend="auto"``, the reference backend instead of a failed launch.

Note [one target per CC]: an ``sm_100f`` (family) build would load on both 10.0 and 10.3, and the
DSL 4.8.1 tcgen05 ops accept it (the SM100 forward and backward compile for it), but the two parts
want different code anyway (``exp2_emulation``), so one binary could not serve both; ``sm_103a``
also lets ptxas schedule for the part that runs it. Hence sm_100a on 10.0 and sm_103a on 10.3.

The arch and SM count are always passed in; nothing here queries the driver at import time, so
every kernel compiles on a machine with no GPU (see ``docs/design.md``, compile-only mode).
"""

from __future__ import annotations

import functools
import os

#: Compute capability (``major * 10 + minor``) -> the target its kernels compile for.
TARGETS = {90: "sm_90a", 100: "sm_100a", 103: "sm_103a"}
#: Compute capabilities we ship kernels for.
SUPPORTED_ARCHS = tuple(TARGETS)
#: Compute capability -> kernel family (the kernel class that runs there).
_FAMILY = {90: 90, 100: 100, 103: 100}

#: SMs per GPU, used by persistent schedulers only when compiling without a device (check.py, CI);
#: launches pass the device's own count (``device_sm_count``). 148 = B200; B300 parts may differ.
SM_COUNT_DEFAULT = {90: 132, 100: 148, 103: 148}

#: Dynamic shared memory a block may request (bytes), per kernel family (sm_90a and sm_10xa alike).
SMEM_BYTES_MAX = {90: 232_448, 100: 232_448}


def parse_arch(arch: str | int) -> int:
    """``"sm_90a"``/``"sm_103a"``/``"sm_100f"``/``"90"``/``90`` -> ``90``/``103``/``100``/``90``/``90``."""
    if isinstance(arch, int):
        return arch
    text = arch.strip().lower().removeprefix("sm_").removeprefix("sm").rstrip("af")
    if not text.isdigit():
        raise ValueError(f"unknown arch {arch!r}; expected e.g. 'sm_90a', 'sm_100a' or 'sm_103a'")
    return int(text)


def arch_name(arch: int) -> str:
    """Compile target of compute capability ``arch``: ``90`` -> ``"sm_90a"``, ``103`` -> ``"sm_103a"``."""
    target = TARGETS.get(arch)
    if target is None:
        raise ValueError(f"no compile target for compute capability {arch}: {arch_reason(arch)}")
    return target


def family(arch: int) -> int:
    """Kernel family of a compute capability: 90 for 9.0, 100 for 10.0 and 10.3, else the CC itself
    (which no kernel supports: 11.x, 12.x consumer Blackwell and < 9.0 have no build)."""
    return _FAMILY.get(arch, arch)


def exp2_emulation(arch: int) -> bool:
    """Whether the SM100 softmax computes part of its exp2 on the FMA pipe (``math_sm100.exp2_poly``).

    On 10.0 MUFU.EX2 throughput limits the softmax, so offloading some exp2 to the FMA pipe pays;
    10.3 (B300) has a faster MUFU.EX2 and FA4 b36 turns the emulation off there (its rule is "10.3 and
    later in the family"), so do we.
    """
    return arch == 100


def arch_reason(arch: int) -> str | None:
    """Why no CuTe kernel runs on compute capability ``arch`` (None for 9.0, 10.0 and 10.3)."""
    if arch in SUPPORTED_ARCHS:
        return None
    cc = f"{arch // 10}.{arch % 10}"
    if 120 <= arch < 130:
        return (f"compute capability {cc} (consumer Blackwell) has no tcgen05 / wgmma; the kernels are "
                f"built for 9.0 (sm_90a), 10.0 (sm_100a) and 10.3 (sm_103a)")
    return (f"no CuTe kernels for compute capability {cc}: the kernels are built for 9.0 (sm_90a), "
            f"10.0 (sm_100a) and 10.3 (sm_103a), whose binaries load only on that exact part")


def compile_only() -> bool:
    """True when ``CUTE_KERNELS_COMPILE_ONLY=1``: build artifacts but never load them on a device."""
    return os.environ.get("CUTE_KERNELS_COMPILE_ONLY", "0") == "1"


def dsl_cuda() -> int | None:
    """The CUDA major version of the DSL build doing the compiling (12: the default ``nvidia-cutlass-dsl`` wheel,
    13: ``nvidia-cutlass-dsl[cu13]``, picked at import: the newest one installed that the driver supports, the newest
    without a driver), read from the loaded IR module's file name; None before cutlass is imported or when the name
    says nothing. Its ptxas allocates registers differently: the same kernel can spill under one and not the other
    (the latent dK/dV kernel did under 13 only, docs/benchmarks.md Run AO8), so ``python -m cute_kernels.check``
    names it and the few register splits that depend on it read it here."""
    import re
    import sys

    mod = sys.modules.get("cutlass._mlir._mlir_libs._cutlass_ir")
    m = re.search(r"\.cu(\d+)\.", os.path.basename(getattr(mod, "__file__", "") or ""))
    return int(m.group(1)) if m else None


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
    """Compute capability to build for (a config's ``arch``): ``arch`` if given, else CUDA device 0's.

    Launchers call this with the caller's arch (the Paddle layer passes the tensors' device CC);
    without one and without a GPU there is nothing to launch on, which is an error.
    """
    if arch is None:
        arch = device_arch()
        if arch is None:
            raise RuntimeError("no CUDA device found: pass arch=90/100/103 or run on a GPU")
    return int(arch)


def tensor_sm_count(tensor) -> int:
    """SMs of the CUDA device holding ``tensor`` (any DLPack tensor: Paddle or torch), for the
    persistent schedulers' grid. Cached per device; raises when the driver cannot say."""
    _, index = tensor.__dlpack_device__()
    n = device_sm_count(int(index or 0))
    if n is None:
        raise RuntimeError("cannot read the SM count of the tensor's CUDA device")
    return n
