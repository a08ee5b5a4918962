"""paddle_fa4.h2o on the reference backend (CPU) against the fp64 oracles; API contracts and errors.

Small shapes (tens of tokens) so the file runs in seconds; the long recurrences live in
``test_h2o_recurrence.py``.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from paddle_fa4 import h2o
from tests.oracles import h2o as oracle

REF = "reference"


def _t(x, dtype):
    return paddle.to_tensor(np.asarray(x), dtype=dtype)


def _np(t):
    if t.dtype in (paddle.bfloat16, paddle.float16):
        t = t.astype("float32")
    return t.numpy().astype(np.float64) if t.dtype == paddle.float32 else t.numpy()


def make_paged(rng, seq, hkv, page_size, d, extra=3, dtype="float32"):
    need = [-(-n // page_size) for n in seq]
    max_pages = max(max(need), 1) + 1
    num_pages = sum(need) + extra
    perm = rng.permutation(num_pages)
    tables = np.full((len(seq), max_pages), -1, dtype=np.int64)
    at = 0
    for b, k in enumerate(need):
        tables[b, :k] = perm[at:at + k]
        at += k
    key = rng.standard_normal((num_pages, hkv, page_size, d))
    return _t(key, dtype), _t(tables, "int32"), _t(seq, "int32")


def rel_err(a, b):
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


# ------------------------------------------------------------------------------------- reset
def test_reset_scores_exact():
    """Slots {3, 5, 11, 40} become exactly 0, padding slots touch nothing, the rest stay 7.5."""
    state = np.full((12, 2, 16), 7.5)
    slots = np.array([3, 5, 11, 40, -1, 12 * 16], dtype=np.int64)
    st = _t(state, "float32")
    h2o.reset_scores(st, _t(slots, "int32"), backend=REF)
    np.testing.assert_array_equal(_np(st), oracle.reset_scores(state, slots))
    assert int((_np(st) == 0).sum()) == 4 * 2


# ---------------------------------------------------------------------------- page summaries
@pytest.mark.parametrize("page_size,summary_dtype", [(1, "float32"), (16, "float32"), (16, "bfloat16"),
                                                     (64, "float32")])
def test_update_page_summary(page_size, summary_dtype):
    rng = np.random.default_rng(page_size)
    seq = [5, page_size * 3, page_size * 2 + 1, 1]
    key, tables, _ = make_paged(rng, seq, hkv=2, page_size=page_size, d=32, dtype="bfloat16")
    bt = _np(tables)
    slots = [int(bt[b, (n - 1) // page_size]) * page_size + (n - 1) % page_size for b, n in enumerate(seq)]
    slots += [int(bt[1, t // page_size]) * page_size + t % page_size for t in range(seq[1])]
    slots += [-1, 10 ** 6]
    summary0 = rng.standard_normal((key.shape[0], 2, 3, 32))
    summary = _t(summary0, summary_dtype)
    start = _np(summary)
    out = h2o.update_page_summary(key, _t(slots, "int32"), summary, backend=REF)
    assert out is summary
    ref = oracle.update_page_summary(_np(key), slots, start)
    tol = 1e-6 if summary_dtype == "float32" else 8e-3
    np.testing.assert_allclose(_np(summary), ref, rtol=tol, atol=tol)


def test_partial_page_summary_as_it_stands():
    """A partial page's mean is over its present tokens only (absent slots may hold garbage)."""
    key = np.zeros((2, 1, 4, 2))
    key[0, 0, :2] = [[1.0, -2.0], [3.0, 4.0]]
    key[0, 0, 2:] = 1e9  # not written yet
    summary = _t(np.zeros((2, 1, 3, 2)), "float32")
    h2o.update_page_summary(_t(key, "float32"), _t([1], "int32"), summary, backend=REF)
    np.testing.assert_allclose(_np(summary)[0, 0], [[2.0, 1.0], [3.0, 4.0], [1.0, -2.0]])
    np.testing.assert_array_equal(_np(summary)[1], 0.0)


