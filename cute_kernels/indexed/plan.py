"""Windowed plan of indexed attention, built on the GPU without a host sync.

Input: ``mIdx [S, Lq, Wsel]`` int32 token indices (S index sets; any index < 0 or >= Lkv is padding).
Output (all int32; ``CAP = WQ * Wsel``, ``NWW = ceil(NW / 32)``, ``PCAP = S * NW * min(CAP, NT)``):

    mWinKey    [S, NW, CAP]     sorted distinct valid keys of window w (first mWinCount[s, w] used)
    mWinMask   [S, NW, CAP]     bit i set <=> window query w * WQ + i selects that key
    mWinCount  [S, NW]
    mTileBits  [S, NT, NWW]     bit (w % 32) of word w // 32 <=> window w has a key in tile t;
                                MUST be zero on entry (the window kernel ORs bits in)
    mTilePtr   [S * NT + 1]     CSR offsets of the transpose over flattened (s, t)
    mTileWin   [PCAP]           windows touching tile (s, t), ascending, at mTilePtr[s*NT+t] ...
    mTileStart [PCAP]           index in mWinKey[s, w] of the window's first key >= KEY_TILE * t

Kernels, in launch order (all deterministic: ORs commute, everything else is scans):

1. ``PlanWindows`` (one CTA per window): the window's key range is cut into chunks of
   ``CHUNK = 8192`` keys; per chunk every entry ORs ``1 << query`` into a shared-memory word per
   key (duplicates collapse), then each warp compacts 32 key tiles of 32 keys with ballots and a
   block scan, writing keys in ascending order and setting the window's bit of every touched tile.
2. ``PlanTileCount`` (a warp per tile): popcount of the tile's bitmap row -> ``mTilePtr[row + 1]``.
3. ``PlanScan`` (one CTA): in-place inclusive scan of ``mTilePtr[1:]`` (``mTilePtr[0] = 0``).
4. ``PlanTileFill`` (a warp per tile): walks the bitmap in ascending window order, writes the window
   ids and, by binary search in the window's sorted keys, where the tile's keys start.

The pair capacity ``PCAP`` bounds the transpose without reading its size back to the host.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from .config import KEY_TILE

THREADS = 256
WARPS = THREADS // 32
CHUNK = THREADS * KEY_TILE  # keys per shared-memory pass: one 32-key tile per thread


@cute.jit
def _warp_sum(val: Int32) -> Int32:
    for i in cutlass.range_constexpr(5):
        val = val + cute.arch.shuffle_sync_bfly(val, offset=1 << i)
    return val


@cute.jit
def _warp_inclusive_scan(val: Int32, lane: Int32) -> Int32:
    for i in cutlass.range_constexpr(5):
        other = cute.arch.shuffle_sync_up(val, offset=1 << i)
        if lane >= (1 << i):
            val = val + other
    return val


class PlanWindows:
    def __init__(self, window_queries: int):
        if not 1 <= window_queries <= 32:
            raise ValueError(f"window_queries must be in [1, 32], got {window_queries}")
        self.wq = window_queries

    @cute.jit
    def __call__(self, mIdx: cute.Tensor, mWinKey: cute.Tensor, mWinMask: cute.Tensor,
                 mWinCount: cute.Tensor, mTileBits: cute.Tensor, kv_len: Int32, stream):
        num_windows = mWinCount.shape[1]
        num_sets = mWinCount.shape[0]
        self.kernel(mIdx, mWinKey, mWinMask, mWinCount, mTileBits, kv_len).launch(
            grid=[num_windows, num_sets, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mIdx: cute.Tensor, mWinKey: cute.Tensor, mWinMask: cute.Tensor,
               mWinCount: cute.Tensor, mTileBits: cute.Tensor, kv_len: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        win, s, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = tidx // 32
        num_q = mIdx.shape[1]
        width = mIdx.shape[2]

        smem = cutlass.utils.SmemAllocator()
        sMask = smem.allocate_tensor(Int32, cute.make_layout(CHUNK), byte_alignment=16)  # (CHUNK,) one word per key
        sRed = smem.allocate_tensor(Int32, cute.make_layout((2, WARPS)), byte_alignment=16)  # per-warp partials

        q0 = win * self.wq
        nq = cutlass.min(num_q - q0, self.wq)

        # 1. key range of the window (min / max over valid entries)
        kmin = kv_len
        kmax = Int32(-1)
        for qi in range(nq):
            for j in range(tidx, width, THREADS):
                key = mIdx[s, q0 + qi, j]
                if key >= 0 and key < kv_len:
                    kmin = cutlass.min(kmin, key)
                    kmax = cutlass.max(kmax, key)
        for i in cutlass.range_constexpr(5):
            kmin = cutlass.min(kmin, cute.arch.shuffle_sync_bfly(kmin, offset=1 << i))
            kmax = cutlass.max(kmax, cute.arch.shuffle_sync_bfly(kmax, offset=1 << i))
        if lane == 0:
            sRed[0, warp] = kmin
            sRed[1, warp] = kmax
        cute.arch.barrier()
        kmin = sRed[0, 0]
        kmax = sRed[1, 0]
        for i in cutlass.range_constexpr(1, WARPS):
            kmin = cutlass.min(kmin, sRed[0, i])
            kmax = cutlass.max(kmax, sRed[1, i])
        cute.arch.barrier()

        base0 = kmin - kmin % KEY_TILE
        num_chunks = Int32(0)
        if kmax >= 0:
            num_chunks = (kmax - base0) // CHUNK + 1
        total = Int32(0)
        win_word = win // 32
        win_bit = Int32(1) << (win % 32)
        for c in range(num_chunks):
            base = base0 + c * CHUNK
            # 2. one OR-word per key of the chunk
            for i in cutlass.range_constexpr(KEY_TILE):
                sMask[i * THREADS + tidx] = Int32(0)
            cute.arch.barrier()
            for qi in range(nq):
                bit = Int32(1) << qi
                for j in range(tidx, width, THREADS):
                    key = mIdx[s, q0 + qi, j]
                    if key >= base and key < base + CHUNK and key < kv_len:
                        cute.arch.atomic_or(sMask.iterator + (key - base), bit, scope="cta")
            cute.arch.barrier()
            # 3. count: lane l of warp v owns key tile v * 32 + l of the chunk
            my_count = Int32(0)
            for jt in cutlass.range_constexpr(32):
                m = sMask[(warp * 32 + jt) * KEY_TILE + lane]
                bal = cute.arch.vote_ballot_sync(m != 0)
                if lane == jt:
                    my_count = cute.arch.popc(bal)
            incl = _warp_inclusive_scan(my_count, lane)
            if lane == 31:
                sRed[0, warp] = incl
            cute.arch.barrier()
            warp_prefix = Int32(0)
            chunk_total = Int32(0)
            for i in cutlass.range_constexpr(WARPS):
                part = sRed[0, i]
                if i < warp:
                    warp_prefix = warp_prefix + part
                chunk_total = chunk_total + part
            tile_pos = total + warp_prefix + incl - my_count
            if my_count > 0:
                tile = base // KEY_TILE + warp * 32 + lane
                cute.arch.atomic_or(mTileBits.iterator + cute.crd2idx((s, tile, win_word), mTileBits.layout),
                                    win_bit, scope="gpu")
            # 4. write the chunk's keys in ascending order
            lt_mask = Int32(cute.arch.lanemask_lt())
            for jt in cutlass.range_constexpr(32):
                m = sMask[(warp * 32 + jt) * KEY_TILE + lane]
                bal = cute.arch.vote_ballot_sync(m != 0)
                pos = cute.arch.shuffle_sync(tile_pos, jt) + cute.arch.popc(bal & lt_mask)
                if m != 0:
                    mWinKey[s, win, pos] = base + (warp * 32 + jt) * KEY_TILE + lane
                    mWinMask[s, win, pos] = m
            total = total + chunk_total
            cute.arch.barrier()
        if tidx == 0:
            mWinCount[s, win] = total


class PlanTileCount:
    """``mTilePtr[row + 1] = popcount(mTileBits[s, t, :])`` for row = s * NT + t; a warp per row."""

    @cute.jit
    def __call__(self, mTileBits: cute.Tensor, mTilePtr: cute.Tensor, stream):
        rows = mTileBits.shape[0] * mTileBits.shape[1]
        self.kernel(mTileBits, mTilePtr).launch(grid=[cute.ceil_div(rows, WARPS), 1, 1],
                                                block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mTileBits: cute.Tensor, mTilePtr: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        row = bidx * WARPS + tidx // 32
        num_tiles = mTileBits.shape[1]
        words = mTileBits.shape[2]
        if row < mTileBits.shape[0] * num_tiles:
            s = row // num_tiles
            t = row - s * num_tiles
            count = Int32(0)
            for i in range(lane, words, 32):
                count = count + cute.arch.popc(mTileBits[s, t, i])
            count = _warp_sum(count)
            if lane == 0:
                mTilePtr[row + 1] = count


class PlanScan:
    """In-place scan of ``mTilePtr`` (counts at [1:]) into CSR offsets; one CTA."""

    @cute.jit
    def __call__(self, mTilePtr: cute.Tensor, stream):
        self.kernel(mTilePtr).launch(grid=[1, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mTilePtr: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        lane = tidx % 32
        warp = tidx // 32
        sRed = cutlass.utils.SmemAllocator().allocate_tensor(Int32, cute.make_layout(WARPS), byte_alignment=16)
        n = mTilePtr.shape[0] - 1
        per = (n + THREADS - 1) // THREADS
        lo = cutlass.min(tidx * per, n)
        hi = cutlass.min(lo + per, n)
        part = Int32(0)
        for i in range(lo, hi):
            part = part + mTilePtr[i + 1]
        incl = _warp_inclusive_scan(part, lane)
        if lane == 31:
            sRed[warp] = incl
        cute.arch.barrier()
        run = incl - part
        for i in cutlass.range_constexpr(WARPS):
            if i < warp:
                run = run + sRed[i]
        for i in range(lo, hi):
            run = run + mTilePtr[i + 1]
            mTilePtr[i + 1] = run
        if tidx == 0:
            mTilePtr[0] = Int32(0)


class PlanTileFill:
    """Per tile: its windows in ascending order and each window's first key index in the tile."""

    @cute.jit
    def __call__(self, mTileBits: cute.Tensor, mTilePtr: cute.Tensor, mWinKey: cute.Tensor,
                 mWinCount: cute.Tensor, mTileWin: cute.Tensor, mTileStart: cute.Tensor, stream):
        rows = mTileBits.shape[0] * mTileBits.shape[1]
        self.kernel(mTileBits, mTilePtr, mWinKey, mWinCount, mTileWin, mTileStart).launch(
            grid=[cute.ceil_div(rows, WARPS), 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mTileBits: cute.Tensor, mTilePtr: cute.Tensor, mWinKey: cute.Tensor,
               mWinCount: cute.Tensor, mTileWin: cute.Tensor, mTileStart: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        row = bidx * WARPS + tidx // 32
        num_tiles = mTileBits.shape[1]
        words = mTileBits.shape[2]
        if row < mTileBits.shape[0] * num_tiles:
            s = row // num_tiles
            t = row - s * num_tiles
            tile_key0 = t * KEY_TILE
            run = mTilePtr[row]
            for w0 in range(0, words, 32):
                wi = w0 + lane
                bits = Int32(0)
                if wi < words:
                    bits = mTileBits[s, t, wi]
                c = cute.arch.popc(bits)
                incl = _warp_inclusive_scan(c, lane)
                pos = run + incl - c
                for b in cutlass.range(0, 32, 1, unroll=1):
                    if (bits >> b) & 1:
                        w = wi * 32 + b
                        lo = Int32(0)
                        hi = mWinCount[s, w]
                        while lo < hi:
                            mid = (lo + hi) // 2
                            if mWinKey[s, w, mid] < tile_key0:
                                lo = mid + 1
                            else:
                                hi = mid
                        mTileWin[pos] = w
                        mTileStart[pos] = lo
                        pos = pos + 1
                run = run + cute.arch.shuffle_sync(incl, 31)
