"""The windowed plan of :func:`paddle_fa4.indexed_attention` (see ``docs/api.md``).

A plan depends only on ``(indices, kv_len, heads_per_kv)``: queries are grouped into windows of
``WQ = window_queries(heads_per_kv)`` consecutive queries (``WQ * G`` fills the kernels' 64 MMA
rows), and for every index set ``s`` (``b`` for ``[B, Lq, W]`` indices, ``b * Hkv + h`` for
``[B, Hkv, Lq, W]``) the plan stores

- per window ``w``: its distinct valid keys in ascending order (``win_key[s, w, :win_count[s, w]]``)
  and, per key, the bitmask of the window queries selecting it (bit ``i`` = query ``w * WQ + i``);
- the transpose, per 32-key tile ``t``: the windows touching it in ascending order
  (``tile_win[tile_ptr[s * NT + t] : tile_ptr[s * NT + t + 1]]``) and, per such window, the index
  in its key list of its first key in the tile (``tile_start``).

Two builders give identical plans (entries past each count / pointer are unspecified): the CuTe
kernels on the GPU (no host sync, ``paddle_fa4._cute.indexed.build_plan``) and :func:`build_plan` here,
Paddle tensor ops on any place (the reference backend's plan, and the windowed union under the
block-sparse plan, ``paddle_fa4._plan.block_sparse``). The public op, :func:`paddle_fa4.indexed_attention_plan`
(``paddle_fa4/indexed.py``), validates and picks the builder. This module imports neither the CuTe glue
nor the reference backend (the layout rule of ``docs/design.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

KEY_TILE = 32
#: MMA rows of a window (``WQ * G``); ``heads_per_kv`` is at most this.
TILE_M = 64


def window_queries(heads_per_kv: int) -> int:
    """Queries per window: ``64 // heads_per_kv``, at most 32 (one mask bit per query)."""
    return min(TILE_M // heads_per_kv, 32)


@dataclass(frozen=True, eq=False)
class IndexedAttentionPlan:
    """Windowed plan; every tensor is int32 on the indices' place. Shapes (``S`` index sets,
    ``NW = ceil(Lq / WQ)`` windows, ``CAP = WQ * W``, ``NT = ceil(kv_len / 32)``,
    ``PCAP = S * NW * min(CAP, NT)``): ``win_key``/``win_mask [S, NW, CAP]``, ``win_count [S, NW]``,
    ``tile_ptr [S * NT + 1]``, ``tile_win``/``tile_start [PCAP]``. ``tile_bits [S, NT, ceil(NW/32)]``
    (window bitmap per tile) is kept by the CuTe builder only."""

    num_sets: int
    num_queries: int
    width: int
    kv_len: int
    heads_per_kv: int
    per_kv_head: bool
    window_queries: int
    backend: str
    win_key: Any
    win_mask: Any
    win_count: Any
    tile_ptr: Any
    tile_win: Any
    tile_start: Any
    tile_bits: Optional[Any] = None

    @property
    def num_windows(self) -> int:
        return -(-self.num_queries // self.window_queries)

    @property
    def num_tiles(self) -> int:
        return -(-self.kv_len // KEY_TILE)

    def matches(self, num_sets: int, num_queries: int, width: int, kv_len: int, heads_per_kv: int,
                per_kv_head: bool) -> bool:
        return (self.num_sets, self.num_queries, self.width, self.kv_len, self.heads_per_kv,
                self.per_kv_head) == (num_sets, num_queries, width, kv_len, heads_per_kv, per_kv_head)


def plan_shapes(num_sets: int, num_queries: int, width: int, kv_len: int, wq: int) -> dict:
    """int32 shapes of the plan tensors (same as ``cute_kernels.indexed.launch.plan_shapes``)."""
    nw = -(-num_queries // wq)
    cap = max(wq * width, 1)
    nt = -(-kv_len // KEY_TILE)
    pairs = max(num_sets * nw * min(cap, nt), 1)
    return {"win_key": [num_sets, nw, cap], "win_mask": [num_sets, nw, cap], "win_count": [num_sets, nw],
            "tile_bits": [num_sets, nt, max(-(-nw // 32), 1)], "tile_ptr": [num_sets * nt + 1],
            "tile_win": [pairs], "tile_start": [pairs]}


def build_plan(indices, *, num_sets: int, num_queries: int, width: int, kv_len: int,
                   heads_per_kv: int, per_kv_head: bool, window: int | None = None) -> IndexedAttentionPlan:
    """The plan of ``indices [S, Lq, W]`` with Paddle tensor ops (sort/unique based), on any place;
    ``window``: queries per window (at most 32, one mask bit each), default ``window_queries(heads_per_kv)``."""
    import paddle

    wq = window_queries(heads_per_kv) if window is None else int(window)
    assert 1 <= wq <= 32, wq
    shapes = plan_shapes(num_sets, num_queries, width, kv_len, wq)
    nw, cap = shapes["win_key"][1], shapes["win_key"][2]
    nt = -(-kv_len // KEY_TILE)
    place = indices.place

    def full(shape, value=0):
        return paddle.full(shape, value, dtype="int32", device=place)

    plan = dict(win_key=full(shapes["win_key"]), win_mask=full(shapes["win_mask"]),
                win_count=full(shapes["win_count"]), tile_ptr=full(shapes["tile_ptr"]),
                tile_win=full(shapes["tile_win"], -1), tile_start=full(shapes["tile_start"], -1))
    total = num_sets * num_queries * width
    if total == 0 or kv_len == 0:
        return IndexedAttentionPlan(backend="reference", window_queries=wq, num_sets=num_sets,
                                    num_queries=num_queries, width=width, kv_len=kv_len,
                                    heads_per_kv=heads_per_kv, per_kv_head=per_kv_head, **plan)
    with paddle.no_grad():
        idx = indices.astype("int64").reshape([-1])
        ent = paddle.arange(total, dtype="int64")
        s = ent // (num_queries * width)
        q = (ent // width) % num_queries
        sw = s * nw + q // wq  # flat (set, window)
        qi = q % wq
        valid = (idx >= 0) & (idx < kv_len)
        # 1. distinct (window, key, query) triples, sorted by window then key
        triple = paddle.masked_select((sw * kv_len + idx) * 32 + qi, valid)
        triple = paddle.unique(triple)
        pair = triple // 32
        bit = paddle.pow(paddle.full_like(triple, 2), triple % 32)
        # 2. distinct (window, key) with the OR (= sum of distinct bits) of its queries
        pairs, inverse = paddle.unique(pair, return_inverse=True)
        mask = paddle.zeros(pairs.shape, dtype="int64").index_add(inverse.reshape([-1]), 0, bit)
        pw = pairs // kv_len
        key = pairs % kv_len
        count = paddle.bincount(pw, minlength=num_sets * nw)
        first = paddle.cumsum(count) - count
        pos = paddle.arange(pairs.shape[0], dtype="int64") - paddle.gather(first, pw)
        slot = pw * cap + pos
        win_key = paddle.scatter(plan["win_key"].reshape([-1]), slot, key.astype("int32"))
        win_mask = paddle.scatter(plan["win_mask"].reshape([-1]), slot, _as_int32_bits(mask))
        plan["win_key"] = win_key.reshape(shapes["win_key"])
        plan["win_mask"] = win_mask.reshape(shapes["win_mask"])
        plan["win_count"] = count.astype("int32").reshape(shapes["win_count"])
        # 3. transpose: distinct (window, tile) in window-then-tile order, with the first key index
        wt = pw * nt + key // KEY_TILE
        wt_unique, wt_first = paddle.unique(wt, return_index=True)
        start = paddle.gather(pos, wt_first)
        w_of = wt_unique // nt
        tile = wt_unique % nt
        s_of = w_of // nw
        row = s_of * nt + tile
        order = paddle.argsort(row * nw + (w_of % nw), stable=True)
        n_pairs = int(wt_unique.shape[0])
        plan["tile_win"] = paddle.scatter(plan["tile_win"], paddle.arange(n_pairs, dtype="int64"),
                                          paddle.gather(w_of % nw, order).astype("int32"))
        plan["tile_start"] = paddle.scatter(plan["tile_start"], paddle.arange(n_pairs, dtype="int64"),
                                            paddle.gather(start, order).astype("int32"))
        per_row = paddle.bincount(row, minlength=num_sets * nt)
        plan["tile_ptr"] = paddle.concat([paddle.zeros([1], dtype="int64"),
                                          paddle.cumsum(per_row)]).astype("int32")
    return IndexedAttentionPlan(backend="reference", window_queries=wq, num_sets=num_sets,
                                num_queries=num_queries, width=width, kv_len=kv_len,
                                heads_per_kv=heads_per_kv, per_kv_head=per_kv_head, **plan)


def _as_int32_bits(mask):
    """int64 bitmask (< 2**32) -> int32 with the same 32 bits (bit 31 becomes the sign)."""
    return (mask - (mask >= 2 ** 31).astype("int64") * 2 ** 32).astype("int32")
