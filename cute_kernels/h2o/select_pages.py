"""select_pages: top-k pages per request and kv head, reserved first/last pages, as a block table.

Per request b and kv head g, with n = seq_lens[b] tokens, n_pages = ceil(n / P) and the budget
K = bos + topk + eos (all in pages):

    n_pages <= K:  out[b, g, :] = block_tables[b, 0 .. n_pages-1], then -1
    otherwise:     out[b, g, :] = [ pages 0 .. bos-1 |
                                    the topk pages of [bos, n_pages - eos) with the largest
                                    score, in ascending page order (ties -> lower page) |
                                    pages n_pages-eos .. n_pages-1 ]         (physical page ids)
    out_lens[b, g] = tokens of the selected pages: count * P, less the n_pages * P - n empty slots of
                     the real last page when it is selected (always if n_pages <= K or eos >= 1; with
                     eos = 0 only when the top-k picks it); 0 for n = 0

so the real (possibly partial) last page is last whenever eos >= 1, and ``out``/``out_lens`` are a
sparse block table and its seq_lens for any paged-attention kernel that takes one row per kv head.

Tensors: scores [B, Hkv, max_pages] float32; block_tables [B, max_pages] int32; seq_lens [B]
int32; out [B, Hkv, K] int32; out_lens [B, Hkv] int32.

One CTA per (b, g). The k-th largest score is found exactly by a 4-pass radix select over the
order-preserving 32-bit image of the fp32 score (one 256-bin shared histogram per pass, filled
with one atomic per distinct digit per warp via match.sync, the digit found by one warp's shuffle
scan); a last pass in page order (4 consecutive pages per thread, a packed shuffle scan and one
barrier per 1024 pages) takes every page above the threshold and the lowest-indexed pages equal
to it. Everything is static-shaped: no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32

THREADS = 256
WARPS = THREADS // 32
BINS = 256
ITEMS = 4  # consecutive pages per thread in the placing pass


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
        Every NaN maps to INT32_MIN, below the key of -inf (0x807FFFFF): a NaN page never takes a
        slot from a number (the NaN rule, docs/api.md) and fills leftover slots in page order.
        """
        bits = Int32(cutlass.select_(bits == Int32(_s32(0x80000000)), Int32(0), bits))  # -0.0 -> +0.0
        key = bits ^ ((bits >> 31) & Int32(0x7FFFFFFF))
        is_nan = (bits & Int32(0x7FFFFFFF)) > Int32(0x7F800000)
        return Int32(cutlass.select_(is_nan, Int32(_s32(0x80000000)), key))

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
        lt_mask = cute.arch.lanemask_lt()

        smem = cutlass.memory.SmemAllocator()
        sHist = smem.allocate_tensor(Int32, cute.make_layout(BINS), byte_alignment=16)
        sWarp = smem.allocate_tensor(Int32, cute.make_layout((WARPS, 2)), byte_alignment=16)  # 2 buffers
        sPick = smem.allocate_tensor(Int32, cute.make_layout(2), byte_alignment=16)

        n = mSeqLen[b]
        n_pages = (n + page_size - 1) // page_size
        budget = bos + topk + eos
        width = mOut.shape[2]
        count = cutlass.min(n_pages, budget)
        empty_slots = n_pages * page_size - n  # of the real last page
        if tidx == 0:
            if (n_pages <= budget) | (eos > 0):  # the real last page is in the row (none when n = 0)
                mOutLen[b, g] = count * page_size - empty_slots

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
                base = w0
                while base < w1:  # uniform trip count: every lane reaches match_sync
                    j = base + tidx
                    digit = Int32(-1)
                    if j < w1:
                        key = self._order_key(mBits[b, g, j]) ^ Int32(_s32(0x80000000))  # unsigned image
                        if (key & Int32(mask)) == prefix:
                            digit = (key >> shift) & Int32(BINS - 1)
                    # one shared atomic per distinct digit per warp (keys often share the top byte)
                    peers = Int32(cute.arch.match_sync(-1, digit))
                    if ((peers & lt_mask) == 0) & (digit >= 0):
                        cute.arch.atomic_add(sHist.iterator + digit, cute.arch.popc(peers), scope="cta")
                    base += THREADS
                cute.arch.sync_threads()
                if warp == 0:
                    self._pick_digit(sHist, sPick, lane, need)
                cute.arch.sync_threads()
                prefix = prefix | (sPick[0] << shift)
                need = sPick[1]
            threshold = prefix ^ Int32(_s32(0x80000000))  # back to the signed order key
            # 2. in page order: every key > threshold and the first `need` keys == threshold.
            #    Picks before an element = (keys > threshold before it) + min(ties before it, need).
            gt_run = Int32(0)
            tie_run = Int32(0)
            parity = Int32(0)
            rKey = cute.make_rmem_tensor(cute.make_layout(ITEMS), Int32)
            base = w0
            while base < w1:
                j0 = base + tidx * ITEMS
                gt_mine = Int32(0)
                tie_mine = Int32(0)
                for it in cutlass.range_constexpr(ITEMS):
                    key = Int32(0)
                    if j0 + it < w1:
                        key = self._order_key(mBits[b, g, j0 + it])
                    rKey[it] = key
                    inside = j0 + it < w1
                    gt_mine += Int32(cutlass.select_(inside & (key > threshold), 1, 0))
                    tie_mine += Int32(cutlass.select_(inside & (key == threshold), 1, 0))
                # CTA exclusive scan of the packed counts (ties << 16 | greater), one barrier
                packed = (tie_mine << 16) | gt_mine
                incl = packed
                for k in cutlass.range_constexpr(5):
                    up = cute.arch.shuffle_sync_up(incl, offset=1 << k)
                    incl += Int32(cutlass.select_(lane >= (1 << k), up, 0))
                if lane == 31:
                    sWarp[warp, parity] = incl
                cute.arch.sync_threads()
                before = incl - packed
                total = Int32(0)
                for w in cutlass.range_constexpr(WARPS):
                    c = sWarp[w, parity]
                    if w < warp:
                        before += c
                    total += c
                gt_before = gt_run + (before & Int32(0xFFFF))
                tie_before = tie_run + (before >> 16)
                for it in cutlass.range_constexpr(ITEMS):
                    j = j0 + it
                    if j < w1:
                        key = rKey[it]
                        took = Int32(0)
                        if key > threshold:
                            mOut[b, g, bos + gt_before + cutlass.min(tie_before, need)] = mTable[b, j]
                            gt_before += 1
                            took = Int32(1)
                        elif key == threshold:
                            if tie_before < need:
                                mOut[b, g, bos + gt_before + tie_before] = mTable[b, j]
                                took = Int32(1)
                            tie_before += 1
                        if (j == n_pages - 1) & (eos == 0):  # the real last page is in the window:
                            # the row's tokens are those of its selected pages (count = budget here)
                            mOutLen[b, g] = budget * page_size - took * empty_slots
                gt_run += total & Int32(0xFFFF)
                tie_run += total >> 16
                parity = parity ^ 1  # double-buffered sWarp: one barrier per chunk is enough
                base += THREADS * ITEMS

    @cute.jit
    def _pick_digit(self, sHist: cute.Tensor, sPick: cute.Tensor, lane: Int32, need: Int32):
        """One warp: the largest digit d with #(keys with digit >= d) >= need; writes (d, need left).

        Lane l owns the 8 bins 255 - 8l .. 248 - 8l (descending); a shuffle scan over lanes gives
        the count above each lane's bins, and the one lane whose bins cross ``need`` walks them.
        """
        local = Int32(0)
        for i in cutlass.range_constexpr(8):
            local += sHist[BINS - 1 - 8 * lane - i]
        incl = local
        for k in cutlass.range_constexpr(5):
            up = cute.arch.shuffle_sync_up(incl, offset=1 << k)
            incl += Int32(cutlass.select_(lane >= (1 << k), up, 0))
        above = incl - local
        if (above < need) & (incl >= need):
            found = Int32(0)
            for i in cutlass.range_constexpr(8):
                d = BINS - 1 - 8 * lane - i
                c = sHist[d]
                if (found == 0) & (above + c >= need):
                    sPick[0] = d
                    sPick[1] = need - above
                    found = Int32(1)
                above += c
