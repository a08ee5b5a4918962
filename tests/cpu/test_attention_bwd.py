"""Attention backward: the reference flash_attn_bwd against a float64 oracle, the autograd contract
of flash_attn_fwd (one PyLayer for both backends), flash_attn_bwd's validation, and the CuTe
backward glue's plumbing driven by a fake launcher."""

from __future__ import annotations

import re
import types
import warnings

import numpy as np
import paddle
import pytest

import paddle_fa4
from paddle_fa4 import attention as attention_mod
from paddle_fa4 import backend as backend_mod
from paddle_fa4._cute import attention as glue
from paddle_fa4.reference import attention as ref_attention
from tests.oracles import attention_bwd as oracle
from tests.oracles.tolerance import assert_close, rel_l2, to_numpy64

GRAD_TOL = {"float32": (1e-4, 1e-4), "bfloat16": (6e-2, 3e-2), "float16": (1e-2, 1e-2)}


@pytest.fixture(autouse=True)
def _quiet_fallback_warnings():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*using the reference backend.*")
        yield


def arr(rng, shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def make_case(seed, b, sq, sk, hq, hkv, d, dv=None, varlen=False, q_scale=1.0):
    """numpy float32 q, k, v, dout (varlen drops the batch axis; b is then ignored)."""
    rng = np.random.default_rng(seed)
    dv = d if dv is None else dv
    lead_q, lead_k = ([sq], [sk]) if varlen else ([b, sq], [b, sk])
    return (arr(rng, lead_q + [hq, d], q_scale), arr(rng, lead_k + [hkv, d]), arr(rng, lead_k + [hkv, dv]),
            arr(rng, lead_q + [hq, dv]))


def tensors(*arrays, dtype="float32"):
    return tuple(paddle.to_tensor(a).astype(dtype) for a in arrays)


def oracle_kw(kw):
    cu_q, cu_k = kw.get("cu_seqlens_q"), kw.get("cu_seqlens_k")
    return dict(softmax_scale=kw.get("softmax_scale"), causal=kw.get("causal", False),
                window=kw.get("window_size", (None, None)), softcap=kw.get("softcap", 0.0),
                cu_seqlens_q=None if cu_q is None else cu_q.numpy(), cu_seqlens_k=None if cu_k is None else cu_k.numpy())


def check_bwd(q_np, k_np, v_np, dout_np, dlse_np=None, dtype="float32", **kw):
    """Reference forward + flash_attn_bwd against the oracle's gradients; returns (dq, dk, dv)."""
    q, k, v, dout = tensors(q_np, k_np, v_np, dout_np, dtype=dtype)
    out, lse = paddle_fa4.flash_attn_fwd(q, k, v, backend="reference", **kw)[:2]
    dlse = None if dlse_np is None else paddle.to_tensor(dlse_np)
    grads = paddle_fa4.flash_attn_bwd(dout, q, k, v, out, lse, dlse=dlse, backend="reference", **kw)
    expected = oracle.attention_bwd(to_numpy64(q), to_numpy64(k), to_numpy64(v), to_numpy64(dout), dlse_np,
                                    **oracle_kw(kw))
    for name, g, e, t in zip(("dq", "dk", "dv"), grads, expected, (q, k, v)):
        assert g.dtype == t.dtype and g.shape == t.shape and g.stop_gradient
        assert_close(name, g, e, *GRAD_TOL[dtype])
    return grads


# ---------------------------------------------------------------------------------------------
# the oracle itself


FD_CASES = [
    pytest.param(dict(causal=True), (1, 5, 7, 2, 1, 4), id="causal-gqa-sq-lt-sk"),
    pytest.param(dict(window_size=(1, 2), softcap=1.5), (2, 6, 4, 2, 2, 3), id="window-softcap-sq-gt-sk"),
    pytest.param(dict(causal=True, softmax_scale=0.7), (1, 6, 3, 3, 1, 4), id="mqa-rows-without-keys"),
]


@pytest.mark.parametrize("with_dlse", [False, True], ids=["dout", "dout-dlse"])
@pytest.mark.parametrize("kw,shape", FD_CASES)
def test_oracle_matches_finite_differences(kw, shape, with_dlse):
    b, sq, sk, hq, hkv, d = shape
    q, k, v, dout = make_case(21, b, sq, sk, hq, hkv, d, q_scale=2.0)
    dlse = np.random.default_rng(22).standard_normal((b, hq, sq)) if with_dlse else None
    okw = oracle_kw(kw)
    grads = oracle.attention_bwd(q, k, v, dout, dlse, **okw)
    rng = np.random.default_rng(23)
    for which, g in zip("qkv", grads):
        for _ in range(6):
            index = tuple(int(rng.integers(0, n)) for n in g.shape)
            fd = oracle.finite_difference(q, k, v, dout, dlse, which, index, **okw)
            assert abs(fd - g[index]) <= 1e-6 + 1e-6 * abs(fd), (which, index, fd, g[index])
    assert max(float(np.abs(g).max()) for g in grads) > 0.1  # not a trivially zero case


# ---------------------------------------------------------------------------------------------
# reference backward vs the oracle

SHAPES = [  # (b, sq, sk, hq, hkv, d, dv)
    pytest.param((1, 17, 17, 2, 2, 16, 16), id="square"),
    pytest.param((2, 9, 30, 2, 2, 16, 16), id="sq-lt-sk"),
    pytest.param((2, 30, 9, 2, 2, 16, 16), id="sq-gt-sk-rows-without-keys"),
    pytest.param((1, 1, 1, 1, 1, 8, 8), id="one-token"),
    pytest.param((1, 12, 20, 8, 2, 16, 16), id="gqa-8-2"),
    pytest.param((1, 12, 20, 8, 1, 16, 16), id="mqa-8-1"),
    pytest.param((1, 11, 23, 4, 2, 24, 8), id="dv-differs"),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES)
def test_shapes(shape, causal):
    b, sq, sk, hq, hkv, d, dv = shape
    check_bwd(*make_case(1, b, sq, sk, hq, hkv, d, dv), causal=causal)


WINDOWS = [
    pytest.param(False, (4, None), id="left-4"),
    pytest.param(False, (None, 3), id="right-3"),
    pytest.param(False, (2, 2), id="left-2-right-2"),
    pytest.param(False, (0, 0), id="diagonal-only"),
    pytest.param(True, (5, None), id="causal-left-5"),
]


@pytest.mark.parametrize("sq,sk", [(16, 16), (9, 30), (30, 9)], ids=["sq-eq-sk", "sq-lt-sk", "sq-gt-sk"])
@pytest.mark.parametrize("causal,window", WINDOWS)
def test_windows(causal, window, sq, sk):
    check_bwd(*make_case(2, 1, sq, sk, 4, 2, 16), causal=causal, window_size=window)


@pytest.mark.parametrize("causal,window", [(False, (None, None)), (True, (None, None)), (False, (3, 2))],
                         ids=["full", "causal", "window"])
def test_softcap(causal, window):
    check_bwd(*make_case(3, 2, 13, 21, 4, 2, 16, q_scale=3.0), causal=causal, window_size=window, softcap=2.5)


def test_softmax_scale():
    check_bwd(*make_case(4, 1, 8, 8, 2, 2, 16), softmax_scale=0.37, causal=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dlse(causal):
    """A loss that reads lse: D = rowsum(dout * out) - dlse."""
    b, sq, sk, hq = 2, 14, 10, 4
    case = make_case(5, b, sq, sk, hq, 2, 16)
    dlse = np.random.default_rng(6).standard_normal((b, hq, sq)).astype(np.float32)
    with_dlse = check_bwd(*case, dlse_np=dlse, causal=causal, softcap=3.0)
    without = check_bwd(*case, causal=causal, softcap=3.0)
    assert float((with_dlse[0] - without[0]).abs().max()) > 1e-2  # dlse changes dq


def test_dlse_zero_equals_none():
    case = make_case(7, 1, 9, 9, 2, 1, 16)
    a = check_bwd(*case, dlse_np=np.zeros((1, 2, 9), np.float32), causal=True)
    b = check_bwd(*case, causal=True)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.numpy(), y.numpy())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_inputs(dtype):
    check_bwd(*make_case(8, 2, 17, 29, 4, 2, 32), dtype=dtype, causal=True)


def test_rows_without_keys_have_zero_gradients():
    """Causal Sq > Sk: the first Sq - Sk rows see nothing -> exactly zero dq there, no NaN anywhere;
    with a window, key rows no query sees get exactly zero dk / dv."""
    q, k, v, dout = tensors(*make_case(9, 1, 12, 5, 2, 2, 16))
    out, lse = paddle_fa4.flash_attn_fwd(q, k, v, causal=True, backend="reference")
    dq, dk, dv = paddle_fa4.flash_attn_bwd(dout, q, k, v, out, lse, causal=True, backend="reference")
    assert np.all(np.isneginf(lse.numpy()[0, :, :7]))
    assert np.all(dq.numpy()[0, :7] == 0) and np.abs(dq.numpy()[0, 7:]).max() > 0
    assert all(np.isfinite(g.numpy()).all() for g in (dq, dk, dv))
    # window (0, 0) with Sq < Sk: only keys Sk - Sq .. Sk - 1 are seen
    q, k, v, dout = tensors(*make_case(10, 1, 4, 9, 2, 2, 16))
    out, lse = paddle_fa4.flash_attn_fwd(q, k, v, window_size=(0, 0), backend="reference")
    dq, dk, dv = paddle_fa4.flash_attn_bwd(dout, q, k, v, out, lse, window_size=(0, 0), backend="reference")
    assert np.all(dk.numpy()[0, :5] == 0) and np.all(dv.numpy()[0, :5] == 0)
    assert np.abs(dv.numpy()[0, 5:]).min() > 0


def test_chunked_rows(monkeypatch):
    """Tiny tiles force many query-row chunks: dk / dv accumulate across chunks correctly."""
    monkeypatch.setattr(ref_attention, "TILE_BYTES", 4 * 4 * 4 * 40 * 3)  # 3 rows per chunk (Hq 4, Sk 40)
    calls = []
    original = ref_attention._chunk_bwd
    monkeypatch.setattr(ref_attention, "_chunk_bwd", lambda *a: calls.append(a[10]) or original(*a))  # a[10]: row0
    check_bwd(*make_case(11, 2, 17, 40, 4, 2, 16), causal=True, window_size=(9, None), softcap=4.0)
    assert calls[:6] == [0, 3, 6, 9, 12, 15] and len(calls) == 12  # 6 chunks per sequence, 2 sequences


def test_no_keys_at_all():
    """Sk = 0: zero gradients of the right shapes; Sq = 0: empty dq, zero dk / dv."""
    for sq, sk in ((5, 0), (0, 7)):
        q, k, v, dout = tensors(*make_case(12, 2, sq, sk, 2, 2, 16))
        out, lse = paddle_fa4.flash_attn_fwd(q, k, v, backend="reference")
        dq, dk, dv = paddle_fa4.flash_attn_bwd(dout, q, k, v, out, lse, backend="reference")
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        for g in (dq, dk, dv):
            assert g.size == 0 or float(g.abs().max()) == 0.0


VARLEN = [  # (q lengths, k lengths): an empty query document, a document without keys, Sq > Sk and Sq < Sk
    pytest.param(([5, 0, 17, 9], [7, 3, 17, 20]), id="ragged-empty-q-doc"),
    pytest.param(([6, 4, 8], [3, 0, 12]), id="doc-without-keys"),
    pytest.param(([9, 20], [20, 9]), id="sq-lt-and-gt-sk"),
]


@pytest.mark.parametrize("causal,window", [(False, (None, None)), (True, (None, None)), (True, (6, None))],
                         ids=["full", "causal", "causal-window"])
@pytest.mark.parametrize("lengths", VARLEN)
def test_varlen(lengths, causal, window):
    lq, lk = lengths
    cu_q = paddle.to_tensor(np.cumsum([0] + lq), dtype="int32")
    cu_k = paddle.to_tensor(np.cumsum([0] + lk), dtype="int32")
    q_np, k_np, v_np, dout_np = make_case(13, None, sum(lq), sum(lk), 4, 2, 16, varlen=True)
    dlse = np.random.default_rng(14).standard_normal((4, sum(lq))).astype(np.float32)
    kw = dict(causal=causal, window_size=window, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lq),
              max_seqlen_k=max(lk))
    dq, dk, dv = check_bwd(q_np, k_np, v_np, dout_np, dlse_np=dlse, **kw)
    # each document equals running it alone through the padded layout
    q, k, v, dout = tensors(q_np, k_np, v_np, dout_np)
    for i in range(len(lq)):
        q0, q1, k0, k1 = sum(lq[:i]), sum(lq[:i + 1]), sum(lk[:i]), sum(lk[:i + 1])
        if q1 == q0 or k1 == k0:
            assert float(dk[k0:k1].abs().sum()) == 0.0 and float(dv[k0:k1].abs().sum()) == 0.0
            assert float(dq[q0:q1].abs().sum()) == 0.0
            continue
        one = [x.unsqueeze(0) for x in (q[q0:q1], k[k0:k1], v[k0:k1], dout[q0:q1])]
        out, lse = paddle_fa4.flash_attn_fwd(*one[:3], causal=causal, window_size=window, backend="reference")
        alone = paddle_fa4.flash_attn_bwd(one[3], *one[:3], out, lse, dlse=paddle.to_tensor(dlse[None, :, q0:q1]),
                                          causal=causal, window_size=window, backend="reference")
        for got, ref in zip((dq[q0:q1], dk[k0:k1], dv[k0:k1]), alone):
            assert_close("doc grad", got, ref[0], 1e-6, 1e-6)


