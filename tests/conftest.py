"""Shared pytest setup: device probes are functions (never evaluated at import)."""

from __future__ import annotations

import functools
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@functools.lru_cache(maxsize=None)
def torch_cuda_arch() -> int | None:
    """Compute capability of torch's current CUDA device (e.g. 90), or None."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def sm90_gpu_marks() -> list:
    """``pytestmark`` of a GPU test file that needs an SM90 (Hopper) GPU through torch."""
    import pytest

    arch = torch_cuda_arch()
    return [pytest.mark.gpu,
            pytest.mark.skipif(arch is None or not (90 <= arch < 100), reason="needs an SM90 (Hopper) GPU")]
