"""Decode attention (paddle_fa4.decode) on the reference backend (CPU) against the fp64 oracle.

``flash_attn_with_kvcache`` over paged (P 1/16/64/128, both layouts) and contiguous caches, ragged
lengths (0, 1, not a multiple of P), padding page ids, Sq 1..16 bottom-right causal, windows,
softcap, GQA/MQA, head dims, bf16/fp16, block_logit; ``sparse_decode_attention`` with per-kv-head
tables, fed by ``h2o.select_pages`` and by ``block_selection_to_page_table``; garbage (NaN / Inf)
in page tails and unlisted pages; every validation error. Small shapes: the file runs in seconds.
The selection helper and the validation errors live in ``test_decode_api.py``.
"""

from __future__ import annotations

import warnings

import numpy as np
import paddle
import pytest

import paddle_fa4
from tests.oracles import decode as oracle
from tests.oracles.tolerance import assert_close, to_numpy64

REF = "reference"
TOL = {"float32": (2e-5, 2e-5), "bfloat16": (1.5e-2, 1.5e-2), "float16": (2e-3, 2e-3)}


def make_case(seed, lens, *, hkv=2, group=2, sq=1, d=32, dv=None, page=16, dtype="float32", garbage=np.nan,
              spare_slots=2):
    """A paged cache with every unused byte poisoned: page tails past each sequence, unlisted pages.

    Table entries past a sequence alternate between -1 and an out-of-range id (both padding)."""
    rng = np.random.default_rng(seed)
    dv = dv or d
    need = [-(-n // page) for n in lens]
    max_pages = max(need + [0]) + spare_slots
    num_pages = sum(need) + 3  # 3 pages nobody lists
    perm = rng.permutation(num_pages)
    table = np.empty((len(lens), max_pages), dtype=np.int32)
    at = 0
    for b, k in enumerate(need):
        table[b, :k] = perm[at:at + k]
        table[b, k:] = [-1 if j % 2 == 0 else num_pages + 7 + j for j in range(max_pages - k)]
        at += k
    k_cache = rng.standard_normal((num_pages, hkv, page, d))
    v_cache = rng.standard_normal((num_pages, hkv, page, dv))
    listed = set(perm[:at].tolist())
    for pid in range(num_pages):
        if pid not in listed:
            k_cache[pid] = garbage
            v_cache[pid] = garbage
    for b, n in enumerate(lens):
        if n % page:
            last = table[b, need[b] - 1]
            k_cache[last, :, n % page:] = garbage
            v_cache[last, :, n % page:] = garbage
    q = rng.standard_normal((len(lens), sq, hkv * group, d))
    return {"q": q, "k": k_cache, "v": v_cache, "table": table, "lens": np.asarray(lens, dtype=np.int32),
            "dtype": dtype, "hkv": hkv}


def tensors(case):
    dt = case["dtype"]
    return (paddle.to_tensor(case["q"], dtype="float32").astype(dt),
            paddle.to_tensor(case["k"], dtype="float32").astype(dt),
            paddle.to_tensor(case["v"], dtype="float32").astype(dt),
            paddle.to_tensor(case["lens"], dtype="int32"), paddle.to_tensor(case["table"], dtype="int32"))


def dense_oracle(case, q, k, v, layout="hnd", **kw):
    hkv = case["hkv"]
    lens = np.repeat(case["lens"][:, None], hkv, axis=1)
    table = np.repeat(case["table"][:, None], hkv, axis=1)
    return oracle.decode(to_numpy64(q), to_numpy64(k), to_numpy64(v), lens, table, layout, **kw)


def check(case, *, layout="hnd", block_size=0, **kw):
    """flash_attn_with_kvcache vs the oracle over the same (rounded) inputs; returns the outputs."""
    q, k, v, lens, table = tensors(case)
    out, lse, *bl = paddle_fa4.flash_attn_with_kvcache(
        q, k, v, lens, block_table=table, return_lse=True, return_block_logit=bool(block_size),
        block_size=block_size or 64, backend=REF, **kw)
    eo, el, ebl = dense_oracle(case, q, k, v, block_size=block_size, **{
        "softmax_scale": kw.get("softmax_scale"), "causal": kw.get("causal", True),
        "window": kw.get("window_size", (None, None)), "softcap": kw.get("softcap", 0.0)})
    atol, rtol = TOL[case["dtype"]]
    assert out.dtype == q.dtype and list(out.shape) == list(eo.shape)
    assert_close("out", out, eo, atol, rtol)
    assert_close("lse", lse, el, 2e-5, 2e-5)
    if block_size:
        assert_close("block_logit", bl[0], ebl, 2e-5, 2e-5)
    return out, lse, (bl[0] if bl else None)


# ------------------------------------------------------------------------- dense paged decode
@pytest.mark.parametrize("page", [1, 16, 64, 128])
def test_page_sizes_ragged_lengths(page):
    """Lengths 0, 1, not a multiple of P, a multiple of P; padding ids past each sequence."""
    lens = [0, 1, 2 * page + 3 if page > 1 else 7, page * 2]
    out, lse, _ = check(make_case(1, lens, page=page, sq=1))
    assert np.all(out.numpy()[0] == 0) and np.all(np.isneginf(lse.numpy()[0]))  # L = 0: out 0, lse -inf
    assert np.isfinite(out.numpy()).all()


@pytest.mark.parametrize("sq", [1, 2, 4, 16])
def test_multi_token_bottom_right_causal(sq):
    """Row s sits at L - Sq + s; rows before the first key (L < Sq) see nothing."""
    lens = [3, 21, 40]
    out, lse, _ = check(make_case(2, lens, sq=sq, page=8, group=2))
    if sq > 3:  # sequence 0 has 3 keys: its first Sq - 3 rows see none
        assert np.all(np.isneginf(lse.numpy()[0, :, :sq - 3]))
        assert np.all(np.isfinite(lse.numpy()[0, :, sq - 3:]))


def test_not_causal_rows_see_every_key():
    check(make_case(3, [5, 30], sq=4, page=8), causal=False)


@pytest.mark.parametrize("window,causal", [((6, None), True), ((6, 2), False), ((None, 1), False), ((0, 0), False)])
def test_windows(window, causal):
    check(make_case(4, [1, 19, 37], sq=4, page=8), window_size=window, causal=causal)


def test_softcap_and_scale():
    check(make_case(5, [17, 33], sq=2, page=16), softcap=2.5, softmax_scale=0.4)


@pytest.mark.parametrize("hkv,group", [(2, 1), (2, 4), (1, 8), (1, 16), (4, 1)])
def test_gqa_and_mqa(hkv, group):
    check(make_case(6, [9, 26], hkv=hkv, group=group, sq=2, page=8))


@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (256, 256), (64, 32)])
def test_head_dims(d, dv):
    check(make_case(7, [13, 20], d=d, dv=dv, page=16, group=2, hkv=1))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_inputs(dtype):
    out, _, bl = check(make_case(8, [11, 40], dtype=dtype, sq=2, page=16), block_size=16)
    assert bl.dtype == paddle.float32


