"""Online softmax over a per-thread (rows, cols) view of S, in the log2 domain.

For each row: m = running max of the logits seen so far, l = running sum of exp2((s - m) * scale_log2),
O is rescaled by exp2((m_old - m_new) * scale_log2) whenever m grows. ``scale_log2`` is
``softmax_scale * log2(e)`` when S holds raw q.k, or ``log2(e)`` when S is already scaled (softcap).
A row whose logits are all -inf keeps m = -inf; exp2 uses 0 as its reference so P = 0, and finalize
gives O = 0 and lse = -inf for it.

The row max is taken per thread first (optionally supplied by the caller, e.g. from block_logit's
block maxima, which is bitwise the same value) and then across the ``threads_per_row`` lanes sharing
a row (butterfly shuffles). Row sums stay per thread until ``finalize``.

The row rules every arch uses (the SM100 forward keeps its state in its own registers and smem, but
takes these functions, so the H200 runs exercise them): ``softcap_logit`` (the logit with softcap),
``exp2_reference`` (the max exp2 subtracts, 0 for a row with no visible key), ``rescale_factor`` (the
O / row-sum rescale when the max moves), ``conditional_max`` (SM100: move the max only when it grew
by more than a threshold) and ``OnlineSoftmax.finalize`` (1 / row sum and lse; the empty-row rule).

Softcap tanh policy, one function for every arch, forward and backward (``softcap_logit``):
tanh(x) = 1 - 2 / (2^(2 x log2(e)) + 1) with ``ex2.approx`` and ``rcp.approx``: absolute error below
5e-7 for every x (tests/cpu/test_softcap_tanh.py from the instructions' error bounds; on a GPU,
tests/gpu/test_softcap_tanh.py), no branches, 2 MUFU + 4 FMA-pipe instructions and one temporary
per element. What matters is the absolute error, since softcap multiplies it into
the logit and P = exp(logit - lse) turns it into a relative error of P. Rejected: ``tanh.approx.f32``
(FA4's; one MUFU op, but an absolute error near 2^-11, i.e. up to 0.025 in the logit at softcap 50,
2.5 % in P, and in block_logit, which selects blocks); libdevice ``tanhf`` (exact, but ~14
instructions with both branch sides, which made the SM100 softmax warps spill). The backward
recomputes P from the forward's lse, so both directions must use this same function.
"""

from __future__ import annotations

import math
import operator

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from .utils import LN_2, row_allreduce, tree_max, tree_sum


_TWO_LOG2_E = 2.0 * math.log2(math.e)


def softcap_logit(s: Float32, softcap_in: Float32, softcap: Float32) -> Float32:
    """``softcap * tanh(s * softcap_in)``: with ``softcap_in = softmax_scale / softcap`` and raw
    ``s = q.k`` this is the scaled, capped logit (tanh per the policy above; +-1 at +-inf, NaN kept)."""
    e = cute.math.exp2(s * (softcap_in * _TWO_LOG2_E), fastmath=True)
    return (1.0 - 2.0 * cute.arch.rcp_approx(e + 1.0)) * softcap


@cute.jit
def exp2_reference(row_max: Float32) -> Float32:
    """The max that P = exp2((s - max) * scale_log2) subtracts: ``row_max``, or 0 while the row has
    seen no visible key (-inf), so P = exp2(-inf) = 0 instead of NaN."""
    return 0.0 if row_max == -Float32.inf else row_max


def rescale_factor(m_old: Float32, m_ref: Float32, scale_log2: Float32) -> Float32:
    """Factor for O and the row sum when the reference max moves from ``m_old`` to ``m_ref``
    (``exp2_reference`` of the new max): exp2((m_old - m_ref) * scale_log2); 0 from an empty row."""
    return cute.math.exp2((m_old - m_ref) * scale_log2, fastmath=True)


@cute.jit
def conditional_max(m_old: Float32, m_new: Float32, scale_log2: Float32, threshold_log2: cutlass.Constexpr):
    """(max to use, rescale factor) for a running max ``m_old`` and ``m_new = max(m_old, tile max)``:
    keep ``m_old`` (factor 1) unless the max grew by more than ``threshold_log2`` in log2 units of the
    scaled logit, so P stays <= 2^threshold and most tiles need no O rescale (FA4's conditional
    rescale). lse is formed from the max actually used, so the result is exact either way."""
    m_ref = exp2_reference(m_new)
    m_use = m_new
    scale = Float32(1.0)
    if (m_old - m_ref) * scale_log2 >= -threshold_log2:
        m_use = m_old
    else:
        scale = rescale_factor(m_old, m_ref, scale_log2)
    return m_use, scale


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
            m_ref = exp2_reference(m_new)
            m_ref_scaled = m_ref * self.scale_log2
            row = acc_mn[r, None].load()
            p = cute.math.exp2(row * self.scale_log2 - m_ref_scaled, fastmath=True)
            acc_mn[r, None].store(p)
            psum = tree_sum([acc_mn[r, c] for c in range(ncols)])
            if const_expr(is_first):
                row_scale[r] = 1.0
                self.row_sum[r] = psum
            else:
                scale = rescale_factor(m_old, m_ref, self.scale_log2)
                row_scale[r] = scale
                self.row_sum[r] = self.row_sum[r] * scale + psum
        return row_scale

    @cute.jit
    def finalize(self):
        """(O scale = 1/l per row, natural-log lse per row); empty rows (sum 0 or NaN) give (1, -inf),
        and their O, a sum of P = 0 terms, stays 0. The SM100 forward runs it on its one row too."""
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
