"""flash_attn_fwd on the reference backend against the float64 numpy oracle."""

from __future__ import annotations

import math

import numpy as np
import paddle
import pytest

import paddle_fa4
from paddle_fa4.reference import attention as ref_attention
from tests.oracles import attention as oracle
from tests.oracles.tolerance import assert_close, to_numpy64

TOL = {  # (atol, rtol) for out; lse and block_logit are float32 in every case
    "float32": (2e-5, 2e-5),
    "bfloat16": (1e-2, 1e-2),  # out is rounded to bf16 (8 mantissa bits)
    "float16": (2e-3, 2e-3),
}
STAT_TOL = (5e-5, 2e-5)


def make_inputs(seed, b, sq, sk, hq, hkv, d, dv=None, dtype="float32", varlen=False):
    """Paddle q, k, v (``dtype``) with values of a few units; varlen drops the batch axis."""
    rng = np.random.default_rng(seed)
    dv = d if dv is None else dv
    qs, ks = ([sq, hq, d], [sk, hkv, d]) if varlen else ([b, sq, hq, d], [b, sk, hkv, d])
    vs = ks[:-1] + [dv]
    return tuple(paddle.to_tensor(rng.standard_normal(s).astype(np.float32)).astype(dtype) for s in (qs, ks, vs))


def check_against_oracle(q, k, v, dtype="float32", **kw):
    """Run the reference with ``kw`` and compare every output with the oracle; return the outputs."""
    outputs = paddle_fa4.flash_attn_fwd(q, k, v, backend="reference", **kw)
    block_size = kw.get("block_size", 64) if (kw.get("return_block_logit") or kw.get("block_logit") is not None) else 0
    expected = oracle.attention(
        to_numpy64(q), to_numpy64(k), to_numpy64(v), softmax_scale=kw.get("softmax_scale"),
        causal=kw.get("causal", False), window=kw.get("window_size", (None, None)),
        softcap=kw.get("softcap", 0.0), block_size=block_size,
        cu_seqlens_q=None if kw.get("cu_seqlens_q") is None else kw["cu_seqlens_q"].numpy(),
        cu_seqlens_k=None if kw.get("cu_seqlens_k") is None else kw["cu_seqlens_k"].numpy(),
        max_seqlen_k=kw.get("max_seqlen_k"))
    assert_close("out", outputs[0], expected[0], *TOL[dtype])
    assert_close("lse", outputs[1], expected[1], *STAT_TOL)
    if block_size:
        assert_close("block_logit", outputs[2], expected[2], *STAT_TOL)
    return outputs


SHAPES = [  # (b, sq, sk, hq, hkv, d, dv)
    pytest.param((1, 33, 33, 2, 2, 32, 32), id="square"),
    pytest.param((2, 10, 40, 2, 2, 16, 16), id="sq-lt-sk"),
    pytest.param((2, 40, 10, 2, 2, 16, 16), id="sq-gt-sk-rows-without-keys"),
    pytest.param((1, 1, 1, 1, 1, 8, 8), id="one-token"),
    pytest.param((1, 7, 70, 2, 1, 16, 16), id="sk-not-multiple-of-block"),
    pytest.param((1, 12, 20, 8, 2, 16, 16), id="gqa-8-2"),
    pytest.param((1, 12, 20, 8, 1, 16, 16), id="gqa-8-1"),
    pytest.param((2, 9, 17, 4, 2, 16, 16), id="gqa-4-2"),
    pytest.param((1, 11, 23, 2, 2, 24, 16), id="dv-differs"),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES)
def test_shapes(shape, causal):
    b, sq, sk, hq, hkv, d, dv = shape
    q, k, v = make_inputs(1, b, sq, sk, hq, hkv, d, dv)
    check_against_oracle(q, k, v, causal=causal, block_size=16, return_block_logit=True)


def test_causal_rows_without_keys_are_zero_and_neg_inf():
    """Sq > Sk causal: the first Sq - Sk rows see nothing -> out 0, lse -inf, block_logit -inf."""
    q, k, v = make_inputs(2, 1, 12, 5, 2, 2, 16)
    out, lse, bl = paddle_fa4.flash_attn_fwd(q, k, v, causal=True, block_size=16, return_block_logit=True,
                                             backend="reference")
    assert np.all(out.numpy()[0, :7] == 0)
    assert np.all(np.isneginf(lse.numpy()[0, :, :7])) and np.all(np.isfinite(lse.numpy()[0, :, 7:]))
    assert np.all(np.isneginf(bl.numpy()[0, :, :7]))