def test_deterministic_bitwise():
    q, k, v, dout = tensors(*make_case(15, 2, 33, 47, 4, 2, 16))
    out, lse = paddle_fa4.flash_attn_fwd(q, k, v, causal=True, backend="reference")
    runs = [paddle_fa4.flash_attn_bwd(dout, q, k, v, out, lse, causal=True, deterministic=True,
                                      backend="reference") for _ in range(3)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_out_params_are_written_and_returned():
    q, k, v, dout = tensors(*make_case(16, 1, 9, 11, 4, 2, 16))
    out, lse = paddle_fa4.flash_attn_fwd(q, k, v, causal=True, backend="reference")
    bufs = [paddle.full(t.shape, float("nan"), dtype="float32") for t in (q, k, v)]
    got = paddle_fa4.flash_attn_bwd(dout, q, k, v, out, lse, causal=True, dq=bufs[0], dk=bufs[1], dv=bufs[2],
                                    backend="reference")
    ref = paddle_fa4.flash_attn_bwd(dout, q, k, v, out, lse, causal=True, backend="reference")
    for g, buf, r in zip(got, bufs, ref):
        assert g is buf
        np.testing.assert_array_equal(buf.numpy(), r.numpy())


def test_non_contiguous_dout_is_copied():
    q, k, v, dout = tensors(*make_case(17, 1, 8, 8, 2, 2, 16))
    out, lse = paddle_fa4.flash_attn_fwd(q, k, v, backend="reference")
    strided = dout.transpose([0, 2, 1, 3]).clone().transpose([0, 2, 1, 3])
    assert not strided.is_contiguous()
    a = paddle_fa4.flash_attn_bwd(strided, q, k, v, out, lse, backend="reference")
    b = paddle_fa4.flash_attn_bwd(dout, q, k, v, out, lse, backend="reference")
    assert not strided.is_contiguous()  # the caller's tensor is left as it was
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.numpy(), y.numpy())


