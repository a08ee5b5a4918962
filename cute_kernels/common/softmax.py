"""Online softmax over a per-thread (rows, cols) view of S, in the log2 domain.

For each row: m = running max of the logits seen so far, l = running sum of exp2((s - m) * scale_log2),
O is rescaled by exp2((m_old - m_new) * scale_log2) whenever m grows. ``scale_log2`` is
``softmax_scale * log2(e)`` when S holds raw q.k, or ``log2(e)`` when S is already scaled (softcap).
A row whose logits are all -inf keeps m = -inf; exp2 uses 0 as its reference so P = 0, and finalize
gives O = 0 and lse = -inf for it.

The row max is taken per thread first (optionally supplied by the caller, e.g. from block_logit's
block maxima, which is bitwise the same value) and then across the ``threads_per_row`` lanes sharing
a row (butterfly shuffles). Row sums stay per thread until ``finalize``.
"""

from __future__ import annotations

import operator

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from .utils import LN_2, row_allreduce, tree_max, tree_sum


class OnlineSoftmax:
    """Running (max, sum) for ``num_rows`` rows per thread; rmem state, mutated in place."""

    def __init__(self, scale_log2: Float32, num_rows: int, threads_per_row: int):
        self.scale_log2 = scale_log2
        self.num_rows = num_rows
        self.threads_per_row = threads_per_row
        self.row_max = cute.make_rmem_tensor((num_rows,), Float32)
        self.row_sum = cute.make_rmem_tensor((num_rows,), Float32)

    def reset(self):
        self.row_max.fill(-Float32.inf)
        self.row_sum.fill(0.0)

    def _row_reduce_max(self, v: Float32) -> Float32:
        return row_allreduce(v, self.threads_per_row, cute.arch.fmax)

    @cute.jit
    def update(self, acc_mn: cute.Tensor, is_first: cutlass.Constexpr, local_max=None) -> cute.Tensor:
        """Exponentiate ``acc_mn`` in place (P, unnormalised) and return the per-row O rescale factor.

        ``local_max``: optional list (per row) of this thread's max over its columns of this tile.
        """
        row_scale = cute.make_rmem_tensor((self.num_rows,), Float32)
        ncols = cute.size(acc_mn, mode=[1])
        for r in cutlass.range_constexpr(self.num_rows):
            if const_expr(local_max is None):
                m_thr = tree_max([acc_mn[r, c] for c in range(ncols)])
            else:
                m_thr = local_max[r]
            if const_expr(not is_first):
                m_thr = cute.arch.fmax(m_thr, self.row_max[r])
            m_new = self._row_reduce_max(m_thr)
            m_old = self.row_max[r]
            self.row_max[r] = m_new
            m_ref = 0.0 if m_new == -Float32.inf else m_new
            m_ref_scaled = m_ref * self.scale_log2
            row = acc_mn[r, None].load()
            p = cute.math.exp2(row * self.scale_log2 - m_ref_scaled, fastmath=True)
            acc_mn[r, None].store(p)
            psum = tree_sum([acc_mn[r, c] for c in range(ncols)])
            if const_expr(is_first):
                row_scale[r] = 1.0
                self.row_sum[r] = psum
            else:
                scale = cute.math.exp2((m_old - m_ref) * self.scale_log2, fastmath=True)
                row_scale[r] = scale
                self.row_sum[r] = self.row_sum[r] * scale + psum
        return row_scale

    @cute.jit
    def finalize(self):
        """(O scale = 1/l per row, natural-log lse per row); empty rows give (1, -inf)."""
        row_scale = cute.make_rmem_tensor((self.num_rows,), Float32)
        lse = cute.make_rmem_tensor((self.num_rows,), Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            total = row_allreduce(self.row_sum[r], self.threads_per_row, operator.add)
            empty = total == 0.0 or total != total
            row_scale[r] = cute.arch.rcp_approx(1.0 if empty else total)
            lse[r] = (-Float32.inf if empty
                      else (self.row_max[r] * self.scale_log2 + cute.math.log2(total, fastmath=True)) * LN_2)
        return row_scale, lse

    @cute.jit
    def rescale(self, acc_o_mn: cute.Tensor, row_scale: cute.Tensor):
        for r in cutlass.range_constexpr(self.num_rows):
            acc_o_mn[r, None].store(acc_o_mn[r, None].load() * row_scale[r])
