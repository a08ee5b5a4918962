"""SM90 forward: the three block_logit reduce modes (Note [block_logit reduce modes] in
cute_kernels/attention/fwd_sm90.py) are bitwise interchangeable.

``split``, ``fused`` and ``deferred`` only move the quad exchange of the block maxima; block_logit,
out and lse must be BITWISE equal across them (the default of each config is checked against the
fp32 reference by tests/gpu/test_fwd_sm90.py), and every block_logit entry must be written.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.conftest import sm90_gpu_marks  # noqa: E402
from tests.gpu._fwd_launch import SENTINEL, make_qkv, run_ours  # noqa: E402

pytestmark = sm90_gpu_marks()

MODES = ("split", "fused", "deferred")


def run(q, k, v, mode, *, block_size=64, cu=None, max_len=None, **kw):
    return run_ours(q, k, v, block_size=block_size, cu_q=cu, cu_k=cu, max_sq=max_len, max_sk=max_len,
                    bl_reduce=mode, **kw)


def assert_modes_identical(q, k, v, **kw):
    ref = run(q, k, v, "split", **kw)
    assert not (ref[2] == SENTINEL).any(), "split left sentinel entries"
    for mode in MODES[1:]:
        got = run(q, k, v, mode, **kw)
        for name, a, b in zip(("out", "lse", "block_logit"), ref, got):
            assert torch.equal(a.view(torch.int16 if a.dtype == torch.bfloat16 else torch.int32),
                               b.view(torch.int16 if b.dtype == torch.bfloat16 else torch.int32)), (
                f"{name}: {mode} differs from split")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("d", [64, 128])
def test_block_sizes(d, block_size, causal):
    # Sk % 128 != 0 and Sk % block != 0: a partial last key tile and a partial last block.
    q, k, v = make_qkv(2, 1000, 1000, 4, 4, d, seed=1)
    assert_modes_identical(q, k, v, causal=causal, block_size=block_size)


@pytest.mark.parametrize("case", ["gqa-sq<sk", "rows-without-keys", "window", "softcap-d96", "single-tile"])
def test_corner_cases(case):
    if case == "gqa-sq<sk":
        q, k, v = make_qkv(1, 300, 1500, 8, 2, 128, seed=2)
        assert_modes_identical(q, k, v, causal=True, block_size=16)
    elif case == "rows-without-keys":
        q, k, v = make_qkv(1, 1500, 300, 4, 4, 64, seed=3)
        assert_modes_identical(q, k, v, causal=True, block_size=32)
    elif case == "window":
        q, k, v = make_qkv(1, 1200, 1200, 4, 4, 128, seed=4)
        assert_modes_identical(q, k, v, window=(300, 0), block_size=32)
    elif case == "softcap-d96":
        q, k, v = make_qkv(1, 700, 900, 4, 4, 96, seed=5)
        assert_modes_identical(q, k, v, softcap=30.0, block_size=64)
    else:  # one key tile: the first tile's maxima are flushed only after the loop
        q, k, v = make_qkv(1, 100, 100, 4, 4, 128, seed=6)
        assert_modes_identical(q, k, v, causal=True, block_size=16)


def test_varlen_unaligned_documents():
    lens = [37, 300, 1, 513, 129]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device="cuda", dtype=torch.int32)
    total = int(cu[-1])
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(total, 4, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    assert_modes_identical(q, k, v, causal=True, block_size=32, cu=cu, max_len=max(lens))
