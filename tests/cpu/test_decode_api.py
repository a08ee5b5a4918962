"""Decode API: the HySparse selection -> page table helper (with sparse decode end to end) and
every validation error of flash_attn_with_kvcache / sparse_decode_attention /
block_selection_to_page_table (raised before any work, naming the argument)."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

import paddle_fa4
from tests.cpu.test_decode import REF, make_case, real_positions, tensors
from tests.oracles import decode as oracle
from tests.oracles.tolerance import assert_close, to_numpy64


# ------------------------------------------------------------------ HySparse selection -> tables
def expected_tokens(blk, b, h, sq, lens, page, bs, window):
    """(selected token set, tokens < L of the pages holding one) for sequence b, kv head h."""
    n = int(lens[b])
    sel = set()
    for s in range(sq):
        for j in blk[b, h if blk.shape[1] > 1 else 0, s]:
            if j >= 0 and j * bs < n:
                sel.update(range(j * bs, min((j + 1) * bs, n)))
    sel.update(range(max(n - max(window, sq), 0), n))
    pages = {t // page for t in sel}
    return sel, [t for t in range(n) if t // page in pages]


@pytest.mark.parametrize("page,sq,shared", [(1, 1, False), (8, 1, False), (16, 2, False), (64, 1, True),
                                            (128, 1, False), (16, 4, True)])
def test_hysparse_selection_to_sparse_decode(page, sq, shared):
    """dense decode with block_logit -> select_topk_blocks -> block_selection_to_page_table ->
    sparse_decode_attention == attention over exactly the covered real tokens (real causal)."""
    bs, window, topk, hkv, group, d = 64, 20, 2, 2, 2, 16
    lens = [650, 130, 0, 3]
    case = make_case(31, lens, hkv=hkv, group=group, sq=sq, d=d, page=page)
    q, k, v, lens_t, table = tensors(case)
    _, lse, bl = paddle_fa4.flash_attn_with_kvcache(q, k, v, lens_t, block_table=table, return_block_logit=True,
                                                    block_size=bs, backend=REF)
    blk = paddle_fa4.select_topk_blocks(bl, lse, topk=topk, num_kv_heads=None if shared else hkv, sink_blocks=1,
                                        backend=REF)
    tables, seq = paddle_fa4.block_selection_to_page_table(blk, table, lens_t, page_size=page, num_kv_heads=hkv,
                                                           block_size=bs, window=window)
    assert tables.dtype == paddle.int32 and seq.dtype == paddle.int32 and list(seq.shape) == [4, hkv]
    per_block = 1 if page % bs == 0 else bs // page
    assert tables.shape[2] == min(table.shape[1], sq * topk * per_block + -(-max(window, sq) // page) + 1)
    out, lse_s = paddle_fa4.sparse_decode_attention(q, k, v, tables, seq, return_lse=True, backend=REF)
    blk_np, tab_np, seq_np = blk.numpy(), tables.numpy(), seq.numpy()
    qn, kn, vn = to_numpy64(q), to_numpy64(k), to_numpy64(v)
    sparse_somewhere = False
    for b, n in enumerate(lens):
        for h in range(hkv):
            sel, covered = expected_tokens(blk_np, b, h, sq, lens, page, bs, window)
            pos = real_positions(case["table"][b], tab_np[b, h], int(seq_np[b, h]), page)
            assert pos.tolist() == covered, (b, h)
            assert (tab_np[b, h, len({t // page for t in covered}):] == -1).all()
            extra = set(covered) - sel
            if bs % page == 0:  # exact but for the window's first page
                start = max(n - max(window, sq), 0)
                assert all(start // page * page <= t < start for t in extra), (b, h, sorted(extra))
            sparse_somewhere |= len(covered) < n
            if n == 0:
                assert np.isneginf(lse_s.numpy()[b]).all()
                continue
            keys = np.array([kn[case["table"][b, t // page], h, t % page] for t in pos])
            vals = np.array([vn[case["table"][b, t // page], h, t % page] for t in pos])
            eo, el, _ = oracle.attend(qn[b, :, h * group:(h + 1) * group], keys, vals, pos, n - sq + np.arange(sq),
                                      scale=d ** -0.5, causal=True, window=(None, None), softcap=0.0)
            assert_close("hysparse out", out.numpy()[b, :, h * group:(h + 1) * group], eo, 2e-5, 2e-5)
            assert_close("hysparse lse", lse_s.numpy()[b, h * group:(h + 1) * group], el, 2e-5, 2e-5)
    assert sparse_somewhere


def test_page_table_exact_blocks_when_page_divides_block():
    """P = 16 | 64, window start on a page boundary: exactly the selected blocks + window."""
    block_idx = paddle.to_tensor(np.array([[[[0, 3]]]], dtype=np.int32))  # blocks 0 and 3 of 64
    table = paddle.to_tensor(np.arange(20, dtype=np.int32)[::-1].copy().reshape(1, 20))
    lens = paddle.to_tensor(np.array([310], dtype=np.int32))
    tables, seq = paddle_fa4.block_selection_to_page_table(block_idx, table, lens, page_size=16, num_kv_heads=1,
                                                           window=310 - 288)  # window start 288 = 18 * 16
    logical = [0, 1, 2, 3, 12, 13, 14, 15, 18, 19]
    assert tables.numpy()[0, 0, :10].tolist() == [19 - j for j in logical]
    assert (tables.numpy()[0, 0, 10:] == -1).all()
    assert int(seq.numpy()[0, 0]) == 9 * 16 + (310 - 19 * 16)


def test_page_table_large_pages_take_whole_pages():
    """P = 128 > 64: block 1 (tokens 64..127) brings page 0 whole; the last page is partial."""
    block_idx = paddle.to_tensor(np.array([[[[1, -1]]]], dtype=np.int32))
    table = paddle.to_tensor(np.array([[7, 3, 5, -1]], dtype=np.int32))
    lens = paddle.to_tensor(np.array([300], dtype=np.int32))
    tables, seq = paddle_fa4.block_selection_to_page_table(block_idx, table, lens, page_size=128, num_kv_heads=2)
    assert tables.numpy().tolist() == [[[7, 5, -1, -1], [7, 5, -1, -1]]]  # Hs = 1: shared by both kv heads
    assert seq.numpy().tolist() == [[128 + 44, 128 + 44]]


# ---------------------------------------------------------------------------- validation errors
def _base():
    case = make_case(40, [20, 9], page=8, sq=2)
    q, k, v, lens, table = tensors(case)
    return {"q": q, "k": k, "v": v, "lens": lens, "table": table}


def _dense(a, **kw):
    kw.setdefault("block_table", a["table"])
    kw.setdefault("backend", REF)
    return paddle_fa4.flash_attn_with_kvcache(a["q"], a["k"], a["v"], a["lens"], **kw)


def _set(a, **over):
    return dict(a, **over)


def _table_with(a, b, j, value):
    t = a["table"].numpy().copy()
    t[b, j] = value
    return paddle.to_tensor(t)


DENSE_ERRORS = [
    ("lens int64 outside int32", lambda a: _dense(_set(a, lens=a["lens"].astype("int64") + 2**32)), ValueError,
     r"cache_seqlens is int64 with the value \d+ outside int32"),
    ("table int16", lambda a: _dense(a, block_table=a["table"].astype("int16")), TypeError,
     r"block_table must be int32 \(int64 is accepted"),
    ("q numpy", lambda a: _dense(_set(a, q=a["q"].numpy())), TypeError, r"q must be a paddle.Tensor"),
    ("q rank", lambda a: _dense(_set(a, q=a["q"][:, 0])), ValueError, r"q must be \[B, Sq, Hq, D\]"),
    ("q dtype", lambda a: _dense(_set(a, q=a["q"].astype("int32"))), TypeError, r"q must be bfloat16"),
    ("Sq 0", lambda a: _dense(_set(a, q=a["q"][:, :0])), ValueError, r"Sq >= 1"),
    ("Sq 17", lambda a: _dense(_set(a, q=paddle.zeros([2, 17, 4, 32]))), NotImplementedError, r"at most 16"),
    ("D 320", lambda a: _dense(_set(a, q=paddle.zeros([2, 1, 4, 320]))), NotImplementedError, r"head_dim 320"),
    ("k dtype", lambda a: _dense(_set(a, k=a["k"].astype("bfloat16"))), TypeError, r"k_cache must have q's dtype"),
    ("v dtype", lambda a: _dense(_set(a, v=a["v"].astype("float16"))), TypeError, r"v_cache must have q's dtype"),
    ("kv_layout", lambda a: _dense(a, kv_layout="NHD"), ValueError, r"kv_layout must be one of"),
    ("k rank", lambda a: _dense(_set(a, k=a["k"][0])), ValueError, r"k_cache must be \[num_pages, Hkv, page_size, D\]"),
    ("v pages", lambda a: _dense(_set(a, v=a["v"][1:])), ValueError, r"v_cache must match k_cache"),
    ("v D 512", lambda a: _dense(_set(a, v=paddle.zeros(list(a["k"].shape[:3]) + [512]))), NotImplementedError,
     r"v head_dim 512"),
    ("Hq", lambda a: _dense(_set(a, q=a["q"][:, :, :3])), ValueError, r"q's head count 3 must be a positive multiple"),
    ("k D", lambda a: _dense(_set(a, k=a["k"][..., :16])), ValueError, r"k_cache must have q's head_dim 32"),
    ("table float", lambda a: _dense(a, block_table=a["table"].astype("float32")), TypeError,
     r"block_table must be int32"),
    ("table batch", lambda a: _dense(a, block_table=a["table"][:1]), ValueError,
     r"block_table must be \[B, max_pages\]"),
    ("lens shape", lambda a: _dense(_set(a, lens=a["lens"].reshape([2, 1]))), ValueError,
     r"cache_seqlens must be \[B\]"),
    ("lens > pages", lambda a: _dense(_set(a, lens=paddle.to_tensor([20, 8 * a["table"].shape[1] + 1], dtype="int32"))),
     ValueError, r"cache_seqlens must be <= max_pages \* page_size = 5 \* 8 = 40, got cache_seqlens\[1\] = 41"),
    ("lens < 0", lambda a: _dense(_set(a, lens=paddle.to_tensor([20, -1], dtype="int32"))), ValueError,
     r"cache_seqlens must be >= 0, got cache_seqlens\[1\] = -1"),
    ("page -1", lambda a: _dense(a, block_table=_table_with(a, 0, 1, -1)), ValueError,
     r"block_table\[0, 1\] = -1 is not a page id in \[0, num_pages = 8\).*cache_seqlens\[0\] = 20"),
    ("page big", lambda a: _dense(a, block_table=_table_with(a, 1, 1, 8)), ValueError,
     r"block_table\[1, 1\] = 8 is not a page id"),
    ("scale", lambda a: _dense(a, softmax_scale=-1.0), ValueError, r"softmax_scale must be >= 0"),
    ("softcap", lambda a: _dense(a, softcap=-1.0), ValueError, r"softcap must be >= 0"),
    ("window pair", lambda a: _dense(a, window_size=(3,)), ValueError, r"window_size must be a \(left, right\) pair"),
    ("window -2", lambda a: _dense(a, window_size=(-2, None)), ValueError, r"window_size\[0\] must be None, -1"),
    ("splits -1", lambda a: _dense(a, num_splits=-1), ValueError, r"num_splits must be >= 0"),
    ("splits float", lambda a: _dense(a, num_splits=2.0), TypeError, r"num_splits must be an int"),
    ("return_lse", lambda a: _dense(a, return_lse="yes"), TypeError, r"return_lse must be a bool"),
    ("causal", lambda a: _dense(a, causal=1), TypeError, r"causal must be a bool"),
    ("block_size", lambda a: _dense(a, block_size=48, return_block_logit=True), ValueError,
     r"block_size must be one of"),
    ("return_block_logit", lambda a: _dense(a, return_block_logit=1), TypeError, r"return_block_logit must be a bool"),
    ("block_logit shape", lambda a: _dense(a, block_logit=paddle.zeros([2, 4, 2, 3])), ValueError,
     r"block_logit must have shape \[2, 4, 2, 1\]"),
    ("block_logit dtype", lambda a: _dense(a, block_logit=paddle.zeros([2, 4, 2, 1], dtype="float16")), TypeError,
     r"block_logit must be float32"),
    ("backend", lambda a: _dense(a, backend="triton"), ValueError, r"backend must be one of"),
    ("contiguous layout", lambda a: _dense(_set(a, k=paddle.zeros([2, 9, 2, 32]), v=paddle.zeros([2, 9, 2, 32])),
                                           block_table=None, kv_layout="nhd"), ValueError, r"applies to paged caches"),
    ("contiguous batch", lambda a: _dense(_set(a, k=paddle.zeros([3, 30, 2, 32]), v=paddle.zeros([3, 30, 2, 32])),
                                          block_table=None), ValueError, r"k_cache must have q's batch size 2"),
    ("contiguous lens", lambda a: _dense(_set(a, k=paddle.zeros([2, 19, 2, 32]), v=paddle.zeros([2, 19, 2, 32])),
                                         block_table=None), ValueError,
     r"cache_seqlens must be <= k_cache.shape\[1\] = 19, got cache_seqlens\[0\] = 20"),
    ("keyword only", lambda a: paddle_fa4.flash_attn_with_kvcache(a["q"], a["k"], a["v"], a["lens"], a["table"]),
     TypeError, r"positional"),
]


@pytest.mark.parametrize("name,call,exc,match", DENSE_ERRORS, ids=[e[0] for e in DENSE_ERRORS])
def test_dense_errors(name, call, exc, match):
    a = _base()
    _dense(a)  # the base call is valid
    with pytest.raises(exc, match=(match if name == "keyword only" else "flash_attn_with_kvcache: .*" + match)):
        call(a)


def _sparse_base():
    a = _base()
    t = np.repeat(a["table"].numpy()[:, None], 2, 1)
    s = np.repeat(a["lens"].numpy()[:, None], 2, 1)
    a["st"], a["sl"] = paddle.to_tensor(t), paddle.to_tensor(s)
    return a


def _sparse(a, **kw):
    kw.setdefault("backend", REF)
    return paddle_fa4.sparse_decode_attention(a["q"], a["k"], a["v"], a["st"], a["sl"], **kw)


def _st_with(a, idx, value):
    t = a["st"].numpy().copy()
    t[idx] = value
    return paddle.to_tensor(t)


SPARSE_ERRORS = [
    ("tables Hkv", lambda a: _sparse(_set(a, st=a["st"][:, :1])), ValueError,
     r"sparse_block_tables must be \[B, Hkv, n\]"),
    ("lens shape", lambda a: _sparse(_set(a, sl=a["sl"][:, 0])), ValueError, r"sparse_seq_lens must be \[B, Hkv\]"),
    ("lens > n*P", lambda a: _sparse(_set(a, sl=paddle.to_tensor([[20, 41], [9, 9]], dtype="int32"))), ValueError,
     r"sparse_seq_lens must be <= n \* page_size = 5 \* 8 = 40, got sparse_seq_lens\[0, 1\] = 41"),
    ("page id", lambda a: _sparse(_set(a, st=_st_with(a, (0, 1, 2), 99))), ValueError,
     r"sparse_block_tables\[0, 1, 2\] = 99 is not a page id .*sparse_seq_lens\[0, 1\] = 20"),
    ("contiguous", lambda a: _sparse(_set(a, k=a["k"][0], v=a["v"][0])), ValueError, r"k_cache must be"),
    ("Sq 17", lambda a: _sparse(_set(a, q=paddle.zeros([2, 17, 4, 32]))), NotImplementedError, r"at most 16"),
    ("window", lambda a: _sparse(a, window_size=(None, -3)), ValueError, r"window_size\[1\]"),
]


@pytest.mark.parametrize("name,call,exc,match", SPARSE_ERRORS, ids=[e[0] for e in SPARSE_ERRORS])
def test_sparse_errors(name, call, exc, match):
    a = _sparse_base()
    _sparse(a)
    with pytest.raises(exc, match="sparse_decode_attention: .*" + match):
        call(a)


def test_sparse_padding_past_length_is_not_an_error():
    a = _sparse_base()
    _sparse(_set(a, st=_st_with(a, (1, 0, 3), 1000)))  # sequence 1 (L = 9) needs pages 0 and 1 only
    with pytest.raises(TypeError, match="block_logit"):
        paddle_fa4.sparse_decode_attention(a["q"], a["k"], a["v"], a["st"], a["sl"], block_logit=None)


def _helper(a, **kw):
    blk = kw.pop("blk", paddle.to_tensor(np.array([[[[0, 1]]], [[[0, -1]]]], dtype=np.int32)))
    kw.setdefault("page_size", 8)
    kw.setdefault("num_kv_heads", 2)
    return paddle_fa4.block_selection_to_page_table(blk, kw.pop("table", a["table"]), kw.pop("lens", a["lens"]), **kw)


HELPER_ERRORS = [
    ("blk rank", lambda a: _helper(a, blk=paddle.zeros([2, 1, 2], dtype="int32")), ValueError,
     r"block_idx must be \[B, Hs, Sq, topk\]"),
    ("blk Hs", lambda a: _helper(a, blk=paddle.zeros([2, 3, 1, 2], dtype="int32")), ValueError,
     r"Hs = 1 or num_kv_heads = 2"),
    ("page_size", lambda a: _helper(a, page_size=0), ValueError, r"page_size must be >= 1"),
    ("window", lambda a: _helper(a, window=-1), ValueError, r"window must be >= 0"),
    ("heads", lambda a: _helper(a, num_kv_heads="2"), TypeError, r"num_kv_heads must be an int"),
    ("lens", lambda a: _helper(a, page_size=3), ValueError,
     r"cache_seqlens must be <= max_pages \* page_size = 5 \* 3 = 15"),
    ("table batch", lambda a: _helper(a, table=a["table"][:1]), ValueError, r"block_table must be \[B, max_pages\]"),
    ("lens float", lambda a: _helper(a, lens=a["lens"].astype("float32")), TypeError, r"cache_seqlens must be int32"),
]


@pytest.mark.parametrize("name,call,exc,match", HELPER_ERRORS, ids=[e[0] for e in HELPER_ERRORS])
def test_helper_errors(name, call, exc, match):
    a = _base()
    _helper(a)
    with pytest.raises(exc, match="block_selection_to_page_table: .*" + match):
        call(a)


def test_docstring_examples_run():
    import doctest

    import paddle_fa4.decode as module

    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


# ---------------------------------------------------------------- the glue call (DECODE contract)
class _FakeGlue:
    """Stands in for paddle_fa4._cute.decode: records what decode.py hands the glue."""

    def __init__(self):
        self.reason_calls, self.calls = [], []

    def unsupported_reason(self, arch, q, k_cache, v_cache, *, layout, paged, sparse, block_logit_size):
        self.reason_calls.append(dict(arch=arch, layout=layout, paged=paged, sparse=sparse,
                                      block_logit_size=block_logit_size, k_shape=list(k_cache.shape)))
        return None

    def decode_fwd(self, q, k_cache, v_cache, seqlens, table, **kw):
        from paddle_fa4.reference import decode as ref

        self.calls.append(dict(kw, seqlens=seqlens, table=table, k_shape=list(k_cache.shape)))
        return ref.decode_fwd(q, k_cache, v_cache, seqlens, table, **kw)


@pytest.fixture
def fake_glue(monkeypatch):
    import sys

    import paddle_fa4._cute
    import paddle_fa4.decode as dec

    glue = _FakeGlue()
    monkeypatch.setitem(sys.modules, "paddle_fa4._cute.decode", glue)
    monkeypatch.setattr(paddle_fa4._cute, "decode", glue, raising=False)

    def resolve(op, backend, tensor, reason, stacklevel=4, **kw):
        return "cute" if backend in ("auto", "cute") and reason(90) is None else "reference"

    monkeypatch.setattr(dec, "resolve_backend", resolve)
    return glue


def test_glue_receives_the_contract_form(fake_glue):
    case = make_case(50, [20, 9], hkv=2, group=2, sq=2, page=8)
    q, k, v, lens, table = tensors(case)
    buf = paddle.full([2, 4, 2, 3], float("nan"), dtype="float32")  # Sk_max 5 * 8 = 40 -> 3 blocks of 16
    out, lse, bl = paddle_fa4.flash_attn_with_kvcache(q, k, v, lens, block_table=table, window_size=(7, 3),
                                                      num_splits=0, block_logit=buf, block_size=16)
    (r,), (c,) = fake_glue.reason_calls, fake_glue.calls
    assert r == dict(arch=90, layout="hnd", paged=True, sparse=False, block_logit_size=16, k_shape=list(k.shape))
    assert c["layout"] == "hnd" and c["window_left"] == 7 and c["window_right"] == 0 and c["causal"] is True
    assert c["num_splits"] is None and c["return_lse"] is True and c["block_logit_size"] == 16
    # the dense form reaches the backend as the caller's own int32 tensors: no copy expands them over kv heads
    assert c["seqlens"] is lens and c["table"] is table
    assert bl is buf and not np.isnan(buf.numpy()).any()  # the glue's block_logit lands in the caller's buffer
    ref = paddle_fa4.flash_attn_with_kvcache(q, k, v, lens, block_table=table, window_size=(7, 3), block_size=16,
                                             return_block_logit=True, backend="reference")
    np.testing.assert_array_equal(out.numpy(), ref[0].numpy())
    np.testing.assert_array_equal(buf.numpy(), ref[2].numpy())


def test_glue_layouts_and_sparse(fake_glue):
    case = make_case(51, [12], hkv=2, group=1, page=4)
    q, k, v, lens, table = tensors(case)
    k_nhd = paddle.to_tensor(case["k"].transpose(0, 2, 1, 3).copy(), dtype="float32")
    v_nhd = paddle.to_tensor(case["v"].transpose(0, 2, 1, 3).copy(), dtype="float32")
    paddle_fa4.flash_attn_with_kvcache(q, k_nhd.transpose([0, 2, 1, 3]), v_nhd.transpose([0, 2, 1, 3]), lens,
                                       block_table=table, causal=False, num_splits=3)
    c = fake_glue.calls[-1]
    assert c["layout"] == "nhd" and c["k_shape"] == list(k_nhd.shape) and c["num_splits"] == 3
    assert c["window_left"] == -1 and c["window_right"] == -1 and c["return_lse"] is False
    assert c["block_logit_size"] is None
    kc = paddle.zeros([1, 30, 2, 32])
    paddle_fa4.flash_attn_with_kvcache(q, kc, kc, lens)
    c = fake_glue.calls[-1]
    assert c["layout"] == "contiguous" and c["table"] is None and c["seqlens"] is lens
    st = paddle.to_tensor(np.repeat(case["table"][:, None], 2, 1))
    sl = paddle.to_tensor(np.array([[12, 5]], dtype=np.int32))
    paddle_fa4.sparse_decode_attention(q, k, v, st, sl, return_lse=True)
    r, c = fake_glue.reason_calls[-1], fake_glue.calls[-1]
    assert r["sparse"] and r["paged"] and r["block_logit_size"] is None
    assert c["seqlens"] is sl and c["table"] is st and c["return_lse"] is True


# -------------------------------------------------------------------------- paddle.jit.to_static
def _decode_step(q, k, v, lens, table):
    out, lse, bl = paddle_fa4.flash_attn_with_kvcache(q, k, v, lens, block_table=table, return_block_logit=True,
                                                      block_size=16, backend=REF)
    blk = paddle_fa4.select_topk_blocks(bl, lse, topk=1, num_kv_heads=2, backend=REF)
    st, sl = paddle_fa4.block_selection_to_page_table(blk, table, lens, page_size=8, num_kv_heads=2, block_size=16)
    return out, lse, bl, st, sl, paddle_fa4.sparse_decode_attention(q, k, v, st, sl, backend=REF)


def test_sot_mode_equals_eager():
    q, k, v, lens, table = tensors(make_case(60, [20, 9], page=8, sq=2))
    want = _decode_step(q, k, v, lens, table)
    got = paddle.jit.to_static(_decode_step)(q, k, v, lens, table)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_full_graph_raises_not_implemented():
    q, k, v, lens, table = tensors(make_case(61, [20, 9], page=8))
    with pytest.raises(NotImplementedError,
                       match=r"flash_attn_with_kvcache: paddle.jit.to_static\(full_graph=True\) is not supported"):
        paddle.jit.to_static(_decode_step, full_graph=True)(q, k, v, lens, table)


def test_int64_index_tensors_give_the_int32_result():
    """Index tensors follow the package rule (docs/api.md "Index arguments"): int64 (what
    ``paddle.to_tensor`` of Python ints gives) is converted once and gives exactly the int32 result."""
    a = _base()
    want = _dense(a, return_lse=True)
    got = _dense(_set(a, lens=a["lens"].astype("int64")), block_table=a["table"].astype("int64"), return_lse=True)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(w.numpy(), g.numpy())
    s = _sparse_base()
    want = _sparse(s, return_lse=True)
    got = _sparse(_set(s, st=s["st"].astype("int64"), sl=s["sl"].astype("int64")), return_lse=True)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(w.numpy(), g.numpy())
    blk = paddle.to_tensor(np.array([[[[0, 1]]], [[[0, -1]]]], dtype=np.int32))
    want = _helper(a, blk=blk)
    got = _helper(a, blk=blk.astype("int64"), table=a["table"].astype("int64"), lens=a["lens"].astype("int64"))
    for w, g in zip(want, got):
        np.testing.assert_array_equal(w.numpy(), g.numpy())


# ------------------------------------------------- the CuTe path up to the kernel call (no GPU needed)
@pytest.fixture
def stub_kernel(monkeypatch):
    """The real op, glue and launcher on CPU tensors up to the compiled kernel: the backend resolves to
    "cute", the arch reads 90 and the SM count 132, and the compile functions return recorders of the launch
    arguments (``rec.cfgs``: configs compiled; ``rec.calls``: the decode kernel's tensor arguments). The
    launch memos are emptied for the test and restored after it, so no stub outlives it."""
    from types import SimpleNamespace

    import paddle_fa4.decode as dec
    from cute_kernels import arch as _arch
    from cute_kernels import jit_cache
    from cute_kernels.decode import launch
    from paddle_fa4._cute import decode as glue

    rec = SimpleNamespace(cfgs=[], calls=[], combines=0)

    def compile_decode(cfg):
        rec.cfgs.append(cfg)
        return lambda *args: rec.calls.append(args)

    def compile_combine(cfg):
        def comb(*args):
            rec.combines += 1
        return comb

    def compile_decode_step(cfg):  # the split kernel + the combine behind one entry (launch.DecodeSplitStep)
        rec.cfgs.append(cfg)

        def step(*args):
            rec.calls.append(args)
            rec.combines += 1
        return step

    monkeypatch.setattr(launch, "compile_decode", compile_decode)
    monkeypatch.setattr(launch, "compile_combine", compile_combine)
    monkeypatch.setattr(launch, "compile_decode_step", compile_decode_step)
    monkeypatch.setattr(glue, "device_of", lambda t: (90, 0, t.place))
    monkeypatch.setattr(_arch, "device_sm_count", lambda index: 132)
    monkeypatch.setattr(dec, "resolve_backend", lambda op, backend, tensor, reason, stacklevel=4, **kw: "cute")
    saved = (dict(jit_cache._FAST), dict(glue._PLANS))
    jit_cache._FAST.clear()
    glue._PLANS.clear()
    yield rec
    jit_cache._FAST.clear()
    jit_cache._FAST.update(saved[0])
    glue._PLANS.clear()
    glue._PLANS.update(saved[1])


def test_dense_index_reaches_the_kernel_as_the_callers_tensors(stub_kernel):
    """flash_attn_with_kvcache's [B] lengths and [B, max_pages] table reach the kernel as the caller's own
    int32 tensors (no copy expands them over the kv heads; Hkv = 2 here) and select the dense-index kernel;
    a second call of the same shapes compiles nothing and launches with the same objects."""
    case = make_case(70, [20, 9], hkv=2, group=2, page=8)
    q, k, v, lens, table = tensors(case)
    q, k, v = (x.astype("bfloat16") for x in (q, k, v))
    for _ in range(2):
        paddle_fa4.flash_attn_with_kvcache(q, k, v, lens, block_table=table, num_splits=1)
    assert len(stub_kernel.cfgs) == 1 and stub_kernel.cfgs[0].dense_index and not stub_kernel.cfgs[0].split
    for call in stub_kernel.calls:
        assert call[3] is lens and call[4] is table  # seqlens, table
    # split: the same tensors, the split kernel and the combine (one entry)
    paddle_fa4.flash_attn_with_kvcache(q, k, v, lens, block_table=table, num_splits=3)
    assert stub_kernel.cfgs[-1].dense_index and stub_kernel.cfgs[-1].split and stub_kernel.combines == 1
    assert stub_kernel.calls[-1][3] is lens and stub_kernel.calls[-1][4] is table
    assert list(stub_kernel.calls[-1][5].shape) == [3, 2, 1, 4, 32]  # o_part [S, B, Sq, Hq, D]
    # contiguous cache: the [B] lengths as they are, no table
    kc = paddle.zeros([2, 30, 2, 32], dtype="bfloat16")
    paddle_fa4.flash_attn_with_kvcache(q, kc, kc, lens, num_splits=1)
    assert stub_kernel.cfgs[-1].dense_index and stub_kernel.cfgs[-1].layout == "contiguous"
    assert stub_kernel.calls[-1][3] is lens and stub_kernel.calls[-1][4] is None


def test_per_kv_head_tables_reach_the_kernel_as_given(stub_kernel):
    case = make_case(71, [12, 30], hkv=2, group=1, page=4)
    q, k, v, _, _ = (x.astype("bfloat16") if x.dtype == paddle.float32 else x for x in tensors(case))
    st = paddle.to_tensor(np.repeat(case["table"][:, None], 2, 1))
    sl = paddle.to_tensor(np.array([[12, 5], [30, 1]], dtype=np.int32))
    paddle_fa4.sparse_decode_attention(q, k, v, st, sl, num_splits=1)
    assert not stub_kernel.cfgs[-1].dense_index
    assert stub_kernel.calls[-1][3] is sl and stub_kernel.calls[-1][4] is st


def test_converted_or_strided_index_tensors_are_copied_once_not_expanded(stub_kernel):
    """int64 index tensors are converted (one int32 copy, the documented cost); a strided table (a transposed
    buffer) is read through one compact copy; both keep the dense shapes [B] / [B, max_pages]."""
    case = make_case(72, [20, 9], hkv=2, group=2, page=8)
    q, k, v, lens, table = tensors(case)
    q, k, v = (x.astype("bfloat16") for x in (q, k, v))
    paddle_fa4.flash_attn_with_kvcache(q, k, v, lens.astype("int64"), block_table=table.astype("int64"),
                                       num_splits=1)
    seq_arg, tab_arg = stub_kernel.calls[-1][3:5]
    assert seq_arg.dtype == paddle.int32 and list(seq_arg.shape) == [2] and list(tab_arg.shape) == list(table.shape)
    np.testing.assert_array_equal(tab_arg.numpy(), case["table"])
    strided = paddle.to_tensor(np.ascontiguousarray(case["table"].T)).transpose([1, 0])
    assert not strided.is_contiguous()
    paddle_fa4.flash_attn_with_kvcache(q, k, v, lens, block_table=strided, num_splits=1)
    tab_arg = stub_kernel.calls[-1][4]
    assert tab_arg is not strided and tab_arg.is_contiguous() and list(tab_arg.shape) == list(table.shape)
    np.testing.assert_array_equal(tab_arg.numpy(), case["table"])
    assert stub_kernel.calls[-1][3] is lens


def test_auto_splits_and_outputs_from_the_cached_plan(stub_kernel):
    """num_splits=None: the split count from shapes (SM count 132), partials and block_logit sized by the plan;
    the plan is built once per shape key."""
    from paddle_fa4._cute import decode as glue

    case = make_case(73, [4000], hkv=2, group=4, page=64)
    q, k, v, lens, table = tensors(case)
    q, k, v = (x.astype("bfloat16") for x in (q, k, v))
    for _ in range(2):
        out, lse, bl = paddle_fa4.flash_attn_with_kvcache(q, k, v, lens, block_table=table,
                                                          return_block_logit=True, block_size=64)
    assert len(glue._PLANS) == 1
    (launch, bl_shape, o_shape, l_shape), = glue._PLANS.values()
    splits = o_shape[0]
    assert splits > 1 and l_shape[0] == splits and launch.config.split and launch.config.dense_index
    sk_max = case["table"].shape[1] * 64
    assert bl_shape == (1, 8, 1, -(-sk_max // 64)) and list(bl.shape) == list(bl_shape)
    assert list(out.shape) == [1, 1, 8, 32] and list(lse.shape) == [1, 8, 1]
    assert len(stub_kernel.cfgs) == 1 and stub_kernel.cfgs[0].split and stub_kernel.cfgs[0].block_size == 64


def test_block_table_entry_limit(monkeypatch):
    """The dense table's row offset is 32-bit: a table of 2^31 or more entries is refused before any work
    (shown with the bound lowered: such a table does not fit this machine)."""
    import paddle_fa4._validate as V

    a = _base()  # table [2, 5]
    _dense(a)  # 10 entries: fine
    monkeypatch.setattr(V, "INT32_MAX", 9)
    with pytest.raises(ValueError, match=r"flash_attn_with_kvcache: block_table must hold fewer than 2\^31 page "
                                         r"ids, got shape \[2, 5\]"):
        _dense(a)


def test_auto_holds_back_the_decode_path_not_yet_run(monkeypatch):
    """``_cute.decode.NOT_YET_RUN`` (empty since the d 256 warp pairs ran on an H100): a path listed there is held
    back from ``auto`` on that arch family with a reason; others are not; the public op hands resolve_backend that
    auto_reason."""
    import paddle_fa4.decode as dec
    from paddle_fa4._cute import decode as glue

    q256 = paddle.zeros([1, 1, 4, 256], dtype="bfloat16")
    assert not glue.NOT_YET_RUN and glue.unverified_reason(90, q256) is None
    monkeypatch.setattr(glue, "NOT_YET_RUN", {(90, "head_dim 256")})
    q128 = paddle.zeros([1, 1, 4, 128], dtype="bfloat16")
    assert "head_dim 256" in glue.unverified_reason(90, q256)
    assert glue.unverified_reason(90, q128) is None and glue.unverified_reason(100, q256) is None
    seen = {}

    def resolve(op, backend, tensor, reason, stacklevel=4, auto_reason=None):
        seen["why"] = auto_reason(90)
        return "reference"

    monkeypatch.setattr(dec, "resolve_backend", resolve)
    k = paddle.zeros([1, 32, 1, 256], dtype="bfloat16")
    lens = paddle.to_tensor([5], dtype="int32")
    paddle_fa4.flash_attn_with_kvcache(paddle.zeros([1, 1, 1, 256], dtype="bfloat16"), k, k, lens)
    assert "head_dim 256" in seen["why"]
