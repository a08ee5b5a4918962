"""H200: the H2O CuTe launchers with torch tensors against the fp64 oracles (tests/oracles/h2o.py).

Covers every kernel (single steps over G, page sizes, reductions, ragged batches, long rows that
span many chunks), the seed harness recurrence (fp32 state error, mass, responsiveness, top-k),
reset on page reuse, the bf16-state freeze at decay=1.0, exact selections and a CUDA-graph replay.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import torch_cuda_arch
from tests.oracles import h2o as oracle

torch = pytest.importorskip("torch", reason="needs a CUDA GPU; torch is used to drive the launchers")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch_cuda_arch() is None or torch_cuda_arch() < 90,
                       reason="needs a CUDA GPU of compute capability >= 9.0 (H200 / Blackwell)"),
]

DEV = "cuda"


def _launch():
    from cute_kernels.h2o import launch

    return launch


def _t(x, dtype):
    return torch.as_tensor(np.asarray(x), dtype=dtype, device=DEV).contiguous()


def _np(t):
    return t.detach().float().cpu().numpy().astype(np.float64) if t.is_floating_point() else t.cpu().numpy()


def make_paged(rng, seq_lens, hkv, page_size, d, extra_pages=3, key_dtype=torch.bfloat16):
    """Random key cache with pages scattered through the pool by a random block table."""
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    need = [-(-int(n) // page_size) for n in seq_lens]
    max_pages = max(max(need), 1) + 1
    num_pages = sum(need) + extra_pages
    perm = rng.permutation(num_pages)
    tables = np.full((len(seq_lens), max_pages), -1, dtype=np.int64)
    at = 0
    for b, k in enumerate(need):
        tables[b, :k] = perm[at:at + k]
        at += k
    key = _t(rng.standard_normal((num_pages, hkv, page_size, d)), key_dtype)
    return key, _t(tables, torch.int32), _t(seq_lens, torch.int32)


def rel_err(a, b):
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


# ------------------------------------------------------------------------------------------ reset
def test_reset_scores_exact():
    rng = np.random.default_rng(0)
    state = np.full((12, 2, 16), 7.5)
    slots = np.array([3, 5, 11, 40, -1, 12 * 16, 191], dtype=np.int64)
    st = _t(state, torch.float32)
    _launch().run_reset_scores(st, _t(slots, torch.int32))
    np.testing.assert_array_equal(_np(st), oracle.reset_scores(state, slots))
    del rng


# ----------------------------------------------------------------------------- page summaries
@pytest.mark.parametrize("page_size,summary_dtype", [(1, torch.float32), (16, torch.float32), (16, torch.bfloat16),
                                                     (64, torch.float32)])
def test_update_page_summary(page_size, summary_dtype):
    rng = np.random.default_rng(page_size)
    seq = [5, page_size * 3, page_size * 2 + 1, 1]
    key, tables, seq_lens = make_paged(rng, seq, hkv=4, page_size=page_size, d=128)
    bt = _np(tables)
    # decode writes (last token of each request) then a prefill-like run over all of request 1
    slots = [int(bt[b, (n - 1) // page_size]) * page_size + (n - 1) % page_size for b, n in enumerate(seq)]
    slots += [int(bt[1, t // page_size]) * page_size + t % page_size for t in range(seq[1])]
    slots += [-1, 10 ** 6]
    summary0 = rng.standard_normal((key.shape[0], 4, 3, 128))
    summary = _t(summary0, summary_dtype)
    _launch().run_update_page_summary(key, _t(slots, torch.int32), summary)
    ref = oracle.update_page_summary(_np(key), slots, _np(_t(summary0, summary_dtype)))
    tol = 1e-6 if summary_dtype == torch.float32 else 8e-3
    np.testing.assert_allclose(_np(summary), ref, rtol=tol, atol=tol)


# -------------------------------------------------------------------------------- page scores
# Each case is a separate compile (~1-2 s on the H200 host), so the cases cover every value of
# every axis rather than the full cross product (the CPU compile matrix covers the rest).
PAGE_CASES = [(1, "mean_q", "float32"), (3, "max", "float32"), (5, "mean_q", "bfloat16"),
              (7, "max", "bfloat16"), (8, "max", "float32"), (4, "mean_q", "float32")]


@pytest.mark.parametrize("G,gqa,summary_dtype", PAGE_CASES, ids=[f"G{g}-{r}-{d}" for g, r, d in PAGE_CASES])
def test_page_scores(G, gqa, summary_dtype):
    summary_dtype = getattr(torch, summary_dtype)
    rng = np.random.default_rng(G)
    hkv, d, page_size = 2, 128, 16
    seq = [1, 700, 33, 16 * 40]
    key, tables, seq_lens = make_paged(rng, seq, hkv, page_size, d)
    bt = _np(tables)
    bt[2, 1] = 10 ** 6  # an out-of-range entry of a valid page scores -inf
    tables = _t(bt, torch.int32)
    summary = _t(rng.standard_normal((key.shape[0], hkv, 3, d)), summary_dtype)
    q = _t(rng.standard_normal((len(seq), hkv * G, d)), torch.bfloat16)
    out = torch.full((len(seq), hkv, bt.shape[1]), 123.0, device=DEV)
    _launch().run_page_scores(q, summary, tables, seq_lens, out, page_size=page_size, w_avg=0.7, w_peak=1.3,
                              gqa_reduce=gqa)
    ref = oracle.page_scores(_np(q), _np(summary), bt, seq, page_size, 0.7, 1.3, gqa)
    got = _np(out)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(ref))
    fin = np.isfinite(ref)
    np.testing.assert_allclose(got[fin], ref[fin], rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------------------- token accumulate
def _token_step(q, key, state, tables, seq_lens, gqa, bos, eos, decay=0.984375, scale=None):
    L = _launch()
    lg_shape, st_shape = L.token_workspace_shapes(q, key, tables, gqa)
    lg = torch.full(lg_shape, float("nan"), device=DEV)
    sts = torch.full(st_shape, float("nan"), device=DEV)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    L.run_token_accumulate(q, key, state, tables, seq_lens, lg, sts, scale=scale, decay=decay, bos=bos,
                           eos=eos, gqa_reduce=gqa)


TOKEN_CASES = [(1, 1, "mean_q"), (3, 16, "max"), (5, 64, "sum"), (7, 16, "mean_p"), (8, 1, "max"),
               (3, 64, "mean_p"), (5, 1, "mean_q"), (8, 16, "sum")]


@pytest.mark.parametrize("G,page_size,gqa", TOKEN_CASES, ids=[f"G{g}-P{p}-{r}" for g, p, r in TOKEN_CASES])
def test_token_accumulate_step(G, page_size, gqa):
    rng = np.random.default_rng(G * 100 + page_size)
    hkv, d, bos, eos = 2, 128, 3, 5
    seq = [0, 4, 9, 200, 1300]  # empty, all-reserved, tiny window, ragged, > 2 chunks
    key, tables, seq_lens = make_paged(rng, seq, hkv, page_size, d)
    q = _t(rng.standard_normal((len(seq), hkv * G, d)), torch.bfloat16)
    state0 = rng.uniform(0, 2, size=(key.shape[0], hkv, page_size))
    state = _t(state0, torch.float32)
    _token_step(q, key, state, tables, seq_lens, gqa, bos, eos, decay=0.9)
    ref = oracle.token_accumulate(_np(q), _np(key), state0.astype(np.float32), _np(tables), seq, None, 0.9, gqa,
                                  bos, eos)
    got = _np(state)
    changed = ref != state0.astype(np.float32).astype(np.float64)
    # window placement: slots outside every window are bitwise untouched
    np.testing.assert_array_equal(got[~changed], state0.astype(np.float32)[~changed])
    assert rel_err(got, ref) < 3e-5


def test_token_accumulate_long_row_many_chunks():
    """A 40k-token row spans 79 chunks of the split softmax; the merge must be exact."""
    rng = np.random.default_rng(7)
    key, tables, seq_lens = make_paged(rng, [40_000, 777], hkv=2, page_size=16, d=128)
    q = _t(rng.standard_normal((2, 8, 128)), torch.bfloat16)
    state = torch.zeros(key.shape[0], 2, 16, device=DEV)
    for gqa in ("mean_q", "max"):
        state.zero_()
        _token_step(q, key, state, tables, seq_lens, gqa, bos=4, eos=8)
        ref = oracle.token_accumulate(_np(q), _np(key), np.zeros(state.shape), _np(tables), [40_000, 777],
                                      None, 0.984375, gqa, 4, 8)
        assert rel_err(_np(state), ref) < 1e-5, gqa


def test_token_page_scores():
    rng = np.random.default_rng(3)
    for page_size in (1, 16, 64):
        key, tables, seq_lens = make_paged(rng, [1, 70, 130, 0], hkv=2, page_size=page_size, d=128)
        state0 = rng.uniform(0, 1, size=(key.shape[0], 2, page_size))
        out = torch.full((4, 2, tables.shape[1]), 5.0, device=DEV)
        _launch().run_token_page_scores(_t(state0, torch.float32), tables, seq_lens, out)
        ref = oracle.token_page_scores(state0.astype(np.float32), _np(tables), _np(seq_lens))
        np.testing.assert_allclose(_np(out), ref, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------- select pages
@pytest.mark.parametrize("case", ["ties", "negative", "large", "short", "nan"])
def test_select_pages_exact(case):
    rng = np.random.default_rng(11)
    page_size, hkv = 16, 3
    if case == "large":
        seq, topk, bos, eos = [16 * 20_000, 16 * 3000 + 5], 257, 2, 3
    elif case == "short":
        seq, topk, bos, eos = [0, 1, 16 * 6, 16 * 7 + 1], 3, 1, 2
    else:
        seq, topk, bos, eos = [16 * 300 + 7, 16 * 50, 16 * 9], 8, 1, 1
    key, tables, seq_lens = make_paged(rng, seq, hkv, page_size, 64)
    max_pages = tables.shape[1]
    if case == "ties":
        scores = rng.integers(0, 4, size=(len(seq), hkv, max_pages)).astype(np.float64)
    elif case == "negative":
        scores = -rng.uniform(0, 1e3, size=(len(seq), hkv, max_pages))
        scores[0, 0, 10:40] = -np.inf
        scores[1, 1, 5:20] = 0.0
        scores[1, 1, 20:30] = -0.0
    elif case == "nan":  # NaN rule: below every number (-inf included), leftover slots by page order
        scores = rng.standard_normal((len(seq), hkv, max_pages))
        scores[0, 0, ::3] = np.nan
        scores[1, 0, 1:48] = np.nan  # 47 of the 48 window pages NaN: one number, then NaN pages
        scores[1, 1, 1:10] = -np.inf
        scores[1, 1, 10:48] = np.nan
        scores[2, 2, :] = -np.nan
    else:
        scores = rng.standard_normal((len(seq), hkv, max_pages))
    scores = scores.astype(np.float32)
    width = bos + topk + eos
    out = torch.full((len(seq), hkv, width), 99, dtype=torch.int32, device=DEV)
    lens = torch.full((len(seq), hkv), 99, dtype=torch.int32, device=DEV)
    _launch().run_select_pages(_t(scores, torch.float32), tables, seq_lens, out, lens, page_size=page_size,
                               topk=topk, bos=bos, eos=eos)
    ref_t, ref_l = oracle.select_pages(scores, _np(tables), seq, page_size, topk, bos, eos)
    np.testing.assert_array_equal(_np(out), ref_t)
    np.testing.assert_array_equal(_np(lens), ref_l)


def test_select_pages_eos0_counts_the_selected_tokens():
    """eos = 0 (issue 43): out_lens counts the tokens of the selected pages -- the real (partial) last page
    taken by score (head 0) or by a tie (head 1) gives count * P - its empty slots, not taken (heads 2, 3)
    count * P -- and a long request whose last page is or is not in the top-k, per head."""
    rng = np.random.default_rng(3)
    _, tables, seq_lens = make_paged(rng, [43, 16 * 300 + 7], 4, 4, 64)
    max_pages = tables.shape[1]
    scores = np.full((2, 4, max_pages), -1.0, np.float32)
    scores[0, 0, 10] = 9.0
    scores[0, 1, 3], scores[0, 1, 7], scores[0, 1, 10] = 5.0, 0.0, 0.0
    scores[0, 2, :] = 0.5
    scores[0, 3, 10] = -7.0
    scores[1] = rng.standard_normal((4, max_pages)).astype(np.float32)
    n_last = -(-(16 * 300 + 7) // 4) - 1
    scores[1, 0, n_last], scores[1, 1, n_last] = 50.0, -50.0
    out = torch.full((2, 4, 4), 99, dtype=torch.int32, device=DEV)
    lens = torch.full((2, 4), 99, dtype=torch.int32, device=DEV)
    _launch().run_select_pages(_t(scores, torch.float32), tables, seq_lens, out, lens, page_size=4, topk=3, bos=1,
                               eos=0)
    ref_t, ref_l = oracle.select_pages(scores, _np(tables), [43, 16 * 300 + 7], 4, 3, 1, 0)
    assert ref_l[0].tolist() == [15, 15, 16, 16] and ref_l[1, 0] == 15 and ref_l[1, 1] == 16
    np.testing.assert_array_equal(_np(out), ref_t)
    np.testing.assert_array_equal(_np(lens), ref_l)


# ------------------------------------------------------------------------ the seed recurrence
def _recurrence(gqa, steps, page_size, state_dtype=torch.float32, decay=0.984375, seed=0):
    """128 tokens, G=4, D=128, bos 4 / eos 8 tokens; per-step affinity queries. Returns arrays."""
    rng = np.random.default_rng(seed)
    n, G, D, hkv = 128, 4, 128, 1
    keys, u = oracle.affinity_problem(rng, n, G, D)
    P = page_size
    n_pages = n // P
    num_pages = n_pages + 5
    perm = rng.permutation(num_pages)[:n_pages]
    kc = np.zeros((num_pages, hkv, P, D))
    for t in range(n):
        kc[perm[t // P], 0, t % P] = keys[t]
    key = _t(kc, torch.float32)  # fp32 keys: the oracle sees exactly the kernel's inputs
    tables = _t(perm[None, :], torch.int32)
    seq_lens = _t([n], torch.int32)
    state = torch.zeros(num_pages, hkv, P, device=DEV, dtype=state_dtype)
    ref = np.zeros((num_pages, hkv, P))
    for _ in range(steps):
        qn = oracle.affinity_query(rng, u, G, D)[None].astype(np.float32)
        _token_step(_t(qn, torch.float32), key, state, tables, seq_lens, gqa, 4, 8, decay=decay)
        ref = oracle.token_accumulate(qn, kc, ref, perm[None, :], [n], None, decay, gqa, 4, 8,
                                      "bfloat16" if state_dtype == torch.bfloat16 else "float32")
    tok = lambda st: np.array([st[perm[t // P], 0, t % P] for t in range(n)])  # noqa: E731
    return tok(_np(state)), tok(ref), (key, tables, seq_lens, state)


@pytest.mark.parametrize("gqa,page_size", [("mean_q", 1), ("mean_p", 16), ("max", 1), ("sum", 16)])
def test_recurrence_fp32_matches_oracle(gqa, page_size):
    got, ref, _ = _recurrence(gqa, 800, page_size)
    assert rel_err(got, ref) < 1e-3
    # window placement: non-zero exactly on [bos, n - eos)
    assert np.all(got[4:120] > 0) and np.all(got[:4] == 0) and np.all(got[120:] == 0)
    if gqa in ("mean_q", "mean_p"):  # steady mass 1 / (1 - decay) = 64
        assert abs(got.sum() - 64.0) / 64.0 < 1e-3, got.sum()


def test_recurrence_topk_and_responsiveness():
    """Top-32 via token_page_scores + select_pages equals the oracle where the gap exceeds rounding."""
    got, ref, (key, tables, seq_lens, state) = _recurrence("mean_q", 800, 1)
    L = _launch()
    scores = torch.empty(1, 1, 128, device=DEV)
    L.run_token_page_scores(state, tables, seq_lens, scores)
    out = torch.empty(1, 1, 44, dtype=torch.int32, device=DEV)
    lens = torch.empty(1, 1, dtype=torch.int32, device=DEV)
    L.run_select_pages(scores, tables, seq_lens, out, lens, page_size=1, topk=32, bos=4, eos=8)
    ref_t, _ = oracle.select_pages(ref[None, None], _np(tables), [128], 1, 32, 4, 8)
    mid = np.sort(ref[4:120])[::-1]
    gap = mid[31] - mid[32]
    # the affinity keys make the boundary gap far above fp32 rounding (~1e-6 of the top score)
    assert gap > 1e-4 * mid[0], (gap, mid[0])
    np.testing.assert_array_equal(_np(out), ref_t)
    # still responsive after 800 steps: one more step moves the state measurably
    before = _np(state).copy()
    q = _t(np.random.default_rng(5).standard_normal((1, 4, 128)), torch.float32)
    _token_step(q, key, state, tables, seq_lens, "mean_q", 4, 8)
    assert np.abs(_np(state) - before).max() > 1e-4


def test_bf16_state_reproduces_upstream_freeze():
    """decay=1.0: bf16 state freezes (mass lost) exactly as a bf16-rounding oracle; fp32 does not."""
    got16, ref16, _ = _recurrence("mean_q", 600, 1, state_dtype=torch.bfloat16, decay=1.0)
    got32, _, _ = _recurrence("mean_q", 600, 1, state_dtype=torch.float32, decay=1.0)
    assert abs(got32.sum() - 600.0) / 600.0 < 1e-3
    assert got16.sum() < 0.9 * 600.0  # the freeze: more than 10% of the mass rounded away
    # matches the round-on-store oracle (within one bf16 ulp of the larger values)
    assert abs(got16.sum() - ref16.sum()) / ref16.sum() < 2e-2
    np.testing.assert_allclose(got16, ref16, rtol=1.6e-2, atol=1e-2)


def test_reset_on_page_reuse():
    """Request B on request A's recycled slots equals a fresh oracle (no inherited scores)."""
    rng = np.random.default_rng(9)
    L = _launch()
    key, tables, seq_lens = make_paged(rng, [96], hkv=2, page_size=16, d=128)
    q = _t(rng.standard_normal((1, 8, 128)), torch.bfloat16)
    state = torch.zeros(key.shape[0], 2, 16, device=DEV)
    for _ in range(50):
        _token_step(q, key, state, tables, seq_lens, "max", 2, 3)
    assert int((state != 0).sum()) > 0
    # request B takes over the same pages: its prefill writes (and resets) all 96 slots
    bt = _np(tables)
    slots = np.array([bt[0, t // 16] * 16 + t % 16 for t in range(96)])
    key_b = _t(rng.standard_normal(tuple(key.shape)), torch.bfloat16)
    L.run_reset_scores(state, _t(slots, torch.int32))
    assert int((state != 0).sum()) == 0
    q_b = _t(rng.standard_normal((1, 8, 128)), torch.bfloat16)
    for _ in range(3):
        _token_step(q_b, key_b, state, tables, seq_lens, "max", 2, 3)
    ref = np.zeros(state.shape)
    for _ in range(3):
        ref = oracle.token_accumulate(_np(q_b), _np(key_b), ref, bt, [96], None, 0.984375, "max", 2, 3)
    assert rel_err(_np(state), ref) < 1e-5


# --------------------------------------------------------------------------------- CUDA graph
def test_cuda_graph_decode_step_replay():
    """reset -> accumulate -> page scores -> select captured once, replayed with growing seq_lens."""
    rng = np.random.default_rng(21)
    L = _launch()
    P, hkv, G, D = 16, 2, 4, 128
    key, tables, seq_lens = make_paged(rng, [400, 260], hkv, P, D)
    q = _t(rng.standard_normal((2, hkv * G, D)), torch.bfloat16)
    state = torch.zeros(key.shape[0], hkv, P, device=DEV)
    slots = torch.zeros(2, dtype=torch.int32, device=DEV)
    lg_shape, st_shape = L.token_workspace_shapes(q, key, tables, "mean_q")
    lg = torch.empty(lg_shape, device=DEV)
    sts = torch.empty(st_shape, device=DEV)
    scores = torch.empty(2, hkv, tables.shape[1], device=DEV)
    out = torch.empty(2, hkv, 1 + 4 + 2, dtype=torch.int32, device=DEV)
    lens = torch.empty(2, hkv, dtype=torch.int32, device=DEV)

    def step():
        L.run_reset_scores(state, slots)
        L.run_token_accumulate(q, key, state, tables, seq_lens, lg, sts, scale=D ** -0.5, decay=0.984375,
                               bos=16, eos=32, gqa_reduce="mean_q")
        L.run_token_page_scores(state, tables, seq_lens, scores)
        L.run_select_pages(scores, tables, seq_lens, out, lens, page_size=P, topk=4, bos=1, eos=2)

    lens_np = np.array([300, 200])
    bt = _np(tables)

    def set_step(lens_now):
        seq_lens.copy_(_t(lens_now, torch.int32))
        slots.copy_(_t([bt[b, (n - 1) // P] * P + (n - 1) % P for b, n in enumerate(lens_now)], torch.int32))

    set_step(lens_np)
    step()  # compile outside the capture
    torch.cuda.synchronize()
    state.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    ref = np.zeros(state.shape)
    for i in range(5):
        now = lens_np + i
        set_step(now)
        graph.replay()
        ref = oracle.reset_scores(ref, _np(slots))
        ref = oracle.token_accumulate(_np(q), _np(key), ref, bt, now, None, 0.984375, "mean_q", 16, 32)
    torch.cuda.synchronize()
    assert rel_err(_np(state), ref) < 1e-5
    ref_scores = oracle.token_page_scores(_np(state), bt, now)
    ref_t, ref_l = oracle.select_pages(ref_scores, bt, now, P, 4, 1, 2)
    np.testing.assert_array_equal(_np(out), ref_t)
    np.testing.assert_array_equal(_np(lens), ref_l)


def test_deterministic():
    rng = np.random.default_rng(4)
    key, tables, seq_lens = make_paged(rng, [3000, 100], hkv=2, page_size=16, d=128)
    q = _t(rng.standard_normal((2, 16, 128)), torch.bfloat16)
    outs = []
    for _ in range(2):
        state = torch.ones(key.shape[0], 2, 16, device=DEV)
        _token_step(q, key, state, tables, seq_lens, "sum", 1, 1)  # G=8, P=16: case of TOKEN_CASES
        outs.append(state.clone())
    assert torch.equal(outs[0], outs[1])
