"""Windowed indexed-attention backward, dK/dV part, for Hopper: warp-specialised, wgmma.

Same contract as ``bwd_dkdv.py`` (the portable ``mma.sync`` kernel, kept for SM100 and as
``dkdv_impl="mma"``): key-major, every key's windows in ascending order, no atomics, bitwise
reproducible, exact zeros for keys no query selects. What changes is the shape of the work:

One CTA per (64 keys = plan tiles 2c and 2c + 1, kv head h, batch b), 384 threads:

    producer WG (warps 0-3)   merges the two tiles' window lists (ascending, each window once; the
                              lists are read 32 entries at a time into registers) and, per window,
                              TMA-loads the Q and dO rows of the window queries that select any of
                              the 64 keys (one box of G head rows per query and tensor), packed to
                              the front of the open stage (one of 2), ORs
                              their bits into each key's packed-query mask and cp.asyncs their LSE
                              and delta; a stage is published (width 16, 32 or 64 row slots) when
                              the next window's queries no longer fit; then an end marker.
                              Completion: the boxes' bytes (issued by warp 1) plus one
                              cp.async-tracked and one plain mbarrier arrival per producer thread.
    consumer WG 0 ("P")       S^T = K Q^T (wgmma m64nW, keys x W row slots), P^T = exp2(S^T scale log2e - lse)
                              on selected pairs (0 elsewhere) -> fp32 to the exchange buffer,
                              dV += P^T dO (wgmma, A = P^T from registers, B = dO read MN-major).
    consumer WG 1 ("dS")      dP^T = V dO^T (same shape, runs while WG 0 computes S^T), then with
                              WG 0's P^T: dS^T = P^T (dP^T - delta), dK += dS^T Q (A from registers).
                              At the end dV (WG 0, through its sK) and dK * scale (WG 1, through its
                              sV) go to 16-byte row stores.

    producer ──Q/dO rows, key masks, LSE/delta (2 stages, mbarriers)──▶ WG 0: S^T, P^T, dV
                                                                        WG 1: dP^T, dS^T, dK
                                                    WG 0 ──P^T (fp32, 2 named barriers)──▶ WG 1

Note [keys as the M dimension]: with the 64 keys as the wgmma M dimension, P^T and dS^T leave
their GEMMs in exactly the register layout of the A operand of dV = P^T dO and dK = dS^T Q, so the
second GEMMs read only dO / Q from shared memory (m64nDk16: 8 KiB per 64x256x16 MACs at D 256),
and S^T / dP^T read 4 KiB per 64x64x16 MACs. The earlier split (each warpgroup 32 keys, m64n32,
P / dS written to shared memory and every operand read from it) moved about twice the shared-memory
bytes per MAC and was bound by shared-memory bandwidth (~4,500 cycles per 64-key window pair at
D 256 on the H200). The price: both warpgroups work on every window of the merged list, also those
that select keys of one tile only; and P^T crosses warpgroups through a 16 KiB fp32 buffer (thread t
of WG 1 owns the same accumulator elements as thread t of WG 0, so the buffer is a plain per-thread
array, written and read conflict-free).

Compared with the portable kernel (8 warps, 32 keys, two CTA-wide barriers per pair) the window's
rows are fetched while both warpgroups compute and a window serves 64 keys with one Q/dO load. The
accumulation order is fixed (window order, then the MMA's k order), so results are bitwise
reproducible; they are not bitwise those of the ``mma.sync`` kernel (another summation order).

Tensors: mQ/mdO [B, Lq, Hq, D] bf16, mK/mV/mdK/mdV [B, Lkv, Hkv, D] bf16, mLSE/mDelta [B, Hq, Lq] fp32;
plan as in ``plan.py``.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from cute_kernels.common.utils import (acc_as_operand_a, acc_mn_view, convert_to_16bit, transpose_view, wgmma_gemm,
                                       wgmma_smem_layout)

from . import common as C
from .config import KEY_TILE, TILE_M, AttnConfig

#: Keys per CTA: one plan tile per consumer warpgroup.
KEYS = 2 * KEY_TILE
WG_THREADS = 128
THREADS = 3 * WG_THREADS
STAGES = 2
# setmaxnreg split: 128 * 56 + 256 * 224 <= 64K registers (the producer spills at 40 with the packed gather).
PRODUCER_REGS, CONSUMER_REGS = 56, 224
#: Named barriers (0 is the CTA barrier): consumer warpgroup w's own is CONSUMER_BARRIER + w;
#: P_FULL (WG 0 arrives after writing P^T, WG 1 waits) and P_EMPTY (WG 1 arrives once it has read
#: P^T, WG 0 waits before overwriting it) guard the exchange buffer.
CONSUMER_BARRIER = 1
P_FULL = 3
P_EMPTY = 4
NO_WINDOW = 0x7FFFFFFF
#: Accumulator elements per consumer thread of an m64n64 fp32 tile (the P^T exchange row).
ACC_PER_THREAD = KEYS * TILE_M // WG_THREADS
#: Row widths (wgmma N of S^T / dP^T, K of dV / dK) of a stage: the rows of the window queries
#: that select any of the CTA's keys are packed to the front (Note [packed rows, narrow windows]).
WIDTHS = (64, 32, 16)
#: ``slot_query`` of a slot past the window's selecting queries (>= any window's query count).
NO_QUERY = 32
# sCtl[field, stage]
CTL_GO, CTL_WIDTH = 0, 1


class IndexedBwdDKDVSm90:
    def __init__(self, cfg: AttnConfig):
        if cfg.arch != 90:
            raise ValueError(f"IndexedBwdDKDVSm90 is the SM90 kernel, got arch {cfg.arch}")
        self.cfg = cfg
        self.d = cfg.head_dim
        self.g = cfg.group
        self.wq = cfg.window_queries

    @staticmethod
    def smem_bytes(cfg: AttnConfig) -> int:
        d = cfg.head_dim
        q_do = 2 * STAGES * TILE_M * d * 2
        k_v = 2 * KEYS * d * 2
        p_x = KEYS * TILE_M * 4
        meta = STAGES * (KEYS + 2 * TILE_M + 4) * 4
        barriers = 2 * STAGES * 8
        return q_do + k_v + p_x + meta + barriers + 5 * 1024  # + 1 KiB alignment per buffer

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE: cute.Tensor, mDelta: cute.Tensor, mWinKey: cute.Tensor, mWinMask: cute.Tensor,
                 mWinCount: cute.Tensor, mTilePtr: cute.Tensor, mTileWin: cute.Tensor,
                 mTileStart: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, softmax_scale: Float32,
                 stream):
        bf16 = cutlass.BFloat16
        sQ_layout = wgmma_smem_layout(bf16, (TILE_M, self.d, STAGES))  # (64 rows, D, stage)
        sKV_layout = wgmma_smem_layout(bf16, (KEYS, self.d))  # (64 keys, D)

        @cute.struct
        class SharedStorage:
            mbar_full: cute.struct.MemRange[Int64, STAGES]
            mbar_empty: cute.struct.MemRange[Int64, STAGES]
            sQ: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sKV_layout)], 1024]
            sPx: cute.struct.Align[cute.struct.MemRange[Float32, KEYS * TILE_M], 1024]
            sKeyMask: cute.struct.Align[cute.struct.MemRange[Int32, KEYS * STAGES], 16]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, TILE_M * STAGES], 16]
            sDelta: cute.struct.Align[cute.struct.MemRange[Float32, TILE_M * STAGES], 16]
            sCtl: cute.struct.Align[cute.struct.MemRange[Int32, 4 * STAGES], 16]

        g2s, plain = C.gmem_copies(bf16, WG_THREADS, self.d)
        # Note [query rows by TMA]: a packed query's G head rows are G * D contiguous elements of
        # Q / dO, so one TMA box of (G rows, D) per query and tensor lands them in the query's row
        # slots; it replaces ~G * D / 8 16-byte cp.asyncs spread over 128 threads, whose issue bound
        # the producer (H200 clock probes: ~1,300 of ~2,650 cycles per window at 16K x 131K). For
        # G not a multiple of 8 the box starts inside a 128-byte-swizzle atom (row slot 12, 24, ...),
        # which is right only if TMA applies the swizzle by shared-memory address, not by row of the
        # box (as wgmma reads it). Verified on the H200: tests/gpu/test_tma_row_box.py.
        box = self.row_box(sQ_layout)
        tma_op = cpasync.CopyBulkTensorTileG2SOp()
        atom_q, tma_q = cpasync.make_tiled_tma_atom(tma_op, self.rows_view(mQ), box, (self.g, self.d))
        atom_do, tma_do = cpasync.make_tiled_tma_atom(tma_op, self.rows_view(mdO), box, (self.g, self.d))
        num_tiles = cute.ceil_div(mK.shape[1], KEY_TILE)
        grid = [cute.ceil_div(num_tiles, 2), self.cfg.num_kv_heads, mK.shape[0]]
        self.kernel(mQ, mK, mV, mdO, mLSE, mDelta, mWinKey, mWinMask, mWinCount, mTilePtr, mTileWin,
                    mTileStart, mdK, mdV, softmax_scale * C.LOG2_E, softmax_scale, sQ_layout, sKV_layout,
                    g2s, plain, atom_q, tma_q, atom_do, tma_do, box, SharedStorage).launch(
            grid=grid, block=[THREADS, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream,
            min_blocks_per_mp=1)

    def rows_view(self, mX: cute.Tensor) -> cute.Tensor:
        """(Hq, D, Lq, B) view of a [B, Lq, Hq, D] tensor: a query's heads are the rows of a TMA box."""
        return cute.make_tensor(mX.iterator, cute.select(mX.layout, mode=[2, 3, 1, 0]))

    def row_box(self, sQ_layout: cute.ComposedLayout) -> cute.ComposedLayout:
        """Shared-memory layout of G consecutive row slots of a stage (the TMA box of one packed
        query): rows 64 elements apart, 64-column chunks TILE_M * 64 apart, the stage's swizzle.
        Checked against the stage layout at trace time (the box is written at any row offset)."""
        D = self.d
        chunks = D // 64
        outer = cute.make_layout((self.g, (64, chunks)), stride=(64, (1, 64 * TILE_M)))
        full = sQ_layout.outer
        for r in range(TILE_M):
            for col in (0, 1, 63, D - 1):
                want = r * 64 + col % 64 + (col // 64) * 64 * TILE_M
                got = cute.crd2idx((r, col, 0), full)
                assert got == want, f"stage layout is not the assumed row-slot layout at ({r}, {col})"
        assert cute.crd2idx((0, 0, 1), full) == TILE_M * D, "stage stride"
        return cute.make_composed_layout(sQ_layout.inner, 0, outer)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
               mLSE: cute.Tensor, mDelta: cute.Tensor, mWinKey: cute.Tensor, mWinMask: cute.Tensor,
               mWinCount: cute.Tensor, mTilePtr: cute.Tensor, mTileWin: cute.Tensor,
               mTileStart: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, scale_log2: Float32,
               softmax_scale: Float32, sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout,
               g2s: cute.TiledCopy, plain: cute.TiledCopy, atom_q: cute.CopyAtom, tma_q: cute.Tensor,
               atom_do: cute.CopyAtom, tma_do: cute.Tensor, box: cute.ComposedLayout,
               SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        c, h, b = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cpasync.prefetch_descriptor(atom_q)
            cpasync.prefetch_descriptor(atom_do)
        s = b
        if const_expr(self.cfg.per_kv_head):
            s = b * self.cfg.num_kv_heads + h

        storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
        full = storage.mbar_full.data_ptr()
        empty = storage.mbar_empty.data_ptr()
        if tidx == 0:
            for i in cutlass.range_constexpr(STAGES):
                # full: per producer thread one cp.async-tracked and one plain arrival, plus the
                # TMA boxes' bytes (expect-tx, Note [query rows by TMA]); empty: every consumer thread.
                cute.arch.mbarrier_init(full + i, 2 * WG_THREADS)
                cute.arch.mbarrier_init(empty + i, 2 * WG_THREADS)
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sV = storage.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        # P^T exchange: thread t's accumulator element j at [t, j] (consecutive threads, consecutive words)
        sPx = storage.sPx.get_tensor(cute.make_layout((WG_THREADS, ACC_PER_THREAD), stride=(1, WG_THREADS)))
        sKeyMask = storage.sKeyMask.get_tensor(cute.make_layout((KEYS, STAGES)))
        sLSE = storage.sLSE.get_tensor(cute.make_layout((TILE_M, STAGES)))
        sDelta = storage.sDelta.get_tensor(cute.make_layout((TILE_M, STAGES)))
        sCtl = storage.sCtl.get_tensor(cute.make_layout((4, STAGES)))
        t0 = c * KEYS
        rows = (atom_q, tma_q, storage.sQ.data_ptr(), atom_do, tma_do, storage.sdO.data_ptr(), box)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            self.produce(mQ, mK, mV, mdO, mLSE, mDelta, mWinKey, mWinMask, mWinCount, mTilePtr, mTileWin,
                         mTileStart, sQ, sdO, sK, sV, sKeyMask, sLSE, sDelta, sCtl, full, empty, g2s, rows,
                         s, h, b, t0, tidx)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            wg = warp_idx // 4 - 1
            ctid = tidx - WG_THREADS * (wg + 1)
            if wg == 0:
                self.consume_p(mK, mdV, sQ, sdO, sK, sPx, sKeyMask, sLSE, sCtl, full, empty, plain,
                               scale_log2, h, b, t0, ctid)
            else:
                self.consume_ds(mK, mdK, sQ, sdO, sV, sPx, sDelta, sCtl, full, empty, plain, softmax_scale, h,
                                b, t0, ctid)

    # ------------------------------------------------------------------ producer
    @cute.jit
    def produce(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                mLSE: cute.Tensor, mDelta: cute.Tensor, mWinKey: cute.Tensor, mWinMask: cute.Tensor,
                mWinCount: cute.Tensor, mTilePtr: cute.Tensor, mTileWin: cute.Tensor,
                mTileStart: cute.Tensor, sQ: cute.Tensor, sdO: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor,
                sKeyMask: cute.Tensor, sLSE: cute.Tensor, sDelta: cute.Tensor, sCtl: cute.Tensor, full, empty,
                g2s: cute.TiledCopy, rows: tuple, s: Int32, h: Int32, b: Int32, t0: Int32, ptid: Int32):
        D = self.d
        kv_len = mK.shape[1]
        num_tiles = (kv_len + KEY_TILE - 1) // KEY_TILE
        thr = g2s.get_slice(ptid)
        tQsQ = thr.partition_D(sQ)  # (CPY, M, K, stage)
        tQsdO = thr.partition_D(sdO)
        tQcQ = thr.partition_S(cute.make_identity_tensor((TILE_M, D)))
        tKsK = thr.partition_D(sK)  # (CPY, M, K)
        tKsV = thr.partition_D(sV)
        tKcK = thr.partition_S(cute.make_identity_tensor((KEYS, D)))

        # The CTA's K and V rows (zeros past kv_len); covered by the first stage's cp.async arrival.
        C.gather_key_rows(g2s, mK, mV, tKsK, tKsV, tKcK, t0, kv_len, D, h, b)

        # Merge the window lists of tiles ta = t0 / 32 and ta + 1 (both ascending; a window in
        # both is visited once, its keys >= t0 start at the first list's mTileStart).
        row_a = s * num_tiles + t0 // KEY_TILE
        pa = mTilePtr[row_a]
        pa_end = mTilePtr[row_a + 1]
        pb = pa_end
        pb_end = pa_end
        if t0 // KEY_TILE + 1 < num_tiles:
            pb_end = mTilePtr[row_a + 2]
        # Note [plan reads one window ahead]: window i + 1's entries are requested before window i's
        # rows, so their latency (mostly DRAM: the window key lists are far larger than L2) overlaps
        # window i's wait and copies instead of adding to every window.
        lane = ptid % 32
        have = pb_end - pa > 0
        w = Int32(NO_WINDOW)
        start = Int32(0)
        cnt, k0, m0, k1, m1 = Int32(0), Int32(-1), Int32(0), Int32(-1), Int32(0)
        # Note [list chunks in registers]: lane l holds entry base + l of each list (window, start),
        # so the merge costs shuffles, and a list load's latency once per 32 windows.
        ba, bb = pa, pb
        ca_w, ca_s = self.list_chunk(mTileWin, mTileStart, pa, pa_end, lane)
        cb_w, cb_s = self.list_chunk(mTileWin, mTileStart, pb, pb_end, lane)
        if have:
            w, start, pa, pb, ba, ca_w, ca_s, bb, cb_w, cb_s = self.next_window(
                mTileWin, mTileStart, pa, pa_end, pb, pb_end, ba, ca_w, ca_s, bb, cb_w, cb_s, lane)
            cnt, k0, m0, k1, m1 = self.fetch_entries(mWinKey, mWinMask, mWinCount, w, start, s, lane)
        # Note [stages of several windows]: consecutive windows share a stage while their selecting
        # queries fit (at most WQ per stage, so WQ * G <= 64 rows and one bit per packed query).
        i = Int32(0)  # stages published so far
        npk = Int32(0)  # packed queries of the open stage (0: none open)
        while have:
            have_n = (pa_end - pa) + (pb_end - pb) > 0
            w_n = Int32(NO_WINDOW)
            start_n = Int32(0)
            cnt_n, k0_n, m0_n, k1_n, m1_n = Int32(0), Int32(-1), Int32(0), Int32(-1), Int32(0)
            if have_n:
                w_n, start_n, pa, pb, ba, ca_w, ca_s, bb, cb_w, cb_s = self.next_window(
                    mTileWin, mTileStart, pa, pa_end, pb, pb_end, ba, ca_w, ca_s, bb, cb_w, cb_s, lane)
                cnt_n, k0_n, m0_n, k1_n, m1_n = self.fetch_entries(mWinKey, mWinMask, mWinCount, w_n, start_n,
                                                                   s, lane)
            keys, masks, qsel = self.window_keys(cnt, start, k0, m0, k1, m1, t0, lane)
            nq = cute.arch.popc(qsel)
            if npk + nq > self.wq:
                self.close_stage(tQsQ, tQsdO, tQcQ, sLSE, sDelta, sCtl, full, npk, i % STAGES, ptid)
                i = i + 1
                npk = Int32(0)
            if npk == 0:
                self.open_stage(sKeyMask, empty, i, ptid)
            self.add_window(rows, mLSE, mDelta, sKeyMask, sLSE, sDelta, full, w, keys, masks, qsel, npk,
                            i % STAGES, h, b, ptid)
            npk = npk + nq
            w, start, cnt, k0, m0, k1, m1 = w_n, start_n, cnt_n, k0_n, m0_n, k1_n, m1_n
            have = have_n
        if npk > 0:
            self.close_stage(tQsQ, tQsdO, tQcQ, sLSE, sDelta, sCtl, full, npk, i % STAGES, ptid)
            i = i + 1
        # End marker (also publishes the K/V rows when no window selects these keys).
        stage = i % STAGES
        if i >= STAGES:
            cute.arch.mbarrier_wait(empty + stage, ((i // STAGES) % 2) ^ 1)
        if ptid == 0:
            sCtl[CTL_GO, stage] = Int32(0)
        cute.arch.cp_async_mbarrier_arrive_noinc(full + stage)
        cute.arch.mbarrier_arrive(full + stage)

    @cute.jit
    def list_chunk(self, mTileWin: cute.Tensor, mTileStart: cute.Tensor, p: Int32, p_end: Int32, lane: Int32):
        """Lane ``lane``'s entry p + lane of a window list: (window, start), (NO_WINDOW, 0) past ``p_end``."""
        cw = Int32(NO_WINDOW)
        cs = Int32(0)
        if p + lane < p_end:
            cw = mTileWin[p + lane]
            cs = mTileStart[p + lane]
        return cw, cs

    @cute.jit
    def next_window(self, mTileWin: cute.Tensor, mTileStart: cute.Tensor, pa: Int32, pa_end: Int32, pb: Int32,
                    pb_end: Int32, ba: Int32, ca_w: Int32, ca_s: Int32, bb: Int32, cb_w: Int32, cb_s: Int32,
                    lane: Int32):
        """Next window of the merged ascending lists [pa, pa_end) and [pb, pb_end) (a window in both
        is taken once; its keys >= t0 start at the first list's mTileStart), read from the lists'
        register chunks (entries ba + lane, bb + lane), which are refilled once consumed:
        (w, start, pa, pb, ba, ca_w, ca_s, bb, cb_w, cb_s)."""
        wa = cute.arch.shuffle_sync(ca_w, pa - ba)
        wb = cute.arch.shuffle_sync(cb_w, pb - bb)
        sa = cute.arch.shuffle_sync(ca_s, pa - ba)
        sb = cute.arch.shuffle_sync(cb_s, pb - bb)
        w = cutlass.min(wa, wb)
        start = sb
        if wa == w:
            start = sa
            pa = pa + 1
        if wb == w:
            pb = pb + 1
        if pa - ba == 32:
            ba = pa
            ca_w, ca_s = self.list_chunk(mTileWin, mTileStart, pa, pa_end, lane)
        if pb - bb == 32:
            bb = pb
            cb_w, cb_s = self.list_chunk(mTileWin, mTileStart, pb, pb_end, lane)
        return w, start, pa, pb, ba, ca_w, ca_s, bb, cb_w, cb_s

    @cute.jit
    def fetch_entries(self, mWinKey: cute.Tensor, mWinMask: cute.Tensor, mWinCount: cute.Tensor, w: Int32,
                      start: Int32, s: Int32, lane: Int32):
        """Raw reads (all independent) of window ``w``'s count and lane ``lane``'s two (key, mask)
        entries at start + lane and start + 32 + lane (any position inside the row: filtered by the
        count in ``window_keys``)."""
        cap = mWinKey.shape[2]
        cnt = mWinCount[s, w]
        k0 = Int32(-1)
        k1 = Int32(-1)
        m0 = Int32(0)
        m1 = Int32(0)
        pos = start + lane
        if pos < cap:
            k0 = mWinKey[s, w, pos]
            m0 = mWinMask[s, w, pos]
        if pos + 32 < cap:
            k1 = mWinKey[s, w, pos + 32]
            m1 = mWinMask[s, w, pos + 32]
        return cnt, k0, m0, k1, m1

    @cute.jit
    def window_keys(self, cnt: Int32, start: Int32, k0: Int32, m0: Int32, k1: Int32, m1: Int32, t0: Int32,
                    lane: Int32):
        """Lane l's two entries among the CTA's keys: (key - t0, query mask) at positions start + l and
        start + 32 + l (key -1 / mask 0 when outside), and the OR of all 64 masks over the warp (which
        window queries select any of these keys). Keys are sorted and distinct, so those in
        [t0, t0 + 64) are at most the 64 positions from ``start``."""
        key0 = Int32(-1)
        key1 = Int32(-1)
        mask0 = Int32(0)
        mask1 = Int32(0)
        pos = start + lane
        if pos < cnt and k0 < t0 + KEYS:
            key0 = k0 - t0
            mask0 = m0
        if pos + 32 < cnt and k1 < t0 + KEYS:
            key1 = k1 - t0
            mask1 = m1
        keys = [key0, key1]
        masks = [mask0, mask1]
        qsel = cute.arch.warp_redux_sync(mask0 | mask1, "or")  # redux.sync: one instruction
        return keys, masks, qsel

    @cute.jit
    def slot_query(self, qsel: Int32, slot: Int32) -> Int32:
        """Window query of packed row slot ``slot``: the (slot // G)-th set bit of ``qsel``, or NO_QUERY."""
        k = slot // self.g
        qi = Int32(NO_QUERY)
        c = Int32(0)
        for j in cutlass.range_constexpr(self.wq):
            bit = (qsel >> j) & 1
            if bit != 0 and c == k:
                qi = Int32(j)
            c = c + bit
        return qi

    @cute.jit
    def pack_mask(self, mask: Int32, qsel: Int32, npk: Int32) -> Int32:
        """A key's window-query bitmask ``mask`` in packed-query bits: window query j, the c-th set
        bit of ``qsel``, is packed query npk + c (``mask`` is a subset of ``qsel``)."""
        packed = Int32(0)
        c = npk
        for j in cutlass.range_constexpr(self.wq):
            packed = packed | (((mask >> j) & 1) << cutlass.min(c, 31))
            c = c + ((qsel >> j) & 1)
        return packed

    @cute.jit
    def open_stage(self, sKeyMask: cute.Tensor, empty, i: Int32, ptid: Int32):
        """Wait until the consumers released stage i % STAGES (from its second use on) and clear its
        key masks (warp 0, which alone writes them)."""
        stage = i % STAGES
        if i >= STAGES:
            cute.arch.mbarrier_wait(empty + stage, ((i // STAGES) % 2) ^ 1)
            # the stage's rows were last written by TMA (async proxy); close_stage may zero some
            cute.arch.fence_view_async_shared()
        if ptid < 32:
            sKeyMask[ptid, stage] = Int32(0)
            sKeyMask[ptid + KEY_TILE, stage] = Int32(0)
            cute.arch.sync_warp()

    @cute.jit
    def add_window(self, rows: tuple, mLSE: cute.Tensor, mDelta: cute.Tensor, sKeyMask: cute.Tensor,
                   sLSE: cute.Tensor, sDelta: cute.Tensor, full, w: Int32, keys: list, masks: list, qsel: Int32,
                   npk: Int32, stage: Int32, h: Int32, b: Int32, ptid: Int32):
        """Window ``w`` into the open stage after its ``npk`` packed queries: the Q / dO rows of the
        queries in ``qsel`` into row slots [npk G, (npk + popc(qsel)) G) (warp 1: one TMA box per
        query and tensor, Note [query rows by TMA]), their LSE and delta (warps 2-3, cp.async), and
        their bits OR-ed into the key masks (warp 0).

        Note [packed rows, narrow windows]: a (CTA, window) pair typically touches a few 4-token
        blocks of the CTA's 64 keys, chosen by some of the window's queries (at 64K x 64K, rho 0.9,
        about 40 % of the pairs have at most 2 of the 5 queries; 60 % at 16K x 131K). The rows of the
        other queries only ever meet P = dS = 0, so they are neither read nor computed: the selecting
        queries' rows are packed to the front, consecutive windows share a stage while the packed
        queries fit (Note [stages of several windows]; 16K x 131K: 0.57 stages per pair), and the
        consumers run all four GEMMs with N (S^T, dP^T) and K (dV, dK) = 16, 32 or 64, the smallest
        width that holds the stage's rows. Row slot r holds packed query r // G, query head h G + r % G;
        a key's mask bit c says whether packed query c selects it."""
        G = self.g
        D = self.d
        q0 = w * self.wq
        lo = npk * G
        nq = cute.arch.popc(qsel)
        hi = lo + nq * G
        warp = ptid // 32
        if warp == 1:
            # TMA copies are issued by a whole warp (cute.copy elects one lane; elect.sync with only
            # one lane active hangs)
            # the boxes' bytes complete on the stage's full barrier with the threads' arrivals
            if ptid == 32:
                cute.arch.mbarrier_expect_tx(full + stage, nq * (2 * G * D * 2))
            c = Int32(0)
            if const_expr(self.wq <= 5):  # G >= 12: unrolled
                for j in cutlass.range_constexpr(self.wq):
                    if (qsel >> j) & 1 != 0:
                        self.row_boxes(rows, full, stage, lo + c * G, q0 + j, h, b)
                    c = c + ((qsel >> j) & 1)
            else:  # up to 64 window queries: a rolled loop (unrolled, the producer's 56 registers spill)
                for j in cutlass.range(self.wq, unroll=1):
                    if (qsel >> j) & 1 != 0:
                        self.row_boxes(rows, full, stage, lo + c * G, q0 + j, h, b)
                    c = c + ((qsel >> j) & 1)
        elif warp == 0:
            for j in cutlass.range_constexpr(2):
                key = keys[j]
                if key >= 0:
                    sKeyMask[key, stage] = sKeyMask[key, stage] | self.pack_mask(masks[j], qsel, npk)
            # the next window's OR may hit the same key from another lane
            cute.arch.sync_warp()
        elif warp >= 2:
            # Slot r's LSE (natural log, as stored; the consumer scales it) and delta, by 4-byte
            # cp.asyncs covered by the stage's arrival: no load latency on the producer's path.
            r = ptid - 2 * 32
            if r >= lo and r < hi:
                qi = self.slot_query(qsel, r - lo)
                coord = (b, h * G + r % G, q0 + qi)
                stat = cute.make_copy_atom(cpasync.CopyG2SOp(), Float32, num_bits_per_copy=32)
                one = cute.make_layout(1)
                for mX, sX in ((mLSE, sLSE), (mDelta, sDelta)):
                    cute.copy(stat, cute.make_tensor(mX.iterator + cute.crd2idx(coord, mX.layout), one),
                              cute.make_tensor(sX.iterator + (stage * TILE_M + r), one))

    @cute.jit
    def row_boxes(self, rows: tuple, full, stage: Int32, slot: Int32, q: Int32, h: Int32, b: Int32):
        """Query ``q``'s G head rows of Q and dO (one TMA box each, Note [query rows by TMA]) into row
        slots [slot, slot + G) of stage ``stage``; the bytes complete on its full barrier. Called by a
        whole warp."""
        atom_q, tma_q, base_q, atom_do, tma_do, base_do, box = rows
        off = stage * (TILE_M * self.d) + slot * 64  # element offset of the first row slot
        for atom, tma, base in ((atom_q, tma_q, base_q), (atom_do, tma_do, base_do)):
            dst = cute.make_tensor(cute.recast_ptr(base + off, box.inner), box.outer)
            src = cute.local_tile(tma[None, None, q, b], (self.g, self.d), (h, 0))
            tS, tG = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(dst, 0, 2),
                                           cute.group_modes(src, 0, 2))
            cute.copy(atom, tG, tS, tma_bar_ptr=full + stage)

    @cute.jit
    def close_stage(self, tQsQ: cute.Tensor, tQsdO: cute.Tensor, tQcQ: cute.Tensor, sLSE: cute.Tensor,
                    sDelta: cute.Tensor, sCtl: cute.Tensor, full, npk: Int32, stage: Int32, ptid: Int32):
        """Publish the open stage holding ``npk`` packed queries: its width, zeros in the row slots
        between the packed rows and the width (0 * x must stay 0 for whatever the slot held before)
        and in the unused LSE / delta slots, then each producer thread's cp.async-tracked and plain
        arrival on the stage's full barrier."""
        live = npk * self.g
        width = Int32(WIDTHS[0])
        if live <= WIDTHS[1]:
            width = Int32(WIDTHS[1])
        if live <= WIDTHS[2]:
            width = Int32(WIDTHS[2])
        tQsQ_s = tQsQ[None, None, None, stage]
        tQsdO_s = tQsdO[None, None, None, stage]
        for m in cutlass.range_constexpr(cute.size(tQsQ_s, mode=[1])):
            r = tQcQ[0, m, 0][0]
            if r >= live and r < width:
                tQsQ_s[None, m, None].fill(0)
                tQsdO_s[None, m, None].fill(0)
        if ptid >= 2 * 32:
            r = ptid - 2 * 32
            if r >= live:
                sLSE[r, stage] = Float32(0.0)
                sDelta[r, stage] = Float32(0.0)
        if ptid == 0:
            sCtl[CTL_GO, stage] = Int32(1)
            sCtl[CTL_WIDTH, stage] = width
        cute.arch.cp_async_mbarrier_arrive_noinc(full + stage)
        cute.arch.mbarrier_arrive(full + stage)

    # ------------------------------------------------------------------ consumers
    def mmas(self, width: int):
        """(S^T / dP^T: (64 keys, width rows) += K|V (64, D) x Q|dO (width, D)^T, both operands from
        smem, K-major; dV / dK: (64 keys, D) += P^T|dS^T (64, width) from registers x dO|Q read
        MN-major)."""
        bf16 = cutlass.BFloat16
        mma_s = sm90_utils.make_trivial_tiled_mma(
            bf16, bf16, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, Float32,
            atom_layout_mnk=(1, 1, 1), tiler_mn=(KEYS, width))
        mma_kv = sm90_utils.make_trivial_tiled_mma(
            bf16, bf16, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN, Float32,
            atom_layout_mnk=(1, 1, 1), tiler_mn=(KEYS, self.d), a_source=warpgroup.OperandSource.RMEM)
        return mma_s, mma_kv

    @cute.jit
    def operands(self, sKV: cute.Tensor, sRows: cute.Tensor, sRows2: cute.Tensor, ctid: Int32):
        """A consumer's view of its two GEMMs, X^T = sKV sRows^T then acc += X^T sRows2 (WG 0: K, Q, dO;
        WG 1: V, dO, Q): (mma_kv, thr_kv, the B fragment of the second GEMM, its zeroed (64 keys, D)
        accumulator, and per width in WIDTHS (mma_s, A / B fragments of the first GEMM over the first
        ``width`` row slots, the register A fragment of the second, the first GEMM's accumulator shape
        and its (key, row slot) coordinates)). The second GEMM reads only the first width / 16
        k-blocks of its B fragment."""
        _, mma_kv = self.mmas(WIDTHS[0])
        thr_kv = mma_kv.get_slice(ctid)
        tKrBt = thr_kv.make_fragment_B(thr_kv.partition_B(transpose_view(sRows2)))  # (.., .., k, stage)
        acc = cute.make_rmem_tensor(thr_kv.partition_shape_C((KEYS, self.d)), Float32)
        acc.fill(0.0)
        per_width = []
        for n in WIDTHS:
            mma_s, _ = self.mmas(n)
            thr_s = mma_s.get_slice(ctid)
            sRows_n = sRows if n == TILE_M else cute.local_tile(sRows, (n, self.d, STAGES), (0, 0, 0))
            per_width.append((
                mma_s,
                thr_s.make_fragment_A(thr_s.partition_A(sKV)),
                thr_s.make_fragment_B(thr_s.partition_B(sRows_n)),  # (.., .., k, stage)
                thr_kv.make_fragment_A(thr_kv.partition_shape_A((KEYS, n))),
                thr_s.partition_shape_C((KEYS, n)),
                acc_mn_view(thr_s.partition_C(cute.make_identity_tensor((KEYS, n)))),
            ))
        return mma_kv, thr_kv, tKrBt, acc, per_width

    @cute.jit
    def column_stats(self, acc_mn: cute.Tensor, tScS: cute.Tensor, sStat: cute.Tensor, stage: Int32) -> list:
        """sStat[row slot, stage] of each of this thread's accumulator columns."""
        stats = []
        for cc in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
            stats.append(sStat[tScS[0, cc][1], stage])
        return stats

    @cute.jit
    def first_gemm(self, pw: tuple, stage: Int32):
        """S^T or dP^T of window ``stage`` at one width (``pw``: an ``operands`` per-width entry),
        completed, and its (key, row slot) view."""
        mma_s, tSrA, tSrB, _, acc_shape, _ = pw
        acc = cute.make_rmem_tensor(acc_shape, Float32)
        wgmma_gemm(mma_s, acc, tSrA, tSrB[None, None, None, stage], True)
        warpgroup.wait_group(0)
        return acc, acc_mn_view(acc)

    @cute.jit
    def by_width(self, step, sCtl: cute.Tensor, stage: Int32):
        """``step(i, stage)`` for the index i in WIDTHS of window ``stage``'s width."""
        width = sCtl[CTL_WIDTH, stage]
        if width == WIDTHS[0]:
            step(0, stage)
        else:
            if width == WIDTHS[1]:
                step(1, stage)
            else:
                step(2, stage)

    @cute.jit
    def window_loop(self, step, sCtl: cute.Tensor, full, empty):
        """Run ``step(stage)`` for every window the producer publishes, releasing each stage after it;
        returns at the end marker."""
        i = Int32(0)
        go = Int32(1)
        while go != 0:
            stage = i % STAGES
            cute.arch.mbarrier_wait(full + stage, (i // STAGES) % 2)
            if sCtl[CTL_GO, stage] == 0:
                go = Int32(0)
            else:
                # cp.async and plain smem writes -> visible to the wgmma (async proxy)
                cute.arch.fence_view_async_shared()
                self.by_width(step, sCtl, stage)
                cute.arch.mbarrier_arrive(empty + stage)
                i = i + 1

    @cute.jit
    def consume_p(self, mK: cute.Tensor, mdV: cute.Tensor, sQ: cute.Tensor, sdO: cute.Tensor, sK: cute.Tensor,
                  sPx: cute.Tensor, sKeyMask: cute.Tensor, sLSE: cute.Tensor, sCtl: cute.Tensor,
                  full, empty, plain: cute.TiledCopy, scale_log2: Float32, h: Int32, b: Int32, t0: Int32,
                  ctid: Int32):
        """Consumer WG 0: per window S^T, P^T (-> exchange buffer), dV += P^T dO; then dV out."""
        mma_kv, thr_kv, tVrdOt, acc_dV, per_width = self.operands(sK, sQ, sdO, ctid)

        @cute.jit
        def step(wi: cutlass.Constexpr, stage: Int32):
            pw = per_width[wi]
            tVrP, tScS = pw[3], pw[5]
            acc_S, S = self.first_gemm(pw, stage)
            # -inf LSE (a row without keys) stays -inf: such a row has no selected pair
            lse = self.column_stats(S, tScS, sLSE, stage)
            # row slot -> packed query (Note [packed rows, narrow windows])
            qbit = []
            for cc in cutlass.range_constexpr(cute.size(S, mode=[1])):
                qbit.append(tScS[0, cc][1] // self.g)
            for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
                msk = sKeyMask[tScS[r, 0][0], stage]
                for cc in cutlass.range_constexpr(cute.size(S, mode=[1])):
                    p_val = Float32(0.0)  # unselected pairs may hold anything (even inf): select, not scale
                    if C.selected(msk, qbit[cc], self.wq):
                        p_val = cute.math.exp2(S[r, cc] * scale_log2 - lse[cc] * C.LOG2_E, fastmath=True)
                    S[r, cc] = p_val
            # WG 1 has read the previous P^T (its first arrival frees the buffer at the start).
            cute.arch.barrier(barrier_id=P_EMPTY, number_of_threads=2 * WG_THREADS)
            for j in cutlass.range_constexpr(cute.size(acc_S)):
                sPx[ctid, j] = acc_S[j]
            cute.arch.barrier_arrive(barrier_id=P_FULL, number_of_threads=2 * WG_THREADS)
            convert_to_16bit(acc_as_operand_a(acc_S), tVrP)
            wgmma_gemm(mma_kv, acc_dV, tVrP, tVrdOt[None, None, None, stage], False)
            warpgroup.wait_group(0)

        self.window_loop(step, sCtl, full, empty)
        # Matches WG 1's arrival after the last window it read.
        cute.arch.barrier(barrier_id=P_EMPTY, number_of_threads=2 * WG_THREADS)
        # sK is WG 0's alone (WG 1 reads sV, sQ, sdO) and its last wgmma has completed.
        self.store_rows(thr_kv, acc_dV, None, sK, mdV, plain, mK.shape[1], h, b, t0, ctid, 0)

    @cute.jit
    def consume_ds(self, mK: cute.Tensor, mdK: cute.Tensor, sQ: cute.Tensor, sdO: cute.Tensor, sV: cute.Tensor,
                   sPx: cute.Tensor, sDelta: cute.Tensor, sCtl: cute.Tensor, full, empty,
                   plain: cute.TiledCopy, softmax_scale: Float32, h: Int32, b: Int32, t0: Int32, ctid: Int32):
        """Consumer WG 1: per window dP^T, dS^T = P^T (dP^T - delta) with WG 0's P^T, dK += dS^T Q;
        then dK * scale out."""
        mma_kv, thr_kv, tKrQt, acc_dK, per_width = self.operands(sV, sdO, sQ, ctid)
        # The exchange buffer starts free.
        cute.arch.barrier_arrive(barrier_id=P_EMPTY, number_of_threads=2 * WG_THREADS)

        @cute.jit
        def step(wi: cutlass.Constexpr, stage: Int32):
            pw = per_width[wi]
            tKrdS, acc_shape, tScS = pw[3], pw[4], pw[5]
            acc_dP, dP = self.first_gemm(pw, stage)
            delta = self.column_stats(dP, tScS, sDelta, stage)
            rP = cute.make_rmem_tensor(acc_shape, Float32)
            cute.arch.barrier(barrier_id=P_FULL, number_of_threads=2 * WG_THREADS)
            for j in cutlass.range_constexpr(cute.size(rP)):
                rP[j] = sPx[ctid, j]
            cute.arch.barrier_arrive(barrier_id=P_EMPTY, number_of_threads=2 * WG_THREADS)
            # Select, not scale: the V row of a key no query selects may hold anything (even NaN).
            # WG 0 wrote P^T = 0 on every unselected pair, so P^T != 0 implies selected (a selected
            # pair whose P underflowed to 0 gets dS 0, as 0 * (dP - delta) would for finite dP).
            P = acc_mn_view(rP)
            for r in cutlass.range_constexpr(cute.size(dP, mode=[0])):
                for cc in cutlass.range_constexpr(cute.size(dP, mode=[1])):
                    ds = Float32(0.0)
                    if P[r, cc] != Float32(0.0):
                        ds = P[r, cc] * (dP[r, cc] - delta[cc])
                    dP[r, cc] = ds
            convert_to_16bit(acc_as_operand_a(acc_dP), tKrdS)
            wgmma_gemm(mma_kv, acc_dK, tKrdS, tKrQt[None, None, None, stage], False)
            warpgroup.wait_group(0)

        self.window_loop(step, sCtl, full, empty)
        # sV is WG 1's alone and its last wgmma has completed.
        self.store_rows(thr_kv, acc_dK, softmax_scale, sV, mdK, plain, mK.shape[1], h, b, t0, ctid, 1)

    @cute.jit
    def store_rows(self, thr_kv: cute.core.ThrMma, acc: cute.Tensor, scale, sX: cute.Tensor, mX: cute.Tensor,
                   plain: cute.TiledCopy, kv_len: Int32, h: Int32, b: Int32, t0: Int32, ctid: Int32,
                   wg: cutlass.Constexpr):
        """acc (64 keys, D) [* scale] -> bf16 -> sX (a (64, D) tile only this warpgroup uses) ->
        16-byte stores of the rows of keys < kv_len."""
        D = self.d
        r16 = cute.make_fragment_like(acc, cutlass.BFloat16)
        if const_expr(scale is None):
            r16.store(acc.load().to(cutlass.BFloat16))
        else:
            r16.store((acc.load() * scale).to(cutlass.BFloat16))
        r_mn = acc_mn_view(r16)
        tXcX = acc_mn_view(thr_kv.partition_C(cute.make_identity_tensor((KEYS, D))))
        for r in cutlass.range_constexpr(cute.size(r_mn, mode=[0])):
            key = tXcX[r, 0][0]
            for cc in cutlass.range_constexpr(cute.size(r_mn, mode=[1])):
                sX[key, tXcX[0, cc][1]] = r_mn[r, cc]
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER + wg, number_of_threads=WG_THREADS)
        thr_plain = plain.get_slice(ctid)
        tXsX = thr_plain.partition_S(sX)
        tXcK = thr_plain.partition_S(cute.make_identity_tensor((KEYS, D)))
        for m in cutlass.range_constexpr(cute.size(tXsX, mode=[1])):
            key = t0 + tXcK[0, m, 0][0]
            if key < kv_len:
                C.copy_row(plain, C.row_ptr(mX, (b, key, h, 0)), tXsX, tXcK, m, D, to_gmem=True)
