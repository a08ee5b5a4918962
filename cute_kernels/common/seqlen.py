"""Per-(batch) sequence lengths and offsets, read once per work tile.

Fixed length: ``offset_q = offset_k = 0`` and the lengths are the tensors' static/dynamic extents.
Varlen (``cu_seqlens``): sequence b occupies rows ``[cu[b], cu[b + 1])`` of the packed tensors, and
every index the kernels produce (key blocks, masks) is relative to the sequence start.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr


@dataclass(frozen=True)
class SeqlenInfo:
    offset_q: Int32
    offset_k: Int32
    seqlen_q: Int32
    seqlen_k: Int32

    @staticmethod
    @cute.jit
    def create(batch_idx: Int32, seqlen_q_static, seqlen_k_static, mCuSeqlensQ, mCuSeqlensK):
        offset_q = Int32(0)
        offset_k = Int32(0)
        seqlen_q = Int32(seqlen_q_static)
        seqlen_k = Int32(seqlen_k_static)
        if const_expr(mCuSeqlensQ is not None):
            offset_q = mCuSeqlensQ[batch_idx]
            seqlen_q = mCuSeqlensQ[batch_idx + 1] - offset_q
        if const_expr(mCuSeqlensK is not None):
            offset_k = mCuSeqlensK[batch_idx]
            seqlen_k = mCuSeqlensK[batch_idx + 1] - offset_k
        return SeqlenInfo(offset_q, offset_k, seqlen_q, seqlen_k)
