"""Edge cases that gave silent wrong results (issue 43, section 4), on the reference backend:
window bounds near the 64-bit limit, NaN / Inf in keys and values a row cannot see, ``h2o.select_pages``'s
``sparse_seq_lens`` with ``eos=0``, ``blocks_to_indices`` past int32, huge selection sizes, a numpy ``lse``."""

from __future__ import annotations

import math
import sys

import numpy as np
import paddle
import pytest

import paddle_fa4
from paddle_fa4 import h2o

REF = "reference"


def _t(x, dtype="float32"):
    return paddle.to_tensor(np.asarray(x)).astype(dtype)


def _qkv(seed, sq, sk, hq=4, hkv=2, d=16, b=1):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((b, sq, hq, d)).astype(np.float32), rng.standard_normal((b, sk, hkv, d)).astype(np.float32),
            rng.standard_normal((b, sk, hkv, d)).astype(np.float32))


# ------------------------------------------------------------------------------------------ window_size
HUGE = [sys.maxsize, 2 ** 63, 2 ** 70]


@pytest.mark.parametrize("huge", HUGE)
@pytest.mark.parametrize("causal", [False, True])
def test_huge_window_is_unbounded(huge, causal):
    q, k, v = (_t(x) for x in _qkv(0, 7, 11))
    want = paddle_fa4.flash_attn_fwd(q, k, v, causal=causal, return_block_logit=True, block_size=16, backend=REF)
    for window in ((huge, None), (None, huge), (huge, huge), (huge, -1)):
        got = paddle_fa4.flash_attn_fwd(q, k, v, causal=causal, window_size=window, return_block_logit=True,
                                        block_size=16, backend=REF)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
    # a huge left bound with causal is plain causal; next to a finite right bound it keeps that bound
    got = paddle_fa4.flash_attn_fwd(q, k, v, window_size=(huge, 0), backend=REF)
    np.testing.assert_array_equal(got[0].numpy(), paddle_fa4.flash_attn_fwd(q, k, v, causal=True, backend=REF)[0].numpy())
    got = paddle_fa4.flash_attn_fwd(q, k, v, window_size=(huge, 2), backend=REF)
    np.testing.assert_array_equal(got[0].numpy(), paddle_fa4.flash_attn_fwd(q, k, v, window_size=(None, 2),
                                                                            backend=REF)[0].numpy())


def test_huge_window_backward_varlen_and_chunked():
    q, k, v = (_t(x) for x in _qkv(1, 6, 6))
    out, lse = paddle_fa4.flash_attn_fwd(q, k, v, causal=True, backend=REF)
    dout = paddle.ones_like(out)
    want = paddle_fa4.flash_attn_bwd(dout, q, k, v, out, lse, causal=True, backend=REF)
    got = paddle_fa4.flash_attn_bwd(dout, q, k, v, out, lse, causal=True, window_size=(sys.maxsize, 2 ** 70),
                                    backend=REF)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    # varlen: the bound is compared with max_seqlen_q + max_seqlen_k
    cu = _t([0, 2, 6], "int32")
    qv, kv, vv = q[0], k[0], v[0]
    want = paddle_fa4.flash_attn_varlen_func(qv, kv, vv, cu, cu, backend=REF)
    got = paddle_fa4.flash_attn_varlen_func(qv, kv, vv, cu, cu, window_size=(2 ** 70, sys.maxsize), backend=REF)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    # the chunked driver: a huge right bound without causal is no mask (was NotImplementedError)
    want = paddle_fa4.select_topk_blocks_chunked(q, k, v, topk=1, causal=False, block_size=16, chunk_q=2,
                                                 backend=REF)
    got = paddle_fa4.select_topk_blocks_chunked(q, k, v, topk=1, causal=False, block_size=16, chunk_q=2,
                                                window_size=(None, sys.maxsize), backend=REF)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_window_bound_within_reach_is_kept():
    """Only bounds that hide no key become unbounded: one key short of it still masks."""
    q, k, v = (_t(x) for x in _qkv(2, 5, 5))
    from paddle_fa4.attention import _check_window

    assert _check_window((9, 9), False, reach=10) == (9, 9, False)
    assert _check_window((10, sys.maxsize), False, reach=10) == (None, None, False)
    assert _check_window((2 ** 70, 3), True, reach=10) == (None, 0, True)
    with pytest.raises(ValueError, match="window_size\\[0\\] must be None, -1"):
        paddle_fa4.flash_attn_fwd(q, k, v, window_size=(-2 ** 70, None), backend=REF)