# ------------------------------------------------------------------------------- page scores
@pytest.mark.parametrize("G", [1, 3, 5, 7, 8])
@pytest.mark.parametrize("gqa", ["mean_q", "max"])
def test_page_scores(G, gqa):
    rng = np.random.default_rng(G)
    hkv, d, page_size = 2, 32, 16
    seq = [1, 70, 33, 0]
    key, tables, seq_lens = make_paged(rng, seq, hkv, page_size, d)
    bt = _np(tables)
    bt[2, 1] = 10 ** 6  # out-of-range entry of a valid page: -inf
    summary = _t(rng.standard_normal((key.shape[0], hkv, 3, d)), "float32")
    q = _t(rng.standard_normal((len(seq), hkv * G, d)), "bfloat16")
    out = h2o.page_scores(q, key, summary, _t(bt, "int32"), seq_lens, w_avg=0.7, w_peak=1.3, gqa_reduce=gqa,
                          backend=REF)
    assert out.dtype == paddle.float32 and list(out.shape) == [len(seq), hkv, bt.shape[1]]
    ref = oracle.page_scores(_np(q), _np(summary), bt, seq, page_size, 0.7, 1.3, gqa)
    got = _np(out)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(ref))
    fin = np.isfinite(ref)
    np.testing.assert_allclose(got[fin], ref[fin], rtol=1e-5, atol=1e-5)


