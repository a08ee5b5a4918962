"""Masks on a per-thread (rows, cols) view of an S tile: seqlen tail, bottom-right causal, window.

Row i (sequence-relative) keeps key t iff ``t < seqlen_k`` (when ``mask_seqlen``),
``t <= i + shift + right`` (when ``mask_right``) and ``t >= i + shift - left`` (when ``mask_left``),
with ``shift = seqlen_k - seqlen_q`` (bottom-right alignment) and (left, right) from
``tile_range.normalize_window``. Masked entries become -inf, so later reductions (row max, block_logit)
and exp2 ignore them.

``cols`` lists the compile-time column of each register column for the thread whose column offset is
0 (SM90: ``utils.sm90_thread0_cols``; SM100: ``range(tile_n)``); ``col_offset`` is this thread's
offset plus ``n_tile * tile_n``, so each compare is one runtime limit against a constant.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr


@cute.jit
def apply_mask(acc_mn: cute.Tensor, cols: cutlass.Constexpr, rows: list, col_offset: Int32,
               seqlen_k: Int32, shift: Int32, left: Int32, right: Int32,
               mask_seqlen: cutlass.Constexpr, mask_right: cutlass.Constexpr,
               mask_left: cutlass.Constexpr):
    """Set masked entries of ``acc_mn`` (rows[r] = sequence row of register row r) to -inf."""
    for r in cutlass.range_constexpr(len(rows)):
        limit_hi = seqlen_k - col_offset
        if const_expr(mask_right):
            right_hi = rows[r] + shift + right + 1 - col_offset
            if const_expr(mask_seqlen):
                limit_hi = cutlass.min(limit_hi, right_hi)
            else:
                limit_hi = right_hi
        limit_lo = Int32(0)
        if const_expr(mask_left):
            limit_lo = rows[r] + shift - left - col_offset
        for c in cutlass.range_constexpr(len(cols)):
            if const_expr(mask_left and (mask_right or mask_seqlen)):
                keep = cols[c] < limit_hi and cols[c] >= limit_lo
                acc_mn[r, c] = acc_mn[r, c] if keep else -Float32.inf
            elif const_expr(mask_left):
                acc_mn[r, c] = acc_mn[r, c] if cols[c] >= limit_lo else -Float32.inf
            elif const_expr(mask_right or mask_seqlen):
                acc_mn[r, c] = acc_mn[r, c] if cols[c] < limit_hi else -Float32.inf


@cute.jit
def apply_mask_kv_major(acc_mn: cute.Tensor, cols: cutlass.Constexpr, keys: list, col_offset: Int32,
                        seqlen_k: Int32, shift: Int32, left: Int32, right: Int32,
                        mask_right: cutlass.Constexpr, mask_left: cutlass.Constexpr,
                        fill: cutlass.Constexpr = float("-inf")):
    """The same rule on a transposed tile (the backward's S^T): register row r holds key keys[r], register
    column c query row cols[c] + col_offset. Key t is kept for rows i with t < seqlen_k and
    t - shift - right <= i (``mask_right``) and i <= t - shift + left (``mask_left``); else ``fill`` (-inf on
    scores; 0 on probabilities, which keeps P = 0 even where a row's lse is NaN)."""
    for r in cutlass.range_constexpr(len(keys)):
        key_ok = keys[r] < seqlen_k
        lo = Int32(0)
        hi = Int32(0)
        if const_expr(mask_right):
            lo = keys[r] - shift - right - col_offset
        if const_expr(mask_left):
            hi = keys[r] - shift + left - col_offset
        for c in cutlass.range_constexpr(len(cols)):
            keep = key_ok
            if const_expr(mask_right):
                keep = keep and cols[c] >= lo
            if const_expr(mask_left):
                keep = keep and cols[c] <= hi
            acc_mn[r, c] = acc_mn[r, c] if keep else Float32(fill)
