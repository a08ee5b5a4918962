"""SM100 (Blackwell) attention forward + fused block_logit: the suite a B200 owner runs first.

    python -m pytest tests/sm100 -q          # skips, with the reason, without an SM10x GPU

Drives the compiled FlashFwdSm100 through ``paddle_fa4.flash_attn_fwd`` (Paddle with CUDA) or
``cute_kernels.attention.launch.run_fwd`` (torch tensors), see ``conftest.py``. References are the
float64 numpy computation in ``_harness.py``. Contracts: block_logit |err| <= 2e-3 + 1e-3 |ref| on
finite entries and the exact -inf pattern; every entry written (sentinel-filled buffers); out/lse
bitwise unchanged by block_logit; varlen documents bitwise equal to running them alone.
Nothing here has been run: no Blackwell GPU was available when it was written (see docs/sm100.md).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.sm100 import _harness as H
from tests.sm100.conftest import sm100_framework

pytestmark = [pytest.mark.sm100]


@pytest.fixture(scope="module")
def runner():
    return H.Runner(sm100_framework())


def full_check(runner, q, k, v, block_size, *, dtype="bfloat16", **kw):
    out, lse, bl = runner.run(q, k, v, dtype=dtype, block_size=block_size, **kw)
    ref_kw = {key: kw[key] for key in ("causal", "window", "softcap", "scale") if key in kw}
    out_ref, lse_ref, bl_ref = H.reference(q, k, v, block_size=block_size, **ref_kw)
    out_eager, _, _ = H.reference(q, k, v, eager_dtype=dtype, **ref_kw)
    H.check_out_lse(out, lse, out_ref, lse_ref, out_eager)
    no_keys = np.isneginf(lse_ref).transpose(0, 2, 1)  # (B, Sq, Hq)
    if no_keys.any():
        assert float(np.abs(out[no_keys]).max()) == 0.0, "rows without keys must give out == 0"
    if block_size:
        H.check_block_logit(bl, bl_ref)
    return out, lse, bl


def test_reference_matches_oracle():
    """The fast harness reference agrees with the independent per-row oracle (small shapes)."""
    from tests.oracles import attention as oracle

    q, k, v = H.make_qkv(2, 37, 70, 4, 2, 64, seed=20)
    for kw in (dict(causal=True), dict(window=(9, 3)), dict(softcap=2.0)):
        window = kw.get("window", (-1, -1))
        o1, l1, b1 = H.reference(q, k, v, block_size=16, **kw)
        o2, l2, b2 = oracle.attention(q, k, v, causal=kw.get("causal", False), window=window,
                                      softcap=kw.get("softcap", 0.0), block_size=16)
        np.testing.assert_allclose(o1, o2, atol=1e-9)
        np.testing.assert_array_equal(np.isneginf(l1), np.isneginf(l2))
        np.testing.assert_allclose(b1, b2, atol=1e-9)


SHAPES = [(1, 256, 256, 8, 64), (2, 512, 512, 4, 128), (1, 512, 512, 8, 256), (1, 1024, 1024, 2, 256),
          (2, 640, 640, 6, 128), (1, 384, 384, 4, 192)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_multi_shapes(runner, shape, causal):
    b, s, sk, h, d = shape
    q, k, v = H.make_qkv(b, s, sk, h, h, d)
    full_check(runner, q, k, v, 64, causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("block_size", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_block_sizes(runner, d, block_size, causal):
    """Sk = 700: neither a multiple of the 128-key tile nor of any block size; d=256 uses one Q stage."""
    q, k, v = H.make_qkv(1, 512, 700, 4, 4, d, seed=1)
    full_check(runner, q, k, v, block_size, causal=causal)


CORNERS = [
    pytest.param(1, 250, 250, 128, id="sk-not-multiple-of-block"),
    pytest.param(1, 130, 130, 128, id="sk-not-multiple-of-tile"),
    pytest.param(1, 63, 63, 128, id="63x63"),
    pytest.param(1, 1, 1, 128, id="1x1"),
    pytest.param(2, 300, 512, 128, id="sq-lt-sk"),
    pytest.param(2, 512, 300, 128, id="sq-gt-sk-rows-without-keys"),
    pytest.param(1, 511, 513, 256, id="ragged-d256"),
    pytest.param(1, 257, 129, 64, id="two-q-stages-partial"),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("b,sq,sk,d", CORNERS)
def test_corner_cases(runner, b, sq, sk, d, causal):
    q, k, v = H.make_qkv(b, sq, sk, 2, 2, d, seed=2)
    full_check(runner, q, k, v, 64, causal=causal)


@pytest.mark.parametrize("hq,hkv,causal", [(8, 2, True), (8, 2, False), (8, 1, True), (4, 2, False)],
                         ids=["8-2-causal", "8-2-full", "8-1-causal", "4-2-full"])
def test_gqa(runner, hq, hkv, causal):
    q, k, v = H.make_qkv(1, 512, 512, hq, hkv, 128, seed=3)
    full_check(runner, q, k, v, 64, causal=causal)


def test_pack_gqa_rejected_with_block_logit():
    """pack_gqa=True with block_logit is refused by flash_attn_fwd before any launch (Paddle layer)."""
    paddle = pytest.importorskip("paddle")
    import paddle_fa4

    q = paddle.zeros([1, 16, 8, 64], dtype="float32")
    k = paddle.zeros([1, 16, 2, 64], dtype="float32")
    with pytest.raises(ValueError, match="pack_gqa"):
        paddle_fa4.flash_attn_fwd(q, k, k, return_block_logit=True, block_size=16, pack_gqa=True,
                                  backend="reference")


def test_gqa_default_is_unpacked(runner):
    """GQA with the default pack_gqa (None) runs unpacked with block_logit; rows stay per query head."""
    q, k, v = H.make_qkv(1, 300, 300, 8, 2, 128, seed=12)
    full_check(runner, q, k, v, 64, causal=True, pack_gqa=None)


@pytest.mark.parametrize("block_size", [32, 64, 128])
def test_large_multitile_noncausal(runner, block_size):
    """2048 x 2048: 16 key tiles x 8 Q tiles per head, persistent CTAs; sentinel buffer overwritten."""
    q, k, v = H.make_qkv(1, 2048, 2048, 2, 2, 128, seed=13)
    full_check(runner, q, k, v, block_size)


@pytest.mark.parametrize("window", [(64, 32), (100, 0), (-1, 40), (200, -1), (0, 0)],
                         ids=["64-32", "100-0", "inf-40", "200-inf", "diagonal-only"])
@pytest.mark.parametrize("sq,sk", [(512, 512), (300, 700)], ids=["square", "sq-lt-sk"])
def test_window(runner, window, sq, sk):
    q, k, v = H.make_qkv(1, sq, sk, 4, 4, 128, seed=4)
    full_check(runner, q, k, v, 64, window=window)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("softcap", [5.0, 30.0])
def test_softcap(runner, softcap, causal):
    """Softcap uses the hardware tanh approximation: block_logit/lse tolerance 5e-3 + 2e-3 |ref|."""
    q, k, v = H.make_qkv(1, 384, 384, 4, 4, 128, seed=5, q_scale=3.0)
    out, lse, bl = runner.run(q, k, v, block_size=64, causal=causal, softcap=softcap)
    out_ref, lse_ref, bl_ref = H.reference(q, k, v, block_size=64, causal=causal, softcap=softcap)
    assert np.array_equal(np.isneginf(bl), np.isneginf(bl_ref))
    fin = np.isfinite(bl_ref)
    assert (np.abs(bl[fin] - bl_ref[fin]) <= 5e-3 + 2e-3 * np.abs(bl_ref[fin])).all()
    assert (np.abs(lse - lse_ref) <= 5e-3 + 2e-3 * np.abs(lse_ref)).all()
    assert float(np.abs(out - out_ref).max()) <= 2e-2


@pytest.mark.parametrize("dtype,d", [("float16", 128), ("float16", 64), ("bfloat16", 192)],
                         ids=["fp16-d128", "fp16-d64", "bf16-d192"])
def test_dtypes_and_head_dims(runner, dtype, d):
    q, k, v = H.make_qkv(2, 333, 333, 4, 4, d, dtype=dtype, seed=6)
    full_check(runner, q, k, v, 64, dtype=dtype, causal=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_head_dims_192_128(runner, causal):
    """MLA-style prefill, Q / K 192 wide and V / O 128: two Q stages, K and V tiles share ring buffers
    sized for K (V loads expect V's bytes); GQA 2, Sk = 700 (neither a tile nor a block multiple)."""
    q, k, v = H.make_qkv(1, 384, 700, 4, 2, 192, seed=7)
    full_check(runner, q, k, np.ascontiguousarray(v[..., :128]), 64, causal=causal)


@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_documents_bit_identical(runner, causal, d):
    """Each packed document (unaligned starts) gives exactly what it gives alone; blocks past it are -inf."""
    lens = [40, 200, 72, 133, 1, 300]
    hq, bs = 4, 64
    total = sum(lens)
    q, k, v = H.make_qkv(1, total, total, hq, hq, d, seed=7, varlen=True)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    out, lse, bl = runner.run(q, k, v, causal=causal, block_size=bs, cu_q=cu, cu_k=cu, max_sq=max(lens),
                              max_sk=max(lens))
    assert not (bl == H.SENTINEL).any()
    out_ref, lse_ref, bl_ref = H.reference(q, k, v, causal=causal, block_size=bs, cu_q=cu, cu_k=cu,
                                           max_sk=max(lens))
    H.check_block_logit(bl, bl_ref)
    for i, n in enumerate(lens):
        a, e = int(cu[i]), int(cu[i + 1])
        one = np.array([0, n], dtype=np.int32)
        o1, l1, b1 = runner.run(q[a:e], k[a:e], v[a:e], causal=causal, block_size=bs, cu_q=one, cu_k=one,
                                max_sq=n, max_sk=n)
        assert np.array_equal(out[a:e], o1), f"doc {i}: out differs from the document alone"
        assert np.array_equal(lse[:, a:e], l1), f"doc {i}: lse differs from the document alone"
        nbd = b1.shape[-1]
        assert np.array_equal(bl[:, a:e, :nbd], b1), f"doc {i}: block_logit differs from the document alone"
        assert np.isneginf(bl[:, a:e, nbd:]).all(), f"doc {i}: blocks past the document are not -inf"


@pytest.mark.parametrize("case", ["full", "causal", "window", "sq-gt-sk", "causal-256"])
def test_sentinel_buffer_fully_overwritten(runner, case):
    """A poisoned buffer (sentinel / NaN) ends bitwise equal to a -inf-filled one: no pre-fill needed."""
    sq, sk = (512, 300) if case == "sq-gt-sk" else (640, 640)
    bs = 256 if case == "causal-256" else 32
    q, k, v = H.make_qkv(1, sq, sk, 2, 2, 128, seed=8)
    kw = dict(causal=case in ("causal", "sq-gt-sk", "causal-256"),
              window=(96, 0) if case == "window" else (-1, -1))
    _, _, a = runner.run(q, k, v, block_size=bs, fill=H.SENTINEL, **kw)
    _, _, b = runner.run(q, k, v, block_size=bs, fill=float("nan"), **kw)
    _, _, c = runner.run(q, k, v, block_size=bs, fill=float("-inf"), **kw)
    assert not (a == H.SENTINEL).any() and not np.isnan(b).any()
    assert np.array_equal(a, c) and np.array_equal(b, c)


def test_causal_unvisited_blocks(runner):
    """Causal: future blocks (key tiles the kernel never loads) are -inf, written by the kernel."""
    q, k, v = H.make_qkv(1, 512, 512, 2, 2, 128, seed=14)
    _, _, bl = runner.run(q, k, v, causal=True, block_size=64)
    _, _, bl_ref = H.reference(q, k, v, causal=True, block_size=64)
    future = np.isneginf(bl_ref)
    assert future.any() and np.isneginf(bl[future]).all()
    H.check_block_logit(bl, bl_ref)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_out_lse_bit_identical_with_without_block_logit(runner, d, causal):
    q, k, v = H.make_qkv(1, 700, 700, 4, 4, d, seed=9)
    o0, l0, _ = runner.run(q, k, v, causal=causal, block_size=0)
    for bs in (16, 64, 256):
        o1, l1, _ = runner.run(q, k, v, causal=causal, block_size=bs)
        assert np.array_equal(o0, o1), f"out changed by block_logit (block_size={bs})"
        assert np.array_equal(l0, l1), f"lse changed by block_logit (block_size={bs})"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_self_consistency(runner, causal):
    """max of two 64-blocks == the 128-block (bit-exact); max_j block_logit <= lse; run-to-run bitwise."""
    q, k, v = H.make_qkv(2, 600, 777, 4, 4, 128, seed=10)
    _, lse, b64 = runner.run(q, k, v, causal=causal, block_size=64)
    _, _, b128 = runner.run(q, k, v, causal=causal, block_size=128)
    nb128 = b128.shape[-1]
    pad = 2 * nb128 - b64.shape[-1]
    b64p = np.concatenate([b64, np.full((*b64.shape[:-1], pad), -np.inf, dtype=b64.dtype)], axis=-1)
    assert np.array_equal(b64p.reshape(*b64.shape[:-1], nb128, 2).max(-1), b128)
    row_max = b64.max(-1)
    fin = np.isfinite(row_max)
    assert (row_max[fin] <= lse[fin] + 1e-5 * np.abs(lse[fin]) + 1e-6).all()
    assert np.array_equal(np.isneginf(row_max), np.isneginf(lse))
    a = runner.run(q, k, v, causal=causal, block_size=64)
    b = runner.run(q, k, v, causal=causal, block_size=64)
    for x, y in zip(a, b):
        assert np.array_equal(x, y), "two runs differ"
