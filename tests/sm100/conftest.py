"""Blackwell (SM10x) suite: skips cleanly, with a reason, on any machine without such a GPU.

Probes are functions (never evaluated at import), so the files collect on a CPU-only machine.
The suite runs with Paddle tensors through ``paddle_fa4.flash_attn_fwd`` when Paddle has CUDA and
sees an SM10x device, with torch tensors through ``cute_kernels.attention.launch.run_fwd``
otherwise; ``PADDLE_FA4_SM100_FRAMEWORK=torch|paddle`` forces one, and ``=reference`` dry-runs the
suite's own logic on CPU against paddle_fa4's reference backend (it checks the tests, not the kernel).
"""

from __future__ import annotations

import functools
import os

import pytest

from cute_kernels.arch import TARGETS, family
from tests.conftest import torch_cuda_arch

#: The compute capabilities with an SM100 build (10.0 -> sm_100a, 10.3 -> sm_103a): exactly these run
#: the suite; any other part would load no binary (cute_kernels.arch.arch_reason).
SM100_BUILDS = tuple(cc for cc in TARGETS if family(cc) == 100)


@functools.lru_cache(maxsize=None)
def paddle_cuda_arch() -> int | None:
    """Compute capability of Paddle's current GPU (e.g. 100), or None (no Paddle, or CPU build)."""
    try:
        import paddle
    except ImportError:
        return None
    try:
        if not paddle.device.is_compiled_with_cuda() or paddle.device.cuda.device_count() == 0:
            return None
        major, minor = paddle.device.cuda.get_device_capability()
    except Exception:  # noqa: BLE001 - any failure means "no usable Paddle GPU"
        return None
    return major * 10 + minor


def _is_sm10x(arch: int | None) -> bool:
    """A part we build the SM100 kernels for (each CC gets its own arch-specific binary)."""
    return arch in SM100_BUILDS


@functools.lru_cache(maxsize=None)
def sm100_framework() -> str | None:
    """"paddle" or "torch" (the framework whose tensors drive the suite), or None to skip."""
    forced = os.environ.get("PADDLE_FA4_SM100_FRAMEWORK")
    if forced == "reference":  # dry run of the suite's logic on CPU (see _harness.Runner)
        return forced
    if forced in ("paddle", "torch"):
        probe = paddle_cuda_arch if forced == "paddle" else torch_cuda_arch
        return forced if _is_sm10x(probe()) else None
    if _is_sm10x(paddle_cuda_arch()):
        return "paddle"
    if _is_sm10x(torch_cuda_arch()):
        return "torch"
    return None


def skip_reason() -> str:
    arches = {"paddle": paddle_cuda_arch(), "torch": torch_cuda_arch()}
    seen = ", ".join(f"{k}: sm_{v}" for k, v in arches.items() if v is not None) or "no CUDA device"
    return f"needs a compute-capability-10.0 (B200 / GB200) or 10.3 (B300 / GB300) GPU via Paddle or torch ({seen})"


def pytest_collection_modifyitems(config, items):
    """Skip every test that launches the kernel (it takes the ``runner`` fixture) without a GPU;
    the checks of the harness itself (reference vs oracle, argument validation) run anywhere."""
    if sm100_framework() is not None:
        return
    mark = pytest.mark.skip(reason=skip_reason())
    for item in items:
        in_suite = "tests/sm100/" in str(item.fspath).replace(os.sep, "/")
        if in_suite and "runner" in getattr(item, "fixturenames", ()):
            item.add_marker(mark)
