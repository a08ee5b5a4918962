"""Combine of the decode kernel's split partials, in split order (bitwise repeatable).

    lse   = log(sum_s exp(lse_s))                         (-inf when every split is empty)
    out   = sum_s exp(lse_s - lse) * o_s                   (0 for an empty row)

``o_part [S, B, Sq, Hq, D]`` fp32 (each split's output, normalised over its own keys; 0 where the
split saw no key), ``lse_part [S, B, Sq, Hq]`` fp32 (-inf where empty). One warp per output row
(b, s, hq); lane ``i`` owns the ``D / 32`` contiguous elements at ``i * D / 32``. The split weights are
computed lane-parallel (lane i: splits i, i + 32, ...; max and sum by butterfly, a fixed pattern) and
staged in shared memory; the weighted sum of the partials runs over s = 0, 1, ... in that order, the
loads of 16 splits issued together before their multiply-adds. At most ``MAX_SPLITS`` splits.

Launched as a programmatic dependent of the split kernel (``use_pdl``): its launch overlaps the split
kernel's tail, and ``griddepcontrol.wait`` at its start holds every thread until the split grid has
completed and its writes are visible (launched after anything else, the wait returns at once).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute

from cutlass import Float32

from cute_kernels.common.softmax import exp2_reference
from cute_kernels.common.utils import LN_2, LOG2_E, row_allreduce
from cute_kernels.dtypes import cutlass_dtype

WARPS = 4
MAX_SPLITS = 128  # config.MAX_SPLITS: the launcher never passes more partials
UNROLL = 16


@dataclass(frozen=True)
class CombineConfig:
    arch: int
    dtype: str = "bfloat16"
    head_dim: int = 128
    pdl: bool = True  # launched as a programmatic dependent of the split kernel (False: an A/B baseline)


class DecodeCombine:
    def __init__(self, cfg: CombineConfig):
        self.cfg = cfg
        self.dtype = cutlass_dtype(cfg.dtype)
        self.vec = cfg.head_dim // 32

    @cute.jit
    def __call__(self, mOp: cute.Tensor, mLp: cute.Tensor, mO: cute.Tensor, mLse: cute.Tensor, stream):
        rows = mO.shape[0] * mO.shape[1] * mO.shape[2]
        # programmatic dependent launch: the combine's CTAs are launched while the split kernel drains
        # (it signals after its key loop) and wait in griddepcontrol.wait until its partials are written
        self.kernel(mOp, mLp, mO, mLse).launch(grid=[(rows + WARPS - 1) // WARPS, 1, 1],
                                               block=[32 * WARPS, 1, 1], stream=stream, use_pdl=self.cfg.pdl)

    @cute.kernel
    def kernel(self, mOp: cute.Tensor, mLp: cute.Tensor, mO: cute.Tensor, mLse: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        if cutlass.const_expr(self.cfg.pdl):
            cute.arch.griddepcontrol_wait()  # the split kernel's partials are complete and visible past this
        smem = cutlass.memory.SmemAllocator()
        sW = smem.allocate_tensor(Float32, cute.make_layout((WARPS, MAX_SPLITS), stride=(MAX_SPLITS, 1)),
                                  byte_alignment=16)
        row = bidx * WARPS + tidx // 32
        sq = mO.shape[1]
        hq = mO.shape[2]
        rows = mO.shape[0] * sq * hq
        if row < rows:
            h = row % hq
            bs = row // hq
            s = bs % sq
            b = bs // sq
            n = cutlass.min(mLp.shape[0], MAX_SPLITS)
            warp = tidx // 32
            # lane-parallel split weights (lane i: splits i, i + 32, ...), into shared memory
            lse = cute.make_rmem_tensor(cute.make_layout(MAX_SPLITS // 32), Float32)
            lse.fill(-Float32.inf)
            for k in cutlass.range_constexpr(MAX_SPLITS // 32):
                if lane + 32 * k < n:
                    lse[k] = mLp[lane + 32 * k, b, s, h]
            mx = lse[0]
            for k in cutlass.range_constexpr(1, MAX_SPLITS // 32):
                mx = cute.arch.fmax(mx, lse[k])
            mx = row_allreduce(mx, 32, cute.arch.fmax)
            m_ref = exp2_reference(mx)
            tot = Float32(0.0)
            for k in cutlass.range_constexpr(MAX_SPLITS // 32):
                w = cute.math.exp2((lse[k] - m_ref) * LOG2_E, fastmath=True)
                sW[warp, lane + 32 * k] = w
                tot = tot + w
            tot = row_allreduce(tot, 32, operator.add)  # butterfly: a fixed order
            cute.arch.sync_warp()
            acc = cute.make_rmem_tensor(cute.make_layout(self.vec), Float32)
            acc.fill(0.0)
            d0 = lane * self.vec
            vals = cute.make_rmem_tensor(cute.make_layout((UNROLL, self.vec)), Float32)
            for base in cutlass.range(0, n, UNROLL, unroll=1):
                # every load of UNROLL splits issued before the first multiply-add (one memory round trip per
                # UNROLL splits), then summed in split order
                for u in cutlass.range_constexpr(UNROLL):
                    sp = base + u
                    for v in cutlass.range_constexpr(self.vec):
                        vals[u, v] = Float32(0.0)
                    if sp < n:
                        for v in cutlass.range_constexpr(self.vec):
                            vals[u, v] = mOp[sp, b, s, h, d0 + v]
                for u in cutlass.range_constexpr(UNROLL):
                    sp = base + u
                    if sp < n:
                        w = sW[warp, sp]
                        for v in cutlass.range_constexpr(self.vec):
                            acc[v] = acc[v] + w * vals[u, v]
            empty = tot == 0.0 or tot != tot
            inv = Float32(0.0) if empty else 1.0 / tot
            for v in cutlass.range_constexpr(self.vec):
                mO[b, s, h, d0 + v] = (acc[v] * inv).to(self.dtype)
            if lane == 0:
                mLse[b, h, s] = -Float32.inf if empty else (m_ref * LOG2_E + cute.math.log2(tot, fastmath=True)) * LN_2

