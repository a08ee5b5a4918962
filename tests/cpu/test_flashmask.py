"""FlashMask (``startend_row_indices``) on the reference backend against the fp64 oracle over the
expanded dense mask (tests/oracles/flashmask.py): every user mask type, Sq != Sk, GQA mask heads,
empty rows, window + mask, block_logit with and without block_bos, gradients, non-finite hidden
keys, document mask == varlen, the helpers, flashmask_attention's Paddle interface, and every
validation error."""

from __future__ import annotations

import types
import warnings

import numpy as np
import paddle
import pytest

import paddle_fa4
from paddle_fa4 import _spec
from paddle_fa4._cute import attention as glue
from tests.oracles import flashmask as F
from tests.oracles.tolerance import assert_close, assert_same_nonfinite

TOL = 2e-5


@pytest.fixture(autouse=True)
def _quiet_fallback_warnings():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*using the reference backend.*")
        yield


def inputs(seed, b, sq, sk, hq, hkv, d=16, dv=None):
    rng = np.random.default_rng(seed)
    dv = d if dv is None else dv
    return (rng.standard_normal((b, sq, hq, d)).astype(np.float32),
            rng.standard_normal((b, sk, hkv, d)).astype(np.float32),
            rng.standard_normal((b, sk, hkv, dv)).astype(np.float32),
            rng.standard_normal((b, sq, hq, dv)).astype(np.float32))


def t(x, dtype=None):
    x = paddle.to_tensor(x)
    return x if dtype is None else x.astype(dtype)


def run(q, k, v, se, causal, window=None, dout=None, **kw):
    """flashmask_attention (reference) with autograd: ``(out, lse, dq, dk, dv)`` as numpy."""
    qt, kt, vt = (t(x) for x in (q, k, v))
    for x in (qt, kt, vt):
        x.stop_gradient = False
    out, lse = paddle_fa4.flashmask_attention(qt, kt, vt, None if se is None else t(se), causal=causal,
                                              window_size=window, return_softmax_lse=True, backend="reference", **kw)
    grads = (None, None, None)
    if dout is not None:
        (out * t(dout)).sum().backward()
        grads = tuple(x.grad.numpy() for x in (qt, kt, vt))
    return (out.numpy(), lse.numpy()) + grads


def check(q, k, v, se, causal, window=(None, None), dout=None):
    """The reference against the oracle (outputs, and gradients when ``dout`` is given)."""
    sq, hq = q.shape[1], q.shape[2]
    vis = F.per_query_head(F.expand(se, causal, sq, window), hq)
    out, lse, dq, dk, dv = run(q, k, v, se, causal, window=None if window == (None, None) else window, dout=dout)
    o_ref, lse_ref, _ = F.attention(q, k, v, vis)
    assert_close("out", out, o_ref, TOL, TOL)
    assert_close("lse", lse, lse_ref, TOL, TOL)
    if dout is not None:
        for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), F.grads(q, k, v, dout, vis)):
            assert_close(name, got, want, TOL, TOL)
    return vis


USER_MASKS = {
    "causal_document": lambda: F.causal_document([5, 9, 1, 7]),
    "bidirectional_document": lambda: F.bidirectional_document([6, 4, 12]),
    "share_question": lambda: F.share_question([(4, [3, 5]), (3, [2, 4])]),
    "sliding_window": lambda: F.sliding_window(21, 5),
    "global_sliding_window": lambda: F.global_sliding_window(20, 3, 2),
    "causal_blockwise": lambda: F.causal_blockwise([5, 6, 4, 6]),
    "prefix_lm": lambda: F.prefix_lm(19, 7),
    "prefix_lm_documents": lambda: F.prefix_lm_documents([(8, 3), (5, 5), (9, 2)]),
    "random_eviction": lambda: F.random_eviction(20, seed=3),
}