# ---------------------------------------------------------------------------------------------
# autograd through flash_attn_fwd


def leaf(a, dtype="float32", grad=True):
    t = paddle.to_tensor(a).astype(dtype)
    t.stop_gradient = not grad
    return t


AUTOGRAD_CASES = [
    pytest.param(dict(causal=True), id="causal"),
    pytest.param(dict(window_size=(3, 1), softcap=2.0), id="window-softcap"),
]


@pytest.mark.parametrize("kw", AUTOGRAD_CASES)
def test_backward_equals_flash_attn_bwd(kw):
    """loss.backward() through flash_attn_fwd gives bitwise flash_attn_bwd's gradients, which match
    the oracle."""
    q_np, k_np, v_np, w_np = make_case(18, 2, 10, 14, 4, 2, 16)
    q, k, v = leaf(q_np), leaf(k_np), leaf(v_np)
    out, lse = paddle_fa4.flash_attn_fwd(q, k, v, backend="reference", **kw)
    assert not out.stop_gradient and lse.stop_gradient
    w = paddle.to_tensor(w_np)
    (out * w).sum().backward()
    ref = paddle_fa4.flash_attn_bwd(w, q.detach(), k.detach(), v.detach(), out.detach(), lse, backend="reference",
                                    **kw)
    expected = oracle.attention_bwd(q_np, k_np, v_np, w_np, **oracle_kw(kw))
    for t, r, e in zip((q, k, v), ref, expected):
        np.testing.assert_array_equal(t.grad.numpy(), r.numpy())
        assert_close("grad", t.grad, e, *GRAD_TOL["float32"])


def test_frozen_inputs_get_no_gradient():
    q_np, k_np, v_np, _ = make_case(19, 1, 6, 8, 2, 1, 16)
    q, k, v = leaf(q_np, grad=False), leaf(k_np), leaf(v_np, grad=False)
    out, _ = paddle_fa4.flash_attn_fwd(q, k, v, causal=True, backend="reference")
    assert not out.stop_gradient
    out.sum().backward()
    assert q.grad is None and v.grad is None and k.grad is not None and float(k.grad.abs().max()) > 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_gradients_have_input_dtype(dtype):
    q_np, k_np, v_np, w_np = make_case(20, 1, 9, 9, 2, 2, 32)
    q, k, v = leaf(q_np, dtype), leaf(k_np, dtype), leaf(v_np, dtype)
    out, _ = paddle_fa4.flash_attn_fwd(q, k, v, causal=True, backend="reference")
    (out.astype("float32") * paddle.to_tensor(w_np)).sum().backward()
    expected = oracle.attention_bwd(to_numpy64(q), to_numpy64(k), to_numpy64(v), w_np, causal=True)
    for t, e in zip((q, k, v), expected):
        assert t.grad.dtype == t.dtype
        assert_close("grad", t.grad, e, *GRAD_TOL[dtype])


