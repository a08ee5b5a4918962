"""select_pages: top-k pages per request and kv head, reserved first/last pages, as a block table.

Per request b and kv head g, with n = seq_lens[b] tokens, n_pages = ceil(n / P) and the budget
K = bos + topk + eos (all in pages):

    n_pages <= K:  out[b, g, :] = block_tables[b, 0 .. n_pages-1], then -1
    otherwise:     out[b, g, :] = [ pages 0 .. bos-1 |
                                    the topk pages of [bos, n_pages - eos) with the largest
                                    score, in ascending page order (ties -> lower page) |
                                    pages n_pages-eos .. n_pages-1 ]         (physical page ids)
    out_lens[b, g] = tokens covered: (count - 1) * P + (n - (n_pages - 1) * P), 0 for n = 0

so the real (possibly partial) last page is last whenever eos >= 1, and ``out``/``out_lens`` are a
sparse block table and its seq_lens for any paged-attention kernel that takes one row per kv head.

Tensors: scores [B, Hkv, max_pages] float32; block_tables [B, max_pages] int32; seq_lens [B]
int32; out [B, Hkv, K] int32; out_lens [B, Hkv] int32.

One CTA per (b, g). The k-th largest score is found exactly by a 4-pass radix select over the
order-preserving 32-bit image of the fp32 score (one 256-bin shared histogram per pass); a last
pass in page order takes every page above the threshold and the lowest-indexed pages equal to it,
placing them with warp ballots and a CTA prefix sum. Everything is static-shaped: no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

THREADS = 256
WARPS = THREADS // 32
BINS = 256


def _s32(x: int) -> int:
    x &= 0xFFFFFFFF
    return x - (1 << 32) if x >= 1 << 31 else x


@dataclass(frozen=True)
class SelectPagesConfig:
    arch: int
    num_kv_heads: int = 8


class SelectPages:
    def __init__(self, cfg: SelectPagesConfig):
        self.cfg = cfg

    @cute.jit
    def __call__(self, mScore: cute.Tensor, mTable: cute.Tensor, mSeqLen: cute.Tensor, mOut: cute.Tensor,
                 mOutLen: cute.Tensor, page_size: Int32, topk: Int32, bos: Int32, eos: Int32, stream):
        # The fp32 scores are read as their int32 bit patterns (see _order_key).
        mBits = cute.recast_tensor(mScore, Int32)
        rows = mSeqLen.shape[0] * self.cfg.num_kv_heads
        self.kernel(mBits, mTable, mSeqLen, mOut, mOutLen, page_size, topk, bos, eos).launch(
            grid=[rows, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.jit
    def _order_key(self, bits: Int32) -> Int32:
        """Signed int32 whose order is the order of the fp32 value with these bits.

        Non-negative floats already order as integers; for negative ones the magnitude bits are
        flipped so that a larger magnitude gives a smaller integer. -0.0 counts as +0.0 (a tie).
        """
        bits = Int32(cutlass.select_(bits == Int32(_s32(0x80000000)), Int32(0), bits))  # -0.0 -> +0.0
        return bits ^ ((bits >> 31) & Int32(0x7FFFFFFF))

    @cute.kernel
    def kernel(self, mBits: cute.Tensor, mTable: cute.Tensor, mSeqLen: cute.Tensor, mOut: cute.Tensor,
               mOutLen: cute.Tensor, page_size: Int32, topk: Int32, bos: Int32, eos: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        hkv = self.cfg.num_kv_heads
        b = row // hkv
        g = row - b * hkv
        warp = tidx // 32
        lane = tidx % 32

        smem = cutlass.memory.SmemAllocator()
        sHist = smem.allocate_tensor(Int32, cute.make_layout(BINS), byte_alignment=16)
        sWarp = smem.allocate_tensor(Int32, cute.make_layout((WARPS, 2)), byte_alignment=16)
        sPick = smem.allocate_tensor(Int32, cute.make_layout(2), byte_alignment=16)

        n = mSeqLen[b]
        n_pages = (n + page_size - 1) // page_size
        budget = bos + topk + eos
        width = mOut.shape[2]
        count = cutlass.min(n_pages, budget)
        if tidx == 0:
            out_len = Int32(0)
            if n > 0:
                out_len = (count - 1) * page_size + (n - (n_pages - 1) * page_size)
            mOutLen[b, g] = out_len

        if n_pages <= budget:
            i = tidx
            while i < width:
                page = Int32(-1)
                if i < n_pages:
                    page = mTable[b, i]
                mOut[b, g, i] = page
                i += THREADS
        else:
            # reserved pages and padding
            i = tidx
            while i < width:
                if i < bos:
                    mOut[b, g, i] = mTable[b, i]
                elif i >= bos + topk:
                    if i < budget:
                        mOut[b, g, i] = mTable[b, n_pages - budget + i]
                    else:
                        mOut[b, g, i] = Int32(-1)
                i += THREADS
            w0 = bos
            w1 = n_pages - eos
            # 1. radix select of the topk-th largest key: 4 passes of 8 bits, most significant first
            prefix = Int32(0)
            need = topk
            for ps in cutlass.range_constexpr(4):
                shift = 24 - 8 * ps
                mask = _s32(((1 << (8 * ps)) - 1) << (32 - 8 * ps))  # digits fixed so far
                i = tidx
                while i < BINS:
                    sHist[i] = Int32(0)
                    i += THREADS
                cute.arch.sync_threads()
                j = w0 + tidx
                while j < w1:
                    key = self._order_key(mBits[b, g, j]) ^ Int32(_s32(0x80000000))  # unsigned image
                    if (key & Int32(mask)) == prefix:
                        digit = (key >> shift) & Int32(BINS - 1)
                        cute.arch.atomic_add(sHist.iterator + digit, Int32(1), scope="cta")
                    j += THREADS
                cute.arch.sync_threads()
                if tidx == 0:
                    # largest digit d with (# keys with digit >= d) >= need
                    above = Int32(0)
                    d = Int32(BINS - 1)
                    while above + sHist[d] < need:
                        above += sHist[d]
                        d -= 1
                    sPick[0] = d
                    sPick[1] = need - above
                cute.arch.sync_threads()
                prefix = prefix | (sPick[0] << shift)
                need = sPick[1]
                cute.arch.sync_threads()
            threshold = prefix ^ Int32(_s32(0x80000000))  # back to the signed order key
            # 2. in page order: all keys > threshold, and the first `need` keys == threshold
            taken = Int32(0)
            ties = Int32(0)
            lt_mask = cute.arch.lanemask_lt()
            base = w0
            while base < w1:
                j = base + tidx
                key = Int32(0)
                if j < w1:
                    key = self._order_key(mBits[b, g, j])
                inside = j < w1
                is_gt = inside & (key > threshold)
                is_tie = inside & (key == threshold)
                tie_rank, tie_total = self._cta_rank(is_tie, sWarp, 0, warp, lane, lt_mask)
                pick = is_gt | (is_tie & (ties + tie_rank < need))
                pos, pick_total = self._cta_rank(pick, sWarp, 1, warp, lane, lt_mask)
                if pick:
                    mOut[b, g, bos + taken + pos] = mTable[b, j]
                taken += pick_total
                ties += tie_total
                base += THREADS

    @cute.jit
    def _cta_rank(self, pred, sWarp: cute.Tensor, slot: cutlass.Constexpr, warp: Int32, lane: Int32,
                  lt_mask: Int32):
        """(number of threads before this one with ``pred``, CTA total); ends with a barrier."""
        ballot = cute.arch.vote_ballot_sync(pred)
        in_warp = cute.arch.popc(ballot & lt_mask)
        if lane == 0:
            sWarp[warp, slot] = cute.arch.popc(ballot)
        cute.arch.sync_threads()
        before = Int32(0)
        total = Int32(0)
        for w in cutlass.range_constexpr(WARPS):
            c = sWarp[w, slot]
            if w < warp:
                before += c
            total += c
        cute.arch.sync_threads()
        return before + in_warp, total
