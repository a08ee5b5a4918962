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
kernels on the GPU (no host sync) and a pure-Paddle reference (any place).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ._static import dynamic_only

OP = "indexed_attention_plan"
KEY_TILE = 32
_TILE_M = 64


def window_queries(heads_per_kv: int) -> int:
    """Queries per window: ``64 // heads_per_kv``, at most 32 (one mask bit per query)."""
    return min(_TILE_M // heads_per_kv, 32)


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


@dynamic_only("indexed_attention_plan")
def indexed_attention_plan(indices, *, kv_len: int, heads_per_kv: int, backend: str = "auto",
                           name: Optional[str] = None) -> IndexedAttentionPlan:
    r"""Build the windowed plan :func:`indexed_attention` uses for ``indices``.

    The plan can be built once and passed to several calls with the same indices (``plan=``);
    ``indexed_attention`` builds it itself when none is given and keeps it for the backward.

    Args:
        indices (Tensor): int32 ``[B, Lq, W]`` (shared by all heads) or ``[B, Hkv, Lq, W]`` (one
            selection per kv head) token indices; any index ``< 0`` or ``>= kv_len`` is padding,
            duplicates in a row count once.
        kv_len (int): length ``Lkv`` of the key axis, ``>= 0``.
        heads_per_kv (int): query heads per kv head ``G = Hq // Hkv`` (sets the window size
            ``min(64 // G, 32)``), ``1 <= G <= 64``.
        backend (str): ``"auto"`` (CuTe kernels on a supported GPU, else the reference),
            ``"cute"`` or ``"reference"``.
        name (str|None, optional): Name for the operation. Default: None.

    Returns:
        IndexedAttentionPlan: see the class docstring for the tensors and their meaning.

    Raises:
        TypeError: ``indices`` is not an int32 tensor.
        ValueError: bad rank, ``kv_len`` or ``heads_per_kv`` out of range.

    Examples:
        .. code-block:: pycon

            >>> import paddle, paddle_fa4
            >>> idx = paddle.to_tensor([[[3, 1, -1], [1, 2, 2]]], dtype="int32")
            >>> plan = paddle_fa4.indexed_attention_plan(idx, kv_len=4, heads_per_kv=12, backend="reference")
            >>> plan.window_queries, plan.win_count.tolist()
            (5, [[3]])
            >>> plan.win_key[0, 0, :3].tolist(), plan.win_mask[0, 0, :3].tolist()
            ([1, 2, 3], [3, 2, 1])
    """
    from . import _validate as V
    from .backend import resolve_backend

    V.check_tensor(OP, "indices", indices)
    V.check_dtype(OP, "indices", indices, ("int32",))
    V.check_rank(OP, "indices", indices, (3, 4), "[B, Lq, W] or [B, Hkv, Lq, W]")
    kv_len = V.check_int(OP, "kv_len", kv_len, low=0)
    heads_per_kv = V.check_int(OP, "heads_per_kv", heads_per_kv, low=1, high=_TILE_M)
    per_kv_head = indices.ndim == 4
    shape = list(indices.shape)
    num_sets = shape[0] * (shape[1] if per_kv_head else 1)
    geometry = dict(num_sets=num_sets, num_queries=shape[-2], width=shape[-1], kv_len=kv_len,
                    heads_per_kv=heads_per_kv, per_kv_head=per_kv_head)

    def reason(arch: int) -> Optional[str]:
        from ._cute.indexed import plan_unsupported_reason
        return plan_unsupported_reason(arch)

    chosen = resolve_backend(OP, backend, indices, reason)
    flat = indices.reshape([num_sets, shape[-2], shape[-1]])
    if chosen == "cute":
        from ._cute.indexed import build_plan
        return build_plan(flat, **geometry)
    return reference_plan(flat, **geometry)


def reference_plan(indices, *, num_sets: int, num_queries: int, width: int, kv_len: int,
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
