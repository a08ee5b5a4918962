"""SM100 (Blackwell) decode attention: the same warp-MMA kernel's sm_100a / sm_103a binary against the fp64 oracle.

    python -m pytest tests/sm100/test_decode_sm100.py -q   # skips without torch on a CC 10.0 / 10.3 GPU

The decode kernel is one source for SM90 and SM100 (mma.sync + cp.async, cute_kernels/decode/fwd.py), so the
Hopper runs of tests/gpu/test_decode.py verify its numerics; this file runs a representative subset of those
cases on the Blackwell binary (paged with NaN tails and padding ids, split vs unsplit and bitwise repeats,
multi-token causal, block_logit's -inf pattern, MQA, d 256, the contiguous layout, a combine of 40 and 128 splits) through the same glue with
torch tensors. Nothing here has been run on a Blackwell GPU: none was available when it was written.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="needs torch with CUDA on a Blackwell GPU")

from tests.conftest import torch_cuda_arch  # noqa: E402
from tests.sm100.conftest import SM100_BUILDS  # noqa: E402
from tests.gpu.test_decode import glue  # noqa: E402,F401  (the same glue fixture: torch allocator, NaN-filled)

pytestmark = [pytest.mark.sm100,
              pytest.mark.skipif(torch_cuda_arch() not in SM100_BUILDS,
                                 reason="needs torch with CUDA on a compute-capability-10.0 (B200) or 10.3 (B300) GPU")]


@pytest.mark.parametrize("kw,check_kw", [
    (dict(lens=[0, 1, 17, 300, 1000, 64]), {}),
    (dict(lens=[3, 40, 517], sq=4, group=8), {}),
    (dict(lens=[0, 1, 70, 333, 1200], sq=4), dict(bs=64)),
    (dict(lens=[1, 77, 600], group=64, hkv=1), {}),
    (dict(lens=[0, 33, 400], d=256, sq=2), {}),
    (dict(lens=[0, 1, 31, 450], layout="contiguous"), dict(layout="contiguous")),
])
def test_decode_sm100(glue, kw, check_kw):
    from tests.gpu.test_decode import full_check, make_case

    full_check(glue, make_case(7, **kw), splits=(1, 3), repeat=2, **check_kw)


@pytest.mark.parametrize("splits", [40, 128])
def test_decode_combine_many_splits_sm100(glue, splits):
    """The combine's 2-8 warps per row (combine.warps_per_row) and its cp.async-staged partials on the Blackwell
    binary: against the oracle, bitwise repeatable, within tolerance of the unsplit result."""
    from tests.gpu.test_decode import full_check, make_case

    full_check(glue, make_case(90 + splits, lens=[0, 5, 3000, 9000], group=8, hkv=1), splits=(1, splits), repeat=2)