@pytest.mark.parametrize("mask", sorted(USER_MASKS))
def test_user_masks_forward_and_grads(mask):
    """Each mask a user builds: its encoding expands to the intended dense mask, and the reference
    matches the oracle in out, lse and (GQA 4/2) gradients."""
    se, causal, intended = USER_MASKS[mask]()
    s = se.shape[2]
    np.testing.assert_array_equal(F.expand(se, causal, s)[0, 0], intended)
    se = np.repeat(se, 2, axis=0)
    q, k, v, dout = inputs(1, 2, s, s, 4, 2)
    check(q, k, v, se, causal, dout=dout)


@pytest.mark.parametrize("causal,cols", [(True, 1), (True, 2), (False, 2), (False, 4)])
@pytest.mark.parametrize("sq,sk", [(7, 19), (19, 7)])
def test_sq_ne_sk_random_masks(causal, cols, sq, sk):
    """Random masks of every layout with Sq != Sk (causal bottom-right), GQA 6/2, Hm = Hkv."""
    rng = np.random.default_rng(sq * 10 + cols)
    se = F.random_mask(rng, 2, 2, sq, sk, causal, cols)
    q, k, v, dout = inputs(2, 2, sq, sk, 6, 2)
    check(q, k, v, se, causal, dout=dout)


@pytest.mark.parametrize("hq,hkv,hm", [(4, 1, 1), (4, 1, 4), (3, 3, 3), (3, 3, 1), (6, 2, 6)])
def test_mask_heads(hq, hkv, hm):
    """Hm = 1 broadcasts, Hm = Hkv per kv head (MQA Hkv = 1 and MHA Hkv = Hq), Hm = Hq per query head;
    different masks per head so a wrong head mapping shows."""
    rng = np.random.default_rng(hq * 100 + hkv * 10 + hm)
    se = F.random_mask(rng, 1, hm, 11, 11, False, 4)
    q, k, v, dout = inputs(3, 1, 11, 11, hq, hkv)
    vis = check(q, k, v, se, False, dout=dout)
    if hm > 1:
        assert not all(np.array_equal(vis[0, 0], vis[0, h]) for h in range(hq))


def test_rows_with_no_keys():
    """Rows every column masks: out 0, lse -inf, zero dq; keys nobody sees: zero dk / dv; no NaN."""
    s = 10
    se = np.full((1, 1, s, 2), s, dtype=np.int32)  # causal [LTS, LTE]
    se[0, 0, :, 0] = 6  # rows 6..9 masked in every column: they see nothing
    se[0, 0, 2, :] = (0, s)  # key 2 hidden from every row
    q, k, v, dout = inputs(4, 1, s, s, 2, 1)
    out, lse, dq, dk, dv = run(q, k, v, se, True, dout=dout)
    assert np.all(out[0, 6:] == 0) and np.all(np.isneginf(lse[0, :, 6:])) and np.all(dq[0, 6:] == 0)
    assert np.all(dk[0, 2] == 0) and np.all(dv[0, 2] == 0)
    assert all(np.isfinite(x).all() for x in (out, dq, dk, dv))
    check(q, k, v, se, True, dout=dout)


@pytest.mark.parametrize("causal,window", [(True, (3, None)), (False, (2, 1)), (False, (None, 0))])
def test_window_combines_with_mask(causal, window):
    se, _, _ = F.causal_document([6, 8, 5]) if causal else F.bidirectional_document([6, 8, 5])
    q, k, v, dout = inputs(5, 1, 19, 19, 2, 2)
    check(q, k, v, se, causal, window=window, dout=dout)


