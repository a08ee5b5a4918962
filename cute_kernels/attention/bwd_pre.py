"""Attention backward preprocess (arch-neutral: plain loads / stores, compiles for sm_90a and sm_100a).

One CTA per (ACCUM_ROW_PAD = 128 accumulator rows, query head, batch), 256 threads. For each row i of
its block (sequence-relative; rows past seqlen_q are the padding of ``bwd_config``):

    dpsum[i]    = sum_d dO[i, d] * O[i, d]  (- dLSE[i] with ``has_dlse``)      0 for padding rows
    lse_log2[i] = LSE[i] * log2(e)                                            +inf for padding rows
                  and for rows without keys (LSE = -inf), so P = exp2(s log2e - lse_log2) = 0 there
    dq_accum[i, :] = 0,  and (``deterministic``) the block's dq_sem counters = 0
    (``group_split``) CTA (0, h, b), h < Hkv: dkv_sem[b, h, :] = 0

Shapes and the varlen row starts: ``bwd_config`` (module docstring, ``accum_row_start``).
A row's Dv elements are read by L adjacent lanes (L = Dv / 8 rounded down to a power of two,
each lane 1 or 3 16-byte chunks) and summed with butterfly shuffles.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from cute_kernels.common.utils import LOG2_E, row_allreduce
from cute_kernels.common.seqlen import SeqlenInfo
from cute_kernels.dtypes import cutlass_dtype

from .bwd_config import ACCUM_ROW_PAD, DQ_SEM_ROWS, BwdConfig, group_split

THREADS = 256
ROWS = ACCUM_ROW_PAD
VEC = 8  # 16-bit elements per 16-byte chunk


def lanes_per_row(dim: int) -> tuple[int, int]:
    """(L lanes per row, 16-byte chunks per lane) for a row of ``dim`` 16-bit elements."""
    chunks = dim // VEC
    lanes = 1 << int(math.log2(chunks))
    while chunks % lanes:
        lanes //= 2
    return lanes, chunks // lanes


def vec_ptr(mX: cute.Tensor, coord, align: int = 16):
    p = mX.iterator + cute.crd2idx(coord, mX.layout)
    return cute.make_ptr(mX.element_type, p.toint(), cute.AddressSpace.gmem, assumed_align=align)


def accum_row0(cfg_varlen: bool, mCuSeqlensQ, batch_idx):
    """First accumulator row of this batch's sequence (``bwd_config.accum_row_start``)."""
    if const_expr(cfg_varlen):
        return (mCuSeqlensQ[batch_idx] + ACCUM_ROW_PAD * batch_idx) // ACCUM_ROW_PAD * ACCUM_ROW_PAD
    return Int32(0)