@pytest.mark.parametrize("block_size", [16, 32, 64, 128, 256])
def test_block_sizes(block_size):
    q, k, v = make_inputs(3, 1, 20, 300, 2, 1, 16)
    out = check_against_oracle(q, k, v, causal=True, block_size=block_size, return_block_logit=True)
    assert out[2].shape == [1, 2, 20, math.ceil(300 / block_size)]


WINDOWS = [
    pytest.param(False, (4, None), id="left-4"),
    pytest.param(False, (None, 3), id="right-3"),
    pytest.param(False, (2, 2), id="left-2-right-2"),
    pytest.param(False, (0, 0), id="diagonal-only"),
    pytest.param(False, (-1, 5), id="minus-one-is-unbounded"),
    pytest.param(True, (5, None), id="causal-left-5"),
    pytest.param(True, (None, 7), id="causal-right-clamped-to-0"),
    pytest.param(False, (None, 0), id="right-0-is-causal"),
]


@pytest.mark.parametrize("sq,sk", [(16, 16), (9, 30), (30, 9)], ids=["sq-eq-sk", "sq-lt-sk", "sq-gt-sk"])
@pytest.mark.parametrize("causal,window", WINDOWS)
def test_windows(causal, window, sq, sk):
    q, k, v = make_inputs(4, 1, sq, sk, 2, 2, 16)
    check_against_oracle(q, k, v, causal=causal, window_size=window, block_size=16, return_block_logit=True)


@pytest.mark.parametrize("causal,window", [(False, (None, None)), (True, (None, None)), (False, (3, 2))],
                         ids=["full", "causal", "window"])
def test_softcap(causal, window):
    q, k, v = make_inputs(5, 2, 13, 21, 4, 2, 16)
    q = q * 3.0  # logits well past the cap
    check_against_oracle(q, k, v, causal=causal, window_size=window, softcap=2.5, block_size=16,
                         return_block_logit=True)


def test_softmax_scale():
    q, k, v = make_inputs(6, 1, 8, 8, 2, 2, 16)
    check_against_oracle(q, k, v, softmax_scale=0.37, block_size=16, return_block_logit=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_inputs(dtype):
    q, k, v = make_inputs(7, 2, 17, 29, 4, 2, 32, dtype=dtype)
    out = check_against_oracle(q, k, v, dtype=dtype, causal=True, block_size=16, return_block_logit=True)
    assert out[0].dtype == q.dtype and out[1].dtype == paddle.float32 and out[2].dtype == paddle.float32


VARLEN = [  # (q lengths, k lengths): unaligned starts, an empty query sequence, Sq > Sk and Sq < Sk
    pytest.param(([5, 0, 17, 33], [7, 3, 17, 20]), id="ragged"),
    pytest.param(([1], [1]), id="single-token"),
    pytest.param(([9, 40], [40, 9]), id="sq-lt-and-gt-sk"),
]


@pytest.mark.parametrize("causal,window", [(False, (None, None)), (True, (None, None)), (True, (6, None))],
                         ids=["full", "causal", "causal-window"])
@pytest.mark.parametrize("lengths", VARLEN)
def test_varlen(lengths, causal, window):
    lq, lk = lengths
    cu_q = paddle.to_tensor(np.cumsum([0] + lq), dtype="int32")
    cu_k = paddle.to_tensor(np.cumsum([0] + lk), dtype="int32")
    q, k, v = make_inputs(8, None, sum(lq), sum(lk), 4, 2, 16, varlen=True)
    kw = dict(causal=causal, window_size=window, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lq),
              max_seqlen_k=max(lk), block_size=16, return_block_logit=True)
    out, lse, bl = check_against_oracle(q, k, v, **kw)
    assert bl.shape == [4, sum(lq), math.ceil(max(lk) / 16)]
    # each document equals running it alone through the padded layout
    for i in range(len(lq)):
        q0, q1, k0, k1 = sum(lq[:i]), sum(lq[:i + 1]), sum(lk[:i]), sum(lk[:i + 1])
        if q1 == q0:
            continue
        alone = paddle_fa4.flash_attn_fwd(q[q0:q1].unsqueeze(0), k[k0:k1].unsqueeze(0), v[k0:k1].unsqueeze(0),
                                          causal=causal, window_size=window, block_size=16,
                                          return_block_logit=True, backend="reference")
        nb = alone[2].shape[-1]
        assert_close("doc out", out[q0:q1], alone[0][0], 1e-6, 1e-6)
        assert_close("doc lse", lse[:, q0:q1], alone[1][0], 1e-6, 1e-6)
        assert_close("doc block_logit", bl[:, q0:q1, :nb], alone[2][0], 1e-6, 1e-6)
        assert np.all(np.isneginf(bl.numpy()[:, q0:q1, nb:]))