def test_window_only_matches_paddle_window():
    """flashmask_attention(window_size=w) without a mask: Paddle's window (built as its own mask)."""
    s, w = 13, 3
    q, k, v, _ = inputs(6, 1, s, s, 2, 2)
    out = run(q, k, v, None, True, window=w)[0]
    se = np.minimum(np.arange(s) + w + 1, s).reshape(1, 1, s, 1).astype(np.int32)  # Paddle's causal window
    np.testing.assert_allclose(out, run(q, k, v, se, True)[0], rtol=1e-6, atol=1e-6)
    out = run(q, k, v, None, False, window=(2, 1))[0]
    j = np.arange(s)
    se = np.stack([np.minimum(j + 3, s), np.maximum(j - 1, 0)], -1).reshape(1, 1, s, 2).astype(np.int32)
    np.testing.assert_allclose(out, run(q, k, v, se, False)[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("with_bos", [False, True])
def test_block_logit(with_bos):
    """block_logit under a document mask, absolute or document-relative (block_bos) block ids:
    the -inf pattern is exact and the values match the oracle."""
    docs = [7, 13, 4, 9]
    se, causal, _ = F.causal_document(docs)
    s = se.shape[2]
    q, k, v, _ = inputs(7, 1, s, s, 4, 2)
    starts = np.repeat(np.cumsum(docs) - np.asarray(docs), docs)
    bos = starts.reshape(1, s).astype(np.int32) if with_bos else None
    out, lse, bl = paddle_fa4.flash_attn_fwd(
        t(q), t(k), t(v), causal=causal, startend_row_indices=t(se), block_size=16, return_block_logit=True,
        block_bos=None if bos is None else t(bos), backend="reference")
    vis = F.per_query_head(F.expand(se, causal, s), 4)
    o_ref, lse_ref, bl_ref = F.attention(q, k, v, vis, block_size=16, bos=bos)
    assert bl.shape == [1, 4, s, 3]
    assert_same_nonfinite("block_logit", bl, bl_ref)
    assert_close("block_logit", bl, bl_ref, TOL, TOL)
    assert_close("out", out, o_ref, TOL, TOL)
    if with_bos:  # document-relative: every row's first block holds its document's first key
        assert np.isfinite(bl.numpy()[..., 0]).all()


def test_block_bos_columns_before_origin_belong_to_no_block():
    """Without a mask, keys before bos_i are attended to but counted in no block."""
    q, k, v, _ = inputs(8, 1, 5, 40, 1, 1)
    bos = np.array([[0, 9, 17, 40, 30]], dtype=np.int32)
    _, _, bl = paddle_fa4.flash_attn_fwd(t(q), t(k), t(v), block_size=16, return_block_logit=True,
                                         block_bos=t(bos), backend="reference")
    vis = np.ones((1, 1, 5, 40), dtype=bool)
    bl_ref = F.attention(q, k, v, vis, block_size=16, bos=bos)[2]
    assert_close("block_logit", bl, bl_ref, TOL, TOL)
    got = np.isfinite(bl.numpy()[0, 0])
    assert got.tolist() == [[True] * 3, [True, True, False], [True, True, False], [False] * 3, [True, False, False]]


def test_hidden_non_finite_keys_do_not_leak():
    """NaN / inf in K and V of keys a row cannot see never reach that row's out or gradients."""
    docs = [5, 6, 5]
    se, causal, _ = F.bidirectional_document(docs)
    s = se.shape[2]
    q, k, v, dout = inputs(9, 1, s, s, 2, 1)
    k_bad, v_bad = k.copy(), v.copy()
    k_bad[0, 7, 0, 3] = np.nan  # document 1 (tokens 5..10)
    v_bad[0, 8, 0, 1] = np.inf
    v_bad[0, 9, 0, 0] = np.nan
    out, lse, dq, dk, dv = run(q, k_bad, v_bad, se, causal, dout=dout)
    ref = run(q, k, v, se, causal, dout=dout)
    for rows in (slice(0, 5), slice(11, 16)):  # the other documents: identical to clean inputs
        np.testing.assert_array_equal(out[0, rows], ref[0][0, rows])
        np.testing.assert_array_equal(dq[0, rows], ref[2][0, rows])
        np.testing.assert_array_equal(dk[0, rows], ref[3][0, rows])
        np.testing.assert_array_equal(dv[0, rows], ref[4][0, rows])
    assert not np.isfinite(out[0, 5:11]).all()  # the document that sees them does see them


@pytest.mark.parametrize("causal", [True, False])
def test_document_mask_equals_varlen(causal):
    """A document mask over packed rows == flash_attn_varlen_func over the same documents (out, lse,
    grads), through both helpers."""
    docs = [[4, 9, 3], [7, 2, 7]]
    s = 16
    cus = [t(np.concatenate([[0], np.cumsum(d)]).astype(np.int32)) for d in docs]
    se = paddle_fa4.startend_row_indices_from_cu_seqlens(cus, causal=causal)
    assert se.shape == [2, 1, s, 1 if causal else 2]
    cu, max_len = paddle_fa4.cu_seqlens_from_startend_row_indices(se, causal=causal)
    assert cu.numpy().tolist() == [0, 4, 13, 16, 23, 25, 32] and max_len == 9
    q, k, v, dout = inputs(10, 2, s, s, 4, 2)
    out, lse, dq, dk, dv = run(q, k, v, se.numpy(), causal, dout=dout)
    flat = [t(x.reshape((2 * s,) + x.shape[2:])) for x in (q, k, v)]
    for x in flat:
        x.stop_gradient = False
    o2, lse2 = paddle_fa4.flash_attn_varlen_func(*flat, cu, cu, max_seqlen_q=max_len, max_seqlen_k=max_len,
                                                 causal=causal, backend="reference")
    (o2 * t(dout.reshape(2 * s, 4, 16))).sum().backward()
    np.testing.assert_allclose(out.reshape(2 * s, 4, 16), o2.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse.transpose(1, 0, 2).reshape(4, 2 * s), lse2.numpy(), rtol=1e-5, atol=1e-5)
    for got, x in zip((dq, dk, dv), flat):
        np.testing.assert_allclose(got.reshape(x.shape), x.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_helpers_padding_and_reverse_errors():
    cu = t(np.array([0, 3, 5], dtype=np.int32))
    se = paddle_fa4.startend_row_indices_from_cu_seqlens(cu, causal=False, seqlen=7)
    assert se.numpy()[0, 0].T.tolist() == [[3, 3, 3, 5, 5, 0, 0], [0, 0, 0, 3, 3, 0, 0]]
    assert paddle_fa4.cu_seqlens_from_startend_row_indices(se, causal=False)[0].numpy().tolist() == [0, 3, 5]
    # padding rows see nothing: out 0 / lse -inf there
    q, k, v, _ = inputs(11, 1, 7, 7, 1, 1)
    out, lse = run(q, k, v, se.numpy(), False)[:2]
    assert np.all(out[0, 5:] == 0) and np.all(np.isneginf(lse[0, :, 5:]))
    with pytest.raises(ValueError, match="not a document mask"):
        paddle_fa4.cu_seqlens_from_startend_row_indices(t(F.sliding_window(8, 2)[0]), causal=True)
    with pytest.raises(ValueError, match="trailing padding"):
        paddle_fa4.cu_seqlens_from_startend_row_indices(t(np.concatenate([se.numpy()] * 2)), causal=False)
    with pytest.raises(ValueError, match="column"):
        paddle_fa4.cu_seqlens_from_startend_row_indices(se, causal=True)
    with pytest.raises(ValueError, match="differs between heads"):
        two = np.concatenate([se.numpy(), se.numpy()[:, :, ::-1]], axis=1)
        paddle_fa4.cu_seqlens_from_startend_row_indices(t(np.ascontiguousarray(two)), causal=False)
    with pytest.raises(ValueError, match="non-decreasing"):
        paddle_fa4.startend_row_indices_from_cu_seqlens(t(np.array([0, 4, 2], dtype=np.int32)))
    with pytest.raises(ValueError, match="seqlen"):
        paddle_fa4.startend_row_indices_from_cu_seqlens(cu, seqlen=4)


def test_flashmask_attention_interface():
    """Paddle's returns and defaults; no mask = plain attention; flash_attn_bwd with the mask
    equals autograd; lse is not differentiable."""
    se, causal, _ = F.causal_document([4, 6])
    q, k, v, dout = inputs(12, 1, 10, 10, 2, 2)
    qt, kt, vt = t(q), t(k), t(v)
    out = paddle_fa4.flashmask_attention(qt, kt, vt, t(se), causal=True, backend="reference")
    assert isinstance(out, paddle.Tensor) and out.shape == [1, 10, 2, 16]
    dense = paddle_fa4.flashmask_attention(qt, kt, vt, causal=True, backend="reference")
    np.testing.assert_array_equal(dense.numpy(), paddle_fa4.flash_attn_func(qt, kt, vt, causal=True,
                                                                            backend="reference")[0].numpy())
    out2, lse = paddle_fa4.flash_attn_fwd(qt, kt, vt, causal=True, startend_row_indices=t(se), backend="reference")
    np.testing.assert_array_equal(out.numpy(), out2.numpy())
    grads = paddle_fa4.flash_attn_bwd(t(dout), qt, kt, vt, out2, lse, causal=True, startend_row_indices=t(se),
                                      backend="reference")
    auto = run(q, k, v, se, True, dout=dout)[2:]
    for got, want in zip(grads, auto):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6)
    # bfloat16 inputs (reference upcasts), rng_name / training accepted with dropout 0
    o16 = paddle_fa4.flashmask_attention(t(q, "bfloat16"), t(k, "bfloat16"), t(v, "bfloat16"), t(se), causal=True,
                                         rng_name="x", training=False, backend="reference")
    assert o16.dtype == paddle.bfloat16


def expect(exc, match, *args, **kw):
    with pytest.raises(exc, match=match):
        paddle_fa4.flashmask_attention(*args, backend="reference", **kw)


def test_validation_errors():
    q, k, v, _ = inputs(13, 2, 8, 6, 4, 2)
    qt, kt, vt = t(q), t(k), t(v)
    good = np.full((2, 1, 6, 2), 8, dtype=np.int32)
    expect(NotImplementedError, "dropout", qt, kt, vt, t(good), dropout=0.1)
    expect(NotImplementedError, "block_mask", qt, kt, vt, t(good), block_mask=t(good))
    expect(NotImplementedError, "return_seed_offset", qt, kt, vt, t(good), return_seed_offset=True)
    expect(NotImplementedError, "fixed_seed_offset", qt, kt, vt, t(good), fixed_seed_offset=t(good))
    expect(TypeError, "startend_row_indices.*int32", qt, kt, vt, t(good.astype(np.float32)))  # int64: converted
    expect(ValueError, "startend_row_indices.*rank|startend_row_indices.*4-D|startend_row_indices", qt, kt, vt,
           t(good[0]))
    expect(ValueError, "1 or 2 columns with causal=True", qt, kt, vt, t(np.full((2, 1, 6, 4), 8, np.int32)),
           causal=True)
    expect(ValueError, "2 or 4 columns with causal=False", qt, kt, vt, t(np.full((2, 1, 6, 1), 8, np.int32)))
    expect(ValueError, r"\[B, H, Sk", qt, kt, vt, t(np.full((1, 1, 6, 2), 8, np.int32)))  # batch
    expect(ValueError, r"\[B, H, Sk", qt, kt, vt, t(np.full((2, 3, 6, 2), 8, np.int32)))  # heads
    expect(ValueError, r"\[B, H, Sk", qt, kt, vt, t(np.full((2, 1, 8, 2), 8, np.int32)))  # Sq instead of Sk
    expect(ValueError, r"\[0, Sq\] = \[0, 8\]", qt, kt, vt, t(np.full((2, 1, 6, 2), 9, np.int32)))
    expect(ValueError, r"\[0, Sq\]", qt, kt, vt, t(np.full((2, 1, 6, 2), -1, np.int32)))
    bad = np.full((2, 1, 6, 2), 8, np.int32)
    bad[1, 0, 4] = (5, 3)
    expect(ValueError, r"LTS > LTE at \[b, h, key\] = \[1, 0, 4\]", qt, kt, vt, t(bad), causal=True)
    flashmask_ok = paddle_fa4.flashmask_attention(qt, kt, vt, t(bad), causal=False, backend="reference")
    assert flashmask_ok.shape == [2, 8, 4, 16]  # [LTS, UTE] has no order
    four = np.zeros((2, 1, 6, 4), np.int32)
    four[0, 0, 1] = (0, 0, 4, 2)
    expect(ValueError, "UTS > UTE", qt, kt, vt, t(four))
    expect(ValueError, "window_size", qt, kt, vt, t(good), window_size=(1, 2, 3))
    # flash_attn_fwd / flash_attn_bwd: varlen, block_bos
    cu = t(np.array([0, 8], np.int32))
    with pytest.raises(NotImplementedError, match="startend_row_indices with cu_seqlens"):
        paddle_fa4.flash_attn_fwd(qt[0], kt[0], vt[0], cu_seqlens_q=cu, cu_seqlens_k=t(np.array([0, 6], np.int32)),
                                  max_seqlen_q=8, max_seqlen_k=6, backend="reference", startend_row_indices=t(good))
    kw = dict(causal=False, backend="reference")
    with pytest.raises(ValueError, match="block_bos only shifts block_logit"):
        paddle_fa4.flash_attn_fwd(qt, kt, vt, block_bos=t(np.zeros((2, 8), np.int32)), **kw)
    for bos, exc, match in ((np.zeros((2, 8), np.float32), TypeError, "block_bos"),
                            (np.zeros((2, 6), np.int32), ValueError, r"block_bos.*\[B, Sq\]"),
                            (np.full((2, 8), 7, np.int32), ValueError, r"block_bos values must lie in \[0, Sk\]")):
        with pytest.raises(exc, match=match):
            paddle_fa4.flash_attn_fwd(qt, kt, vt, block_bos=t(bos), return_block_logit=True, **kw)
    with pytest.raises(ValueError, match=r"\[0, Sq\]"):
        paddle_fa4.flash_attn_bwd(qt, qt, kt, vt, qt, t(np.zeros((2, 4, 8), np.float32)), causal=False,
                                  startend_row_indices=t(np.full((2, 1, 6, 2), 9, np.int32)), backend="reference")


def test_cute_backend_names_the_case():
    """Cases without a FlashMask kernel are named (auto runs the reference, cute raises): varlen; the SM90 /
    SM100 forward and backward take every layout, and both forwards take block_bos."""
    base = dict(batch=1, seqlen_q=128, seqlen_k=128, total_q=128, total_k=128, num_heads=2, num_heads_k=2,
                head_dim=128, head_dim_v=128, dtype="bfloat16", varlen=False, softmax_scale=0.1, softcap=0.0,
                causal=True, window_left=None, window_right=0, block_size=0, num_blocks=0, pack_gqa=False)
    spec = _spec.AttnFwdSpec(**base, startend="lts", startend_heads=1)
    assert glue.unsupported_reason(90, spec) is None and glue.bwd_unsupported_reason(90, spec, True, False) is None
    for arch in (100, 103):  # the SM100 kernels take every layout too (compile-verified)
        assert glue.unsupported_reason(arch, spec) is None
        assert glue.bwd_unsupported_reason(arch, spec, True, False) is None
    varlen = _spec.AttnFwdSpec(**dict(base, varlen=True), startend="lts", startend_heads=1)
    assert "with varlen" in glue.unsupported_reason(90, varlen)
    spec = _spec.AttnFwdSpec(**dict(base, block_size=64, num_blocks=2), has_block_bos=True)
    for arch in (90, 100, 103):  # block_bos: both forwards take it (SM100 compile-verified, never run)
        assert glue.unsupported_reason(arch, spec) is None
    spec = _spec.AttnFwdSpec(**dict(base, block_size=64, num_blocks=2), has_block_bos=True, startend="lts",
                             startend_heads=1)
    assert glue.unsupported_reason(90, spec) is None
    with pytest.raises(NotImplementedError, match="backend='cute'"):
        q = t(np.zeros((1, 4, 1, 16), np.float32))
        paddle_fa4.flashmask_attention(q, q, q, t(np.full((1, 1, 4, 1), 4, np.int32)), causal=True, backend="cute")


@pytest.mark.parametrize("causal,cols", [(True, 1), (True, 2), (False, 2), (False, 4)])
def test_visible_pairs_counts_the_dense_mask(causal, cols):
    """The benchmark's visible-pair count (no dense mask) equals the dense mask's."""
    rng = np.random.default_rng(cols + 7 * causal)
    for sq, sk in ((13, 13), (9, 21), (21, 9)):
        se = F.random_mask(rng, 2, 3, sq, sk, causal, cols)
        assert F.visible_pairs(se, causal, sq) == int(F.expand(se, causal, sq).sum())


def test_cute_glue_plumbing(monkeypatch):
    """The CuTe forward path of a FlashMask call (fake launcher, pretend SM90): the config names the
    layout, run_fwd gets the bounds and the fm_meta workspace in the kernel's tiles; the backward's
    config names it too and run_bwd gets the bounds and the key-tile workspace."""
    from cute_kernels.attention import fm_meta
    from paddle_fa4 import backend as backend_mod

    seen = {}

    class Launch:
        def fwd_config(self, **kw):
            seen["cfg"] = kw
            return types.SimpleNamespace(**kw)

        def unsupported_reason(self, cfg):
            return None

        def fm_meta_config(self, cfg):
            return fm_meta.FmMetaConfig(90, cfg.startend, 128, 128)

        def run_fwd(self, cfg, q, k, v, out, lse, block_logit, cu_q, cu_k, **kw):
            seen["run"] = kw
            paddle.assign(paddle.full(out.shape, 7.0).astype(out.dtype), out)
            paddle.assign(paddle.full(lse.shape, 3.0), lse)

    launch = Launch()
    monkeypatch.setattr(backend_mod, "tensor_arch", lambda tensor: 90)
    monkeypatch.setattr(glue, "arch_of", lambda tensor: 90)
    monkeypatch.setattr(glue, "_launch", lambda: launch)
    q = t(np.zeros((2, 300, 4, 128), np.float32), "bfloat16")
    k = t(np.zeros((2, 200, 2, 128), np.float32), "bfloat16")
    se = t(np.full((2, 2, 200, 4), 300, np.int32))
    out = paddle_fa4.flashmask_attention(q, k, k, se, backend="cute")
    assert seen["cfg"]["startend"] == "lts_lte_uts_ute" and seen["cfg"]["causal"] is False
    run = seen["run"]
    assert run["startend"] is not None and list(run["startend"].shape) == [2, 2, 200, 4]
    assert list(run["fm_minmax"].shape) == [2, 2, 2, 8] and list(run["fm_ranges"].shape) == [2, 2, 3, 2 * 2 + 3]
    assert float(out.astype("float32").mean()) == 7.0
    bwd = {}

    class BwdLaunch:
        def bwd_config(self, **kw):
            bwd["cfg"] = kw
            return types.SimpleNamespace(**kw)

        def unsupported_reason(self, cfg):
            return None

        def fm_meta_config(self, cfg):
            return fm_meta.FmMetaConfig(90, cfg.startend, 64, 128)

        def workspace_shapes(self, cfg, **kw):
            return {}

        def run_bwd(self, cfg, dout, q, k, v, out, lse, dlse, dq, dk, dv, cu_q, cu_k, ws, **kw):
            bwd["run"] = kw
            for g in (dq, dk, dv):
                paddle.assign(paddle.full(g.shape, 2.0).astype(g.dtype), g)

    monkeypatch.setattr(glue, "_bwd_launch", lambda: BwdLaunch())
    q.stop_gradient = False
    out = paddle_fa4.flashmask_attention(q, k, k, se, backend="cute", deterministic=True)
    out.sum().backward()
    assert bwd["cfg"]["startend"] == "lts_lte_uts_ute" and bwd["cfg"]["deterministic"] is True
    assert list(bwd["run"]["fm_minmax"].shape) == [2, 2, 2, 8]
    assert list(bwd["run"]["startend"].shape) == [2, 2, 200, 4]
    assert float(q.grad.astype("float32").mean()) == 2.0


def test_cute_glue_block_bos_plumbing(monkeypatch):
    """block_bos on the CuTe forward path (fake launcher, pretend SM90): the config says block_bos, run_fwd
    gets the int32 [B, Sq] origins (int64 input converted) next to the FlashMask bounds and block_logit;
    without block_bos neither the flag nor the tensor reaches the launcher."""
    from cute_kernels.attention import fm_meta
    from paddle_fa4 import backend as backend_mod

    seen = {}

    class Launch:
        def fwd_config(self, **kw):
            seen["cfg"] = kw
            return types.SimpleNamespace(**kw)

        def unsupported_reason(self, cfg):
            return None

        def fm_meta_config(self, cfg):
            return fm_meta.FmMetaConfig(90, cfg.startend, 128, 128)

        def run_fwd(self, cfg, q, k, v, out, lse, block_logit, cu_q, cu_k, **kw):
            seen["run"] = kw
            seen["block_logit"] = block_logit
            paddle.assign(paddle.full(out.shape, 7.0).astype(out.dtype), out)
            paddle.assign(paddle.full(lse.shape, 3.0), lse)
            paddle.assign(paddle.full(block_logit.shape, 5.0), block_logit)

    monkeypatch.setattr(backend_mod, "tensor_arch", lambda tensor: 90)
    monkeypatch.setattr(glue, "arch_of", lambda tensor: 90)
    monkeypatch.setattr(glue, "_launch", lambda: Launch())
    q = t(np.zeros((2, 300, 4, 128), np.float32), "bfloat16")
    k = t(np.zeros((2, 200, 2, 128), np.float32), "bfloat16")
    se = t(np.full((2, 1, 200, 1), 300, np.int32))
    bos = np.zeros((2, 300), np.int64)
    bos[:, 150:] = 120
    _out, _lse, bl = paddle_fa4.flash_attn_fwd(q, k, k, causal=True, startend_row_indices=se,
                                               return_block_logit=True, block_size=64, block_bos=t(bos),
                                               backend="cute")
    assert seen["cfg"]["block_bos"] is True and seen["cfg"]["startend"] == "lts"
    run = seen["run"]
    assert run["startend"] is not None and run["block_bos"] is not None
    assert list(run["block_bos"].shape) == [2, 300] and run["block_bos"].dtype == paddle.int32
    np.testing.assert_array_equal(run["block_bos"].numpy(), bos.astype(np.int32))
    assert list(seen["block_logit"].shape) == [2, 4, 300, 4] and float(bl.mean()) == 5.0
    paddle_fa4.flash_attn_fwd(q, k, k, causal=True, startend_row_indices=se, return_block_logit=True,
                              block_size=64, backend="cute")
    assert seen["cfg"]["block_bos"] is False and "block_bos" not in seen["run"]


def test_flashmask_attention_signature_is_paddles():
    """Replacing the import is the whole migration: every parameter of Paddle's own
    ``paddle.nn.functional.flashmask_attention`` exists here with the same kind and default, in the same order;
    ours only adds keyword-only parameters after them."""
    import inspect

    import paddle

    import paddle_fa4

    theirs = getattr(paddle.nn.functional, "flashmask_attention", None)
    if theirs is None:
        pytest.skip("this Paddle build has no paddle.nn.functional.flashmask_attention")
    p_theirs = list(inspect.signature(theirs).parameters.values())
    p_ours = list(inspect.signature(paddle_fa4.flashmask_attention).parameters.values())
    assert [p.name for p in p_ours[:len(p_theirs)]] == [p.name for p in p_theirs]
    for a, b in zip(p_ours, p_theirs):
        assert a.kind == b.kind and a.default == b.default, (a, b)
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in p_ours[len(p_theirs):])
