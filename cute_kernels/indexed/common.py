"""Device helpers shared by the indexed-attention kernels (``@cute.jit`` only, no host logic).

Row-gathered copies: a CTA tile's rows come from arbitrary global rows (window query heads, or the
window's key union). The tiled copy is built for a dense ``(rows, D)`` tile; for each row the thread
owns we make a ``(D,)`` view at that row's global address and copy the thread's 16-byte chunks of it.
"""

from __future__ import annotations

import operator

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warp

from cute_kernels.common.utils import LN_2, LOG2_E, row_allreduce  # noqa: F401 - C.LOG2_E / C.LN_2 in the kernels

COPY_BITS = 128


def smem_layout(dtype, rows: int, cols: int, stages: int = 0):
    """Swizzled row-major ``(rows, cols)`` smem tile of 16-bit elements (conflict-free ldmatrix);
    ``(rows, cols, stages)`` when ``stages`` > 0."""
    k_tile = 64 if cols % 64 == 0 else 32
    atom = cute.make_composed_layout(cute.make_swizzle(3 if k_tile == 64 else 2, 3, 3), 0,
                                     cute.make_layout((8, k_tile), stride=(k_tile, 1)))
    if stages:
        return cute.tile_to_shape(atom, (rows, cols, stages), (0, 1, 2))
    return cute.tile_to_shape(atom, (rows, cols), (0, 1))


def transposed_view(s: cute.Tensor, rows: int, cols: int, stages: int = 0) -> cute.Tensor:
    """``(cols, rows[, stages])`` view of a ``(rows, cols[, stages])`` smem tile (B operand read
    with ldmatrix.trans)."""
    if stages:
        return cute.composition(s, cute.make_layout((cols, rows, stages), stride=(rows, 1, rows * cols)))
    return cute.composition(s, cute.make_layout((cols, rows), stride=(rows, 1)))


def gmem_copies(dtype, threads: int, cols: int):
    """(cp.async tiled copy, plain 128-bit tiled copy) with 16-byte chunks, row-major threads."""
    elems = COPY_BITS // dtype.width
    k_tile = 64 if cols % 64 == 0 else 32
    per_row = k_tile // elems
    thr = cute.make_layout((threads // per_row, per_row), stride=(per_row, 1))
    val = cute.make_layout((1, elems))
    g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dtype,
                              num_bits_per_copy=COPY_BITS)
    plain = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=COPY_BITS)
    return cute.make_tiled_copy_tv(g2s, thr, val), cute.make_tiled_copy_tv(plain, thr, val)


def mma_bf16(warps_m: int, warps_n: int):
    """Warp-level m16n8k16 bf16 MMA (mma.sync: runs on SM80+, compiles for sm_90a and sm_100a)."""
    return cute.make_tiled_mma(warp.MmaF16BF16Op(cutlass.BFloat16, Float32, (16, 8, 16)),
                               (warps_m, warps_n, 1),
                               permutation_mnk=(warps_m * 16, warps_n * 16, 16))


def ldmatrix_copies(tiled_mma):
    """(A, B, B-transposed) smem->register tiled copies for ``tiled_mma``."""
    a = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), cutlass.BFloat16)
    bt = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), cutlass.BFloat16)
    return (cute.make_tiled_copy_A(a, tiled_mma), cute.make_tiled_copy_B(a, tiled_mma),
            cute.make_tiled_copy_B(bt, tiled_mma))


@cute.jit
def row_ptr(mX: cute.Tensor, coord) -> cute.Pointer:
    """16-byte-aligned pointer to element ``coord`` of ``mX`` (the start of a row)."""
    p = mX.iterator + cute.crd2idx(coord, mX.layout)
    return cute.make_ptr(mX.element_type, p.toint(), cute.AddressSpace.gmem, assumed_align=16)


@cute.jit
def copy_row(tiled_copy: cute.TiledCopy, ptr: cute.Pointer, tXsX: cute.Tensor, tXcX: cute.Tensor,
             m: cutlass.Constexpr, cols: cutlass.Constexpr, to_gmem: cutlass.Constexpr = False):
    """Copy this thread's chunks of smem row-slot ``m`` from / to the global row at ``ptr``."""
    elems = COPY_BITS // 16
    gRow = cute.tiled_divide(cute.make_tensor(ptr, cute.make_layout((cols,))), (elems,))
    for k in cutlass.range_constexpr(cute.size(tXsX, mode=[2])):
        ki = tXcX[0, 0, k][1] // elems
        g = cute.make_tensor(gRow[None, ki].iterator, tXsX[None, m, k].layout)
        if cutlass.const_expr(to_gmem):
            cute.copy(tiled_copy, tXsX[None, m, k], g)
        else:
            cute.copy(tiled_copy, g, tXsX[None, m, k])


def mn_view(acc: cute.Tensor) -> cute.Tensor:
    """``(rows, cols)`` view of an m16n8 accumulator ``((2, 2), MMA_M, MMA_N)``."""
    l = cute.make_layout(acc.layout.shape)
    mn = cute.make_layout(((l.shape[0][1], l.shape[1]), (l.shape[0][0], l.shape[2])),
                          stride=((l.stride[0][1], l.stride[1]), (l.stride[0][0], l.stride[2])))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


