"""Attention backward postprocess (arch-neutral): dQ = softmax_scale * dq_accum, in q's dtype.

One CTA per (ACCUM_ROW_PAD = 128 rows, query head, batch), 256 threads; dq_accum is the row-major
fp32 workspace of ``bwd_config`` (varlen: rows from ``accum_row_start``). Every row < seqlen_q of dQ
is written; a row's D elements are covered by L adjacent lanes (``bwd_pre.lanes_per_row``), one
8-element chunk (two 16-byte loads, one 16-byte store) at a time.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from cute_kernels.common.seqlen import SeqlenInfo
from cute_kernels.dtypes import cutlass_dtype

from .bwd_config import ACCUM_ROW_PAD, BwdConfig
from .bwd_pre import THREADS, VEC, accum_row0, lanes_per_row, vec_ptr

ROWS = ACCUM_ROW_PAD


class FlashBwdPost:
    def __init__(self, cfg: BwdConfig):
        self.cfg = cfg
        self.dtype = cutlass_dtype(cfg.dtype)
        self.lanes, self.chunks = lanes_per_row(cfg.head_dim)

    @cute.jit
    def __call__(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, mCuSeqlensQ, softmax_scale: Float32,
                 max_seqlen_q: Int32, stream):
        if const_expr(self.cfg.varlen):
            batch = mCuSeqlensQ.shape[0] - 1
            heads = mdQ.shape[1]
        else:
            batch = mdQ.shape[0]
            heads = mdQ.shape[2]
        grid = (cute.ceil_div(max_seqlen_q, ROWS), heads, batch)
        self.kernel(mdQaccum, mdQ, mCuSeqlensQ, softmax_scale).launch(
            grid=grid, block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, mCuSeqlensQ, softmax_scale: Float32):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        m_blk, h, b = cute.arch.block_idx()
        L = self.lanes
        seq = SeqlenInfo.create(b, mdQ.shape[1], 0, mCuSeqlensQ if const_expr(cfg.varlen) else None, None)
        offset_q, seqlen_q = seq.offset_q, seq.seqlen_q
        m_start = m_blk * ROWS
        if m_start < seqlen_q:
            row0 = accum_row0(cfg.varlen, mCuSeqlensQ, b) + m_start
            ld = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
            st = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
            warp = tidx // 32
            lane = tidx % 32
            rows_per_pass = THREADS // L
            layout = cute.make_layout((VEC,))
            for p in cutlass.range_constexpr(ROWS // rows_per_pass):
                r = p * rows_per_pass + warp * (32 // L) + lane // L
                i = m_start + r
                if i < seqlen_q:
                    for k in cutlass.range_constexpr(self.chunks):
                        col = (lane % L + k * L) * VEC
                        if const_expr(cfg.varlen):
                            src = vec_ptr(mdQaccum, (h, row0 + r, col))
                            dst = vec_ptr(mdQ, (offset_q + i, h, col))
                        else:
                            src = vec_ptr(mdQaccum, (b, h, row0 + r, col))
                            dst = vec_ptr(mdQ, (b, i, h, col))
                        acc = cute.make_rmem_tensor((VEC,), Float32)
                        cute.copy(ld, cute.make_tensor(src, layout), acc)
                        out = cute.make_rmem_tensor((VEC,), self.dtype)
                        out.store((acc.load() * softmax_scale).to(self.dtype))
                        cute.copy(st, out, cute.make_tensor(dst, layout))


class FlashBwdZeroKV:
    """dK = dV = 0 (every row < seqlen_k of every kv head): the backward of a call without queries, where
    the main kernel does not run. One CTA per (128 rows, kv head, batch), 16-byte stores."""

    def __init__(self, cfg: BwdConfig):
        self.cfg = cfg
        self.dtype = cutlass_dtype(cfg.dtype)

    @cute.jit
    def __call__(self, mdK: cute.Tensor, mdV: cute.Tensor, mCuSeqlensK, max_seqlen_k: Int32, stream):
        if const_expr(self.cfg.varlen):
            batch = mCuSeqlensK.shape[0] - 1
            heads = mdK.shape[1]
        else:
            batch = mdK.shape[0]
            heads = mdK.shape[2]
        grid = (cute.ceil_div(max_seqlen_k, ROWS), heads, batch)
        self.kernel(mdK, mdV, mCuSeqlensK).launch(grid=grid, block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mdK: cute.Tensor, mdV: cute.Tensor, mCuSeqlensK):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        m_blk, h, b = cute.arch.block_idx()
        if const_expr(cfg.varlen):
            offset = mCuSeqlensK[b]
            seqlen = mCuSeqlensK[b + 1] - offset
        else:
            offset = Int32(0)
            seqlen = mdK.shape[1]
        st = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        zero = cute.make_rmem_tensor((VEC,), self.dtype)
        zero.fill(0.0)
        layout = cute.make_layout((VEC,))
        for mX, dim in ((mdK, cfg.head_dim), (mdV, cfg.head_dim_v)):
            chunks = dim // VEC
            for k in cutlass.range_constexpr((ROWS * chunks + THREADS - 1) // THREADS):
                e = k * THREADS + tidx
                i = m_blk * ROWS + e // chunks
                if e < ROWS * chunks and i < seqlen:
                    col = (e % chunks) * VEC
                    if const_expr(cfg.varlen):
                        dst = vec_ptr(mX, (offset + i, h, col))
                    else:
                        dst = vec_ptr(mX, (b, i, h, col))
                    cute.copy(st, zero, cute.make_tensor(dst, layout))
