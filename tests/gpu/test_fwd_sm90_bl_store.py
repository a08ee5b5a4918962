"""SM90 forward, opt-in block_logit store variant (bl_store="producer", CUTE_KERNELS_SM90_BL_STORE).

Warps 1-3 finish the block maxima that the consumer warpgroups stage in shared memory. The variant
must be indistinguishable from the default: block_logit, out and lse BITWISE equal to the default
("consumer") build, which tests/gpu/test_fwd_sm90.py checks against the fp32 reference. Also a
poisoned output buffer (sentinel / NaN) must be fully overwritten.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.conftest import sm90_gpu_marks  # noqa: E402
from tests.gpu._fwd_launch import SENTINEL, make_qkv, run_ours  # noqa: E402

pytestmark = sm90_gpu_marks()


def run(q, k, v, bl_store, *, block_size=64, fill=SENTINEL, cu=None, max_len=None, **kw):
    return run_ours(q, k, v, block_size=block_size, fill=fill, cu_q=cu, cu_k=cu, max_sq=max_len,
                    max_sk=max_len, bl_store=bl_store, **kw)


def assert_same_as_default(q, k, v, **kw):
    o_c, l_c, b_c = run(q, k, v, "consumer", **kw)
    o_p, l_p, b_p = run(q, k, v, "producer", **kw)
    assert not (b_p == SENTINEL).any(), "producer variant left sentinel entries"
    assert torch.equal(b_p, b_c), (
        f"block_logit differs from the default in {(b_p != b_c).sum().item()} entries")
    assert torch.equal(o_p, o_c), "out differs from the default"
    assert torch.equal(l_p, l_c), "lse differs from the default"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("block_size", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("d", [128, 256])
def test_block_sizes(d, block_size, causal):
    # Sk % 128 != 0 and Sk % block != 0; enough key tiles to reuse each staging slot many times.
    q, k, v = make_qkv(2, 1000, 1000, 4, 4, d, seed=1)
    assert_same_as_default(q, k, v, causal=causal, block_size=block_size)


@pytest.mark.parametrize("sq,sk", [(2048, 2048), (300, 1500), (1500, 300), (1, 1), (63, 63)])
@pytest.mark.parametrize("block_size", [16, 256])
def test_long_and_corner_shapes(sq, sk, block_size):
    """Many key tiles; Sq < Sk; Sq > Sk under causal (rows with no keys); tiny shapes."""
    q, k, v = make_qkv(1, sq, sk, 2, 2, 128, seed=2)
    for causal in (False, True):
        assert_same_as_default(q, k, v, causal=causal, block_size=block_size)


@pytest.mark.parametrize("hq,hkv", [(8, 2), (8, 1)])
def test_gqa(hq, hkv):
    q, k, v = make_qkv(1, 500, 700, hq, hkv, 128, seed=3)
    assert_same_as_default(q, k, v, causal=True, block_size=32)


@pytest.mark.parametrize("window", [(96, 0), (200, 50), (0, 0)])
@pytest.mark.parametrize("block_size", [32, 256])
def test_window(window, block_size):
    q, k, v = make_qkv(1, 900, 900, 2, 2, 128, seed=4)
    assert_same_as_default(q, k, v, window=window, block_size=block_size)


@pytest.mark.parametrize("block_size", [16, 64, 256])
def test_softcap(block_size):
    q, k, v = make_qkv(1, 600, 600, 2, 2, 128, seed=5)
    for causal in (False, True):
        assert_same_as_default(q, k, v, causal=causal, softcap=30.0, block_size=block_size)


@pytest.mark.parametrize("dtype,d", [(torch.float16, 64), (torch.bfloat16, 96), (torch.bfloat16, 192)])
def test_head_dims(dtype, d):
    q, k, v = make_qkv(1, 700, 700, 2, 2, d, dtype=dtype, seed=6)
    for bs in (16, 128):
        assert_same_as_default(q, k, v, causal=True, block_size=bs)


@pytest.mark.parametrize("block_size", [16, 64, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen(causal, block_size):
    lens = [40, 200, 72, 133, 1, 700]
    q, k, v = make_qkv(1, sum(lens), sum(lens), 4, 4, 128, seed=7)
    q, k, v = q[0], k[0], v[0]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device="cuda", dtype=torch.int32)
    assert_same_as_default(q, k, v, causal=causal, block_size=block_size, cu=cu, max_len=max(lens))


@pytest.mark.parametrize("fill", [SENTINEL, float("nan")], ids=["sentinel", "nan"])
@pytest.mark.parametrize("case", ["full", "causal", "window", "sq-gt-sk"])
def test_poisoned_buffer_overwritten(case, fill):
    sq, sk = (512, 300) if case == "sq-gt-sk" else (640, 640)
    q, k, v = make_qkv(1, sq, sk, 2, 2, 128, seed=8)
    kw = dict(causal=case in ("causal", "sq-gt-sk"), window=(96, 0) if case == "window" else (-1, -1))
    _, _, poisoned = run(q, k, v, "producer", block_size=32, fill=fill, **kw)
    _, _, clean = run(q, k, v, "producer", block_size=32, fill=float("-inf"), **kw)
    assert not (poisoned == SENTINEL).any() and not torch.isnan(poisoned).any()
    assert torch.equal(poisoned, clean)


def test_env_variable_selects_variant(monkeypatch):
    """CUTE_KERNELS_SM90_BL_STORE=producer reaches the compile key; results stay identical."""
    from cute_kernels.attention import launch

    q, k, v = make_qkv(1, 256, 256, 2, 2, 128, seed=9)
    cfg = launch.fwd_config(90, q.dtype, 128, 128, 1, True, False, False, 64, False)
    monkeypatch.setenv(launch.BL_STORE_ENV, "producer")
    assert launch.bl_store_mode(cfg) == "producer"
    o_env, l_env, b_env = run(q, k, v, None, causal=True, block_size=64)
    o_p, l_p, b_p = run(q, k, v, "producer", causal=True, block_size=64)
    assert torch.equal(b_env, b_p) and torch.equal(o_env, o_p) and torch.equal(l_env, l_p)


def test_run_to_run_deterministic():
    q, k, v = make_qkv(2, 1100, 1100, 4, 4, 128, seed=10)
    a = run(q, k, v, "producer", causal=True, block_size=16)
    b = run(q, k, v, "producer", causal=True, block_size=16)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
