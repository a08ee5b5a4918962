"""Combine of the decode kernel's split partials, in split order (bitwise repeatable).

    lse   = log(sum_s exp(lse_s))                         (-inf when every split is empty)
    out   = sum_s exp(lse_s - lse) * o_s                   (0 for an empty row)

``o_part [S, B, Sq, Hq, D]`` fp32 (each split's output, normalised over its own keys; 0 where the
split saw no key), ``lse_part [S, B, Sq, Hq]`` fp32 (-inf where empty). A CTA of ``WARPS`` warps;
each output row (b, s, hq) gets ``warps_per_row(S)`` of them (1 up to 16 splits, then one more warp
per 16 splits, at most ``WARPS``), so a row's partials are loaded in one round of at most ``UNROLL``
splits a warp however many splits there are (one kv head over 128 SMs leaves few rows with many
splits each; one warp per row took 8 dependent rounds there). Lane ``i`` owns the ``D / 32``
contiguous elements at ``i * D / 32``. A warp's partials arrive through ``cp.async`` into its own
shared-memory stage (``stage_splits`` splits at once, each lane reading back only its own copies):
plain loads of 16 splits compiled to 34-42 registers, so ptxas had not kept them in flight together.
Every warp of a row computes the split weights over all S (lane i: splits i, i + 32, ...; max and sum
by butterfly, a fixed pattern; the same instructions on the same data, so the same weights) into its
own row of shared memory; warp ``p`` of the row sums the
weighted partials of its contiguous part of the splits in split order, and the row's first warp adds
the parts' sums in part order. The order depends on S alone: results are bitwise repeatable and
depend only on the inputs and the split count. At most ``MAX_SPLITS`` splits.

Launched as a programmatic dependent of the split kernel (``use_pdl``): its launch overlaps the split
kernel's tail, and ``griddepcontrol.wait`` at its start holds every thread until the split grid has
completed and its writes are visible (launched after anything else, the wait returns at once).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute

from cutlass import Float32, Int64

from cute_kernels.common.softmax import exp2_reference
from cute_kernels.common.utils import LN_2, LOG2_E, row_allreduce
from cute_kernels.dtypes import cutlass_dtype

from .ptx import cp_async_ca

WARPS = 8
MAX_SPLITS = 128  # config.MAX_SPLITS: the launcher never passes more partials
UNROLL = 16


def warps_per_row(num_splits: int) -> int:
    """Warps that combine one row: one per ``UNROLL`` splits, 1..``WARPS`` (the kernel derives it the same way)."""
    return max(1, min(WARPS, -(-min(num_splits, MAX_SPLITS) // UNROLL)))


def stage_splits(head_dim: int) -> int:
    """Splits a warp stages at once: UNROLL (8 at d 256, which would need 16 KB a warp)."""
    return UNROLL if head_dim <= 128 else UNROLL // 2


def smem_bytes(head_dim: int) -> int:
    """The split weights (a row of MAX_SPLITS per warp) and each warp's stage of partials (its part's sum is
    written over the stage's first row)."""
    return 4 * WARPS * (MAX_SPLITS + stage_splits(head_dim) * head_dim)


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
        n = cutlass.min(mLp.shape[0], MAX_SPLITS)
        wpr = cutlass.max(cutlass.min((n + UNROLL - 1) // UNROLL, WARPS), 1)  # warps_per_row
        rpc = WARPS // wpr  # rows per CTA
        # programmatic dependent launch: the combine's CTAs are launched while the split kernel drains
        # (it signals after its key loop) and wait in griddepcontrol.wait until its partials are written
        self.kernel(mOp, mLp, mO, mLse).launch(grid=[(rows + rpc - 1) // rpc, 1, 1],
                                               block=[32 * WARPS, 1, 1], stream=stream, use_pdl=self.cfg.pdl)

    @cute.kernel
    def kernel(self, mOp: cute.Tensor, mLp: cute.Tensor, mO: cute.Tensor, mLse: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = tidx // 32
        if cutlass.const_expr(self.cfg.pdl):
            cute.arch.griddepcontrol_wait()  # the split kernel's partials are complete and visible past this
        smem = cutlass.memory.SmemAllocator()
        sW = smem.allocate_tensor(Float32, cute.make_layout((WARPS, MAX_SPLITS), stride=(MAX_SPLITS, 1)),
                                  byte_alignment=16)
        d = self.cfg.head_dim
        ns = stage_splits(d)
        # warp w's stage: ns splits x D fp32, lane i's D / 32 at [u, i * D / 32]
        sStage = smem.allocate_tensor(Float32, cute.make_layout((WARPS, ns, d), stride=(ns * d, d, 1)),
                                      byte_alignment=16)
        n = cutlass.min(mLp.shape[0], MAX_SPLITS)
        wpr = cutlass.max(cutlass.min((n + UNROLL - 1) // UNROLL, WARPS), 1)  # as in __call__ / warps_per_row
        rpc = WARPS // wpr
        part = warp % wpr
        row = bidx * rpc + warp // wpr
        sq = mO.shape[1]
        hq = mO.shape[2]
        rows = mO.shape[0] * sq * hq
        active = warp // wpr < rpc and row < rows
        h = row % hq
        bs = row // hq
        s = bs % sq
        b = bs // sq
        d0 = lane * self.vec
        tot = Float32(0.0)
        m_ref = Float32(0.0)
        acc = cute.make_rmem_tensor(cute.make_layout(self.vec), Float32)
        acc.fill(0.0)
        if active:
            # lane-parallel split weights (lane i: splits i, i + 32, ...), into this warp's row of shared memory
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
            for k in cutlass.range_constexpr(MAX_SPLITS // 32):
                w = cute.math.exp2((lse[k] - m_ref) * LOG2_E, fastmath=True)
                sW[warp, lane + 32 * k] = w
                tot = tot + w
            tot = row_allreduce(tot, 32, operator.add)  # butterfly: a fixed order
            cute.arch.sync_warp()
            # this warp's contiguous part of the splits, summed in split order
            chunk = (n + wpr - 1) // wpr
            lo = part * chunk
            hi = cutlass.min(n, lo + chunk)
            # partials are contiguous fp32 [S, B, Sq, Hq, D] (the launcher allocates them): element offsets
            row_off = ((Int64(b) * sq + s) * hq + h) * self.cfg.head_dim + d0
            split_stride = Int64(mOp.shape[1]) * mOp.shape[2] * mOp.shape[3] * self.cfg.head_dim
            g_base = mOp.iterator.toint()
            s_base = sStage.iterator.toint() + (warp * ns * self.cfg.head_dim + d0) * 4
            nbytes = min(16, self.vec * 4)
            for base in cutlass.range(lo, hi, ns, unroll=1):
                # every copy of ns splits issued before the first multiply-add (one memory round trip per
                # ns splits); each lane waits for its own copies and reads back only those, so no warp barrier.
                # The slot tests are warp-uniform (a warp's lanes share one row and part): a slot past the part
                # is neither copied nor added (its stage entry may hold anything, NaN included).
                for u in cutlass.range_constexpr(ns):
                    if base + u < hi:
                        g = g_base + (Int64(base + u) * split_stride + row_off) * 4
                        for c in cutlass.range_constexpr(self.vec * 4 // nbytes):
                            cp_async_ca(s_base + (u * self.cfg.head_dim) * 4 + c * nbytes, g + c * nbytes, nbytes)
                cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(0)
                for u in cutlass.range_constexpr(ns):
                    if base + u < hi:
                        w = sW[warp, base + u]
                        for v in cutlass.range_constexpr(self.vec):
                            acc[v] = acc[v] + w * sStage[warp, u, d0 + v]
            for v in cutlass.range_constexpr(self.vec):
                sStage[warp, 0, d0 + v] = acc[v]
        cute.arch.sync_threads()
        if active and part == 0:
            if wpr > 1:  # the parts' sums in part order (part 0's own included, from shared memory like the rest)
                for v in cutlass.range_constexpr(self.vec):
                    acc[v] = Float32(0.0)
                for p in cutlass.range(wpr, unroll=1):
                    for v in cutlass.range_constexpr(self.vec):
                        acc[v] = acc[v] + sStage[warp + p, 0, d0 + v]
            empty = tot == 0.0 or tot != tot
            inv = Float32(0.0) if empty else 1.0 / tot
            for v in cutlass.range_constexpr(self.vec):
                mO[b, s, h, d0 + v] = (acc[v] * inv).to(self.dtype)
            if lane == 0:
                mLse[b, h, s] = -Float32.inf if empty else (m_ref * LOG2_E + cute.math.log2(tot, fastmath=True)) * LN_2