def test_page_scores_peak_bounds_every_key():
    """Quest property (fp64 oracle on real summaries): peak >= max_t q.k_t and >= avg per page."""
    rng = np.random.default_rng(1)
    key, tables, seq_lens = make_paged(rng, [64], 1, 16, 32)
    summary = _t(np.zeros((key.shape[0], 1, 3, 32)), "float32")
    bt = _np(tables)
    slots = [int(bt[0, t // 16]) * 16 + t % 16 for t in range(64)]
    h2o.update_page_summary(key, _t(slots, "int32"), summary, backend=REF)
    q = rng.standard_normal((1, 1, 32))
    peak = h2o.page_scores(_t(q, "float32"), key, summary, tables, seq_lens, w_avg=0.0, w_peak=1.0, backend=REF)
    avg = h2o.page_scores(_t(q, "float32"), key, summary, tables, seq_lens, w_avg=1.0, w_peak=0.0, backend=REF)
    k = _np(key)
    for j in range(4):
        dots = k[bt[0, j], 0] @ q[0, 0]
        assert _np(peak)[0, 0, j] >= dots.max() - 1e-4
        assert _np(peak)[0, 0, j] >= _np(avg)[0, 0, j] - 1e-4



def test_page_scores_takes_the_page_size_from_the_key_cache():
    """Issue 19 item 5: page_size= disagreeing with the summarised cache gave -inf for real pages
    (or blamed seq_lens). The page size is now key_cache.shape[2]: there is nothing to mismatch."""
    rng = np.random.default_rng(4)
    seq = [10, 3]
    key, tables, seq_lens = make_paged(rng, seq, 2, 4, 8)
    bt = _np(tables)
    summary = _t(np.zeros((key.shape[0], 2, 3, 8)), "float32")
    slots = [int(bt[b, t // 4]) * 4 + t % 4 for b, n in enumerate(seq) for t in range(n)]
    h2o.update_page_summary(key, _t(slots, "int32"), summary, backend=REF)
    q = _t(rng.standard_normal((2, 4, 8)), "float32")
    got = _np(h2o.page_scores(q, key, summary, tables, seq_lens, backend=REF))
    ref = oracle.page_scores(_np(q), _np(summary), bt, seq, 4, 1.0, 1.0, "mean_q")
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(ref))
    assert np.isfinite(got[0, :, :3]).all() and np.isfinite(got[1, :, :1]).all()  # every real page scored
    np.testing.assert_allclose(got[np.isfinite(ref)], ref[np.isfinite(ref)], rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError):
        h2o.page_scores(q, key, summary, tables, seq_lens, page_size=8, backend=REF)
    # A summary of another cache (other page count or kv heads) names both shapes.
    with pytest.raises(ValueError, match=r"summary must have shape \[\d+, 2, 3, 8\] .*key_cache.*got \[3, 2, 3, 8\]"):
        h2o.page_scores(q, key, summary[:3], tables, seq_lens, backend=REF)
    # select_pages cannot check its page_size against anything: a too-small one is named with the numbers.
    with pytest.raises(ValueError, match=r"h2o.select_pages: seq_lens must be <= max_pages \* page_size = "
                                         r"\d+ \* 2 = \d+ \(page_size from the page_size argument\), got 10"):
        h2o.select_pages(_t(got, "float32"), tables, seq_lens, page_size=2, topk=1, backend=REF)
    with pytest.raises(ValueError, match=r"page_size from key_cache.shape\[2\]"):
        h2o.page_scores(q, key, summary, tables, _t([100, 3], "int32"), backend=REF)

# -------------------------------------------------------------------------- token accumulate
@pytest.mark.parametrize("gqa", ["mean_q", "max", "sum", "mean_p"])
@pytest.mark.parametrize("G,page_size", [(1, 1), (3, 16), (5, 64), (7, 16), (8, 1)])
def test_token_accumulate_step(G, page_size, gqa):
    rng = np.random.default_rng(G * 100 + page_size)
    hkv, d, bos, eos = 2, 32, 3, 5
    seq = [0, 4, 9, 70, 130]  # empty, all reserved, tiny window, ragged
    key, tables, seq_lens = make_paged(rng, seq, hkv, page_size, d, dtype="bfloat16")
    q = _t(rng.standard_normal((len(seq), hkv * G, d)), "bfloat16")
    state0 = rng.uniform(0, 2, size=(key.shape[0], hkv, page_size)).astype(np.float32)
    state = _t(state0, "float32")
    out = h2o.token_accumulate(q, key, state, tables, seq_lens, decay=0.9, gqa_reduce=gqa, bos=bos, eos=eos,
                               backend=REF)
    assert out is state
    ref = oracle.token_accumulate(_np(q), _np(key), state0, _np(tables), seq, None, 0.9, gqa, bos, eos)
    got = _np(state)
    untouched = ref == state0.astype(np.float64)
    np.testing.assert_array_equal(got[untouched], state0[untouched])  # window placement is exact
    assert rel_err(got, ref) < 1e-5


def test_token_accumulate_explicit_scale_and_page_scores():
    rng = np.random.default_rng(2)
    key, tables, seq_lens = make_paged(rng, [40, 17], 2, 4, 16)
    q = _t(rng.standard_normal((2, 6, 16)), "float32")
    state = _t(np.zeros((key.shape[0], 2, 4)), "float32")
    st, pages = h2o.token_accumulate(q, key, state, tables, seq_lens, softmax_scale=0.3, decay=0.5, gqa_reduce="sum",
                                     bos=1, eos=2, return_page_scores=True, backend=REF)
    ref = oracle.token_accumulate(_np(q), _np(key), np.zeros(state.shape), _np(tables), [40, 17], 0.3, 0.5, "sum",
                                  1, 2)
    assert rel_err(_np(st), ref) < 1e-5
    ref_pages = oracle.token_page_scores(ref, _np(tables), [40, 17])
    got = _np(pages)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(ref_pages))
    np.testing.assert_allclose(got[np.isfinite(got)], ref_pages[np.isfinite(ref_pages)], rtol=1e-5, atol=1e-6)


def test_short_rows_hold_probabilities_not_logits():
    """n <= any selection budget: the window is still softmaxed (no raw logits, mass 1 per step)."""
    rng = np.random.default_rng(3)
    key, tables, seq_lens = make_paged(rng, [6], 1, 1, 16)
    key = key * 50.0  # huge logits: raw accumulation would show values far above 1
    q = _t(rng.standard_normal((1, 1, 16)), "float32")
    state = _t(np.zeros((key.shape[0], 1, 1)), "float32")
    h2o.token_accumulate(q, key, state, tables, seq_lens, decay=1.0, bos=1, eos=1, backend=REF)
    got = _np(state).ravel()
    assert got.min() >= 0.0 and abs(got.sum() - 1.0) < 1e-5


def test_token_page_scores_reference():
    rng = np.random.default_rng(4)
    for page_size in (1, 16):
        key, tables, seq_lens = make_paged(rng, [1, 70, 0], 2, page_size, 8)
        state0 = rng.uniform(0, 1, size=(key.shape[0], 2, page_size))
        out = h2o.token_page_scores(_t(state0, "float32"), tables, seq_lens, backend=REF)
        ref = oracle.token_page_scores(state0.astype(np.float32), _np(tables), [1, 70, 0])
        np.testing.assert_allclose(_np(out), ref, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------ select
@pytest.mark.parametrize("case", ["ties", "negative", "short", "random", "nan"])
def test_select_pages(case):
    rng = np.random.default_rng(11)
    page_size, hkv = 4, 3
    topk, bos, eos = 5, 1, 2
    seq = [4 * 30 + 3, 4 * 12, 0, 1, 4 * 8] if case != "short" else [0, 1, 4 * 8, 4 * 8 + 1]
    key, tables, seq_lens = make_paged(rng, seq, hkv, page_size, 8)
    mp = tables.shape[1]
    if case == "ties":
        scores = rng.integers(0, 3, size=(len(seq), hkv, mp)).astype(np.float64)
    elif case == "negative":
        scores = -rng.uniform(0, 1e3, size=(len(seq), hkv, mp))
        scores[0, 0, 5:15] = -np.inf
        scores[1, 1, 3:6] = 0.0
        scores[1, 1, 6:9] = -0.0
    elif case == "nan":  # NaN rule: NaN below every number (-inf included), never displaces one
        scores = rng.standard_normal((len(seq), hkv, mp))
        scores[0, 0, 1:20] = np.nan  # 19 of the 28 window pages: every number wins, then NaN by page
        scores[0, 1, 2:4] = -np.inf
        scores[0, 1, 4:30] = np.nan  # the two -inf pages beat NaN
        scores[1, 2, ::2] = -np.nan  # negative-signed NaN too
    else:
        scores = rng.standard_normal((len(seq), hkv, mp))
    scores = scores.astype(np.float32)
    tabs, lens = h2o.select_pages(_t(scores, "float32"), tables, seq_lens, page_size=page_size, topk=topk, bos=bos, eos=eos, backend=REF)
    assert tabs.dtype == paddle.int32 and list(tabs.shape) == [len(seq), hkv, bos + topk + eos]
    ref_t, ref_l = oracle.select_pages(scores, _np(tables), seq, page_size, topk, bos, eos)
    np.testing.assert_array_equal(_np(tabs), ref_t)
    np.testing.assert_array_equal(_np(lens), ref_l)


def _eos0_scores(max_pages):
    """Request of 43 tokens (P 4: 11 pages, the last holding 3), window [1, 11), top-3 with bos 1, eos 0.
    Head 0 picks the real last page by score, head 1 by a tie it wins (ties 7 and 10 both fit), head 2 not
    at all (all-equal scores: the lowest pages), head 3 not (it scores lowest)."""
    s = np.full((1, 4, max_pages), -1.0, np.float32)
    s[0, 0, 10] = 9.0
    s[0, 1, 3], s[0, 1, 7], s[0, 1, 10] = 5.0, 0.0, 0.0
    s[0, 2, :] = 0.5
    s[0, 3, 10] = -7.0
    return s


def test_select_pages_eos0_counts_the_selected_tokens():
    """eos = 0: sparse_seq_lens counts the tokens of the selected pages; when the real (partial) last page is
    not selected every selected page is full (it used to report (count - 1) * P + 3 for every head)."""
    _, tables, seq_lens = make_paged(np.random.default_rng(3), [43], 4, 4, 8)
    scores = _eos0_scores(tables.shape[1])
    tabs, lens = h2o.select_pages(_t(scores, "float32"), tables, seq_lens, page_size=4, topk=3, bos=1, eos=0,
                                  backend=REF)
    bt = _np(tables)[0]
    logical = [[bt.tolist().index(p) for p in row] for row in _np(tabs)[0].tolist()]
    assert logical == [[0, 1, 2, 10], [0, 3, 7, 10], [0, 1, 2, 3], [0, 1, 2, 3]]
    assert _np(lens).tolist() == [[15, 15, 16, 16]]
    ref_t, ref_l = oracle.select_pages(scores, _np(tables), [43], 4, 3, 1, 0)
    np.testing.assert_array_equal(_np(tabs), ref_t)
    np.testing.assert_array_equal(_np(lens), ref_l)
    # eos >= 1 keeps the last page: count * P minus its empty slot, every head
    _, lens1 = h2o.select_pages(_t(scores, "float32"), tables, seq_lens, page_size=4, topk=3, bos=1, eos=1,
                                backend=REF)
    assert _np(lens1).tolist() == [[19] * 4]


def test_select_pages_nan_never_displaces_a_number():
    """The issue's case: a NaN page ranked above a page scoring 99."""
    _, tables, seq_lens = make_paged(np.random.default_rng(2), [4 * 10], 1, 4, 8)
    scores = np.full((1, 1, tables.shape[1]), -5.0, np.float32)
    scores[0, 0, 3] = np.nan
    scores[0, 0, 6] = 99.0
    tabs, _ = h2o.select_pages(_t(scores, "float32"), tables, seq_lens, page_size=4, topk=1, bos=1, eos=1, backend=REF)
    assert _np(tabs)[0, 0].tolist() == _np(tables)[0, [0, 6, 9]].tolist()


def test_select_pages_nan_check_opt_in(monkeypatch):
    _, tables, seq_lens = make_paged(np.random.default_rng(2), [4 * 10], 1, 4, 8)
    scores = np.zeros((1, 1, tables.shape[1]), np.float32)
    scores[0, 0, 3] = np.nan
    h2o.select_pages(_t(scores, "float32"), tables, seq_lens, page_size=4, topk=1, bos=1, eos=1, backend=REF)  # rule applies
    monkeypatch.setenv("PADDLE_FA4_CHECK_NAN", "1")
    with pytest.raises(FloatingPointError, match="h2o.select_pages: scores holds 1 NaN"):
        h2o.select_pages(_t(scores, "float32"), tables, seq_lens, page_size=4, topk=1, bos=1, eos=1, backend=REF)


def test_select_pages_contract():
    """Length min(n_pages, budget), no duplicates, BOS/EOS present, the real last page last."""
    rng = np.random.default_rng(5)
    key, tables, seq_lens = make_paged(rng, [4 * 40 + 1], 2, 4, 8)
    bt = _np(tables)
    scores = _t(rng.standard_normal((1, 2, bt.shape[1])), "float32")
    tabs, lens = h2o.select_pages(scores, tables, seq_lens, page_size=4, topk=6, bos=2, eos=3, backend=REF)
    n_pages = 41
    for g in range(2):
        row = _np(tabs)[0, g].tolist()
        assert len(set(row)) == len(row) == 11
        assert row[:2] == bt[0, :2].tolist() and row[-3:] == bt[0, n_pages - 3:n_pages].tolist()
        assert row[-1] == bt[0, n_pages - 1]
        logical = [bt[0].tolist().index(p) for p in row]
        assert logical == sorted(logical)
    assert _np(lens).tolist() == [[10 * 4 + 1] * 2]


# --------------------------------------------------------------------------------- contracts
def test_errors_name_op_and_argument():
    rng = np.random.default_rng(6)
    key, tables, seq_lens = make_paged(rng, [8], 2, 4, 8)
    q = _t(rng.standard_normal((1, 4, 8)), "float32")
    state = _t(np.zeros((key.shape[0], 2, 4)), "float32")
    with pytest.raises(TypeError, match="h2o.token_accumulate: block_tables must be int32"):
        h2o.token_accumulate(q, key, state, tables.astype("float32"), seq_lens, backend=REF)
    with pytest.raises(ValueError, match="h2o.token_accumulate: q heads Hq = 3"):
        h2o.token_accumulate(_t(np.zeros((1, 3, 8)), "float32"), key, state, tables, seq_lens, backend=REF)
    with pytest.raises(ValueError, match="h2o.token_accumulate: gqa_reduce"):
        h2o.token_accumulate(q, key, state, tables, seq_lens, gqa_reduce="min", backend=REF)
    with pytest.raises(ValueError, match="h2o.token_accumulate: decay must be >= 0"):
        h2o.token_accumulate(q, key, state, tables, seq_lens, decay=-0.1, backend=REF)
    with pytest.raises(ValueError, match="h2o.token_accumulate: softmax_scale must be >= 0"):
        h2o.token_accumulate(q, key, state, tables, seq_lens, softmax_scale=-0.5, backend=REF)
    with pytest.raises(TypeError, match="h2o.token_accumulate: state must be float32 or bfloat16"):
        h2o.token_accumulate(q, key, state.astype("float16"), tables, seq_lens, backend=REF)
    with pytest.raises(ValueError, match="h2o.token_accumulate: state must have shape"):
        h2o.token_accumulate(q, key, state[:, :1], tables, seq_lens, backend=REF)
    with pytest.raises(ValueError, match="h2o.token_accumulate: seq_lens must be <= max_pages"):
        h2o.token_accumulate(q, key, state, tables, _t([1000], "int32"), backend=REF)
    with pytest.raises(ValueError, match="h2o.select_pages: topk must be >= 1"):
        h2o.select_pages(_t(np.zeros((1, 2, tables.shape[1])), "float32"), tables, seq_lens, page_size=4, topk=0, backend=REF)
    with pytest.raises(TypeError, match="h2o.select_pages: scores must be float32"):
        h2o.select_pages(_t(np.zeros((1, 2, tables.shape[1])), "float64"), tables, seq_lens, page_size=4, topk=2, backend=REF)
    with pytest.raises(ValueError, match=r"h2o.page_scores: summary must have shape \[\d+, 2, 3, 8\]"):
        h2o.page_scores(q, key, _t(np.zeros((key.shape[0], 2, 2, 8)), "float32"), tables, seq_lens, backend=REF)
    with pytest.raises(ValueError, match="h2o.update_page_summary: summary must have shape"):
        h2o.update_page_summary(key, _t([0], "int32"), _t(np.zeros((1, 2, 3, 8)), "float32"), backend=REF)
    with pytest.raises(TypeError, match="h2o.reset_scores: slot_mapping must be int32"):
        h2o.reset_scores(state, _t([0], "int16"), backend=REF)
    with pytest.raises(ValueError, match="backend must be one of"):
        h2o.reset_scores(state, _t([0], "int32"), backend="triton")


def test_cute_backend_refuses_cpu_tensors():
    state = _t(np.zeros((2, 1, 4)), "float32")
    with pytest.raises(NotImplementedError, match="h2o.reset_scores: backend='cute'"):
        h2o.reset_scores(state, _t([0], "int32"), backend="cute")


def test_auto_backend_falls_back_to_reference_on_cpu():
    state = _t(np.full((2, 1, 4), 3.0), "float32")
    with pytest.warns(UserWarning, match="reference backend"):
        h2o.reset_scores(state, _t([1], "int32"), backend="auto")
    assert _np(state)[0, 0, 1] == 0.0


def test_empty_inputs_return_shaped_outputs():
    tables = _t(np.zeros((0, 3)), "int32")
    seq_lens = _t(np.zeros((0,)), "int32")
    scores = h2o.page_scores(_t(np.zeros((0, 4, 8)), "float32"), _t(np.zeros((5, 2, 4, 8)), "float32"),
                             _t(np.zeros((5, 2, 3, 8)), "float32"), tables, seq_lens, backend=REF)
    assert list(scores.shape) == [0, 2, 3]
    tabs, lens = h2o.select_pages(_t(np.zeros((0, 2, 3)), "float32"), tables, seq_lens, page_size=4, topk=2, backend=REF)
    assert list(tabs.shape) == [0, 2, 1 + 2 + 1] and list(lens.shape) == [0, 2]