@pytest.mark.parametrize("fill", [float("nan"), 12345.0, float("inf")], ids=["nan", "big", "inf"])
def test_sentinel_buffer_fully_overwritten(fill):
    """A caller's block_logit buffer needs no pre-fill: every entry is written, the buffer is returned."""
    q, k, v = make_inputs(9, 2, 10, 37, 2, 2, 16)
    buf = paddle.full([2, 2, 10, 3], fill, dtype="float32")
    out = check_against_oracle(q, k, v, causal=True, block_logit=buf, block_size=16)
    assert out[2] is buf


def test_block_logit_bounded_by_lse():
    """max_j block_logit <= lse on every row (the lse adds the other keys' mass)."""
    q, k, v = make_inputs(10, 2, 24, 50, 4, 2, 16)
    _, lse, bl = paddle_fa4.flash_attn_fwd(q, k, v, causal=True, softcap=4.0, block_size=16,
                                           return_block_logit=True, backend="reference")
    row_max = bl.numpy().max(axis=-1)
    finite = np.isfinite(lse.numpy())
    assert finite.any()
    assert np.all(row_max[finite] <= lse.numpy()[finite])
    assert np.all(np.isneginf(row_max[~finite]))


def test_block_64_pairs_equal_block_128():
    """The max of two adjacent 64-blocks is the 128-block, bit for bit."""
    q, k, v = make_inputs(11, 1, 30, 300, 2, 2, 16)
    kw = dict(causal=True, window_size=(150, None), return_block_logit=True, backend="reference")
    bl64 = paddle_fa4.flash_attn_fwd(q, k, v, block_size=64, **kw)[2].numpy()
    bl128 = paddle_fa4.flash_attn_fwd(q, k, v, block_size=128, **kw)[2].numpy()
    pad = np.full(bl64.shape[:-1] + (1,), -np.inf, dtype=np.float32)
    pairs = np.concatenate([bl64, pad], axis=-1).reshape(bl64.shape[:-1] + (3, 2)).max(axis=-1)
    np.testing.assert_array_equal(pairs, bl128)


def test_block_logit_leaves_out_and_lse_unchanged():
    q, k, v = make_inputs(12, 2, 19, 45, 4, 1, 16)
    out0, lse0 = paddle_fa4.flash_attn_fwd(q, k, v, causal=True, backend="reference")
    out1, lse1, _ = paddle_fa4.flash_attn_fwd(q, k, v, causal=True, block_size=32, return_block_logit=True,
                                              backend="reference")
    np.testing.assert_array_equal(out0.numpy(), out1.numpy())
    np.testing.assert_array_equal(lse0.numpy(), lse1.numpy())


def test_chunked_rows(monkeypatch):
    """Tiny tiles force many query-row chunks; results still match the oracle."""
    monkeypatch.setattr(ref_attention, "TILE_BYTES", 4 * 2 * 3 * 64)  # 3 rows per chunk
    q, k, v = make_inputs(13, 2, 17, 40, 2, 1, 16)
    check_against_oracle(q, k, v, causal=True, window_size=(9, None), block_size=16, return_block_logit=True)


