"""indexed_attention_plan on the reference backend (CPU) vs a numpy expansion of the index rows,
plus the index sources' contracts and the API's argument checks."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

import paddle_fa4
from paddle_fa4._plan.indexed import IndexedAttentionPlan, window_queries
from tests.oracles import index_sources as src

KEY_TILE = 32


def expected_plan(idx: np.ndarray, kv_len: int, wq: int):
    """Per set: list over windows of (sorted keys, masks); per tile: [(window, first key index)]."""
    sets = src.row_sets(idx, kv_len)
    num_sets = int(np.prod(idx.shape[:-2]))
    lq = idx.shape[-2]
    nw, nt = -(-lq // wq), -(-kv_len // KEY_TILE)
    out = []
    for s in range(num_sets):
        windows, tiles = [], [[] for _ in range(nt)]
        for w in range(nw):
            masks = {}
            for i in range(wq):
                q = w * wq + i
                if q < lq:
                    for key in sets[s * lq + q]:
                        masks[key] = masks.get(key, 0) | (1 << i)
            keys = sorted(masks)
            windows.append((keys, [masks[k] for k in keys]))
            for t in sorted({k // KEY_TILE for k in keys}):
                tiles[t].append((w, int(np.searchsorted(keys, t * KEY_TILE))))
        out.append((windows, tiles))
    return out


def assert_plan_matches(plan: IndexedAttentionPlan, idx: np.ndarray, kv_len: int):
    wq = plan.window_queries
    key, mask = plan.win_key.numpy(), plan.win_mask.numpy()
    count, ptr = plan.win_count.numpy(), plan.tile_ptr.numpy()
    twin, tstart = plan.tile_win.numpy(), plan.tile_start.numpy()
    nt = plan.num_tiles
    for s, (windows, tiles) in enumerate(expected_plan(idx, kv_len, wq)):
        for w, (keys, masks) in enumerate(windows):
            n = count[s, w]
            assert key[s, w, :n].tolist() == keys, f"set {s} window {w} keys"
            assert (mask[s, w, :n].astype(np.int64) & 0xFFFFFFFF).tolist() == masks, f"set {s} window {w} masks"
        for t, pairs in enumerate(tiles):
            p0, p1 = ptr[s * nt + t], ptr[s * nt + t + 1]
            assert list(zip(twin[p0:p1].tolist(), tstart[p0:p1].tolist())) == pairs, f"set {s} tile {t}"


def _plan(idx: np.ndarray, kv_len: int, group: int):
    return paddle_fa4.indexed_attention_plan(paddle.to_tensor(idx, dtype="int32"), kv_len=kv_len, heads_per_kv=group,
                                             backend="reference")


@pytest.mark.parametrize("group", [12, 1, 4, 16])
def test_reference_plan_round_trip_prime_rl(group):
    idx = src.prime_rl_indices(53, 300, 0.9, budget_blocks=8, seed=group)[None]
    assert_plan_matches(_plan(idx, 300, group), idx, 300)


def test_reference_plan_padding_duplicates_batch():
    idx = np.stack([src.with_duplicates(src.with_padding(src.uniform_indices(41, 150, 30, seed=s), 150, 0.3,
                                                         seed=s), 150, 0.2, seed=s) for s in range(3)])
    plan = _plan(idx, 150, 12)
    assert plan.num_sets == 3 and not plan.per_kv_head
    assert_plan_matches(plan, idx, 150)


def test_reference_plan_per_kv_head_layout():
    idx = np.stack([src.uniform_indices(23, 90, 12, seed=s) for s in range(4)]).reshape(2, 2, 23, 12)
    plan = _plan(idx, 90, 8)
    assert plan.per_kv_head and plan.num_sets == 4 and plan.window_queries == 8
    assert_plan_matches(plan, idx, 90)


def test_identical_and_disjoint_windows_bound_the_union():
    wq = window_queries(12)
    same = src.identical_windows(20, 400, 30, wq, seed=1)[None]
    apart = src.disjoint_windows(20, 400, 30, wq, seed=1)[None]
    assert (_plan(same, 400, 12).win_count.numpy() == 30).all()
    assert (_plan(apart, 400, 12).win_count.numpy() == 30 * wq).all()
    assert src.union_ratio(same, 400, wq) == 1.0 and src.union_ratio(apart, 400, wq) == wq


def test_top_query_bit_round_trips():
    """With G = 1 a window has 32 queries; the mask of the last query is bit 31 (the int32 sign)."""
    idx = np.full((1, 32, 1), 7, dtype=np.int32)
    plan = _plan(idx, 10, 1)
    assert plan.win_count.numpy().tolist() == [[1]]
    assert int(plan.win_mask.numpy()[0, 0, 0]) & 0xFFFFFFFF == 0xFFFFFFFF
    assert_plan_matches(plan, idx, 10)


def test_all_padding_and_empty_shapes():
    idx = np.full((1, 9, 4), -1, dtype=np.int32)
    plan = _plan(idx, 50, 12)
    assert (plan.win_count.numpy() == 0).all() and (plan.tile_ptr.numpy() == 0).all()
    empty = _plan(np.zeros((1, 0, 4), np.int32), 50, 12)
    assert empty.num_windows == 0 and empty.tile_ptr.numpy().tolist() == [0, 0, 0]
    no_keys = _plan(np.zeros((1, 3, 4), np.int32), 0, 12)
    assert (no_keys.win_count.numpy() == 0).all()


def test_prime_rl_indices_format():
    """512-style rows: selected blocks are runs of `ratio` consecutive tokens, then the query's
    tail tokens; causal; sentinel kv_len; the first positions only see their tail."""
    kv_len, ratio, budget = 120, 4, 6
    idx = src.prime_rl_indices(kv_len, kv_len, 0.9, budget_blocks=budget, ratio=ratio, seed=3)
    assert idx.shape == (kv_len, budget * ratio + ratio - 1) and idx.dtype == np.int32
    for p, row in enumerate(idx):
        valid = row[row < kv_len]
        assert (valid <= p).all()
        nsel = min(budget, (p + 1) // ratio)
        blocks = row[: nsel * ratio].reshape(nsel, ratio)
        assert (np.diff(blocks, axis=1) == 1).all() and (blocks[:, 0] % ratio == 0).all()
        tail = (p + 1) % ratio
        assert row[nsel * ratio: nsel * ratio + tail].tolist() == list(range(p - tail + 1, p + 1))
        assert len(valid) == nsel * ratio + tail == len(set(valid.tolist()))
    assert src.row_sets(idx[:1], kv_len) == [frozenset({0})]


def test_locality_knob_orders_union_ratios():
    local = src.prime_rl_indices(300, 3000, 0.9, budget_blocks=64, seed=0)
    less = src.prime_rl_indices(300, 3000, 0.5, budget_blocks=64, seed=0)
    assert 1.0 < src.union_ratio(local, 3000, 5) < src.union_ratio(less, 3000, 5) < 5.0


def test_document_starts_select_one_to_three_own_tokens():
    idx = src.document_starts(40, 60, 5, doc_len=7, seed=2)
    for i, row in enumerate(idx):
        p = 20 + i
        valid = row[row < 60]
        assert 1 <= len(valid) <= 3 and (valid <= p).all() and (valid >= p - p % 7).all()


def test_shuffle_rows_keeps_sets():
    idx = src.with_padding(src.uniform_indices(30, 80, 10, seed=1), 80, 0.2)
    assert src.row_sets(src.shuffle_rows(idx, seed=3), 80) == src.row_sets(idx, 80)


def test_plan_argument_errors():
    idx = paddle.zeros([1, 4, 3], dtype="int32")
    with pytest.raises(TypeError, match="indexed_attention_plan: indices must be int32"):
        paddle_fa4.indexed_attention_plan(idx.astype("int16"), kv_len=8, heads_per_kv=12)
    with pytest.raises(ValueError, match="indexed_attention_plan: indices"):
        paddle_fa4.indexed_attention_plan(paddle.zeros([4, 3], dtype="int32"), kv_len=8, heads_per_kv=12)
    with pytest.raises(ValueError, match="kv_len"):
        paddle_fa4.indexed_attention_plan(idx, kv_len=-1, heads_per_kv=12)
    with pytest.raises(ValueError, match="heads_per_kv"):
        paddle_fa4.indexed_attention_plan(idx, kv_len=8, heads_per_kv=0)
    with pytest.raises(NotImplementedError, match="backend='cute'"):
        paddle_fa4.indexed_attention_plan(idx, kv_len=8, heads_per_kv=12, backend="cute")


def test_plan_is_accepted_by_indexed_attention_reference():
    """A reference plan passes indexed_attention's plan check and leaves the result unchanged."""
    q = paddle.randn([1, 6, 4, 16])
    kv = paddle.randn([1, 9, 2, 16])
    idx = paddle.to_tensor(src.uniform_indices(6, 9, 4, seed=0)[None], dtype="int32")
    plan = paddle_fa4.indexed_attention_plan(idx, kv_len=9, heads_per_kv=2, backend="reference")
    a = paddle_fa4.indexed_attention(q, kv, kv, idx, backend="reference")
    b = paddle_fa4.indexed_attention(q, kv, kv, idx, backend="reference", plan=plan)
    assert np.array_equal(a.numpy(), b.numpy())
