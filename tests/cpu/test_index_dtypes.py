"""Index arguments take int32 or int64 (docs/api.md, "Index arguments"): ``paddle.to_tensor`` of Python ints
and ``paddle.randint`` give int64. An int64 argument gives exactly the int32 call's result; int64 values
outside int32 saturate where every out-of-range value means padding (``indices``, ``block_idx``,
``slot_mapping``, ``block_tables``) and are a ValueError naming the argument elsewhere (host tensors);
other dtypes are a TypeError that says how to convert."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

import paddle_fa4
from paddle_fa4 import h2o

REF = "reference"
BIG = 2 ** 40


def _t(x, dtype):
    return paddle.to_tensor(np.asarray(x)).astype(dtype)


def _rand(rng, shape):
    return _t(rng.standard_normal(shape), "float32")


def _same(a, b):
    a = a if isinstance(a, (tuple, list)) else [a]
    b = b if isinstance(b, (tuple, list)) else [b]
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.numpy(), y.numpy())


# ---------------------------------------------------------------------------------------- attention
def _varlen_case():
    rng = np.random.default_rng(0)
    q, k, v = _rand(rng, [9, 4, 16]), _rand(rng, [12, 2, 16]), _rand(rng, [12, 2, 16])
    return q, k, v, [0, 4, 9], [0, 5, 12]


@pytest.mark.parametrize("op", ["flash_attn_fwd", "flash_attn_varlen_func", "flash_attn_bwd"])
def test_cu_seqlens_int64(op):
    q, k, v, cq0, ck0 = _varlen_case()

    def call(dtype, cq=cq0, ck=ck0):
        cu_q, cu_k = _t(cq, dtype), _t(ck, dtype)
        kw = dict(causal=True, max_seqlen_q=5, max_seqlen_k=7, backend=REF)
        if op == "flash_attn_fwd":
            return paddle_fa4.flash_attn_fwd(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kw)
        if op == "flash_attn_varlen_func":
            return paddle_fa4.flash_attn_varlen_func(q, k, v, cu_q, cu_k, **kw)
        out, lse = paddle_fa4.flash_attn_fwd(q, k, v, cu_seqlens_q=_t(cq0, "int32"), cu_seqlens_k=_t(ck0, "int32"),
                                             **kw)
        return paddle_fa4.flash_attn_bwd(paddle.ones_like(out), q, k, v, out, lse, cu_seqlens_q=cu_q,
                                         cu_seqlens_k=cu_k, **kw)

    _same(call("int64"), call("int32"))
    with pytest.raises(ValueError, match=f"^{op}: cu_seqlens_k is int64 with the value {BIG} outside int32"):
        call("int64", ck=[0, 5, BIG])


def test_cu_seqlens_int64_keeps_autograd():
    q, k, v, cq, ck = _varlen_case()
    grads = []
    for dtype in ("int64", "int32"):
        qq = q.detach()
        qq.stop_gradient = False
        out, _ = paddle_fa4.flash_attn_varlen_func(qq, k, v, _t(cq, dtype), _t(ck, dtype), causal=True, backend=REF)
        out.sum().backward()
        grads.append(qq.grad)
    _same(grads[0], grads[1])


# ---------------------------------------------------------------------------------------- indexed
def _indexed_case():
    rng = np.random.default_rng(1)
    q, k, v = _rand(rng, [1, 5, 4, 16]), _rand(rng, [1, 9, 2, 16]), _rand(rng, [1, 9, 2, 16])
    idx = np.array([[[0, 3, -1], [8, 8, 2], [-1, -1, -1], [4, 9, 1], [7, 6, 5]]], dtype=np.int64)
    return q, k, v, idx


def test_indexed_attention_int64():
    q, k, v, idx = _indexed_case()
    want = paddle_fa4.indexed_attention(q, k, v, _t(idx, "int32"), return_lse=True, backend=REF)
    _same(paddle_fa4.indexed_attention(q, k, v, _t(idx, "int64"), return_lse=True, backend=REF), want)
    # beyond int32: padding like any other index outside [0, Lkv) (saturates; never wraps onto a key)
    wide = np.where(idx < 0, -BIG, idx)
    wide[0, 3, 1] = BIG + 3  # wraps to key 3 if truncated to 32 bits
    _same(paddle_fa4.indexed_attention(q, k, v, _t(wide, "int64"), return_lse=True, backend=REF),
          paddle_fa4.indexed_attention(q, k, v, _t(np.where((wide < 0) | (wide >= 9), -1, wide), "int32"),
                                       return_lse=True, backend=REF))


def test_indexed_attention_int64_gradients():
    q, k, v, idx = _indexed_case()
    grads = []
    for dtype in ("int64", "int32"):
        qq, kk = q.detach(), k.detach()
        qq.stop_gradient = kk.stop_gradient = False
        paddle_fa4.indexed_attention(qq, kk, v, _t(idx, dtype), backend=REF).sum().backward()
        grads += [qq.grad, kk.grad]
    _same(grads[:2], grads[2:])


def test_indexed_attention_plan_int64():
    _, _, _, idx = _indexed_case()
    a = paddle_fa4.indexed_attention_plan(_t(idx, "int64"), kv_len=9, heads_per_kv=2, backend=REF)
    b = paddle_fa4.indexed_attention_plan(_t(idx, "int32"), kv_len=9, heads_per_kv=2, backend=REF)
    for name in ("win_key", "win_mask", "win_count", "tile_ptr", "tile_win", "tile_start"):
        assert getattr(a, name).dtype == paddle.int32
        _same(getattr(a, name), getattr(b, name))


# ---------------------------------------------------------------------------------------- block-sparse
def _block_sparse_case():
    rng = np.random.default_rng(2)
    s = 40
    q, k = _rand(rng, [1, s, 4, 16]), _rand(rng, [1, s, 2, 16])
    ids = np.stack([np.arange(s) // 16, np.zeros(s, dtype=np.int64) - 1], axis=-1)[None]  # diagonal block
    ids[0, 20:, 1] = 0
    return q, k, ids, [0, 17, 40]


def test_block_sparse_int64():
    q, k, ids, cu = _block_sparse_case()
    ids = np.where(np.arange(40)[None, :, None] >= 17, np.maximum(ids - 1, -1), ids)  # document-relative
    ids[0, 17:, 0] = (np.arange(17, 40) - 17) // 16

    def call(dtype):
        return paddle_fa4.block_sparse_attention(q, k, k, _t(ids, dtype), block_size=16, cu_seqlens=_t(cu, dtype),
                                                 return_lse=True, backend=REF)

    _same(call("int64"), call("int32"))
    plan = {d: paddle_fa4.block_sparse_plan(_t(ids, d), heads_per_kv=2, block_size=16, cu_seqlens=_t(cu, d))
            for d in ("int64", "int32")}
    for name in ("tile_start", "tile_mask", "tile_count", "q_limit", "key_start", "key_ptr"):
        _same(getattr(plan["int64"], name), getattr(plan["int32"], name))
    bad = ids.copy()
    bad[0, 3, 1] = BIG
    with pytest.raises(ValueError, match=f"^block_sparse_attention: block_ids is int64 with the value {BIG}"):
        paddle_fa4.block_sparse_attention(q, k, k, _t(bad, "int64"), block_size=16, backend=REF)
    with pytest.raises(ValueError, match="^block_sparse_plan: cu_seqlens is int64 with the value"):
        paddle_fa4.block_sparse_plan(_t(ids, "int64"), heads_per_kv=2, block_size=16,
                                     cu_seqlens=_t([0, 17, BIG], "int64"))


# ---------------------------------------------------------------------------------------- selection
def test_blocks_to_indices_int64():
    blk = np.array([[[[0, 1, -1], [2, 1, 0], [BIG, 1, -BIG]]]], dtype=np.int64)
    want = paddle_fa4.blocks_to_indices(_t(np.where(np.abs(blk) >= BIG, -1, blk), "int32"), block_size=16,
                                        seqlen_k=40, causal=False, backend=REF)
    got = paddle_fa4.blocks_to_indices(_t(blk, "int64"), block_size=16, seqlen_k=40, causal=False, backend=REF)
    _same(got, want)


# ---------------------------------------------------------------------------------------- h2o
def _paged():
    rng = np.random.default_rng(3)
    seq, hkv, ps, d = [7, 12], 2, 4, 8
    need = [-(-n // ps) for n in seq]
    tables = np.full((2, 4), -1, dtype=np.int64)
    tables[0, :2], tables[1, :3] = [4, 1], [0, 2, 3]
    key = _rand(rng, [6, hkv, ps, d])
    q = _rand(rng, [2, 4, d])
    assert need == [2, 3]
    return q, key, tables, np.array(seq, dtype=np.int64), rng


def test_h2o_paged_int64():
    q, key, tables, seq, rng = _paged()
    summary = paddle.zeros([6, 2, 3, 8])
    h2o.update_page_summary(key, _t(np.arange(24), "int32"), summary, backend=REF)
    wide = tables.copy()
    wide[0, 3] = BIG  # beyond the request's pages: unread, saturates instead of wrapping
    for tbl in (tables, wide):
        _same(h2o.page_scores(q, key, summary, _t(tbl, "int64"), _t(seq, "int64"), backend=REF),
              h2o.page_scores(q, key, summary, _t(tables, "int32"), _t(seq, "int32"), backend=REF))
    states = []
    for dtype in ("int64", "int32"):
        state = paddle.zeros([6, 2, 4])
        _, scores = h2o.token_accumulate(q, key, state, _t(tables, dtype), _t(seq, dtype), return_page_scores=True,
                                         backend=REF)
        states += [state, scores, h2o.token_page_scores(state, _t(tables, dtype), _t(seq, dtype), backend=REF)]
    _same(states[:3], states[3:])
    scores = _rand(rng, [2, 2, 4])
    _same(h2o.select_pages(scores, _t(tables, "int64"), _t(seq, "int64"), page_size=4, topk=1, bos=1, eos=0,
                           backend=REF),
          h2o.select_pages(scores, _t(tables, "int32"), _t(seq, "int32"), page_size=4, topk=1, bos=1, eos=0,
                           backend=REF))
    with pytest.raises(ValueError, match=f"^h2o.page_scores: seq_lens is int64 with the value {BIG}"):
        h2o.page_scores(q, key, summary, _t(tables, "int64"), _t([7, BIG], "int64"), backend=REF)


def test_h2o_slot_mapping_int64():
    rng = np.random.default_rng(4)
    key = _rand(rng, [3, 2, 4, 8])
    slots = np.array([0, 5, -1, BIG + 2, 11, -BIG], dtype=np.int64)  # BIG + 2 wraps to slot 2 if truncated
    padded = np.where((slots < 0) | (slots >= 12), -1, slots)
    for dtype, s in (("int64", slots), ("int32", padded)):
        state = paddle.full([3, 2, 4], 7.5)
        h2o.reset_scores(state, _t(s, dtype), backend=REF)
        summary = paddle.zeros([3, 2, 3, 8])
        h2o.update_page_summary(key, _t(s, dtype), summary, backend=REF)
        if dtype == "int64":
            got = (state, summary)
        else:
            _same(got, (state, summary))


@pytest.mark.parametrize("call", [
    lambda: paddle_fa4.indexed_attention(paddle.zeros([1, 2, 2, 8]), paddle.zeros([1, 3, 1, 8]),
                                         paddle.zeros([1, 3, 1, 8]), paddle.zeros([1, 2, 2], dtype="int16"),
                                         backend=REF),
    lambda: h2o.reset_scores(paddle.zeros([2, 1, 4]), paddle.zeros([3], dtype="float32"), backend=REF),
    lambda: paddle_fa4.blocks_to_indices(paddle.zeros([1, 1, 2, 2], dtype="uint8"), block_size=16, seqlen_k=32,
                                         backend=REF),
])
def test_other_dtypes_say_how_to_convert(call):
    with pytest.raises(TypeError, match=r"must be int32 \(int64 is accepted and converted to int32\), got \w+; "
                                        r"convert with \w+\.astype\('int32'\)"):
        call()


# ---------------------------------------------------------------------------------------- FlashMask
def test_flashmask_indices_int64():
    """``startend_row_indices`` (flash_attn_fwd, flashmask_attention, flash_attn_bwd) and ``block_bos``: int64
    gives the int32 result; a value outside int32 is a ValueError naming the argument."""
    rng = np.random.default_rng(1)
    q, k, v = _rand(rng, [1, 32, 2, 16]), _rand(rng, [1, 32, 2, 16]), _rand(rng, [1, 32, 2, 16])
    lts = np.full([1, 1, 32, 1], 32)  # causal document packing: documents [0, 20), [20, 32)
    lts[..., :20, 0] = 20
    bos = np.array([[0] * 20 + [20] * 12])

    def fwd(dtype, mask=lts, origin=bos):
        return paddle_fa4.flash_attn_fwd(q, k, v, causal=True, startend_row_indices=_t(mask, dtype),
                                         block_bos=_t(origin, dtype), block_size=16, return_block_logit=True,
                                         backend=REF)

    _same(fwd("int64"), fwd("int32"))
    _same(paddle_fa4.flashmask_attention(q, k, v, _t(lts, "int64"), causal=True, backend=REF),
          paddle_fa4.flashmask_attention(q, k, v, _t(lts, "int32"), causal=True, backend=REF))
    out, lse, _ = fwd("int32")

    def bwd(dtype):
        return paddle_fa4.flash_attn_bwd(paddle.ones_like(out), q, k, v, out, lse, causal=True,
                                         startend_row_indices=_t(lts, dtype), backend=REF)

    _same(bwd("int64"), bwd("int32"))
    with pytest.raises(ValueError, match=f"^flash_attn_fwd: startend_row_indices is int64 with the value {BIG}"):
        fwd("int64", mask=np.where(lts == 32, BIG, lts))
    with pytest.raises(ValueError, match=f"^flash_attn_fwd: block_bos is int64 with the value {BIG}"):
        fwd("int64", origin=np.where(bos == 20, BIG, bos))