# ------------------------------------------------------------------------------------------ NaN / Inf in keys
def _poison(x, keys, value):
    x = x.copy()
    x[:, keys] = value
    return x


def _fwd_bwd(q, k, v, **kw):
    q, k, v = _t(q), _t(k), _t(v)
    out, lse = paddle_fa4.flash_attn_fwd(q, k, v, backend=REF, **kw)
    dq, dk, dv = paddle_fa4.flash_attn_bwd(paddle.ones_like(out), q, k, v, out, lse, backend=REF, **kw)
    return [x.numpy() for x in (out, lse, dq, dk, dv)]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_keys_no_row_sees(value, softcap):
    """Sq 4, Sk 10, causal, window (1, 0): rows see keys 5..9, keys 0..4 none. Poisoned k and v there change
    nothing at all: out, lse, dq, and dk / dv (0 on the keys no row sees)."""
    q, k, v = _qkv(3, 4, 10)
    kw = dict(causal=True, window_size=(1, 0), softcap=softcap)
    want = _fwd_bwd(q, k, v, **kw)
    got = _fwd_bwd(q, _poison(k, [0, 3], value), _poison(v, [1, 4], value), **kw)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        np.testing.assert_array_equal(a, b, err_msg=name)
        assert np.isfinite(a).all(), name


@pytest.mark.parametrize("value", [math.nan, math.inf])
@pytest.mark.parametrize("where", ["causal", "window"])
def test_rows_keep_clean_of_keys_they_cannot_see(value, where):
    """Keys some rows see and others do not: the rows that cannot see a poisoned key get out / lse / dq exactly
    as with a finite key there, block_logit too; the rows that see it get a non-finite out."""
    sq = sk = 12
    q, k, v = _qkv(4, sq, sk)
    if where == "causal":  # key 8 (k) and 9 (v): rows >= 8 see them
        kw, bad_k, bad_v, clean_rows = dict(causal=True), [8], [9], np.arange(8)
    else:  # window (2, 1), not causal: row i sees keys i-2..i+1; key 0 seen by rows 0..2, key 1 by rows 0..3
        kw, bad_k, bad_v, clean_rows = dict(window_size=(2, 1)), [0], [1], np.arange(4, sq)
    dirty_rows = np.setdiff1d(np.arange(sq), clean_rows)
    want = _fwd_bwd(q, k, v, **kw)
    got = _fwd_bwd(q, _poison(k, bad_k, value), _poison(v, bad_v, value), **kw)
    for name, a, b in zip(("out", "dq"), (got[0], got[2]), (want[0], want[2])):
        np.testing.assert_array_equal(a[:, clean_rows], b[:, clean_rows], err_msg=name)
    assert not np.isfinite(got[0][:, dirty_rows]).all()  # the rows that see a poisoned key do get it
    if where == "window":
        # keys 5.. are seen by rows 4.. only: the rows that see a poisoned key (their out and D = rowsum(dO * O)
        # are NaN) must not reach them through a masked pair, dS = P (dP - D) with P = 0
        for name, a, b in zip(("dk", "dv"), got[3:], want[3:]):
            np.testing.assert_array_equal(a[:, 5:], b[:, 5:], err_msg=name)
    np.testing.assert_array_equal(got[1][:, :, clean_rows], want[1][:, :, clean_rows], err_msg="lse")
    # block_logit: the max logit of each block over the visible keys
    kwb = dict(kw, return_block_logit=True, block_size=16)
    bl_want = paddle_fa4.flash_attn_fwd(_t(q), _t(k), _t(v), backend=REF, **kwb)[2].numpy()
    bl_got = paddle_fa4.flash_attn_fwd(_t(q), _t(_poison(k, bad_k, value)), _t(_poison(v, bad_v, value)), backend=REF,
                                       **kwb)[2].numpy()
    np.testing.assert_array_equal(bl_got[:, :, clean_rows], bl_want[:, :, clean_rows])