class FlashBwdPre:
    def __init__(self, cfg: BwdConfig):
        self.cfg = cfg
        self.dtype = cutlass_dtype(cfg.dtype)
        self.lanes, self.chunks = lanes_per_row(cfg.head_dim_v)

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mdLSE, mLSElog2: cute.Tensor,
                 mdPsum: cute.Tensor, mdQaccum: cute.Tensor, mdQsem, mdKVsem, mCuSeqlensQ,
                 max_seqlen_q: Int32, stream):
        if const_expr(self.cfg.varlen):
            batch = mCuSeqlensQ.shape[0] - 1
            heads = mO.shape[1]
        else:
            batch = mO.shape[0]
            heads = mO.shape[2]
        grid = (cute.ceil_div(max_seqlen_q, ROWS), heads, batch)
        self.kernel(mO, mdO, mLSE, mdLSE, mLSElog2, mdPsum, mdQaccum, mdQsem, mdKVsem, mCuSeqlensQ,
                    max_seqlen_q).launch(grid=grid, block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mdLSE, mLSElog2: cute.Tensor,
               mdPsum: cute.Tensor, mdQaccum: cute.Tensor, mdQsem, mdKVsem, mCuSeqlensQ, max_seqlen_q: Int32):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        m_blk, h, b = cute.arch.block_idx()
        L = self.lanes
        seq = SeqlenInfo.create(b, mO.shape[1], 0, mCuSeqlensQ if const_expr(cfg.varlen) else None, None)
        offset_q, seqlen_q = seq.offset_q, seq.seqlen_q
        m_start = m_blk * ROWS
        if m_start < seqlen_q:
            row0 = accum_row0(cfg.varlen, mCuSeqlensQ, b) + m_start  # workspace row of local row 0
            if const_expr(cfg.varlen):
                ws_lse = mLSElog2[h, None]
                ws_dpsum = mdPsum[h, None]
            else:
                ws_lse = mLSElog2[b, h, None]
                ws_dpsum = mdPsum[b, h, None]
            copy16 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
            warp = tidx // 32
            lane = tidx % 32
            rows_per_pass = THREADS // L
            for p in cutlass.range_constexpr(ROWS // rows_per_pass):
                r = p * rows_per_pass + warp * (32 // L) + lane // L
                i = m_start + r
                acc = Float32(0.0)
                if i < seqlen_q:
                    for k in cutlass.range_constexpr(self.chunks):
                        col = (lane % L + k * L) * VEC
                        if const_expr(cfg.varlen):
                            coord = (offset_q + i, h, col)
                        else:
                            coord = (b, i, h, col)
                        ro = cute.make_rmem_tensor((VEC,), self.dtype)
                        rdo = cute.make_rmem_tensor((VEC,), self.dtype)
                        layout = cute.make_layout((VEC,))
                        cute.copy(copy16, cute.make_tensor(vec_ptr(mO, coord), layout), ro)
                        cute.copy(copy16, cute.make_tensor(vec_ptr(mdO, coord), layout), rdo)
                        prod = ro.load().to(Float32) * rdo.load().to(Float32)
                        for e in cutlass.range_constexpr(VEC):
                            acc = acc + prod[e]
                acc = row_allreduce(acc, L, lambda x, y: x + y)
                if lane % L == 0:
                    lse2 = Float32.inf
                    dps = Float32(0.0)
                    if i < seqlen_q:
                        if const_expr(cfg.varlen):
                            lse = mLSE[h, offset_q + i]
                        else:
                            lse = mLSE[b, h, i]
                        if lse != -Float32.inf:
                            lse2 = lse * LOG2_E
                        dps = acc
                        if const_expr(cfg.has_dlse):
                            if const_expr(cfg.varlen):
                                dps = dps - mdLSE[h, offset_q + i]
                            else:
                                dps = dps - mdLSE[b, h, i]
                    ws_lse[row0 + r] = lse2
                    ws_dpsum[row0 + r] = dps
            # Zero this block's dQ accumulator rows (ROWS x D contiguous fp32) with 16-byte stores.
            D = cfg.head_dim
            if const_expr(cfg.varlen):
                zbase = vec_ptr(mdQaccum, (h, row0, 0))
            else:
                zbase = vec_ptr(mdQaccum, (b, h, row0, 0))
            zflat = cute.make_tensor(zbase, cute.make_layout((4, ROWS * D // 4)))
            zero = cute.make_rmem_tensor((4,), Float32)
            zero.fill(0.0)
            copy16f = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
            for k in cutlass.range_constexpr(ROWS * D // 4 // THREADS):
                cute.copy(copy16f, zero, zflat[None, k * THREADS + tidx])
            if const_expr(cfg.deterministic):
                if tidx < ROWS // DQ_SEM_ROWS:
                    if const_expr(cfg.varlen):
                        mdQsem[h, row0 // DQ_SEM_ROWS + tidx] = Int32(0)
                    else:
                        mdQsem[b, h, row0 // DQ_SEM_ROWS + tidx] = Int32(0)
            if const_expr(group_split(cfg)):
                # The dK / dV turn counters of kv head h (a batch without queries has no main-kernel
                # CTA that waits on them: its key tiles have no steps).
                if m_blk == 0 and h < mdKVsem.shape[1]:
                    nt = mdKVsem.shape[2]
                    for j in cutlass.range((nt + THREADS - 1) // THREADS, unroll=1):
                        if j * THREADS + tidx < nt:
                            mdKVsem[b, h, j * THREADS + tidx] = Int32(0)