def test_no_keys_at_all():
    """Sk = 0: every row is empty; Sq = 0: empty outputs of the right shapes."""
    q, k, v = make_inputs(14, 2, 5, 0, 2, 2, 16)
    out, lse, bl = paddle_fa4.flash_attn_fwd(q, k, v, return_block_logit=True, backend="reference")
    assert out.shape == [2, 5, 2, 16] and np.all(out.numpy() == 0)
    assert np.all(np.isneginf(lse.numpy())) and bl.shape == [2, 2, 5, 0]
    q, k, v = make_inputs(14, 2, 0, 7, 2, 2, 16)
    out, lse, bl = paddle_fa4.flash_attn_fwd(q, k, v, return_block_logit=True, block_size=16, backend="reference")
    assert out.shape == [2, 0, 2, 16] and lse.shape == [2, 2, 0] and bl.shape == [2, 2, 0, 1]


DOC_PICTURES = [  # the 0/1 pictures of docs/api.md: (sq, sk, causal, window, picture)
    pytest.param(3, 5, True, (None, None), ["11100", "11110", "11111"], id="causal-sq-lt-sk"),
    pytest.param(5, 3, True, (None, None), ["000", "000", "100", "110", "111"], id="causal-sq-gt-sk"),
    pytest.param(5, 5, False, (1, 1), ["11000", "11100", "01110", "00111", "00011"], id="window-1-1"),
    pytest.param(4, 6, True, (2, None), ["111000", "011100", "001110", "000111"], id="causal-window-2"),
]


@pytest.mark.parametrize("sq,sk,causal,window,picture", DOC_PICTURES)
def test_doc_pictures(sq, sk, causal, window, picture):
    """The masks drawn in docs/api.md are what the reference computes (lse -inf exactly on empty rows,
    block_logit with block_size 16 > Sk is -inf exactly on empty rows)."""
    expected = np.array([[c == "1" for c in row] for row in picture])
    np.testing.assert_array_equal(oracle.visible(sq, sk, causal, window), expected)
    q, k, v = make_inputs(15, 1, sq, sk, 1, 1, 8)
    _, lse, bl = paddle_fa4.flash_attn_fwd(q, k, v, causal=causal, window_size=window, block_size=16,
                                           return_block_logit=True, backend="reference")
    empty = ~expected.any(axis=1)
    np.testing.assert_array_equal(np.isneginf(lse.numpy()[0, 0]), empty)
    np.testing.assert_array_equal(np.isneginf(bl.numpy()[0, 0, :, 0]), empty)


def test_doc_block_logit_picture():
    """docs/api.md: causal Sq=3, Sk=5, block_size 2 -> only block 2 of rows 0 and 1 is -inf (oracle and
    the reference's block reduction; the public op takes block sizes from 16 up)."""
    from paddle_fa4.reference.attention import _block_max

    expected = [[False, False, True], [False, False, True], [False, False, False]]
    rng = np.random.default_rng(16)
    q, k = rng.standard_normal((1, 3, 1, 8)), rng.standard_normal((1, 5, 1, 8))
    _, _, bl = oracle.attention(q, k, k, causal=True, block_size=2)
    np.testing.assert_array_equal(np.isneginf(bl[0, 0]), expected)
    s = paddle.where(paddle.to_tensor(oracle.visible(3, 5, causal=True)).unsqueeze(0),
                     paddle.ones([1, 3, 5]), paddle.full([1, 3, 5], -math.inf))
    np.testing.assert_array_equal(np.isneginf(_block_max(s, 2, 3).numpy()[0]), expected)


def test_varlen_sentinel_buffer_fully_overwritten():
    """Varlen: blocks past a shorter sequence's end and rows of empty documents are written too."""
    lq, lk = [3, 0, 6], [2, 4, 40]
    cu_q = paddle.to_tensor(np.cumsum([0] + lq), dtype="int32")
    cu_k = paddle.to_tensor(np.cumsum([0] + lk), dtype="int32")
    q, k, v = make_inputs(17, None, sum(lq), sum(lk), 2, 1, 16, varlen=True)
    buf = paddle.full([2, sum(lq), 3], float("nan"), dtype="float32")
    out = check_against_oracle(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=6,
                               max_seqlen_k=40, block_logit=buf, block_size=16)
    assert out[2] is buf and not np.isnan(buf.numpy()).any()
