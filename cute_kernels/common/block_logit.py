"""block_logit: per (query row, key block) max of the scaled logit, fused into an attention forward.

    block_logit[b, h, i, j] = max_{t in key block j, t visible to row i} softmax_scale * q_i . k_t
                              (with softcap: softcap * tanh(softmax_scale * q_i . k_t / softcap))
                            = -inf when no key of block j is visible to row i

Key block j covers the sequence-relative keys ``[j * block_size, (j + 1) * block_size)``. The kernel
computes it from the S = Q K^T tile while S is still in registers, BEFORE exponentiation, and
writes every entry of ``[0, nb)`` of each valid row exactly once with plain stores (no global
reads, no atomics, no read-modify-write), so the caller needs no pre-fill.

ONE copy for SM90 and SM100. The helpers only see

* a per-thread (rows, cols) register view ``acc_mn`` of the S tile (SM90: 2 rows x tile_n/4 columns
  of a wgmma m64 accumulator, a row shared by ``threads_per_row = 4`` lanes of a quad; SM100: 1 row x
  tile_n columns, ``threads_per_row = 1``), and
* ``cols``: the compile-time column (within the n-tile) of each register column for the thread
  whose column offset is 0. Other threads differ by an offset smaller than 8 (SM90:
  ``2 * (lane % 4)``), which never crosses a block boundary because ``block_size % 8 == 0``.

API (all device functions are ``@cute.jit``; sizes are compile-time Python ints):

``BlockLogitShape(tile_n, block_size, rows_per_thread, threads_per_row)``
    Compile-time bookkeeping: ``blocks_per_tile`` (tile_n // block_size, at least 1),
    ``tiles_per_block`` (block_size // tile_n when a block spans several tiles, else 1), ``owned`` (values each thread
    stores per n-tile after the cross-lane reduction). Raises ValueError for a block size that
    would straddle tiles.
``partial_block_max(shape, acc_mn, cols) -> (R, blocks_per_tile) rmem``
    This thread's max per (row, block) over its own columns (tree of fmax, no shuffles).
``row_max_from_blocks(shape, blk, r) -> Float32``
    This thread's max of row r from the block maxima (so the softmax's row max needs no second pass
    over S; fmax is exact, so the result is bitwise the same as a direct row max).
``reduce_row_threads(shape, blk, lane) -> owned (K,) rmem``
    Max across the ``threads_per_row`` lanes sharing a row, as a reduce-scatter (quad: xor-2 then
    xor-1 butterflies exchanging half the values each) so that every lane ends up owning K
    finished values: row ``row_sel`` of its R rows, blocks ``first_block + k`` of the tile, k < K,
    with ``(row_sel, first_block, is_owner)`` from ``owner_position`` (``is_owner`` is False only
    for duplicate holders, when fewer values than lanes remain).
``reduce_single_block(shape, blk, row_sel) -> (row_max list, owned (1,) rmem)``
    ``blocks_per_tile == 1`` shortcut for ``reduce_row_threads``: a row's block max over the tile
    IS its tile max, so one butterfly all-reduce per row gives both the softmax's row max (already
    reduced across the row's lanes: the softmax must not reduce it again) and the lane's owned
    value (row ``row_sel``; owners as in ``owner_position``). Costs what the softmax's own row
    reduction costs, so block_logit adds only the select and the store.
``owner_position(shape, lane) -> (row_sel, first_block, is_owner)``
    Where ``reduce_row_threads`` leaves this lane's values, from the lane alone, so a kernel can
    resolve its row pointer and validity once, outside the key-tile loop.
``carry_across_tiles(owned, carry, n_tile, n_tile_min, tiles_per_block) -> Boolean``
    block_size == tiles_per_block * tile_n: fold this tile into the running max carried from tile n_tile + 1
    (tiles are visited in descending order) and say whether the block is finished (even tile, or
    the last visited tile) and must be stored now. ``carry`` is an rmem tensor like ``owned`` that
    the kernel fills with -inf at the start of each work tile.
``store_blocks(gRow, owned, first_block, nb, valid, scale)``
    Scalar plain stores ``gRow[first_block + k] = owned[k] * scale`` for ``first_block + k < nb``
    when ``valid`` (row < seqlen_q and is_owner). ``scale`` = softmax_scale (logits are raw q.k), or
    None when the values are already scaled (softcap path). ``-inf * scale = -inf``.
``store_owned(gOwn, owned, block, limit, scale)``
    Hot-loop form of ``store_blocks``: ``gOwn`` is this lane's row already shifted to its first
    owned block and ``limit`` the number of entries it may write from there (0 or less for a lane
    that writes nothing: not an owner, or a row past seqlen_q), both loop invariant; per tile this
    is one compare, one scale and one predicated store per owned value (no branch, no row
    address arithmetic).
``pin_row(gOwn) -> Int64`` / ``row_at(addr, layout) -> Tensor``
    Compute a row view's address once (outside the key-tile loop) as an opaque register and
    rebuild the view from it inside the loop.
``fill_unvisited(gRows, num_rows, nb, block_lo, block_hi, thread, num_threads)``
    -inf for blocks ``[0, block_lo)`` and ``[block_hi, nb)`` of rows ``[0, num_rows)`` of a tile
    (key tiles the kernel never visits: causal future, left of a window, rows with no keys, blocks
    past this sequence's keys in varlen). One flat walk over (row, 4-column group) items, 16-byte
    stores where rows are 16-byte aligned (Note [filling unvisited blocks]).
``fill_unvisited_by_row(gRows, num_rows, nb, block_lo, block_hi, thread, num_threads, warp_size)``
    The same entries, one row per warp and one column per lane: fewer live registers, more
    instructions (for a caller at its register limit: the SM100 softmax warpgroup).
``visited_block_range(shape, n_tile_min, n_tile_max) -> (block_lo, block_hi)``
    The blocks touched by the visited key tiles ``[n_tile_min, n_tile_max)``.

Masked columns must already be -inf in ``acc_mn`` (masking happens before these helpers); a
visited block whose columns are all masked is therefore written as -inf by ``store_blocks``.
See docs/api.md for the user-facing contract.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .math_sm100 import fmax3
from .utils import row_allreduce, tree_max


class BlockLogitShape:
    """Compile-time description of how block_logit maps onto one thread's part of an S tile."""

    def __init__(self, tile_n: int, block_size: int, rows_per_thread: int, threads_per_row: int):
        if block_size % 8 != 0 or block_size & (block_size - 1):
            raise ValueError(f"block_logit: block_size must be a power of two >= 8, got {block_size}")
        if tile_n % block_size != 0 and block_size % tile_n != 0:
            raise ValueError(f"block_logit: block_size {block_size} would straddle key tiles of {tile_n}")
        if threads_per_row not in (1, 2, 4):
            raise ValueError(f"block_logit: threads_per_row must be 1, 2 or 4, got {threads_per_row}")
        self.tile_n = tile_n
        self.block_size = block_size
        self.rows = rows_per_thread
        self.threads_per_row = threads_per_row
        self.blocks_per_tile = max(1, tile_n // block_size)
        self.tiles_per_block = max(1, block_size // tile_n)
        # Reduce-scatter plan: one stage per butterfly distance, each either splitting the values
        # in halves between the two lanes (when an even count >= 2 remains) or all-reducing them.
        stages = []
        count = self.rows * self.blocks_per_tile
        dist = threads_per_row // 2
        while dist >= 1:
            split = count >= 2 and count % 2 == 0
            stages.append((dist, split))
            if split:
                count //= 2
            dist //= 2
        self.stages = tuple(stages)
        self.owned = count
        if self.owned > self.blocks_per_tile or self.blocks_per_tile % self.owned:
            raise ValueError("block_logit: reduce-scatter left values spanning two rows")


@cute.jit
def partial_block_max(shape: cutlass.Constexpr, acc_mn: cute.Tensor, cols: cutlass.Constexpr) -> cute.Tensor:
    """(rows, blocks_per_tile) fp32: this thread's max over its columns of each (row, block)."""
    blk = cute.make_rmem_tensor((shape.rows, shape.blocks_per_tile), Float32)
    for r in cutlass.range_constexpr(shape.rows):
        for b in cutlass.range_constexpr(shape.blocks_per_tile):
            members = [acc_mn[r, c] for c in range(len(cols))
                       if (cols[c] // shape.block_size) % shape.blocks_per_tile == b]
            blk[r, b] = tree_max(members)
    return blk


@cute.jit
def row_max_from_blocks(shape: cutlass.Constexpr, blk: cute.Tensor, r: cutlass.Constexpr) -> Float32:
    """This thread's max of row ``r`` over the tile, from its block maxima."""
    return tree_max([blk[r, b] for b in range(shape.blocks_per_tile)])


@cute.jit
def reduce_row_threads(shape: cutlass.Constexpr, blk: cute.Tensor, lane: Int32):
    """Reduce-scatter the block maxima across the lanes sharing a row (see module docstring)."""
    # Flat order: row-major over (row, block), so halves split rows first, then blocks.
    vals = [blk[r, b] for r in range(shape.rows) for b in range(shape.blocks_per_tile)]
    for dist, split in shape.stages:
        hi = (lane // dist) % 2
        if const_expr(split):
            half = len(vals) // 2
            keep = []
            for i in cutlass.range_constexpr(half):
                lo_v = vals[i]
                hi_v = vals[i + half]
                send = hi_v if hi == 0 else lo_v
                mine = lo_v if hi == 0 else hi_v
                other = cute.arch.shuffle_sync_bfly(send, offset=dist)
                keep.append(cute.arch.fmax(mine, other))
            vals = keep
        else:
            vals = [cute.arch.fmax(v, cute.arch.shuffle_sync_bfly(v, offset=dist)) for v in vals]
    owned = cute.make_rmem_tensor((shape.owned,), Float32)
    for k in cutlass.range_constexpr(shape.owned):
        owned[k] = vals[k]
    return owned


@cute.jit
def reduce_single_block(shape: cutlass.Constexpr, blk: cute.Tensor, row_sel: Int32):
    """blocks_per_tile == 1: all-reduced row maxima (list) and this lane's owned value (see docstring)."""
    row_max = [row_allreduce(blk[r, 0], shape.threads_per_row, cute.arch.fmax) for r in range(shape.rows)]
    owned = cute.make_rmem_tensor((1,), Float32)
    owned[0] = row_max[0]
    for r in cutlass.range_constexpr(1, shape.rows):
        if row_sel == r:
            owned[0] = row_max[r]
    return row_max, owned


@cute.jit
def owner_position(shape: cutlass.Constexpr, lane: Int32):
    """(row_sel, first_block, is_owner) of the values ``reduce_row_threads`` leaves in this lane."""
    start = Int32(0)
    is_owner = Boolean(True)
    count = shape.rows * shape.blocks_per_tile
    for dist, split in shape.stages:
        hi = (lane // dist) % 2
        if const_expr(split):
            count = count // 2
            start = start + hi * count
        else:
            is_owner = is_owner and hi == 0
    row_sel = start // shape.blocks_per_tile
    first_block = start - row_sel * shape.blocks_per_tile
    return row_sel, first_block, is_owner


@cute.jit
def carry_across_tiles(owned: cute.Tensor, carry: cute.Tensor, n_tile: Int32, n_tile_min: Int32,
                       tiles_per_block: cutlass.Constexpr) -> Boolean:
    """block_size == tiles_per_block * tile_n: fold ``carry`` into ``owned``; True when the block is
    finished (its lowest tile, or the last visited tile) and must be stored now."""
    flush = (n_tile % tiles_per_block == 0) or (n_tile == n_tile_min)
    for k in cutlass.range_constexpr(cute.size(owned)):
        owned[k] = cute.arch.fmax(owned[k], carry[k])
        carry[k] = -Float32.inf if flush else owned[k]
    return flush


@cute.jit
def store_blocks(gRow: cute.Tensor, owned: cute.Tensor, first_block: Int32, nb: Int32, valid: Boolean,
                 scale: Float32 | None):
    """Plain stores of the finished block maxima of one row (no reads, no atomics)."""
    if valid:
        for k in cutlass.range_constexpr(cute.size(owned)):
            col = first_block + k
            if col < nb:
                val = owned[k]
                if const_expr(scale is not None):
                    val = val * scale
                gRow[col] = val


@dsl_user_op
def _opaque_i64(x, *, loc=None, ip=None) -> Int64:
    """``x`` through a register move the compiler cannot see through (keeps a value computed once)."""
    return Int64(llvm.inline_asm(T.i64(), [Int64(x).ir_value(loc=loc, ip=ip)], "mov.b64 $0, $1;", "=l,l",
                                 has_side_effects=False, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT))


def pin_row(gOwn: cute.Tensor) -> Int64:
    """Global address of ``gOwn`` (a 1-D fp32 row view) as an opaque Int64, computed where called.

    Without this the compiler re-derives the row address (block indices, strides, row select) inside
    the key-tile loop next to each store; ``row_at(pinned, gOwn.layout)`` rebuilds the view.
    """
    return _opaque_i64(gOwn.iterator.toint())


def row_at(addr: Int64, layout) -> cute.Tensor:
    """fp32 global view with ``layout`` at ``addr`` (from ``pin_row``)."""
    ptr = cute.make_ptr(Float32, addr, cute.AddressSpace.gmem, assumed_align=4)
    return cute.make_tensor(ptr, layout)


@cute.jit
def store_owned(gOwn: cute.Tensor, owned: cute.Tensor, block: Int32, limit: Int32, scale: Float32 | None):
    """``gOwn[block + k] = owned[k] * scale`` for ``block + k < limit`` (see module docstring)."""
    for k in cutlass.range_constexpr(cute.size(owned)):
        if block + k < limit:
            val = owned[k]
            if const_expr(scale is not None):
                val = val * scale
            gOwn[block + k] = val


@cute.jit
def visited_block_range(shape: cutlass.Constexpr, n_tile_min: Int32, n_tile_max: Int32):
    """Blocks covered by key tiles [n_tile_min, n_tile_max): (block_lo, block_hi), empty if lo >= hi."""
    if const_expr(shape.tiles_per_block == 1):
        return n_tile_min * shape.blocks_per_tile, n_tile_max * shape.blocks_per_tile
    else:
        return n_tile_min // shape.tiles_per_block, (n_tile_max + shape.tiles_per_block - 1) // shape.tiles_per_block


FILL_VEC = 4  # fp32 per vector store of fill_unvisited (16 bytes)


@cute.jit
def _unvisited_bounds(nb: Int32, block_lo: Int32, block_hi: Int32):
    """(lo, hi): the unvisited blocks of a row are [0, lo) and [hi, nb); the whole row when no tile was
    visited (block_lo >= block_hi)."""
    lo = cutlass.min(block_lo, nb)
    hi = cutlass.max(block_hi, lo)
    if block_lo >= block_hi:
        lo = nb
        hi = nb
    return lo, hi


@cute.jit
def fill_unvisited(gRows: cute.Tensor, num_rows: Int32, nb: Int32, block_lo: Int32, block_hi: Int32,
                   thread: Int32, num_threads: cutlass.Constexpr):
    """-inf into blocks [0, block_lo) and [block_hi, nb) of rows [0, num_rows) of ``gRows`` (rows, nb).

    With no visited tile (block_lo >= block_hi) the whole row is filled. See Note [filling unvisited
    blocks].
    """
    lo, hi = _unvisited_bounds(nb, block_lo, block_hi)
    # 16-byte stores need 16-byte aligned rows: a 16-byte aligned buffer and a row stride that keeps it.
    vec_ok = (gRows.iterator.toint() % (4 * FILL_VEC) == 0) and (gRows.stride[0] % FILL_VEC == 0)
    _fill_columns(gRows, num_rows, Int32(0), lo, vec_ok, thread, num_threads)
    _fill_columns(gRows, num_rows, hi, nb, vec_ok, thread, num_threads)


@cute.jit
def fill_unvisited_by_row(gRows: cute.Tensor, num_rows: Int32, nb: Int32, block_lo: Int32, block_hi: Int32,
                          thread: Int32, num_threads: cutlass.Constexpr, warp_size: cutlass.Constexpr = 32):
    """``fill_unvisited`` with the fewest live registers: one row per warp at a time, one column per lane,
    scalar stores. For callers at their register limit (the SM100 softmax warpgroup, where the flat
    walk's extra loop state spills at head_dim 256); more instructions per stored value."""
    num_warps = num_threads // warp_size
    warp = thread // warp_size
    lane = thread % warp_size
    lo, hi = _unvisited_bounds(nb, block_lo, block_hi)
    for r in cutlass.range(warp, num_rows, num_warps, unroll=1):
        for c in cutlass.range(lane, lo, warp_size, unroll=1):
            gRows[r, c] = -Float32.inf
        for c in cutlass.range(hi + lane, nb, warp_size, unroll=1):
            gRows[r, c] = -Float32.inf


# Note [filling unvisited blocks]: the unvisited blocks of a work tile are one or two column ranges
# shared by all its rows (causal future, left of a window), often most of a row for the light query
# tiles of a causal pass. They are walked as ONE flat sequence of (row, group of FILL_VEC columns) items,
# groups aligned to absolute column multiples of FILL_VEC, handed round-robin to the threads: a
# thread's next item is ``num_threads`` further, i.e. (row + dr, group + dg) with a wrap, so the walk
# costs two divisions per range and a few integer ops per item, not a loop per row. A group wholly
# inside the range is one 16-byte store when rows are 16-byte aligned, otherwise (range edges, or
# unaligned rows) up to FILL_VEC predicated scalar stores. Consecutive threads take consecutive groups,
# so a warp writes whole rows contiguously. (The per-row loop, ``fill_unvisited_by_row``, costs ~25
# instructions per row; on the SM90 fill warps that was about 2 % of the short causal passes on the H200.
# It stays for the SM100 softmax warpgroup, where the flat walk's loop state spills at head_dim 256.)
@cute.jit
def _fill_columns(gRows: cute.Tensor, num_rows: Int32, c_begin: Int32, c_end: Int32, vec_ok,
                  thread: Int32, num_threads: cutlass.Constexpr):
    """-inf into rows [0, num_rows) x columns [c_begin, c_end) of ``gRows`` (Note [filling unvisited blocks])."""
    if c_begin < c_end and num_rows > 0:
        g_lo = c_begin // FILL_VEC
        groups = (c_end + FILL_VEC - 1) // FILL_VEC - g_lo
        dr = num_threads // groups
        dg = num_threads - dr * groups
        row = thread // groups
        grp = thread - row * groups
        ninf = cute.make_rmem_tensor((FILL_VEC,), Float32)
        ninf.fill(-Float32.inf)
        for _ in cutlass.range(thread, num_rows * groups, num_threads, unroll=1):
            c = (g_lo + grp) * FILL_VEC
            if vec_ok and c >= c_begin and c + FILL_VEC <= c_end:
                dst = cute.make_ptr(Float32, (gRows.iterator + cute.crd2idx((row, c), gRows.layout)).toint(),
                                    cute.AddressSpace.gmem, assumed_align=4 * FILL_VEC)
                cute.autovec_copy(ninf, cute.make_tensor(dst, cute.make_layout(FILL_VEC)))
            else:
                for j in cutlass.range_constexpr(FILL_VEC):
                    if c + j >= c_begin and c + j < c_end:
                        gRows[row, c + j] = -Float32.inf
            grp = grp + dg
            row = row + dr
            if grp >= groups:
                grp = grp - groups
                row = row + 1


# ---------------------------------------------------------------------------------------------
# Document-relative blocks (``block_bos``)
#
# With ``block_bos`` (int32 [B, Sq], each query row's document start ``bos_i``) key ``c`` of row ``i``
# lies in block ``floor((c - bos_i) / block_size)``; keys ``c < bos_i`` lie in no block. The block grid
# of a row is shifted by ``bos_i mod block_size``, so it no longer follows the key tiles: a tile of
# ``tile_n`` keys starting at ``n0`` meets, in each row, the ``candidates`` = blocks_per_tile + 1
# relative blocks ``k_lo + i`` (``k_lo = floor((n0 - bos) / bs)``, ``off = n0 - bos - k_lo * bs`` in
# [0, bs)). Tile column ``col`` lies in candidate ``(off + col) // bs``; since ``off < bs`` that is
# ``col // bs`` or ``col // bs + 1`` (``col // bs`` is 0 for every column when bs > tile_n), so each S
# entry is split once by one compare into a "lower" and an "upper" value (-inf in the other).
#
# Per tile and row: the lanes' partial maxima per candidate (``partial_relative_block_max``), all-reduced
# across the row's lanes (``allreduce_relative_blocks``), then ``store_relative_blocks`` by one lane: candidate ``i`` (block ``k = k_lo + i``) holds
# keys of this tile iff ``i * bs < tile_n + off``; it is finished iff its first key ``n0 - off + i * bs``
# is in this tile (``i * bs >= off``) or this is the last visited tile (tiles are visited in descending
# order, consecutively: the callers disable FlashMask's gap skip with block_logit). The unfinished one
# (``i = 0``, ``off > 0``) is carried to the next (lower) tile, where it is the candidate with the same
# block id. Visited blocks are therefore each stored exactly once, by plain stores; the blocks no visited
# tile meets (a per-row range, since it depends on bos_i) get -inf from ``fill_unvisited_relative``.
# This path costs two selects per S entry plus an all-reduce per candidate and row: simple, not tuned.

_BIG = 1 << 30  # a multiple of every block size: floor division of (possibly negative) x by bs as (x + _BIG) // bs


class RelativeBlockShape:
    """Compile-time facts of the document-relative block_logit path (see the section comment)."""

    def __init__(self, tile_n: int, block_size: int, threads_per_row: int):
        if block_size % 8 != 0 or block_size & (block_size - 1):
            raise ValueError(f"block_logit: block_size must be a power of two >= 8, got {block_size}")
        if tile_n % block_size != 0 and block_size % tile_n != 0:
            raise ValueError(f"block_logit: block_size {block_size} would straddle key tiles of {tile_n}")
        self.tile_n = tile_n
        self.block_size = block_size
        self.threads_per_row = threads_per_row
        self.candidates = max(1, tile_n // block_size) + 1


@cute.jit
def relative_origin(block_size: cutlass.Constexpr, n0: Int32, bos: Int32):
    """(k_lo, off): the relative block of key ``n0`` for origin ``bos`` (floor division, also for
    n0 < bos) and ``n0``'s offset in it, in [0, block_size)."""
    x = n0 - bos + _BIG
    k_lo = x // block_size - _BIG // block_size
    off = x - (x // block_size) * block_size
    return k_lo, off


@cute.jit
def partial_relative_block_max(shape: cutlass.Constexpr, acc_mn: cute.Tensor, cols: cutlass.Constexpr,
                               thr_col: Int32, r: cutlass.Constexpr, off: Int32) -> cute.Tensor:
    """(candidates,) fp32: this thread's max per candidate block of register row ``r`` of an S tile.

    ``cols``: the compile-time tile column of each register column for a thread whose column offset is 0,
    ``thr_col`` this thread's offset (< 8), ``off`` the row's offset from ``relative_origin``. Each entry
    is folded into its two possible candidates at once (a running max per candidate, so no per-entry
    temporaries stay live next to the S tile). One row at a time keeps a kernel's live registers at
    ``candidates`` (block_size 16 with 128-key tiles: 9).
    """
    bs = shape.block_size
    blk = cute.make_rmem_tensor((shape.candidates,), Float32)
    blk.fill(-Float32.inf)
    t = off + thr_col
    for c in cutlass.range_constexpr(len(cols)):
        base = cols[c] // bs
        # column cols[c] + thr_col lies in candidate base + 1 iff cols[c] + t >= (base + 1) * bs
        up = t >= (base + 1) * bs - cols[c]
        v = acc_mn[r, c]
        blk[base] = cute.arch.fmax(blk[base], -Float32.inf if up else v)
        blk[base + 1] = cute.arch.fmax(blk[base + 1], v if up else -Float32.inf)
    return blk


@cute.jit
def allreduce_relative_blocks(shape: cutlass.Constexpr, blk: cute.Tensor):
    """All-reduce every candidate maximum of ``blk`` (candidates,) across the ``threads_per_row`` lanes
    sharing the row."""
    for i in cutlass.range_constexpr(shape.candidates):
        blk[i] = row_allreduce(blk[i], shape.threads_per_row, cute.arch.fmax)


@cute.jit
def _store_scaled(gRow: cute.Tensor, k: Int32, v: Float32, scale: Float32 | None):
    if const_expr(scale is not None):
        gRow[k] = v * scale
    else:
        gRow[k] = v


@cute.jit
def store_relative_blocks(shape: cutlass.Constexpr, vals: cute.Tensor, gRow: cute.Tensor, k_lo: Int32,
                          off: Int32, limit: Int32, last_tile: Boolean, carry_val: cute.Tensor,
                          carry_id: cute.Tensor, slot: cutlass.Constexpr, scale: Float32 | None):
    """One row's finished candidate blocks of a tile -> ``gRow[k]`` (plain stores, ``0 <= k < limit``;
    ``limit`` 0 for a lane that stores nothing for this row); the unfinished one into
    ``carry_val[slot]``/``carry_id[slot]`` (an Int32 rmem, -1 = nothing carried; fill both before the
    first tile). ``vals``: this row's (candidates,) all-reduced maxima; ``last_tile``: no lower tile
    will be visited."""
    bs = shape.block_size
    cid = carry_id[slot]
    cval = carry_val[slot]
    new_val = Float32(-Float32.inf)
    new_id = Int32(-1)
    for i in cutlass.range_constexpr(shape.candidates):
        k = k_lo + i
        v = vals[i]
        v = cute.arch.fmax(v, cval) if k == cid else v
        # Compile-time where it can be: candidates i >= 1 start inside the tile (i * bs >= bs > off) and are
        # finished; all but the last hold keys of the tile (i * bs <= tile_n - bs < tile_n + off).
        if const_expr(i == 0):
            finished = off == 0 or last_tile
            if k >= 0 and k < limit and finished:
                _store_scaled(gRow, k, v, scale)
            if not finished and k >= 0:
                new_val = v
                new_id = k
        elif const_expr(i == shape.candidates - 1):
            if i * bs < shape.tile_n + off and k >= 0 and k < limit:
                _store_scaled(gRow, k, v, scale)
        else:
            if k >= 0 and k < limit:
                _store_scaled(gRow, k, v, scale)
    carry_val[slot] = new_val
    carry_id[slot] = new_id


@cute.jit
def fill_unvisited_relative(gRows: cute.Tensor, gBos: cute.Tensor, num_rows: Int32, nb: Int32, key_lo: Int32,
                            key_hi: Int32, block_size: cutlass.Constexpr, thread: Int32,
                            num_threads: cutlass.Constexpr, warp_size: cutlass.Constexpr = 32):
    """-inf into the relative blocks of rows [0, num_rows) of ``gRows`` (rows, nb) that meet no key of the
    visited keys [key_lo, key_hi) (``gBos``: the rows' origins; key_lo >= key_hi: nothing visited, the
    whole row). Row r's visited blocks are [floor((key_lo - bos) / bs), ceil((key_hi - bos) / bs)) clamped
    to [0, nb): exactly the blocks ``store_relative_blocks`` writes. One row per warp, a column per lane."""
    num_warps = num_threads // warp_size
    warp = thread // warp_size
    lane = thread % warp_size
    for r in cutlass.range(warp, num_rows, num_warps, unroll=1):
        bos = gBos[r]
        lo_k, _off = relative_origin(block_size, key_lo, bos)
        hi_k, _off2 = relative_origin(block_size, key_hi + block_size - 1, bos)
        lo = cutlass.min(cutlass.max(lo_k, 0), nb)
        hi = cutlass.min(cutlass.max(hi_k, lo), nb)
        if key_lo >= key_hi:
            lo = nb
            hi = nb
        for c in cutlass.range(lane, lo, warp_size, unroll=1):
            gRows[r, c] = -Float32.inf
        for c in cutlass.range(hi + lane, nb, warp_size, unroll=1):
            gRows[r, c] = -Float32.inf


# ---------------------------------------------------------------------------------------------
# Document-relative blocks with one row per thread (the SM100 softmax: a thread holds its whole S row,
# register k = tile column k)
#
# Same rule as above (key ``c`` of row ``i`` in relative block ``floor((c - bos_i) / bs)``), a cheaper
# form for a thread that owns whole rows. Cut the tile into ``segments`` aligned segments of
# ``seg = min(bs, tile_n)`` columns. The row's block starts are ``bos_i + k * bs``; since a tile starts
# at a multiple of ``tile_n``, every segment holds at most one start, at the same column ``u`` of each
# segment: ``u_abs = (bos_i - n0) mod bs`` (bs <= tile_n: the start in every segment, u = u_abs; bs >
# tile_n: a start in this tile iff u_abs < tile_n, and u = min(u_abs, tile_n)). So each segment splits
# once, at the runtime column u, into a ``lower`` part (columns < u: the block that started further
# down) and an ``upper`` part (columns >= u: the block starting at u) -- per pair of S entries two
# compares, four selects and two three-input maxima; no per-entry block ids.
#
# Walking the segments from the top of the tile down (tiles are visited in descending order), the
# block starting in segment m is finished there: max(upper(m), the running ``cur``); then ``cur =
# lower(m)`` carries its predecessor down to the next segment or, from segment 0, to the next (lower)
# key tile (``carry``). ``row_relative_maxima`` does this while S is in registers; the finished blocks
# are stored later by ``store_relative_row`` (the SM100 softmax: after the row max is handed over, where
# the plain path stores its blocks; stored next to the split they spilled at block size 16 with softcap,
# and after P was written the row address, scheduled early, spilled at d 64 causal bs 256). With
# bs > tile_n a tile without a start folds all of itself into ``cur``. On the last visited tile the carried block
# is stored too, unless it is empty (u_abs == 0: the block containing the tile's first key starts
# exactly there and was stored already). Every block that meets the visited keys is so stored exactly
# once, by plain stores -- the same set ``fill_unvisited_relative`` leaves alone -- with no global
# reads. The integer part of a tile's plan is ``relative_tile_plan`` (plain operators: also evaluated
# on Python ints by tests/cpu/test_block_bos_row_plan.py, which replays the whole plan).


class RowRelativeShape:
    """Compile-time facts of the one-row-per-thread document-relative path (section comment)."""

    def __init__(self, tile_n: int, block_size: int):
        if block_size % 8 != 0 or block_size & (block_size - 1):
            raise ValueError(f"block_logit: block_size must be a power of two >= 8, got {block_size}")
        if tile_n & (tile_n - 1):
            raise ValueError(f"block_logit: tile_n must be a power of two, got {tile_n}")
        self.tile_n = tile_n
        self.block_size = block_size
        self.seg = min(block_size, tile_n)
        self.segments = tile_n // self.seg
        self.log2_block = block_size.bit_length() - 1


def relative_tile_plan(shape, n0, bos):
    """(u_abs, k_top) of the key tile starting at ``n0`` (a multiple of tile_n) for origin ``bos``:
    ``u_abs = (bos - n0) mod bs`` (the first block start at or above n0 is n0 + u_abs) and ``k_top``, the
    id of the block starting in the top segment (at n0 + tile_n - seg + u_abs; for bs > tile_n that may
    lie above the tile). Plain operators only, so it runs on DSL Int32 and on Python ints alike."""
    u_abs = (bos - n0) & (shape.block_size - 1)
    k_top = (n0 + (shape.tile_n - shape.seg) + u_abs - bos) >> shape.log2_block
    return u_abs, k_top


@cute.jit
def split_segment(row: cute.Tensor, first: cutlass.Constexpr, size: cutlass.Constexpr, u: Int32):
    """(lower, upper): the max of ``row[first + j]`` over j < u and over j >= u (-inf if empty)."""
    ninf = -Float32.inf
    lower = ninf
    upper = ninf
    for j in cutlass.range_constexpr(0, size, 2):
        a = row[first + j]
        b = row[first + j + 1]
        lo_a = j < u
        lo_b = j + 1 < u
        lower = fmax3(lower, a if lo_a else ninf, b if lo_b else ninf)
        upper = fmax3(upper, ninf if lo_a else a, ninf if lo_b else b)
    return lower, upper


@cute.jit
def _store_block(gRow: cute.Tensor, k: Int32, v: Float32, limit: Int32, scale: Float32 | None):
    """``gRow[k] = v * scale`` for 0 <= k < limit (scale None: v as it is)."""
    if k >= 0 and k < limit:
        _store_scaled(gRow, k, v, scale)


@cute.jit
def row_relative_maxima(shape: cutlass.Constexpr, row: cute.Tensor, n0: Int32, bos: Int32, carry: cute.Tensor):
    """One key tile of one row, first half (while S is in registers): ``row`` holds the tile_n masked scores
    (register k = column k), ``n0`` the tile's first key. Returns ``(finished, tile_max)``: ``finished``
    (segments,) fp32, entry i the block starting in segment ``segments - 1 - i`` (bs > tile_n: the one
    starting in the tile, if any), and the row's tile max (every column lies in exactly one part, so this is
    the plain row max); ``carry`` (1,) fp32 becomes the part below the lowest start, folded into what it
    carried from the tile above (-inf before a work tile's first key tile). ``store_relative_row`` stores."""
    u_abs, _k_top = relative_tile_plan(shape, n0, bos)
    wide = shape.block_size > shape.tile_n
    u = u_abs
    if const_expr(wide):
        u = cutlass.min(u_abs, Int32(shape.tile_n))
    finished = cute.make_rmem_tensor((shape.segments,), Float32)
    cur = carry[0]
    tile_max = -Float32.inf
    for i in cutlass.range_constexpr(shape.segments):
        m = shape.segments - 1 - i
        lower, upper = split_segment(row, m * shape.seg, shape.seg, u)
        tile_max = fmax3(tile_max, lower, upper)
        val = cute.arch.fmax(upper, cur)
        finished[i] = val
        if const_expr(wide):
            cur = lower if u_abs < shape.tile_n else cute.arch.fmax(val, lower)
        else:
            cur = lower
    carry[0] = cur
    return finished, tile_max


@cute.jit
def store_relative_row(shape: cutlass.Constexpr, finished: cute.Tensor, n0: Int32, bos: Int32, carry: cute.Tensor,
                       gRow: cute.Tensor, limit: Int32, last_tile: Boolean, scale: Float32 | None):
    """Second half (any time later in the same key step): the blocks of
    ``finished`` (``row_relative_maxima``) into ``gRow[k]`` for 0 <= k < ``limit`` (0 for a row past the
    sequence), and on the ``last_tile`` the carried block too (unless the tile's first key starts a block:
    it is empty), leaving ``carry`` -inf for the next work tile."""
    u_abs, k_top = relative_tile_plan(shape, n0, bos)
    if const_expr(shape.block_size > shape.tile_n):
        if u_abs < shape.tile_n:
            _store_block(gRow, k_top, finished[0], limit, scale)
    else:
        for i in cutlass.range_constexpr(shape.segments):
            _store_block(gRow, k_top - i, finished[i], limit, scale)
    if last_tile:
        if u_abs != 0:
            _store_block(gRow, k_top - shape.segments, carry[0], limit, scale)
        carry[0] = -Float32.inf
