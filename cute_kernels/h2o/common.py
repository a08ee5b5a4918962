"""Device helpers shared by the H2O kernels (``@cute.jit`` only, no host logic).

Every H2O kernel reads rows of ``D`` contiguous elements (a key, a page summary, a query head). A
row is split over ``lanes_per_row`` consecutive lanes of a warp, each lane owning one 16-byte
vector (``vec`` elements); the partial results of a row are then combined with butterfly shuffles
inside that lane group. ``row_split(dtype_bytes, D)`` picks the split on the host.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

#: Finite stand-in for -inf in running maxima: exp2(m - M) stays 0 or 1, never NaN (-inf - -inf).
NEG_BIG = -3.0e38

WARP = 32


def row_split(dtype_bytes: int, head_dim: int) -> tuple[int, int] | None:
    """``(vec, lanes_per_row)`` for 16-byte vectors over a row of ``head_dim`` elements, or None.

    Needs ``head_dim`` a multiple of the vector and the lane count a power of two <= 32.
    """
    vec = 16 // dtype_bytes
    if head_dim % vec:
        return None
    lanes = head_dim // vec
    if lanes > WARP or lanes & (lanes - 1):
        return None
    return vec, lanes


@cute.jit
def load_vec_f32(row: cute.Tensor, lane: cutlass.Int32, vec: cutlass.Constexpr):
    """The ``lane``-th ``vec``-element slice of a contiguous 1-D row, as an fp32 register fragment.

    The row start is 16-byte aligned in every tensor we read (validated on the host), which the
    slice loses through its dynamic offset; ``align(16)`` restores it so one 16-byte load is issued.
    """
    tile = cute.local_tile(row, (vec,), (lane,))
    src = cute.make_tensor(tile.iterator.align(16), cute.make_layout(vec))
    raw = cute.make_rmem_tensor_like(src)
    cute.autovec_copy(src, raw)
    out = cute.make_rmem_tensor(cute.make_layout(vec), Float32)
    out.store(raw.load().to(Float32))
    return out


@cute.jit
def store_vec(row: cute.Tensor, lane: cutlass.Int32, vals: cute.Tensor, vec: cutlass.Constexpr):
    """Store an fp32 fragment of ``vec`` values into the ``lane``-th slice of ``row`` (its dtype)."""
    tile = cute.local_tile(row, (vec,), (lane,))
    dst = cute.make_tensor(tile.iterator.align(16), cute.make_layout(vec))
    tmp = cute.make_rmem_tensor_like(dst)
    tmp.store(vals.load().to(row.element_type))
    cute.autovec_copy(tmp, dst)


@cute.jit
def group_sum(x: Float32, lanes: cutlass.Constexpr) -> Float32:
    """Sum over a group of ``lanes`` consecutive lanes (every lane of the group gets the result)."""
    return cute.arch.warp_reduction_sum(x, threads_in_group=lanes)


@cute.jit
def combine_max_sum(m1: Float32, s1: Float32, m2: Float32, s2: Float32):
    """Merge two partial softmax normalisers in the log2 domain: ``(max, sum of exp2(x - max))``."""
    m = cute.arch.fmax(m1, m2)
    s = s1 * exp2(m1 - m) + s2 * exp2(m2 - m)
    return m, s


@cute.jit
def exp2(x: Float32) -> Float32:
    """2^x with the fast ``ex2.approx`` path (relative error ~2^-22, far below our tolerances)."""
    return cute.math.exp2(x, fastmath=True)


@cute.jit
def warp_max_sum(m: Float32, s: Float32):
    """``combine_max_sum`` over the 32 lanes of a warp (every lane gets the result)."""
    for i in cutlass.range_constexpr(5):
        offset = 16 >> i
        m_o = cute.arch.shuffle_sync_bfly(m, offset=offset)
        s_o = cute.arch.shuffle_sync_bfly(s, offset=offset)
        m, s = combine_max_sum(m, s, m_o, s_o)
    return m, s
