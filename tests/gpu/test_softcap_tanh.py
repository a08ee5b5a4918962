"""The softcap tanh policy (``common/softmax.softcap_logit``, every attention kernel, forward and backward)
run on the GPU at hand (the H200: sm_90a; the same ex2.approx / rcp.approx sequence the SM100 kernels use):

    python -m pytest tests/gpu/test_softcap_tanh.py -q

A tiny kernel applies ``softcap_logit(x, 1, 1)`` = tanh(x) one value per thread; the absolute error
against float64 tanh must stay below the documented 5e-7 (tests/cpu/test_softcap_tanh.py derives it
from the instructions' error bounds on CPU); +-inf give +-1 and NaN stays NaN.
"""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels.arch import TARGETS
from tests.conftest import torch_cuda_arch

ARCH = torch_cuda_arch()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(ARCH not in TARGETS, reason=f"needs a CUDA GPU we build for {sorted(TARGETS)}")]

BOUND = 5e-7
THREADS = 128


pytest.importorskip("cutlass")
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32  # noqa: E402

from cute_kernels.common.softmax import softcap_logit  # noqa: E402
from cute_kernels.fake import arch_options, fake_stream, fake_tensor, sym  # noqa: E402


class _Softcap:
    @cute.jit
    def __call__(self, mX: cute.Tensor, mY: cute.Tensor, stream):
        grid = [(mX.shape[0] + THREADS - 1) // THREADS, 1, 1]
        self.kernel(mX, mY).launch(grid=grid, block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mY: cute.Tensor):
        i = cute.arch.block_idx()[0] * THREADS + cute.arch.thread_idx()[0]
        if i < mX.shape[0]:
            mY[i] = softcap_logit(mX[i], Float32(1.0), Float32(1.0))


def _compile(arch: int):
    n = sym()
    return cute.compile(_Softcap(), fake_tensor(Float32, (n,), align_bytes=4),
                        fake_tensor(Float32, (n,), align_bytes=4), fake_stream(), options=arch_options(arch))


def test_softcap_tanh_on_the_gpu():
    torch = pytest.importorskip("torch")
    x = np.concatenate([np.linspace(-60.0, 60.0, 1_200_001), np.geomspace(1e-9, 1e-2, 20001),
                        -np.geomspace(1e-9, 1e-2, 20001), [0.0, 89.0, -89.0, 1e30, -1e30]]).astype(np.float32)
    specials = np.array([np.inf, -np.inf, np.nan], np.float32)
    tx = torch.from_numpy(np.concatenate([x, specials])).cuda()
    ty = torch.empty_like(tx)
    _compile(ARCH)(tx, ty)
    torch.cuda.synchronize()
    y = ty.cpu().numpy()
    err = np.abs(y[: x.size].astype(np.float64) - np.tanh(x.astype(np.float64)))
    assert err.max() < BOUND, (float(err.max()), float(x[err.argmax()]))
    assert y[-3] == 1.0 and y[-2] == -1.0 and np.isnan(y[-1])