def test_poisoned_keys_through_autograd_bf16():
    """flash_attn_func's PyLayer (bf16 inputs, GQA) keeps the rows and the gradients clean as well."""
    q, k, v = _qkv(5, 6, 9, hq=4, hkv=1)
    grads = []
    for kk, vv in ((k, v), (_poison(k, [0], math.nan), _poison(v, [1], math.inf))):
        tq, tk, tv = (_t(x, "bfloat16") for x in (q, kk, vv))
        for x in (tq, tk, tv):
            x.stop_gradient = False
        out, lse = paddle_fa4.flash_attn_func(tq, tk, tv, window_size=(3, 0), backend=REF)
        out.astype("float32").sum().backward()
        grads.append([out.astype("float32").numpy(), tq.grad.astype("float32").numpy(),
                      tk.grad.astype("float32").numpy()[:, 2:], tv.grad.astype("float32").numpy()[:, 2:]])
    # rows 0..2 see key 0 / 1 (window 3 back from row i + 3): rows 5 see neither
    for a, b in zip(grads[1][:2], grads[0][:2]):
        np.testing.assert_array_equal(a[:, 5:], b[:, 5:])
    assert not np.isfinite(grads[1][0][:, :5]).all()


def _sparse_grads(op, q, k, v, sel, **kw):
    """out, dq, dk, dv of ``op`` (block_sparse_attention / indexed_attention, reference backend) with a fixed dout."""
    tq, tk, tv = (_t(x) for x in (q, k, v))
    for x in (tq, tk, tv):
        x.stop_gradient = False
    out = op(tq, tk, tv, _t(sel, "int32"), backend=REF, **kw)
    dout = np.random.default_rng(7).standard_normal(out.shape).astype(np.float32)
    paddle.autograd.backward([out], [_t(dout)])
    return out.numpy(), tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()


@pytest.mark.parametrize("op", ["indexed", "block_sparse"])
def test_sparse_ops_keep_gradients_clean_of_values_rows_did_not_select(op):
    """A NaN value row selected by one row makes that row's out and D = rowsum(dO * O) NaN; the keys only the
    other rows select keep their dk / dv, key 0 included: the references gather unused slots as token 0 with P = 0,
    and dS = P (dP - D) = 0 * NaN there reached dk[0] (found 2026-12-08; dS is now 0 where P = 0)."""
    if op == "indexed":
        q, k, v = _qkv(8, 6, 12)
        # row 0 selects key 5 (poisoned) and pads; key 0 is selected by rows 1..5 only
        sel = np.array([[5, -1, -1, 3], [0, 1, 2, -1], [0, 2, 4, -1], [0, 3, -1, -1], [0, 6, 7, 8], [0, 9, 10, -1]])
        run = lambda k_, v_: _sparse_grads(paddle_fa4.indexed_attention, q, k_, v_, sel[None])  # noqa: E731
        bad, seeing, clean_keys = [5], [0], [0, 1, 2, 4, 6, 7, 8, 9, 10]
    else:
        q, k, v = _qkv(8, 130, 130)
        # 64-key blocks, causal: rows 64.. select block 1 (keys 64..) and pad; rows < 64 select block 0 only
        sel = np.full((1, 130, 2), -1)
        sel[0, :, 0] = np.arange(130) // 64
        run = lambda k_, v_: _sparse_grads(paddle_fa4.block_sparse_attention, q, k_, v_, sel,  # noqa: E731
                                           block_size=64, causal=True)
        bad, seeing, clean_keys = [64], list(range(64, 128)), list(range(64))  # key 64: rows 64..127 (block 1)
    want = run(k, v)
    got = run(k, _poison(v, bad, math.nan))
    assert not np.isfinite(got[0][:, seeing]).all(axis=-1).any()  # the rows that selected it do get it
    for name, a, b in zip(("dk", "dv"), got[2:], want[2:]):
        np.testing.assert_array_equal(a[:, clean_keys], b[:, clean_keys], err_msg=name)
        assert np.isfinite(a[:, clean_keys]).all(), name