def test_no_grad_saves_nothing_and_skips_the_pylayer(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the PyLayer must not be used")

    monkeypatch.setattr(attention_mod._FlashAttnFn, "apply", forbidden)
    q_np, k_np, v_np, _ = make_case(21, 1, 6, 6, 2, 2, 16)
    q = leaf(q_np)
    with paddle.no_grad():
        outs = paddle_fa4.flash_attn_fwd(q, q, q, return_block_logit=True, block_size=16, backend="reference")
    assert all(x.stop_gradient for x in outs)
    outs = paddle_fa4.flash_attn_fwd(leaf(q_np, grad=False), leaf(k_np, grad=False), leaf(v_np, grad=False),
                                     backend="reference")
    assert all(x.stop_gradient for x in outs)
    with pytest.raises(AssertionError, match="PyLayer must not be used"):  # the patch is live
        paddle_fa4.flash_attn_fwd(q, q, q, backend="reference")


def test_pylayer_saves_only_q_k_v_out_lse(monkeypatch):
    saved = []
    original = paddle.autograd.PyLayerContext.save_for_backward

    def record(ctx, *tensors):
        saved.append(tensors)
        return original(ctx, *tensors)

    monkeypatch.setattr(paddle.autograd.PyLayerContext, "save_for_backward", record)
    q_np, k_np, v_np, _ = make_case(22, 1, 6, 20, 2, 2, 16)
    q, k, v = leaf(q_np), leaf(k_np), leaf(v_np)
    out, lse, bl = paddle_fa4.flash_attn_fwd(q, k, v, return_block_logit=True, block_size=16, backend="reference")
    assert len(saved) == 1 and len(saved[0]) == 5
    for got, want in zip(saved[0], (q, k, v, out, lse)):
        assert got is want
    assert all(t is not bl for t in saved[0])
    # a strided view is saved as a contiguous copy of itself
    saved.clear()
    qkv = leaf(np.stack([q_np, q_np, q_np], axis=2))  # [1, 6, 3, 2, 16]
    views = [qkv[:, :, i] for i in range(3)]
    assert not views[0].is_contiguous()
    paddle_fa4.flash_attn_fwd(*views, backend="reference")
    assert len(saved) == 1 and all(t.is_contiguous() for t in saved[0])
    np.testing.assert_array_equal(saved[0][0].numpy(), q_np)


def test_block_logit_changes_nothing_in_the_backward():
    """Gradients with return_block_logit, with a caller's buffer and without block_logit are bitwise
    equal; the buffer is filled in place, returned as is and gets no gradient."""
    q_np, k_np, v_np, w_np = make_case(23, 2, 12, 40, 4, 2, 16)
    w = paddle.to_tensor(w_np)
    grads = []
    for mode in ("none", "return", "buffer"):
        q, k, v = leaf(q_np), leaf(k_np), leaf(v_np)
        kw = dict(causal=True, block_size=16, backend="reference")
        if mode == "return":
            out, lse, bl = paddle_fa4.flash_attn_fwd(q, k, v, return_block_logit=True, **kw)
            assert bl.stop_gradient
        elif mode == "buffer":
            buf = paddle.full([2, 4, 12, 3], float("nan"), dtype="float32")
            out, lse, bl = paddle_fa4.flash_attn_fwd(q, k, v, block_logit=buf, **kw)
            assert bl is buf and bl.stop_gradient and not np.isnan(buf.numpy()).any()
        else:
            out, lse = paddle_fa4.flash_attn_fwd(q, k, v, **kw)
        (out * w).sum().backward()
        if mode == "buffer":
            assert buf.grad is None
        grads.append([t.grad.numpy() for t in (q, k, v)])
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            np.testing.assert_array_equal(a, b)


def test_varlen_backward_through_autograd():
    lq, lk = [5, 0, 9], [7, 3, 11]
    cu_q = paddle.to_tensor(np.cumsum([0] + lq), dtype="int32")
    cu_k = paddle.to_tensor(np.cumsum([0] + lk), dtype="int32")
    q_np, k_np, v_np, w_np = make_case(24, None, sum(lq), sum(lk), 4, 2, 16, varlen=True)
    q, k, v = leaf(q_np), leaf(k_np), leaf(v_np)
    kw = dict(causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=9, max_seqlen_k=11)
    out, lse, bl = paddle_fa4.flash_attn_fwd(q, k, v, return_block_logit=True, block_size=16, backend="reference",
                                             **kw)
    (out * paddle.to_tensor(w_np)).sum().backward()
    assert cu_q.grad is None and cu_k.grad is None
    expected = oracle.attention_bwd(q_np, k_np, v_np, w_np, **oracle_kw(kw))
    for t, e in zip((q, k, v), expected):
        assert_close("varlen grad", t.grad, e, *GRAD_TOL["float32"])


def test_lse_in_the_loss_adds_no_gradient():
    """lse is not differentiable: a loss adding it gives the gradients of the out term alone."""
    q_np, k_np, v_np, _ = make_case(25, 1, 7, 7, 2, 2, 16)
    grads = []
    for with_lse in (False, True):
        q, k, v = leaf(q_np), leaf(k_np), leaf(v_np)
        out, lse = paddle_fa4.flash_attn_fwd(q, k, v, causal=True, backend="reference")
        loss = out.sum() + (lse.sum() if with_lse else 0.0)
        loss.backward()
        grads.append(q.grad.numpy())
    np.testing.assert_array_equal(*grads)


def test_autograd_without_keys_gives_zero_gradients():
    """Sk = 0 with inputs needing gradients: the PyLayer still runs and returns zeros (no launch)."""
    q_np, k_np, v_np, _ = make_case(31, 2, 5, 0, 2, 2, 16)
    q, k, v = leaf(q_np), leaf(k_np), leaf(v_np)
    out, lse = paddle_fa4.flash_attn_fwd(q, k, v, backend="reference")
    assert not out.stop_gradient and np.all(np.isneginf(lse.numpy()))
    out.sum().backward()
    assert q.grad.shape == [2, 5, 2, 16] and float(q.grad.abs().max()) == 0.0


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_recompute_gives_the_same_gradients(use_reentrant):
    """Under Paddle's recompute the forward (with block_logit) runs again with grad enabled; the
    gradients equal those without recompute bitwise. q/k/v are strided slices of one projection
    (Paddle's non-reentrant recompute restores saved views without their strides: the PyLayer
    saves contiguous copies)."""
    from paddle.distributed.fleet.utils import recompute

    paddle.seed(1)
    proj = paddle.nn.Linear(16, 3 * 2 * 8)
    x_np = np.random.default_rng(32).standard_normal((2, 20, 16)).astype(np.float32)

    def block(x):
        qkv = proj(x).reshape([2, 20, 3, 2, 8])
        out, _, _ = paddle_fa4.flash_attn_fwd(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True,
                                              return_block_logit=True, block_size=16, backend="reference")
        return out

    grads = []
    for use_recompute in (False, True):
        proj.clear_gradients()
        x = leaf(x_np)
        out = recompute(block, x, use_reentrant=use_reentrant) if use_recompute else block(x)
        (out ** 2).sum().backward()
        grads.append((proj.weight.grad.numpy(), x.grad.numpy()))
    assert float(np.abs(grads[0][0]).max()) > 0
    for a, b in zip(*grads):
        np.testing.assert_array_equal(a, b)


def test_custom_pylayer_with_flash_attn_bwd_matches_autograd():
    """The PaddleFleet pattern: a caller's own PyLayer runs flash_attn_fwd (grad mode is off inside, so
    no inner PyLayer) with a -inf-prefilled block_logit buffer as an in-place input, saves q/k/v/out/lse
    and calls flash_attn_bwd in its backward. Its gradients equal flash_attn_fwd's own autograd."""
    from paddle.autograd import PyLayer

    class BlockScoreAttn(PyLayer):
        @staticmethod
        def forward(ctx, q, k, v, block_logit):
            out, lse, _ = paddle_fa4.flash_attn_fwd(q, k, v, causal=True, block_logit=block_logit, block_size=16,
                                                    backend="reference")
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse = ctx.saved_tensor()
            dq, dk, dv = paddle_fa4.flash_attn_bwd(dout, q, k, v, out, lse, causal=True, backend="reference")
            return dq, dk, dv, None

    q_np, k_np, v_np, w_np = make_case(33, 2, 12, 20, 4, 2, 16)
    w = paddle.to_tensor(w_np)
    grads = []
    for custom in (True, False):
        q, k, v = leaf(q_np), leaf(k_np), leaf(v_np)
        if custom:
            buf = paddle.full([2, 4, 12, 2], float("-inf"), dtype="float32")
            out = BlockScoreAttn.apply(q, k, v, buf)
            assert np.isfinite(buf.numpy()).any()
        else:
            out, _ = paddle_fa4.flash_attn_fwd(q, k, v, causal=True, backend="reference")
        (out * w).sum().backward()
        grads.append([t.grad.numpy() for t in (q, k, v)])
    for a, b in zip(*grads):
        np.testing.assert_array_equal(a, b)


def test_double_backward_raises():
    q_np, k_np, v_np, _ = make_case(26, 1, 5, 5, 2, 2, 16)
    q, k, v = leaf(q_np), leaf(k_np), leaf(v_np)
    out, _ = paddle_fa4.flash_attn_fwd(q, k, v, causal=True, backend="reference")
    with pytest.raises(Exception, match="flash_attn_fwd: double backward .create_graph=True. is not supported"):
        paddle.grad(out.sum(), [q], create_graph=True)


def test_parameter_before_the_op_gets_a_gradient():
    paddle.seed(0)
    d_model, heads, d = 32, 4, 8
    proj = paddle.nn.Linear(d_model, 3 * heads * d)
    x = paddle.randn([2, 10, d_model])
    qkv = proj(x).reshape([2, 10, 3, heads, d])
    out, _ = paddle_fa4.flash_attn_fwd(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True, backend="reference")
    (out ** 2).mean().backward()
    assert proj.weight.grad is not None and float(proj.weight.grad.abs().max()) > 0
    assert float(proj.bias.grad.abs().max()) > 0


def test_deterministic_reaches_the_backward(monkeypatch):
    seen = []
    original = ref_attention.flash_attn_bwd

    def record(*args, **kwargs):
        seen.append(kwargs["deterministic"])
        return original(*args, **kwargs)

    monkeypatch.setattr(ref_attention, "flash_attn_bwd", record)
    q_np = make_case(27, 1, 5, 5, 2, 2, 16)[0]
    for flag in (False, True):
        q = leaf(q_np)
        out, _ = paddle_fa4.flash_attn_fwd(q, q, q, deterministic=flag, backend="reference")
        out.sum().backward()
    assert seen == [False, True]
    with pytest.raises(TypeError, match="^flash_attn_fwd: deterministic must be a bool"):
        paddle_fa4.flash_attn_fwd(q, q, q, deterministic=1, backend="reference")


# ---------------------------------------------------------------------------------------------
# flash_attn_bwd validation


def _t(shape, dtype="float32"):
    return paddle.to_tensor(np.random.default_rng(0).standard_normal(shape).astype(np.float32)).astype(dtype)


Q, K, V = _t([1, 8, 4, 32]), _t([1, 10, 2, 32]), _t([1, 10, 2, 16])
OUT, LSE = paddle_fa4.flash_attn_fwd(Q, K, V, backend="reference")
DOUT = _t([1, 8, 4, 16])

BWD_ERRORS = [  # (kwargs overriding a valid call, exception, message fragment)
    pytest.param(dict(dout=np.zeros([1, 8, 4, 16])), TypeError, "dout must be a paddle.Tensor", id="dout-numpy"),
    pytest.param(dict(dout=_t([1, 8, 4, 32])), ValueError, "dout must have shape [1, 8, 4, 16]", id="dout-shape"),
    pytest.param(dict(dout=_t([1, 8, 4, 16], "bfloat16")), TypeError, "dout must have q's dtype float32",
                 id="dout-dtype"),
    pytest.param(dict(out=_t([1, 8, 4, 32])), ValueError, "out must have shape [1, 8, 4, 16]", id="out-shape"),
    pytest.param(dict(out=_t([1, 8, 4, 16], "float16")), TypeError, "out must have q's dtype", id="out-dtype"),
    pytest.param(dict(out=None), TypeError, "out must be a paddle.Tensor", id="out-none"),
    pytest.param(dict(lse=_t([1, 8, 4])), ValueError, "lse must have shape [1, 4, 8]", id="lse-shape"),
    pytest.param(dict(lse=_t([1, 4, 8], "bfloat16")), TypeError, "lse must be float32", id="lse-dtype"),
    pytest.param(dict(dlse=_t([1, 4, 7])), ValueError, "dlse must have shape [1, 4, 8]", id="dlse-shape"),
    pytest.param(dict(dlse=_t([1, 4, 8], "float16")), TypeError, "dlse must be float32", id="dlse-dtype"),
    pytest.param(dict(dq=_t([1, 8, 4, 16])), ValueError, "dq must have shape [1, 8, 4, 32]", id="dq-shape"),
    pytest.param(dict(dk=_t([1, 10, 2, 32], "bfloat16")), TypeError, "dk must have k's dtype float32",
                 id="dk-dtype"),
    pytest.param(dict(dv=_t([1, 10, 2, 32])), ValueError, "dv must have shape [1, 10, 2, 16]", id="dv-shape"),
    pytest.param(dict(dv=[1, 2]), TypeError, "dv must be a paddle.Tensor", id="dv-list"),
    pytest.param(dict(deterministic=1), TypeError, "deterministic must be a bool", id="deterministic-int"),
    pytest.param(dict(q=_t([8, 4, 32])), ValueError, "q must be [B, Sq, Hq, D]", id="q-rank"),
    pytest.param(dict(k=_t([1, 10, 2, 32], "bfloat16")), TypeError, "k must have q's dtype", id="k-dtype"),
    pytest.param(dict(window_size=(-2, None)), ValueError, "window_size[0]", id="window-negative"),
    pytest.param(dict(softcap=-1.0), ValueError, "softcap must be >= 0", id="softcap-negative"),
    pytest.param(dict(max_seqlen_q=8), ValueError, "max_seqlen_q is only used with cu_seqlens", id="max-seqlen"),
    pytest.param(dict(cu_seqlens_q=paddle.to_tensor([0, 8], dtype="int32")), ValueError, "cu_seqlens_k is required",
                 id="half-varlen"),
    pytest.param(dict(backend="triton"), ValueError, "backend must be one of", id="backend"),
]


@pytest.mark.parametrize("override,exc,fragment", BWD_ERRORS)
def test_flash_attn_bwd_errors(override, exc, fragment, monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("validation must fail before any work")

    monkeypatch.setattr(ref_attention, "flash_attn_bwd", no_launch)
    kw = dict(dout=DOUT, q=Q, k=K, v=V, out=OUT, lse=LSE, backend="reference")
    kw.update(override)
    with pytest.raises(exc, match="^flash_attn_bwd: .*" + re.escape(fragment)):
        paddle_fa4.flash_attn_bwd(**kw)


def test_flash_attn_bwd_valid_call_passes():
    dq, dk, dv = paddle_fa4.flash_attn_bwd(DOUT, Q, K, V, OUT, LSE, backend="reference")
    assert dq.shape == [1, 8, 4, 32] and dk.shape == [1, 10, 2, 32] and dv.shape == [1, 10, 2, 16]


def test_flash_attn_bwd_varlen_lse_layout():
    q, k = _t([9, 4, 16]), _t([12, 2, 16])
    cu_q, cu_k = paddle.to_tensor([0, 4, 9], dtype="int32"), paddle.to_tensor([0, 5, 12], dtype="int32")
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=7, backend="reference")
    out, lse = paddle_fa4.flash_attn_fwd(q, k, k, **kw)
    with pytest.raises(ValueError, match=re.escape("flash_attn_bwd: lse must have shape [4, 9] ([Hq, total_q])")):
        paddle_fa4.flash_attn_bwd(out, q, k, k, out, lse.reshape([4, 9, 1]), **kw)
    with pytest.raises(ValueError, match=re.escape("flash_attn_bwd: cu_seqlens_q[-1] must equal")):
        paddle_fa4.flash_attn_bwd(out, q, k, k, out, lse, **dict(kw, cu_seqlens_q=paddle.to_tensor(
            [0, 4, 8], dtype="int32")))
    dq, dk, dv = paddle_fa4.flash_attn_bwd(out, q, k, k, out, lse, **kw)
    assert dq.shape == [9, 4, 16] and dk.shape == [12, 2, 16]


# ---------------------------------------------------------------------------------------------
# backend selection of the backward and the CuTe backward glue (fake launcher)


def test_bwd_auto_on_cpu_warns_and_cute_raises(monkeypatch):
    monkeypatch.setattr(backend_mod, "_warned", set())
    q = _t([1, 4, 2, 16], "bfloat16")
    out, lse = paddle_fa4.flash_attn_fwd(q, q, q, backend="reference")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paddle_fa4.flash_attn_bwd(out, q, q, q, out, lse)
    msgs = [str(w.message) for w in caught if "reference backend" in str(w.message)]
    assert msgs == ["flash_attn_bwd: using the reference backend (inputs are on Place(cpu), CuTe kernels need a "
                    "CUDA place)"]
    assert caught[0].filename == __file__
    with pytest.raises(NotImplementedError, match="flash_attn_bwd: backend='cute' is not available: .*CUDA place"):
        paddle_fa4.flash_attn_bwd(out, q, q, q, out, lse, backend="cute")


class FakeBwdLaunch(types.SimpleNamespace):
    """Stands in for cute_kernels.attention.bwd_launch: the real BwdConfig / workspace_shapes of the
    contract (cute_kernels/attention/bwd_config.py), a recording run_bwd that fills dq/dk/dv with the
    reference gradients of the call it was given."""

    def __init__(self, reason=None):
        super().__init__(configs=[], runs=[], reason=reason)

    def bwd_config(self, **kw):
        from cute_kernels.attention.bwd_config import BwdConfig

        self.configs.append(kw)
        return BwdConfig(**kw)

    def unsupported_reason(self, cfg):
        return self.reason

    def workspace_shapes(self, cfg, **kw):
        from cute_kernels.attention.bwd_config import workspace_shapes

        self.workspace_kw = kw
        return workspace_shapes(cfg, **kw)

    def run_bwd(self, cfg, dout, q, k, v, out, lse, dlse, dq, dk, dv, cu_q, cu_k, workspace, **kw):
        self.runs.append(dict(cfg=cfg, tensors=(dout, q, k, v, out, lse, dlse, dq, dk, dv, cu_q, cu_k),
                              workspace=workspace, **kw))
        spec = self.spec_of_next_run
        grads = ref_attention.flash_attn_bwd(spec, dout, q, k, v, out, lse, dlse, None, None, None, cu_q, cu_k)
        for buf, g in zip((dq, dk, dv), grads):
            paddle.assign(g, buf)


class FakeFwdLaunch(types.SimpleNamespace):
    """Stands in for cute_kernels.attention.launch: runs the reference forward."""

    def fwd_config(self, **kw):
        return ("fwd-cfg", tuple(sorted(kw.items())))

    def unsupported_reason(self, cfg):
        return None

    def run_fwd(self, cfg, q, k, v, out, lse, block_logit, cu_q, cu_k, **kw):
        ref_attention.flash_attn_fwd(self.spec_of_next_run, q, k, v, out, lse, block_logit, cu_q, cu_k)


@pytest.fixture
def fake_gpu(monkeypatch):
    """Every tensor on an SM90 GPU; fake forward and backward launchers that record their calls."""
    fwd, bwd = FakeFwdLaunch(), FakeBwdLaunch()
    monkeypatch.setattr(backend_mod, "tensor_arch", lambda tensor: 90)
    monkeypatch.setattr(glue, "arch_of", lambda tensor: 90)
    monkeypatch.setattr(glue, "_launch", lambda: fwd)
    monkeypatch.setattr(glue, "_bwd_launch", lambda: bwd)
    original = attention_mod._validate

    def validate(*args, **kwargs):  # hand the fakes the spec they serve
        spec = original(*args, **kwargs)
        fwd.spec_of_next_run = bwd.spec_of_next_run = spec
        return spec

    monkeypatch.setattr(attention_mod, "_validate", validate)
    return types.SimpleNamespace(fwd=fwd, bwd=bwd)


def test_bwd_glue_translates_spec(fake_gpu):
    q_np, k_np, v_np, w_np = make_case(28, 2, 8, 12, 4, 2, 128, dv=128)
    q, k, v, dout = tensors(q_np, k_np, v_np, w_np, dtype="bfloat16")
    out, lse = paddle_fa4.flash_attn_fwd(q, k, v, causal=True, window_size=(5, None), softcap=3.0,
                                         softmax_scale=0.1, backend="reference")
    dlse = paddle.zeros(lse.shape, dtype="float32")
    dq, dk, dv = paddle_fa4.flash_attn_bwd(dout, q, k, v, out, lse, causal=True, window_size=(5, None), softcap=3.0,
                                           softmax_scale=0.1, dlse=dlse, deterministic=True, backend="cute")
    assert fake_gpu.bwd.configs[-1] == dict(
        arch=90, dtype="bfloat16", head_dim=128, head_dim_v=128, qhead_per_kvhead=2, causal=True, has_window=True,
        has_softcap=True, varlen=False, deterministic=True, has_dlse=True, startend="")
    run = fake_gpu.bwd.runs[-1]
    assert (run["softmax_scale"], run["softcap"]) == (pytest.approx(0.1), 3.0)
    assert (run["window_left"], run["window_right"], run["max_seqlen_q"], run["max_seqlen_k"]) == (5, 0, 8, 12)
    assert fake_gpu.bwd.workspace_kw == dict(batch=2, seqlen_q=8, num_heads=4, total_q=16, seqlen_k=12,
                                             num_kv_heads=2, total_k=24)
    ws = run["workspace"]
    # deterministic GQA with causal: the group split's fp32 dK / dV partials and turn counters too
    assert sorted(ws) == ["dk_accum", "dkv_sem", "dpsum", "dq_accum", "dq_sem", "dv_accum", "lse_log2"]
    assert ws["dk_accum"].shape == [2, 12, 2, 128] and ws["dkv_sem"].shape == [2, 2, 1]
    from cute_kernels.attention import bwd_config as contract

    rows = contract.round_up(8, contract.ACCUM_ROW_PAD)
    assert ws["dq_accum"].shape == [2, 4, rows, 128] and ws["dq_accum"].dtype == paddle.float32
    assert ws["lse_log2"].shape == [2, 4, rows] and ws["dpsum"].dtype == paddle.float32
    sem_rows = getattr(contract, "DQ_SEM_ROWS", contract.ACCUM_ROW_PAD)
    assert ws["dq_sem"].shape == [2, 4, rows // sem_rows] and ws["dq_sem"].dtype == paddle.int32
    tdout, tq, tk, tv, tout, tlse, tdlse, tdq, tdk, tdv, cu_q, cu_k = run["tensors"]
    assert all(t.stop_gradient for t in (tdout, tq, tdq))  # detached views
    assert tq.data_ptr() == q.data_ptr() and tout.data_ptr() == out.data_ptr() and tdlse.data_ptr() == dlse.data_ptr()
    assert tdq.data_ptr() == dq.data_ptr() and tdk.data_ptr() == dk.data_ptr() and tdv.data_ptr() == dv.data_ptr()
    assert cu_q is None and cu_k is None
    assert dq.dtype == paddle.bfloat16 and dk.shape == [2, 12, 2, 128]
    ref = paddle_fa4.flash_attn_bwd(dout, q, k, v, out, lse, causal=True, window_size=(5, None), softcap=3.0,
                                    softmax_scale=0.1, backend="reference")
    for a, b in zip((dq, dk, dv), ref):
        np.testing.assert_array_equal(a.astype("float32").numpy(), b.astype("float32").numpy())


def test_bwd_glue_varlen_and_defaults(fake_gpu):
    q, k = _t([9, 4, 64], "float16"), _t([12, 2, 64], "float16")
    cu_q, cu_k = paddle.to_tensor([0, 4, 9], dtype="int32"), paddle.to_tensor([0, 5, 12], dtype="int32")
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=7)
    out, lse = paddle_fa4.flash_attn_fwd(q, k, k, backend="reference", **kw)
    paddle_fa4.flash_attn_bwd(out, q, k, k, out, lse, backend="cute", **kw)
    cfg, run = fake_gpu.bwd.configs[-1], fake_gpu.bwd.runs[-1]
    assert cfg["varlen"] and not cfg["deterministic"] and not cfg["has_dlse"] and not cfg["causal"]
    assert (run["window_left"], run["window_right"], run["max_seqlen_q"], run["max_seqlen_k"]) == (-1, -1, 5, 7)
    assert run["tensors"][6] is None
    assert run["tensors"][10].data_ptr() == cu_q.data_ptr() and run["tensors"][11].data_ptr() == cu_k.data_ptr()
    ws = run["workspace"]
    assert sorted(ws) == ["dpsum", "dq_accum", "lse_log2"]  # no semaphores unless deterministic
    from cute_kernels.attention import bwd_config as contract

    rows = contract.varlen_accum_rows(9, 2)  # every document padded to whole accumulator tiles
    assert rows >= 2 * contract.ACCUM_ROW_PAD
    assert ws["lse_log2"].shape == [4, rows] and ws["dq_accum"].shape == [4, rows, 64]


def test_bwd_glue_writes_a_strided_out_param_through_a_temporary(fake_gpu):
    q = _t([1, 8, 2, 64], "bfloat16")
    out, lse = paddle_fa4.flash_attn_fwd(q, q, q, backend="reference")
    dq = paddle.zeros([1, 2, 8, 64], dtype="bfloat16").transpose([0, 2, 1, 3])
    got, _, _ = paddle_fa4.flash_attn_bwd(out, q, q, q, out, lse, dq=dq, backend="cute")
    passed = fake_gpu.bwd.runs[-1]["tensors"][7]
    assert got is dq and passed.is_contiguous() and passed.data_ptr() != dq.data_ptr()
    want, _, _ = paddle_fa4.flash_attn_bwd(out, q, q, q, out, lse, backend="reference")
    np.testing.assert_array_equal(dq.astype("float32").numpy(), want.astype("float32").numpy())


def test_bwd_glue_copies_a_non_contiguous_dout(fake_gpu):
    q = _t([1, 8, 2, 64], "bfloat16")
    out, lse = paddle_fa4.flash_attn_fwd(q, q, q, backend="reference")
    dout = _t([1, 2, 8, 64], "bfloat16").transpose([0, 2, 1, 3])
    assert not dout.is_contiguous()
    paddle_fa4.flash_attn_bwd(dout, q, q, q, out, lse, backend="cute")
    passed = fake_gpu.bwd.runs[-1]["tensors"][0]
    assert passed.is_contiguous() and not dout.is_contiguous()
    np.testing.assert_array_equal(passed.astype("float32").numpy(), dout.astype("float32").numpy())


def test_bwd_unsupported_reasons(fake_gpu, monkeypatch):
    from paddle_fa4.attention import _validate

    def spec(q, k, v):
        return _validate(q, k, v, None, False, (None, None), 0.0, None, None, None, None, None, 64, False, None)

    assert "float32" in glue.bwd_unsupported_reason(90, spec(*(_t([1, 4, 2, 64]),) * 3), False, False)
    assert "head_dim 80" in glue.bwd_unsupported_reason(90, spec(*(_t([1, 4, 2, 80], "bfloat16"),) * 3), False, False)
    q = _t([1, 4, 2, 64], "bfloat16")
    assert glue.bwd_unsupported_reason(90, spec(q, q, q), False, False) is None
    fake_gpu.bwd.reason = "deterministic varlen is not implemented on sm_90a"
    assert glue.bwd_unsupported_reason(90, spec(q, q, q), True, False) == fake_gpu.bwd.reason
    out, lse = paddle_fa4.flash_attn_fwd(q, q, q, backend="reference")
    with pytest.raises(NotImplementedError, match="flash_attn_bwd: backend='cute' is not available: deterministic "
                                                  "varlen is not implemented"):
        paddle_fa4.flash_attn_bwd(out, q, q, q, out, lse, deterministic=True, backend="cute")
    monkeypatch.setattr(glue, "_bwd_launch", lambda: None)
    assert "cute_kernels.attention.bwd_launch is missing" in glue.bwd_unsupported_reason(90, spec(q, q, q), False,
                                                                                         False)


def test_autograd_cute_forward_and_cute_backward(fake_gpu):
    q_np, k_np, v_np, w_np = make_case(29, 1, 8, 8, 4, 2, 64)
    q, k, v = leaf(q_np, "bfloat16"), leaf(k_np, "bfloat16"), leaf(v_np, "bfloat16")
    out, lse = paddle_fa4.flash_attn_fwd(q, k, v, causal=True, deterministic=True, backend="cute")
    (out.astype("float32") * paddle.to_tensor(w_np)).sum().backward()
    assert len(fake_gpu.bwd.runs) == 1 and fake_gpu.bwd.configs[-1]["deterministic"]
    assert not fake_gpu.bwd.configs[-1]["has_dlse"]  # lse is not differentiable: no dlse in the autograd path
    run = fake_gpu.bwd.runs[-1]
    assert run["tensors"][1].data_ptr() == q.data_ptr() and run["tensors"][4].data_ptr() == out.data_ptr()
    assert q.grad is not None and q.grad.dtype == paddle.bfloat16


def test_autograd_auto_forward_cute_backward_falls_back(fake_gpu, monkeypatch):
    """auto: the forward may run on the kernels while the backward (no launcher) runs the reference."""
    monkeypatch.setattr(backend_mod, "_warned", set())
    monkeypatch.setattr(glue, "_bwd_launch", lambda: None)
    q_np = make_case(30, 1, 8, 8, 2, 2, 64)[0]
    q = leaf(q_np, "bfloat16")
    with pytest.warns(UserWarning, match=r"flash_attn_bwd: using the reference backend .*bwd_launch is missing"):
        out, _ = paddle_fa4.flash_attn_fwd(q, q, q, causal=True)
    out.astype("float32").sum().backward()
    assert q.grad is not None and not fake_gpu.bwd.runs
    # backend="cute" with an input needing gradients and no backward kernel: refused before any work
    q2 = leaf(q_np, "bfloat16")
    with pytest.raises(NotImplementedError, match="flash_attn_bwd: backend='cute' is not available: .*bwd_launch"):
        paddle_fa4.flash_attn_fwd(q2, q2, q2, backend="cute")
    with paddle.no_grad():  # no gradients wanted: the forward kernel alone is enough
        paddle_fa4.flash_attn_fwd(q2, q2, q2, backend="cute")


def test_bwd_glue_matches_the_real_launcher_contract(monkeypatch):
    """The glue against the real cute_kernels.attention.bwd_launch (no GPU needed): its bwd_config
    keywords, its workspace_shapes, and a call that binds to run_bwd's signature."""
    import inspect

    launch = pytest.importorskip("cute_kernels.attention.bwd_launch", reason="backward launcher not in this tree")
    from cute_kernels.attention.bwd_config import BwdConfig
    from paddle_fa4.attention import _validate

    q, k = _t([2, 8, 4, 128], "bfloat16"), _t([2, 8, 2, 128], "bfloat16")
    spec = _validate(q, k, k, None, True, (5, None), 5.0, None, None, None, None, None, 64, False, None)
    cfg = glue.bwd_config(90, spec, True, False)
    assert isinstance(cfg, BwdConfig)
    assert (cfg.arch, cfg.dtype, cfg.head_dim, cfg.qhead_per_kvhead, cfg.causal, cfg.has_window, cfg.has_softcap,
            cfg.deterministic, cfg.has_dlse) == (90, "bfloat16", 128, 2, True, True, True, True, False)
    reason = glue.bwd_unsupported_reason(90, spec, True, False)
    assert reason is None or isinstance(reason, str)
    calls = []
    signature = inspect.signature(launch.run_bwd)

    def record(*args, **kwargs):
        calls.append(signature.bind(*args, **kwargs))  # raises TypeError on a mismatched call

    monkeypatch.setattr(launch, "run_bwd", record)
    monkeypatch.setattr(glue, "arch_of", lambda tensor: 90)
    out, lse = paddle_fa4.flash_attn_fwd(q, k, k, causal=True, window_size=(5, None), softcap=5.0,
                                         backend="reference")
    dq, dk, dv = glue.flash_attn_bwd(spec, out, q, k, k, out, lse, None, None, None, None, None, None,
                                     deterministic=True)
    bound = calls[-1].arguments
    assert bound["cfg"] == cfg and bound["dlse"] is None and bound["cu_seqlens_q"] is None
    assert bound["dq"].data_ptr() == dq.data_ptr() and bound["dk"].shape == [2, 8, 2, 128]
    assert (bound["window_left"], bound["window_right"], bound["max_seqlen_q"], bound["max_seqlen_k"]) == (5, 0, 8, 8)
    expected = launch.workspace_shapes(cfg, batch=2, seqlen_q=8, num_heads=4, total_q=16, seqlen_k=8, num_kv_heads=2,
                                       total_k=16)
    assert "dkv_sem" in expected  # deterministic GQA with causal: the group split's workspace is allocated too
    assert {n: (list(t.shape), str(t.dtype).replace("paddle.", "")) for n, t in bound["workspace"].items()} == {
        n: (list(shape), dtype) for n, (shape, dtype) in expected.items()}


def sink_case(seed, sq=256, hq=2, d=64, gap=12.0):
    """bf16-representable q, k, v, dout where key 0 is a sink: its logit is ~``gap`` above the others on
    every row, so P(row, 0) is ~0.995 (gap 12) and dS is tiny next to dP."""
    rng = np.random.default_rng(seed)
    q, k, v, dout = make_case(seed, 1, sq, sq, hq, hq, d)
    u = rng.standard_normal(d)
    u /= np.linalg.norm(u)
    q = q - (q @ u)[..., None] * u + u  # q . u = 1 on every row and head
    k[:, 0] = (gap * np.sqrt(d)) * u  # logit q . k_0 / sqrt(d) = gap
    return tuple(paddle.to_tensor(a).astype("bfloat16").astype("float32").numpy() for a in (q, k, v, dout))


@pytest.mark.parametrize("gap,tol", [(8.0, 1e-2), (12.0, 1e-2), (16.0, 5e-2)])
def test_peaked_rows_bf16(gap, tol):
    """Rows whose weight sits on one key (an attention sink, P ~0.8 / 0.995 / 0.99995 at gap 8 / 12 / 16):
    D = rowsum(P dP) from the float32 P and dP keeps dq / dk within 1e-2 of the float64 gradients (5e-2 at
    gap 16, where float32's rounding of s - lse itself is a few % of 1 - P). D from the bf16-rounded out
    (rowsum(dO * O), as FA computes it) gave 2.2e-2, 1.0, 1.0 here: its rounding error, 2^-9 |dO| |O|, is
    larger than dS on such rows."""
    q_np, k_np, v_np, dout_np = sink_case(5, gap=gap)
    q, k, v, dout = tensors(q_np, k_np, v_np, dout_np, dtype="bfloat16")
    out, lse = paddle_fa4.flash_attn_fwd(q, k, v, causal=True, backend="reference")[:2]
    grads = paddle_fa4.flash_attn_bwd(dout, q, k, v, out, lse, causal=True, backend="reference")
    expected = oracle.attention_bwd(q_np, k_np, v_np, dout_np, None, causal=True)
    s0 = np.einsum("ihd,hd->hi", q_np[0], k_np[0, 0]) / np.sqrt(q_np.shape[-1])
    p0 = np.exp(s0 - to_numpy64(lse)[0])[:, 1:]  # weight of the sink key, rows that see another key too
    assert p0.mean() > 0.7 and (gap < 12 or p0.min() > 0.99), p0.mean()
    rel = {n: rel_l2(g, e) for n, g, e in zip(("dq", "dk", "dv"), grads, expected)}
    assert max(rel.values()) <= tol, rel