@pytest.mark.parametrize("block_size", [16, 64])
def test_block_logit_pattern_and_values(block_size):
    """Per query head, -inf exactly where a block holds no visible key (windows, Sq > 1, L = 0,
    blocks past L, out to Sk_max = max_pages * P)."""
    case = make_case(9, [0, 5, 70, 129], sq=4, page=16, group=4)
    _, lse, bl = check(case, block_size=block_size, window_size=(40, None))
    blk = bl.numpy()
    assert blk.shape[-1] == -(-case["table"].shape[1] * 16 // block_size)
    assert np.isneginf(blk[0]).all() and np.isfinite(blk[3]).any() and np.isneginf(blk[3]).any()
    # the max block logit never exceeds the row's lse (the lse adds the other keys' mass)
    finite = np.isfinite(lse.numpy())
    assert np.all(blk.max(-1)[finite] <= lse.numpy()[finite] + 1e-6)


def test_block_logit_buffer_filled_and_returned():
    case = make_case(10, [3, 50], sq=2, page=16)
    q, k, v, lens, table = tensors(case)
    nb = case["table"].shape[1]  # Sk_max = max_pages * 16 -> max_pages blocks of 16
    buf = paddle.full([2, 4, 2, nb], float("nan"), dtype="float32")
    out, lse, bl = paddle_fa4.flash_attn_with_kvcache(q, k, v, lens, block_table=table, block_logit=buf,
                                                      block_size=16, backend=REF)
    assert bl is buf and not np.isnan(buf.numpy()).any()
    _, _, ebl = dense_oracle(case, q, k, v, block_size=16)
    assert_close("block_logit", buf, ebl, 2e-5, 2e-5)
    # the same call without block_logit returns out alone, and the same out bit for bit
    plain = paddle_fa4.flash_attn_with_kvcache(q, k, v, lens, block_table=table, backend=REF)
    assert isinstance(plain, paddle.Tensor)
    np.testing.assert_array_equal(plain.numpy(), out.numpy())


def test_return_conventions():
    case = make_case(11, [5], page=4)
    q, k, v, lens, table = tensors(case)
    kw = dict(block_table=table, backend=REF)
    assert isinstance(paddle_fa4.flash_attn_with_kvcache(q, k, v, lens, **kw), paddle.Tensor)
    assert len(paddle_fa4.flash_attn_with_kvcache(q, k, v, lens, return_lse=True, **kw)) == 2
    out = paddle_fa4.flash_attn_with_kvcache(q, k, v, lens, return_block_logit=True, **kw)
    assert len(out) == 3 and list(out[1].shape) == [1, 4, 1] and all(t.stop_gradient for t in out)


# -------------------------------------------------------------------------- layouts
def test_nhd_layout_argument_and_transposed_view():
    """FA's [num_pages, P, Hkv, D]: by argument, or through a transpose([0, 2, 1, 3]) view."""
    case = make_case(12, [7, 30], sq=2, page=8)
    q, k, v, lens, table = tensors(case)
    ref = paddle_fa4.flash_attn_with_kvcache(q, k, v, lens, block_table=table, backend=REF).numpy()
    k_nhd = paddle.to_tensor(case["k"].transpose(0, 2, 1, 3).copy(), dtype="float32")
    v_nhd = paddle.to_tensor(case["v"].transpose(0, 2, 1, 3).copy(), dtype="float32")
    by_arg = paddle_fa4.flash_attn_with_kvcache(q, k_nhd, v_nhd, lens, block_table=table, kv_layout="nhd",
                                                backend=REF)
    np.testing.assert_array_equal(by_arg.numpy(), ref)
    view_k, view_v = k_nhd.transpose([0, 2, 1, 3]), v_nhd.transpose([0, 2, 1, 3])
    assert not view_k.is_contiguous()
    by_view = paddle_fa4.flash_attn_with_kvcache(q, view_k, view_v, lens, block_table=table, backend=REF)
    np.testing.assert_array_equal(by_view.numpy(), ref)
    # the oracle on the nhd buffer agrees as well
    lens2 = np.repeat(case["lens"][:, None], 2, 1)
    eo, _, _ = oracle.decode(case["q"], case["k"].transpose(0, 2, 1, 3), case["v"].transpose(0, 2, 1, 3), lens2,
                             np.repeat(case["table"][:, None], 2, 1), "nhd")
    assert_close("nhd out", by_arg, eo, 2e-5, 2e-5)


@pytest.mark.parametrize("sq", [1, 3])
def test_contiguous_cache(sq):
    rng = np.random.default_rng(13)
    b, sk, hkv, d = 3, 40, 2, 32
    k = rng.standard_normal((b, sk, hkv, d))
    v = rng.standard_normal((b, sk, hkv, d))
    lens = np.array([0, 17, 40], dtype=np.int32)
    k[1, 17:] = np.nan  # past the length
    v[1, 17:] = np.inf
    q = rng.standard_normal((b, sq, 4 * hkv, d))
    out, lse, bl = paddle_fa4.flash_attn_with_kvcache(
        *(paddle.to_tensor(x, dtype="float32") for x in (q, k, v)),
        paddle.to_tensor(lens), block_size=16, return_block_logit=True, window_size=(20, None), backend=REF)
    eo, el, ebl = oracle.decode(q, k, v, np.repeat(lens[:, None], hkv, 1), None, "contiguous", block_size=16,
                                window=(20, None))
    assert bl.shape[-1] == 3  # ceil(Sk_max 40 / 16)
    assert_close("out", out, eo, 2e-5, 2e-5)
    assert_close("lse", lse, el, 2e-5, 2e-5)
    assert_close("block_logit", bl, ebl, 2e-5, 2e-5)


# ------------------------------------------------------------------------- garbage never leaks
@pytest.mark.parametrize("garbage", [np.nan, np.inf, -np.inf, 1e30])
def test_poisoned_tails_and_unlisted_pages_never_leak(garbage):
    """Bit for bit the result of the same cache with zeros in every unused byte."""
    lens = [5, 33, 16]
    kw = dict(sq=4, page=16, group=2)
    poisoned = make_case(14, lens, garbage=garbage, **kw)
    clean = make_case(14, lens, garbage=0.0, **kw)
    results = []
    for case in (poisoned, clean):
        q, k, v, lens_t, table = tensors(case)
        results.append(paddle_fa4.flash_attn_with_kvcache(
            q, k, v, lens_t, block_table=table, return_block_logit=True, block_size=16, window_size=(9, None),
            backend=REF))
    for a, b in zip(results[0], results[1]):
        assert np.isfinite(a.numpy()[np.isfinite(b.numpy())]).all()
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_keys_outside_every_window_never_leak():
    """Pages wholly left of every row's window hold NaN (a sliding-window engine recycles them)."""
    case = make_case(15, [64, 40], sq=2, page=8, garbage=0.0)
    window = (10, None)
    for b, n in enumerate(case["lens"]):
        first_seen = n - 2 - window[0]  # row 0 sees t >= L - Sq - left
        for j in range(first_seen // 8):  # pages entirely before it
            case["k"][case["table"][b, j]] = np.nan
            case["v"][case["table"][b, j]] = np.nan
    out, _, _ = check(case, window_size=window)
    assert np.isfinite(out.numpy()).all()


def test_num_splits_does_not_change_results():
    case = make_case(16, [9, 45], sq=2, page=8)
    q, k, v, lens, table = tensors(case)
    outs = [paddle_fa4.flash_attn_with_kvcache(q, k, v, lens, block_table=table, num_splits=s, return_lse=True,
                                               backend=REF) for s in (None, 0, 1, 3)]
    for o in outs[1:]:
        np.testing.assert_array_equal(o[0].numpy(), outs[0][0].numpy())
        np.testing.assert_array_equal(o[1].numpy(), outs[0][1].numpy())


def test_empty_shapes_need_no_launch():
    case = make_case(17, [4], page=4)
    q, k, v, lens, table = tensors(case)
    # B = 0
    out, lse, bl = paddle_fa4.flash_attn_with_kvcache(q[:0], k, v, lens[:0], block_table=table[:0],
                                                      return_block_logit=True, backend=REF)
    assert list(out.shape) == [0, 1, 4, 32] and list(lse.shape) == [0, 4, 1] and list(bl.shape) == [0, 4, 1, 1]
    # max_pages = 0 and num_pages = 0: nothing exists, out 0, lse -inf
    zero = paddle.zeros([1], dtype="int32")
    for tab, kk, vv in ((table[:, :0], k, v), (table, k[:0], v[:0])):
        lens_ok = zero if tab.shape[1] == 0 else zero
        o, l, b_ = paddle_fa4.flash_attn_with_kvcache(q, kk, vv, lens_ok, block_table=tab, return_block_logit=True,
                                                      backend=REF)
        assert np.all(o.numpy() == 0) and np.isneginf(l.numpy()).all() and np.isneginf(b_.numpy()).all()


def test_backends_on_cpu():
    case = make_case(18, [6], page=4)
    q, k, v, lens, table = tensors(case)
    with pytest.raises(NotImplementedError, match="flash_attn_with_kvcache: backend='cute' is not available"):
        paddle_fa4.flash_attn_with_kvcache(q, k, v, lens, block_table=table, backend="cute")
    from paddle_fa4 import backend as backend_mod

    backend_mod._warned.difference_update({key for key in backend_mod._warned if key[0] == "flash_attn_with_kvcache"})
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        auto = paddle_fa4.flash_attn_with_kvcache(q, k, v, lens, block_table=table)
    ref = paddle_fa4.flash_attn_with_kvcache(q, k, v, lens, block_table=table, backend=REF)
    np.testing.assert_array_equal(auto.numpy(), ref.numpy())
    assert any("flash_attn_with_kvcache: using the reference backend" in str(w.message) for w in rec)


def test_inputs_needing_grad_run_without_autograd():
    case = make_case(19, [6, 9], page=4)
    q, k, v, lens, table = tensors(case)
    q.stop_gradient = False
    out = paddle_fa4.flash_attn_with_kvcache(q, k, v, lens, block_table=table, backend=REF)
    assert out.stop_gradient


# ------------------------------------------------------------------------------ sparse decode
def sparse_oracle(case, q, k, v, tables, seq_lens, **kw):
    return oracle.decode(to_numpy64(q), to_numpy64(k), to_numpy64(v), np.asarray(seq_lens), np.asarray(tables),
                         "hnd", **kw)


def test_sparse_per_kv_head_tables():
    """Each kv head its own page list and length; padding past each length; poisoned elsewhere."""
    case = make_case(20, [40], hkv=3, group=2, sq=2, page=8)
    pages = case["table"][0]
    tables = np.array([[[pages[4], pages[0], pages[2], -1, 99],
                        [pages[1], pages[3], -1, -1, -1],
                        [pages[0], pages[1], pages[2], pages[3], pages[4]]]], dtype=np.int32)
    seq_lens = np.array([[20, 9, 0]], dtype=np.int32)
    q, k, v, _, _ = tensors(case)
    for causal, window in ((True, (None, None)), (False, (5, 3))):
        out, lse = paddle_fa4.sparse_decode_attention(q, k, v, paddle.to_tensor(tables), paddle.to_tensor(seq_lens),
                                                      causal=causal, window_size=window, return_lse=True, backend=REF)
        eo, el, _ = sparse_oracle(case, q, k, v, tables, seq_lens, causal=causal, window=window)
        assert_close("sparse out", out, eo, 2e-5, 2e-5)
        assert_close("sparse lse", lse, el, 2e-5, 2e-5)
        assert np.isneginf(lse.numpy()[0, 4:]).all()  # kv head 2 has L = 0


def test_sparse_equals_dense_with_broadcast_tables():
    case = make_case(21, [3, 37], sq=3, page=16)
    q, k, v, lens, table = tensors(case)
    dense = paddle_fa4.flash_attn_with_kvcache(q, k, v, lens, block_table=table, return_lse=True, softcap=3.0,
                                               backend=REF)
    st = paddle.to_tensor(np.repeat(case["table"][:, None], 2, 1))
    sl = paddle.to_tensor(np.repeat(case["lens"][:, None], 2, 1))
    sparse = paddle_fa4.sparse_decode_attention(q, k, v, st, sl, return_lse=True, softcap=3.0, backend=REF)
    for a, b in zip(dense, sparse):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


@pytest.mark.parametrize("layout", ["hnd", "nhd", "contiguous"])
def test_reference_dense_index_is_a_zero_kv_head_stride(layout):
    """The backends' dense form (seqlens [B], table [B, n]: what flash_attn_with_kvcache hands them, no copy)
    means the per-kv-head form with the same row for every kv head (a kv-head stride of 0): bitwise equal
    through the reference, with a window, softcap and block_logit, Hkv 3."""
    from paddle_fa4.reference import decode as ref

    case = make_case(23, [0, 13, 40], hkv=3, group=2, sq=2, page=8)
    q, k, v, lens, table = tensors(case)
    if layout == "nhd":
        k, v = k.transpose([0, 2, 1, 3]).contiguous(), v.transpose([0, 2, 1, 3]).contiguous()
    if layout == "contiguous":  # [B, Sk, Hkv, D]
        rng = np.random.default_rng(3)
        k = paddle.to_tensor(rng.standard_normal((3, 48, 3, 32)), dtype="float32")
        v = paddle.to_tensor(rng.standard_normal((3, 48, 3, 32)), dtype="float32")
        table = None
    kw = dict(layout=layout, softmax_scale=0.3, causal=False, window_left=7, window_right=1, softcap=4.0,
              num_splits=None, return_lse=True, block_logit_size=16)
    dense = ref.decode_fwd(q, k, v, lens, table, **kw)
    per_head = ref.decode_fwd(q, k, v, paddle.to_tensor(np.repeat(case["lens"][:, None], 3, 1)),
                              None if table is None else paddle.to_tensor(np.repeat(case["table"][:, None], 3, 1)),
                              **kw)
    for a, b in zip(dense, per_head):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def real_positions(dense_table_row, sparse_row, n_tokens, page):
    """Real key positions of the first ``n_tokens`` compacted keys of a sparse row."""
    logical = {int(p): j for j, p in enumerate(dense_table_row)}
    return np.array([logical[int(sparse_row[c // page])] * page + c % page for c in range(n_tokens)], dtype=np.int64)


def test_h2o_token_flow_feeds_sparse_decode():
    """reset_scores -> token_accumulate -> select_pages -> sparse_decode_attention, fed straight in;
    the result is attention over exactly the selected real tokens."""
    from paddle_fa4 import h2o

    page, hkv, group, d = 4, 2, 2, 16
    case = make_case(22, [37, 9], hkv=hkv, group=group, page=page, d=d, garbage=0.0)
    q, k, v, lens, table = tensors(case)
    num_pages = case["k"].shape[0]
    state = paddle.full([num_pages, hkv, page], 5.0, dtype="float32")  # a recycled page's stale scores
    slots = np.concatenate([[case["table"][b, t // page] * page + t % page for t in range(n)]
                            for b, n in enumerate(case["lens"])]).astype(np.int32)
    h2o.reset_scores(state, paddle.to_tensor(slots), backend=REF)
    q3 = q[:, 0]
    state, scores = h2o.token_accumulate(q3, k, state, table, lens, return_page_scores=True, backend=REF)
    st, sl = h2o.select_pages(scores, table, lens, page_size=page, topk=2, bos=1, eos=1, backend=REF)
    assert st.dtype == paddle.int32 and sl.dtype == paddle.int32
    out, lse = paddle_fa4.sparse_decode_attention(q, k, v, st, sl, return_lse=True, backend=REF)
    st_np, sl_np = st.numpy(), sl.numpy()
    assert sl_np[0].max() < 37 and (sl_np[1] == 9).all()  # sequence 0 is sparse, sequence 1 fits the budget
    qn, kn, vn = to_numpy64(q), to_numpy64(k), to_numpy64(v)
    for b in range(2):
        n = int(case["lens"][b])
        for h in range(hkv):
            pos = real_positions(case["table"][b], st_np[b, h], int(sl_np[b, h]), page)
            assert np.all(np.diff(pos) > 0) and pos[-1] == n - 1  # sequence order, the real last token last
            keys = np.array([kn[case["table"][b, t // page], h, t % page] for t in pos])
            vals = np.array([vn[case["table"][b, t // page], h, t % page] for t in pos])
            eo, el, _ = oracle.attend(qn[b, :, h * group:(h + 1) * group], keys, vals, pos, np.array([n - 1]),
                                      scale=d ** -0.5, causal=True, window=(None, None), softcap=0.0)
            assert_close("h2o sparse out", out.numpy()[b, :, h * group:(h + 1) * group], eo, 2e-5, 2e-5)
            assert_close("h2o sparse lse", lse.numpy()[b, h * group:(h + 1) * group], el, 2e-5, 2e-5)
    dense = paddle_fa4.flash_attn_with_kvcache(q, k, v, lens, block_table=table, backend=REF)
    assert np.abs(dense.numpy()[0] - out.numpy()[0]).max() > 1e-4  # the tables were really used


def test_pages_wholly_before_the_window_may_be_padding():
    """A sliding-window engine recycles pages no row can see any more: their table entries may be -1
    (dense and sparse); a page the window still reaches may not."""
    case = make_case(23, [64, 40], sq=2, page=8)
    q, k, v, lens, table = tensors(case)
    window = (10, None)  # row 0 of sequence b sees t >= L - 2 - 10
    want = paddle_fa4.flash_attn_with_kvcache(q, k, v, lens, block_table=table, window_size=window, return_lse=True,
                                              backend=REF)
    holes = case["table"].copy()
    holes[0, :(64 - 12) // 8] = -1  # pages 0..5 of sequence 0 end before t = 52
    holes[1, :(40 - 12) // 8] = 10_000
    got = paddle_fa4.flash_attn_with_kvcache(q, k, v, lens, block_table=paddle.to_tensor(holes), window_size=window,
                                             return_lse=True, backend=REF)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    st = paddle.to_tensor(np.repeat(holes[:, None], 2, 1))
    sl = paddle.to_tensor(np.repeat(case["lens"][:, None], 2, 1))
    sparse = paddle_fa4.sparse_decode_attention(q, k, v, st, sl, window_size=window, backend=REF)
    np.testing.assert_array_equal(sparse.numpy(), want[0].numpy())
    holes[0, (64 - 12) // 8] = -1  # page 6 holds t = 48..55: row 0 sees 52..55
    with pytest.raises(ValueError, match=r"block_table\[0, 6\] = -1 is not a page id"):
        paddle_fa4.flash_attn_with_kvcache(q, k, v, lens, block_table=paddle.to_tensor(holes), window_size=window,
                                           backend=REF)
    with pytest.raises(ValueError, match=r"block_table\[0, 0\] = -1 is not a page id"):  # no window: all needed
        paddle_fa4.flash_attn_with_kvcache(q, k, v, lens, block_table=paddle.to_tensor(holes), backend=REF)