def test_key_matmul_ieee_values():
    """The guarded matmul gives each row the IEEE value of its products over the keys it sees (numpy's sum of
    those products): invisible NaN / Inf are dropped, visible ones give NaN (NaN, 0 * Inf, Inf - Inf) or +-Inf."""
    from paddle_fa4.reference.attention import key_matmul

    inf, nan = math.inf, math.nan
    a = np.array([[1, 0, 2, 0], [0, 1, 0, 0], [1, 1, 0, 0], [-1, 0, 1, 0], [0, -1, 0, 0], [0, 1, 0, -1],
                  [0, 0, 0, 0], [2, 0, 0, 3]], dtype=np.float32)
    live = np.array([[1, 0, 1, 0], [0, 1, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [0, 1, 0, 0], [0, 1, 0, 1],
                     [1, 0, 0, 0], [1, 0, 0, 1]], dtype=bool)
    b = np.array([[1, 5, inf], [inf, nan, 2], [3, inf, -inf], [-inf, 4, 1]], dtype=np.float32)
    assert not (a[~live]).any()  # a is 0 where a row does not see the key
    with np.errstate(invalid="ignore"):
        want = np.array([[np.sum(a[i, live[i]] * b[live[i], j]) for j in range(3)] for i in range(len(a))])
    got = key_matmul(_t(a[None]), _t(b[None]), _t(live[None], "bool"), False).numpy()[0]
    np.testing.assert_array_equal(got, want)
    assert np.isnan(want).any() and np.isposinf(want).any() and np.isneginf(want).any() and np.isfinite(want).any()
    finite_b = np.nan_to_num(b, nan=0.5, posinf=2.0, neginf=-3.0)
    np.testing.assert_array_equal(key_matmul(_t(a[None]), _t(finite_b[None]), _t(live[None], "bool"), True).numpy()[0],
                                  a @ finite_b)


# ------------------------------------------------------------------------------------------ sizes and types
def test_blocks_to_indices_rejects_seqlen_k_past_int32():
    blk = paddle.to_tensor([[[[0, 1]]]], dtype="int32")
    ok = paddle_fa4.blocks_to_indices(blk, block_size=16, seqlen_k=2 ** 31 - 1, causal=False, backend=REF)
    assert ok[0, 0].numpy().tolist() == list(range(32))
    for seqlen_k in (2 ** 31, 2 ** 32 + 5, 2 ** 62):  # ids would wrap to negative / small numbers
        with pytest.raises(ValueError, match=f"^blocks_to_indices: seqlen_k must be <= {2 ** 31 - 1}.*got {seqlen_k}"):
            paddle_fa4.blocks_to_indices(blk, block_size=16, seqlen_k=seqlen_k, backend=REF)


def test_selection_sizes_name_the_argument():
    bl, lse = paddle.zeros([1, 2, 4, 3]), paddle.zeros([1, 2, 4])
    for topk in (2 ** 31, 2 ** 62):
        with pytest.raises(ValueError, match=f"^select_topk_blocks: topk must be <= {2 ** 31 - 1}"):
            paddle_fa4.select_topk_blocks(bl, lse, topk=topk, backend=REF)
    with pytest.raises(ValueError, match="^select_topk_blocks: seqlen_k must be <= "):
        paddle_fa4.select_topk_blocks(bl, lse, topk=2, block_size=16, seqlen_k=2 ** 62, backend=REF)
    q = paddle.zeros([1, 8, 2, 16])
    with pytest.raises(ValueError, match="^select_topk_blocks_chunked: topk must be <= "):
        paddle_fa4.select_topk_blocks_chunked(q, q, q, topk=2 ** 62, block_size=16, backend=REF)
    # an output past the 47-bit address space (512 TB; no allocator, overcommitting or not, returns it): a
    # MemoryError naming the output and topk, not Paddle's allocator message alone
    big_bl, big_lse = paddle.zeros([1, 2, 2 ** 16, 3]), paddle.zeros([1, 2, 2 ** 16])
    with pytest.raises(MemoryError, match=r"^select_topk_blocks: not enough memory for the output \[B, Hs, Sq, topk\] "
                                          r"= \[1, 1, 65536, 2147483647\] int32, sized by topk=2147483647"):
        paddle_fa4.select_topk_blocks(big_bl, big_lse, topk=2 ** 31 - 1, backend=REF)


def test_lengths_past_int32_name_the_argument():
    q = paddle.zeros([2 ** 18, 2, 4])
    cu = paddle.to_tensor([0, 2 ** 18], dtype="int32")
    for name in ("max_seqlen_q", "max_seqlen_k"):
        kw = {"max_seqlen_q": 2 ** 18, "max_seqlen_k": 2 ** 18, name: 2 ** 62}
        with pytest.raises(ValueError, match=f"^flash_attn_fwd: {name} must be <= {2 ** 31 - 1}"):
            paddle_fa4.flash_attn_fwd(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, backend=REF, **kw)
    # block_logit [Hq, total_q, ceil(max_seqlen_k / 16)] of 256 TB: named, with the lengths that size it
    with pytest.raises(MemoryError, match=r"^flash_attn_fwd: not enough memory for block_logit \[2, 262144, 134217728\] "
                                          r"float32, sized by max_seqlen_q=262144, max_seqlen_k=2147483647 and "
                                          r"block_size=16"):
        paddle_fa4.flash_attn_fwd(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=2 ** 18,
                                  max_seqlen_k=2 ** 31 - 1, block_size=16, return_block_logit=True, backend=REF)
    idx = paddle.zeros([1, 2, 2], dtype="int32")
    with pytest.raises(ValueError, match=f"^indexed_attention_plan: kv_len must be <= {2 ** 31 - 1}"):
        paddle_fa4.indexed_attention_plan(idx, kv_len=2 ** 62, heads_per_kv=2, backend=REF)
    scores, tables, lens = paddle.zeros([1, 1, 3]), paddle.zeros([1, 3], dtype="int32"), paddle.to_tensor([9])
    with pytest.raises(ValueError, match="^h2o.select_pages: topk must be <= "):
        h2o.select_pages(scores, tables, lens, page_size=4, topk=2 ** 62, backend=REF)
    with pytest.raises(ValueError, match="^h2o.select_pages: bos \\+ topk \\+ eos"):
        h2o.select_pages(scores, tables, lens, page_size=4, topk=2 ** 31 - 1, bos=1, backend=REF)


@pytest.mark.parametrize("which", ["block_logit", "lse"])
def test_numpy_inputs_are_a_type_error(which):
    bl, lse = paddle.zeros([1, 2, 4, 3]), paddle.zeros([1, 2, 4])
    args = {"block_logit": bl, "lse": lse}
    args[which] = args[which].numpy()
    with pytest.raises(TypeError, match=f"^select_topk_blocks: {which} must be a paddle.Tensor, got ndarray"):
        paddle_fa4.select_topk_blocks(args["block_logit"], args["lse"], topk=2, backend=REF)
    with pytest.raises(TypeError, match=f"^block_log_weight: {which} must be a paddle.Tensor, got ndarray"):
        paddle_fa4.block_log_weight(args["block_logit"], args["lse"])
