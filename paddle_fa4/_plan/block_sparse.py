"""The block rule and the reusable plan of :func:`paddle_fa4.block_sparse_attention` (``docs/api.md``).

Block rule (the one definition, used by the reference backend and by the plan): query ``t`` of a
document ``[bos, eos)`` and block id ``j >= 0`` name the keys ``[bos + bs * j, bos + bs * j + bs)``
(``bs = block_size``); the block is *live* for ``t`` iff its start is ``< limit(t)``, where
``limit(t) = t + 1`` (causal) or ``eos`` (not causal), and its visible keys are those ``< limit(t)``
(the diagonal block and the document's tail block are cut there). ``-1`` is padding; a repeated
id counts once; ids that are not live (past the document, or wholly after the query) select nothing.

Plan (built once per selection, reused by every sparse layer sharing it): queries are grouped into
tiles of ``WQ = window_queries(G)`` consecutive queries (``WQ * G`` query heads fill the kernels'
64 MMA rows, as in :mod:`paddle_fa4._plan.indexed`), and for each index set ``s`` (``b`` for ids
``[B, S, topk]``, ``b * Hkv + h`` for ``[B, Hkv, S, topk]``) the plan stores

- per query tile ``w``: the ascending absolute start rows of the union of its queries' live blocks
  (``tile_start[s, w, :tile_count[s, w]]``) and, per start, the bitmask of the tile queries that
  selected it (bit ``i`` = query ``w * WQ + i``): exactly the windowed union of
  :func:`paddle_fa4._plan.indexed.build_plan` over the start rows, which builds it;
- per query ``q_limit[b, t] = limit(t)``, the exclusive key bound of every row;
- the key-major transpose: the distinct selected key blocks of each set (``key_start``/``key_end``
  = their rows ``[start, min(start + bs, eos))``, ascending, ``key_count[s]`` of them) and, per key
  block ``r`` (flat row ``s * KCAP + r``), the query tiles using it in ascending order with the slot
  of the block in each tile's list: ``key_tile/key_slot[key_ptr[row] : key_ptr[row + 1]]``;
- ``key_order``: the order in which the dK/dV kernels run the segments of those lists (Note
  [tile-ordered segments] in ``cute_kernels/block_sparse/bwd_dkdv_sm90.py``): a schedule, not a result.
  The kernels trust it to be this builder's (a permutation that runs each block's segments in order: a
  segment waits for the one before it); build plans with :func:`paddle_fa4.block_sparse_plan`, not by hand.

The public op :func:`paddle_fa4.block_sparse_plan` and the argument checks live in
``paddle_fa4/block_sparse.py``; this module holds the plan type, the block rule and the builder (Paddle
tensor ops, any place) and imports neither the CuTe glue nor the reference (``docs/design.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .indexed import build_plan as windowed_plan, window_queries

#: Block sizes accepted (the CuTe kernels take 64).
BLOCK_SIZES = (16, 32, 64, 128, 256)


def tile_queries(heads_per_kv: int, arch: int | None = None, head_dim_v: int = 128) -> int:
    """Queries per query tile. SM90 (and any place without an SM100 GPU, ``arch`` None): indexed attention's
    ``window_queries(G)`` (``min(64 // G, 32)``), one query for ``G >= 64`` (MQA with many heads: one
    query's heads fill the MMA rows). SM100 (``arch`` 100 / 103): the Q stages of that forward kernel
    (``cute_kernels.block_sparse.config.tile_queries``; ``head_dim_v`` > 128 takes one stage), the same
    rule written here so that a CPU-only install needs no cutlass."""
    if arch is not None and arch // 10 == 10:
        gc = min(heads_per_kv, 64)
        per_stage = 128 // gc
        stages = 2 if head_dim_v <= 128 and per_stage < 32 else 1
        return min(stages * per_stage, 32)
    return window_queries(min(heads_per_kv, 64))


@dataclass(frozen=True, eq=False)
class BlockSparsePlan:
    """Plan of one selection; int32 tensors on the ids' place. Shapes (``NS`` sets, ``NQT =
    ceil(S / WQ)`` query tiles, ``CAP = WQ * topk``, ``KCAP = ceil(S / bs) + num_docs``):
    ``tile_start``/``tile_mask [NS, NQT, CAP]``, ``tile_count [NS, NQT]``, ``q_limit [B, S]``,
    ``key_start``/``key_end [NS, KCAP]``, ``key_count [NS]``, ``key_ptr [NS * KCAP + 1]``,
    ``key_tile``/``key_slot [NS * NQT * CAP]``, ``key_order [NS, KCAP * 8]``. Entries past a count / pointer
    are unspecified."""

    batch: int
    num_sets: int
    num_queries: int
    topk: int
    block_size: int
    heads_per_kv: int
    per_kv_head: bool
    causal: bool
    num_docs: int
    window_queries: int
    tile_start: Any
    tile_mask: Any
    tile_count: Any
    q_limit: Any
    key_start: Any
    key_end: Any
    key_count: Any
    key_ptr: Any
    key_tile: Any
    key_slot: Any
    key_order: Any

    @property
    def num_query_tiles(self) -> int:
        return -(-self.num_queries // self.window_queries)

    @property
    def key_capacity(self) -> int:
        return -(-self.num_queries // self.block_size) + self.num_docs

    def geometry(self) -> tuple:
        return (self.batch, self.num_sets, self.num_queries, self.topk, self.block_size, self.heads_per_kv,
                self.per_kv_head, self.causal, self.num_docs)


def num_docs(cu_seqlens) -> int:
    return 1 if cu_seqlens is None else int(cu_seqlens.shape[-1]) - 1



# ----------------------------------------------------------------------------------------------
# the block rule


def doc_bounds(batch: int, seqlen: int, cu_seqlens, place):
    """int64 ``(bos [B, S], eos [B, S])``: the document ``[bos, eos)`` of every token."""
    import paddle

    t = paddle.arange(seqlen, dtype="int64", device=place)
    if cu_seqlens is None:
        return (paddle.zeros([batch, seqlen], dtype="int64", device=place),
                paddle.full([batch, seqlen], seqlen, dtype="int64", device=place))
    cu = cu_seqlens.astype("int64")
    cu = cu.unsqueeze(0).expand([batch, cu.shape[-1]]) if cu.ndim == 1 else cu
    doc = paddle.searchsorted(cu, t.unsqueeze(0).expand([batch, seqlen]).contiguous(), right=True) - 1
    return paddle.take_along_axis(cu, doc, axis=1), paddle.take_along_axis(cu, doc + 1, axis=1)


def query_limits(bos, eos, causal: bool):
    """int64 ``[B, S]`` exclusive key bound of each query: ``t + 1`` (causal) or its document's end."""
    import paddle

    if not causal:
        return eos
    return paddle.arange(bos.shape[1], dtype="int64", device=bos.place).unsqueeze(0).expand(bos.shape) + 1


def block_starts(block_ids, bos, limit, block_size: int):
    """int64 absolute start row of every id (shape of ``block_ids``), -1 where nothing is live."""
    import paddle

    ids = block_ids.astype("int64")
    if ids.ndim == 4:
        bos, limit = bos.unsqueeze(1), limit.unsqueeze(1)
    start = bos.unsqueeze(-1) + ids * block_size
    live = (ids >= 0) & (start < limit.unsqueeze(-1))
    return paddle.where(live, start, paddle.full_like(start, -1))


def block_tokens(start, limit, block_size: int):
    """int64 ``token [..., topk * block_size]`` and bool ``keep`` of it: the ``block_size`` keys from each
    ``start [..., topk]`` (-1: no block) that a row with exclusive key bound ``limit [..., 1]`` sees."""
    import paddle

    token = start.unsqueeze(-1) + paddle.arange(block_size, dtype="int64", device=start.place)
    keep = (start >= 0).unsqueeze(-1) & (token < limit.unsqueeze(-1))
    shape = list(start.shape[:-1]) + [start.shape[-1] * block_size]
    return token.reshape(shape), keep.reshape(shape)


# ----------------------------------------------------------------------------------------------
# builder


def build_plan(block_ids, *, heads_per_kv: int, block_size: int, causal: bool, cu_seqlens,
               head_dim_v: int = 128) -> BlockSparsePlan:
    """The plan of validated arguments (Paddle tensor ops, any place); its query tile is that of the
    ids' GPU (``tile_queries``)."""
    import paddle

    from ..backend import tensor_arch

    per_kv_head = block_ids.ndim == 4
    shape = list(block_ids.shape)
    batch, seqlen, topk = shape[0], shape[-2], shape[-1]
    sets = batch * (shape[1] if per_kv_head else 1)
    place = block_ids.place
    ndoc = num_docs(cu_seqlens)
    kcap = -(-seqlen // block_size) + ndoc
    with paddle.no_grad():
        bos, eos = doc_bounds(batch, seqlen, cu_seqlens, place)
        limit = query_limits(bos, eos, causal)
        starts = block_starts(block_ids, bos, limit, block_size).astype("int32").reshape([sets, seqlen, topk])
        union = windowed_plan(starts, num_sets=sets, num_queries=seqlen, width=topk, kv_len=seqlen,
                               heads_per_kv=min(heads_per_kv, 64), per_kv_head=per_kv_head,
                               window=tile_queries(heads_per_kv, tensor_arch(block_ids), head_dim_v))
        keys = _key_transpose(union.win_key, union.win_count, eos, sets, batch, seqlen, kcap, block_size)
    return BlockSparsePlan(batch=batch, num_sets=sets, num_queries=seqlen, topk=topk, block_size=block_size,
                           heads_per_kv=heads_per_kv, per_kv_head=per_kv_head, causal=causal, num_docs=ndoc,
                           window_queries=union.window_queries, tile_start=union.win_key,
                           tile_mask=union.win_mask, tile_count=union.win_count,
                           q_limit=limit.astype("int32"), **keys)


def plan_for(spec, block_ids, cu_seqlens, plan) -> BlockSparsePlan:
    """``plan`` (the caller checked it fits ``spec``, a ``BlockSparseSpec``) or a new one for this call."""
    if plan is None:
        return build_plan(block_ids, heads_per_kv=spec.group, block_size=spec.block_size, causal=spec.causal,
                          cu_seqlens=cu_seqlens, head_dim_v=spec.Dv)
    return plan


def _key_transpose(tile_start, tile_count, eos, sets: int, batch: int, seqlen: int, kcap: int,
                   block_size: int) -> dict:
    """Distinct selected key blocks per set and, per block, its (query tile, slot) pairs in order."""
    import paddle

    place = tile_start.place
    _, nqt, cap = tile_start.shape
    pairs = max(sets * nqt * cap, 1)
    out = dict(key_start=paddle.full([sets, kcap], -1, dtype="int32", device=place),
               key_end=paddle.full([sets, kcap], -1, dtype="int32", device=place),
               key_count=paddle.zeros([sets], dtype="int32", device=place),
               key_ptr=paddle.zeros([sets * kcap + 1], dtype="int32", device=place),
               key_tile=paddle.full([pairs], -1, dtype="int32", device=place),
               key_slot=paddle.full([pairs], -1, dtype="int32", device=place))
    from cute_kernels.block_sparse.config import SEGMENTS
    out["key_order"] = paddle.arange(kcap * SEGMENTS, dtype="int32", device=place).reshape([1, -1]).tile([sets, 1])
    if sets * nqt * cap == 0:
        return out
    slot = paddle.arange(cap, dtype="int64", device=place).reshape([1, 1, cap])
    used = slot < tile_count.astype("int64").unsqueeze(-1)  # [NS, NQT, CAP]
    set_of = paddle.arange(sets, dtype="int64", device=place).reshape([sets, 1, 1]).expand(used.shape)
    tile_of = paddle.arange(nqt, dtype="int64", device=place).reshape([1, nqt, 1]).expand(used.shape)
    s_e = paddle.masked_select(set_of, used)
    if s_e.shape[0] == 0:
        return out
    w_e = paddle.masked_select(tile_of, used)
    j_e = paddle.masked_select(slot.expand(used.shape), used)
    st_e = paddle.masked_select(tile_start.astype("int64"), used)
    # 1. distinct (set, start) in ascending order = the key blocks; rank within the set
    flat, inverse = paddle.unique(s_e * seqlen + st_e, return_inverse=True)
    inverse = inverse.reshape([-1])
    k_set = flat // seqlen
    k_start = flat % seqlen
    per_set = paddle.bincount(k_set, minlength=sets)
    rank = paddle.arange(flat.shape[0], dtype="int64", device=place) - paddle.gather(paddle.cumsum(per_set) - per_set, k_set)
    row = k_set * kcap + rank
    b_of = k_set // (sets // batch)
    k_end = paddle.minimum(k_start + block_size, paddle.gather(eos.reshape([-1]), b_of * seqlen + k_start))
    out["key_start"] = paddle.scatter(out["key_start"].reshape([-1]), row, k_start.astype("int32")).reshape([sets, kcap])
    out["key_end"] = paddle.scatter(out["key_end"].reshape([-1]), row, k_end.astype("int32")).reshape([sets, kcap])
    out["key_count"] = per_set.astype("int32")
    # 2. pairs sorted by (key block row, query tile); each (tile, start) entry is one pair
    pair_row = paddle.gather(row, inverse)
    order = paddle.argsort(pair_row * nqt + w_e, stable=True)
    n = int(order.shape[0])
    idx = paddle.arange(n, dtype="int64", device=place)
    out["key_tile"] = paddle.scatter(out["key_tile"], idx, paddle.gather(w_e, order).astype("int32"))
    out["key_slot"] = paddle.scatter(out["key_slot"], idx, paddle.gather(j_e, order).astype("int32"))
    counts = paddle.bincount(pair_row, minlength=sets * kcap)
    ptr = paddle.concat([paddle.zeros([1], dtype="int64", device=place), paddle.cumsum(counts)])
    out["key_ptr"] = ptr.astype("int32")
    out["key_order"] = _key_order(ptr, out["key_tile"], sets, kcap, nqt)
    return out


def _key_order(key_ptr, key_tile, sets: int, kcap: int, nqt: int):
    """int32 [NS, KCAP * SEGMENTS]: the dK/dV CTA order of Note [tile-ordered segments]
    (cute_kernels/block_sparse/bwd_dkdv_sm90.py) -- per set, the CTA ids ``x = r * SEGMENTS + k`` sorted by
    the first query tile of segment k of key block r (``segment_split`` at ``ORDERED_MIN_SEGMENT_PAIRS``),
    then by id; ids without a segment last, by id."""
    import paddle

    from cute_kernels.block_sparse.config import ORDERED_MIN_SEGMENT_PAIRS, SEGMENTS, segment_split

    place = key_ptr.place
    nx = kcap * SEGMENTS
    x = paddle.arange(nx, dtype="int64", device=place)
    rows = (paddle.arange(sets, dtype="int64", device=place).reshape([sets, 1]) * kcap + (x // SEGMENTS).reshape([1, nx]))
    p0 = paddle.gather(key_ptr, rows.reshape([-1])).reshape([sets, nx])
    n = paddle.gather(key_ptr, rows.reshape([-1]) + 1).reshape([sets, nx]) - p0
    seg_len, nseg = segment_split(n, ORDERED_MIN_SEGMENT_PAIRS, _maximum)
    k = (x % SEGMENTS).reshape([1, nx])
    live = k < nseg
    first = paddle.clip(p0 + k * seg_len, 0, key_tile.shape[0] - 1)
    tile = paddle.gather(key_tile.astype("int64"), first.reshape([-1])).reshape([sets, nx])
    tile = paddle.where(live, tile, paddle.full_like(tile, nqt))
    return paddle.argsort(tile * nx + x.reshape([1, nx]), axis=-1).astype("int32")


def _maximum(a, b):
    """Element-wise max of tensors and / or ints (``segment_split``'s ``maximum`` on Paddle tensors)."""
    import paddle

    if not isinstance(a, paddle.Tensor):
        a, b = b, a
    return paddle.maximum(a, b if isinstance(b, paddle.Tensor) else paddle.full_like(a, b))