def as_a_operand(r: cute.Tensor) -> cute.Tensor:
    """View an m16n8 accumulator-shaped bf16 fragment as the A operand of an m16n8k16 MMA."""
    d = cute.logical_divide(r.layout, (None, None, 2))
    view = cute.make_layout(((d.shape[0], d.shape[2][0]), d.shape[1], d.shape[2][1]),
                            stride=((d.stride[0], d.stride[2][0]), d.stride[1], d.stride[2][1]))
    return cute.make_tensor(r.iterator, view)


@cute.jit
def quad_max(v: Float32) -> Float32:
    return row_allreduce(v, 4, cute.arch.fmax)


@cute.jit
def quad_sum(v: Float32) -> Float32:
    return row_allreduce(v, 4, operator.add)


@cute.jit
def gemm_ss(tiled_mma, acc, tCrA, tCrB, copy_a, tCsA, tCrA_view, copy_b, tCsB, tCrB_view):
    """acc += A @ B with both operands streamed from smem one k-block at a time."""
    for k in cutlass.range_constexpr(cute.size(tCsA.shape[2])):
        cute.copy(copy_a, tCsA[None, None, k], tCrA_view[None, None, k])
        cute.copy(copy_b, tCsB[None, None, k], tCrB_view[None, None, k])
        cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)


@cute.jit
def gemm_rs(tiled_mma, acc, tCrA, tCrB, copy_b, tCsB, tCrB_view):
    """acc += A @ B with A already in registers (MMA A layout) and B streamed from smem."""
    for k in cutlass.range_constexpr(cute.size(tCsB.shape[2])):
        cute.copy(copy_b, tCsB[None, None, k], tCrB_view[None, None, k])
        cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)


@cute.jit
def selected(msk: Int32, qbit: Int32, wq: cutlass.Constexpr) -> cutlass.Boolean:
    """Whether window query ``qbit`` selects a key with query bitmask ``msk`` (rows past the window's
    WQ queries select nothing; the shift stays < 32 so it is always defined)."""
    return qbit < wq and ((msk >> cutlass.min(qbit, 31)) & 1) != 0


@cute.jit
def gather_window_rows(g2s: cute.TiledCopy, mQ: cute.Tensor, mdO: cute.Tensor, tQsQ: cute.Tensor,
                       tQsdO: cute.Tensor, tQcQ: cute.Tensor, rows_valid: Int32, group: cutlass.Constexpr,
                       cols: cutlass.Constexpr, h: Int32, b: Int32, q0: Int32):
    """cp.async a window's Q and dO rows into one stage (``tQsQ`` / ``tQsdO``: this thread's
    ``(CPY, M, K)`` slots): row r is query ``q0 + r // group``, head ``h * group + r % group``. Rows
    past ``rows_valid`` are written as zeros."""
    for m in cutlass.range_constexpr(cute.size(tQsQ, mode=[1])):
        r = tQcQ[0, m, 0][0]
        if r < rows_valid:
            qi = r // group
            hq = h * group + r - qi * group
            copy_row(g2s, row_ptr(mQ, (b, q0 + qi, hq, 0)), tQsQ, tQcQ, m, cols)
            copy_row(g2s, row_ptr(mdO, (b, q0 + qi, hq, 0)), tQsdO, tQcQ, m, cols)
        else:
            tQsQ[None, m, None].fill(0)
            tQsdO[None, m, None].fill(0)


@cute.jit
def gather_key_rows(g2s: cute.TiledCopy, mK: cute.Tensor, mV: cute.Tensor, tKsK: cute.Tensor, tKsV: cute.Tensor,
                    tKcK: cute.Tensor, t0: Int32, kv_len: Int32, cols: cutlass.Constexpr, h: Int32, b: Int32):
    """cp.async the K and V rows of keys t0 + i (i: this thread's ``tKcK`` rows) of kv head ``h``;
    rows of keys >= ``kv_len`` are written as zeros."""
    for m in cutlass.range_constexpr(cute.size(tKsK, mode=[1])):
        key = t0 + tKcK[0, m, 0][0]
        if key < kv_len:
            copy_row(g2s, row_ptr(mK, (b, key, h, 0)), tKsK, tKcK, m, cols)
            copy_row(g2s, row_ptr(mV, (b, key, h, 0)), tKsV, tKcK, m, cols)
        else:
            tKsK[None, m, None].fill(0)
            tKsV[None, m, None].fill(0)


@cute.jit
def window_row_stats(mLSE: cute.Tensor, mDelta: cute.Tensor, r: Int32, rows_valid: Int32,
                     group: cutlass.Constexpr, h: Int32, b: Int32, q0: Int32):
    """(LSE in log2 units, delta) of window row ``r`` (as in ``gather_window_rows``); (0, 0) past
    ``rows_valid``, and LSE 0 for a row without keys (-inf: it selects nothing, its P is 0)."""
    lse2 = Float32(0.0)
    delta = Float32(0.0)
    if r < rows_valid:
        qi = r // group
        hq = h * group + r - qi * group
        lse = mLSE[b, hq, q0 + qi]
        if lse != -Float32.inf:
            lse2 = lse * LOG2_E
        delta = mDelta[b, hq, q0 + qi]
    return lse2, delta
