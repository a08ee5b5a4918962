"""Windowed indexed-attention backward, dK/dV part, for Hopper: warp-specialised, wgmma.

Same contract as ``bwd_dkdv.py`` (the portable ``mma.sync`` kernel, kept for SM100 and as
``dkdv_impl="mma"``): key-major, every key's windows in ascending order, no atomics, bitwise
reproducible, exact zeros for keys no query selects. What changes is the shape of the work:

One CTA per (64 keys = plan tiles 2c and 2c + 1, kv head h, batch b), 384 threads:

    producer WG (warps 0-3)   merges the two tiles' window lists (ascending, each window once) and,
                              per window, cp.asyncs its 64 Q and dO rows into one of 2 stages, and
                              writes the query bitmask of each of the 64 keys, the rows' LSE (log2)
                              and delta, and which key half any window query selects; then an end
                              marker. Completion: one cp.async-tracked and one plain mbarrier
                              arrival per producer thread.
    consumer WG w (w = 0, 1)  owns keys 32w .. 32w + 31. Per window that selects any of them:
                                S = Q K_w^T, dP = dO V_w^T              wgmma m64n32, smem x smem
                                P = exp2(S log2e scale - lse), dS = P (dP - delta) on selected
                                pairs (0 elsewhere) -> bf16 in smem as (key, row)
                                dV_w^T += dO^T P, dK_w^T += Q^T dS      wgmma, D/64 x m64n32, A read
                                                                        MN-major from the same smem
                              and releases the stage. At the end dK * scale and dV go through smem
                              to 16-byte row stores.

    producer ──Q/dO rows, key masks, LSE/delta (2 stages, mbarriers)──▶ WG 0 (keys 0-31)
                                                                       WG 1 (keys 32-63)

Compared with the portable kernel (8 warps, 32 keys, two CTA-wide barriers per pair) the window's
rows are fetched while both warpgroups compute, a window serves 64 keys with one Q/dO load, and
the two warpgroups do not wait for each other. The accumulation order is fixed (window order, then
the MMA's k order), so results are bitwise reproducible; they are not bitwise those of the
``mma.sync`` kernel (another summation order inside a pair).

Tensors: mQ/mdO [B, Lq, Hq, D] bf16, mK/mV/mdK/mdV [B, Lkv, Hkv, D] bf16, mLSE/mDelta [B, Hq, Lq] fp32;
plan as in ``plan.py``.
"""

from __future__ import annotations

import operator

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import warpgroup

from cute_kernels.common.utils import acc_mn_view, transpose_view, wgmma_gemm, wgmma_smem_layout

from . import common as C
from .config import KEY_TILE, TILE_M, AttnConfig

#: Keys per CTA: one plan tile per consumer warpgroup.
KEYS = 2 * KEY_TILE
WG_THREADS = 128
THREADS = 3 * WG_THREADS
STAGES = 2
# setmaxnreg split: 128 * 40 + 256 * 232 <= 64K registers.
PRODUCER_REGS, CONSUMER_REGS = 40, 232
#: Named barrier of consumer warpgroup w: CONSUMER_BARRIER + w (0 is the CTA barrier).
CONSUMER_BARRIER = 1
NO_WINDOW = 0x7FFFFFFF
# sCtl[field, stage]
CTL_GO, CTL_HALF0, CTL_HALF1 = 0, 1, 2


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
        p_ds = 2 * KEYS * TILE_M * 2
        meta = STAGES * (KEYS + 2 * TILE_M + 4) * 4
        barriers = 2 * STAGES * 8
        return q_do + k_v + p_ds + meta + barriers + 6 * 1024  # + 1 KiB alignment per operand buffer

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE: cute.Tensor, mDelta: cute.Tensor, mWinKey: cute.Tensor, mWinMask: cute.Tensor,
                 mWinCount: cute.Tensor, mTilePtr: cute.Tensor, mTileWin: cute.Tensor,
                 mTileStart: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, softmax_scale: Float32,
                 stream):
        bf16 = cutlass.BFloat16
        sQ_layout = wgmma_smem_layout(bf16, (TILE_M, self.d, STAGES))  # (64 rows, D, stage)
        sKV_layout = wgmma_smem_layout(bf16, (KEY_TILE, self.d, 2))  # (32 keys, D, half)
        sP_layout = wgmma_smem_layout(bf16, (KEY_TILE, TILE_M, 2))  # (32 keys, 64 rows, half)

        @cute.struct
        class SharedStorage:
            mbar_full: cute.struct.MemRange[Int64, STAGES]
            mbar_empty: cute.struct.MemRange[Int64, STAGES]
            sQ: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sKV_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sP_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sP_layout)], 1024]
            sKeyMask: cute.struct.Align[cute.struct.MemRange[Int32, KEYS * STAGES], 16]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, TILE_M * STAGES], 16]
            sDelta: cute.struct.Align[cute.struct.MemRange[Float32, TILE_M * STAGES], 16]
            sCtl: cute.struct.Align[cute.struct.MemRange[Int32, 4 * STAGES], 16]

        g2s, plain = C.gmem_copies(bf16, WG_THREADS, self.d)
        num_tiles = cute.ceil_div(mK.shape[1], KEY_TILE)
        grid = [cute.ceil_div(num_tiles, 2), self.cfg.num_kv_heads, mK.shape[0]]
        self.kernel(mQ, mK, mV, mdO, mLSE, mDelta, mWinKey, mWinMask, mWinCount, mTilePtr, mTileWin,
                    mTileStart, mdK, mdV, softmax_scale * C.LOG2_E, softmax_scale, sQ_layout, sKV_layout,
                    sP_layout, g2s, plain, SharedStorage).launch(
            grid=grid, block=[THREADS, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream,
            min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
               mLSE: cute.Tensor, mDelta: cute.Tensor, mWinKey: cute.Tensor, mWinMask: cute.Tensor,
               mWinCount: cute.Tensor, mTilePtr: cute.Tensor, mTileWin: cute.Tensor,
               mTileStart: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, scale_log2: Float32,
               softmax_scale: Float32, sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout,
               sP_layout: cute.ComposedLayout, g2s: cute.TiledCopy, plain: cute.TiledCopy,
               SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        c, h, b = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        s = b
        if const_expr(self.cfg.per_kv_head):
            s = b * self.cfg.num_kv_heads + h

        storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
        full = storage.mbar_full.data_ptr()
        empty = storage.mbar_empty.data_ptr()
        if tidx == 0:
            for i in cutlass.range_constexpr(STAGES):
                # full: per producer thread one cp.async-tracked and one plain arrival;
                # empty: every consumer thread.
                cute.arch.mbarrier_init(full + i, 2 * WG_THREADS)
                cute.arch.mbarrier_init(empty + i, 2 * WG_THREADS)
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sV = storage.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
        sdS = storage.sdS.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
        sKeyMask = storage.sKeyMask.get_tensor(cute.make_layout((KEYS, STAGES)))
        sLSE = storage.sLSE.get_tensor(cute.make_layout((TILE_M, STAGES)))
        sDelta = storage.sDelta.get_tensor(cute.make_layout((TILE_M, STAGES)))
        sCtl = storage.sCtl.get_tensor(cute.make_layout((4, STAGES)))
        t0 = c * KEYS

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            self.produce(mQ, mK, mV, mdO, mLSE, mDelta, mWinKey, mWinMask, mWinCount, mTilePtr, mTileWin,
                         mTileStart, sQ, sdO, sK, sV, sKeyMask, sLSE, sDelta, sCtl, full, empty, g2s, s, h, b,
                         t0, tidx)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            wg = warp_idx // 4 - 1
            self.consume(mK, mdK, mdV, sQ, sdO, sK, sV, sP, sdS, sKeyMask, sLSE, sDelta, sCtl, full, empty,
                         plain, scale_log2, softmax_scale, h, b, t0, wg, tidx - WG_THREADS * (wg + 1))

    # ------------------------------------------------------------------ producer
    @cute.jit
    def produce(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                mLSE: cute.Tensor, mDelta: cute.Tensor, mWinKey: cute.Tensor, mWinMask: cute.Tensor,
                mWinCount: cute.Tensor, mTilePtr: cute.Tensor, mTileWin: cute.Tensor,
                mTileStart: cute.Tensor, sQ: cute.Tensor, sdO: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor,
                sKeyMask: cute.Tensor, sLSE: cute.Tensor, sDelta: cute.Tensor, sCtl: cute.Tensor, full,
                empty, g2s: cute.TiledCopy, s: Int32, h: Int32, b: Int32, t0: Int32, ptid: Int32):
        D = self.d
        kv_len = mK.shape[1]
        num_tiles = (kv_len + KEY_TILE - 1) // KEY_TILE
        thr = g2s.get_slice(ptid)
        tQsQ = thr.partition_D(sQ)  # (CPY, M, K, stage)
        tQsdO = thr.partition_D(sdO)
        tQcQ = thr.partition_S(cute.make_identity_tensor((TILE_M, D)))
        tKsK = thr.partition_D(sK)  # (CPY, M, K, half)
        tKsV = thr.partition_D(sV)
        tKcK = thr.partition_S(cute.make_identity_tensor((KEY_TILE, D)))

        # The CTA's K and V rows (zeros past kv_len); covered by the first stage's cp.async arrival.
        for half in cutlass.range_constexpr(2):
            tKsK_h = tKsK[None, None, None, half]
            tKsV_h = tKsV[None, None, None, half]
            for m in cutlass.range_constexpr(cute.size(tKsK_h, mode=[1])):
                key = t0 + half * KEY_TILE + tKcK[0, m, 0][0]
                if key < kv_len:
                    C.copy_row(g2s, C.row_ptr(mK, (b, key, h, 0)), tKsK_h, tKcK, m, D)
                    C.copy_row(g2s, C.row_ptr(mV, (b, key, h, 0)), tKsV_h, tKcK, m, D)
                else:
                    tKsK_h[None, m, None].fill(0)
                    tKsV_h[None, m, None].fill(0)

        # Merge the window lists of tiles ta = t0 / 32 and ta + 1 (both ascending; a window in
        # both is visited once, its keys >= t0 start at the first list's mTileStart).
        row_a = s * num_tiles + t0 // KEY_TILE
        pa = mTilePtr[row_a]
        pa_end = mTilePtr[row_a + 1]
        pb = pa_end
        pb_end = pa_end
        if t0 // KEY_TILE + 1 < num_tiles:
            pb_end = mTilePtr[row_a + 2]
        remaining = pb_end - pa
        i = Int32(0)
        while remaining > 0:
            wa = Int32(NO_WINDOW)
            wb = Int32(NO_WINDOW)
            if pa < pa_end:
                wa = mTileWin[pa]
            if pb < pb_end:
                wb = mTileWin[pb]
            w = cutlass.min(wa, wb)
            start = Int32(0)
            if wa == w:
                start = mTileStart[pa]
                pa = pa + 1
            else:
                start = mTileStart[pb]
            if wb == w:
                pb = pb + 1
            remaining = (pa_end - pa) + (pb_end - pb)
            # The window's entries for these keys are read before waiting for a free stage, so
            # their latency overlaps the wait (Note [rows of selecting queries only]).
            keys, masks, qsel = self.window_keys(mWinKey, mWinMask, mWinCount, w, start, s, t0, ptid % 32)
            stage = i % STAGES
            if i >= STAGES:
                cute.arch.mbarrier_wait(empty + stage, ((i // STAGES) % 2) ^ 1)
            self.load_window(mQ, mdO, mLSE, mDelta, tQsQ, tQsdO, tQcQ, g2s, sKeyMask, sLSE, sDelta, sCtl, w,
                             keys, masks, qsel, stage, h, b, t0, ptid)
            cute.arch.cp_async_mbarrier_arrive_noinc(full + stage)
            cute.arch.mbarrier_arrive(full + stage)
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
    def window_keys(self, mWinKey: cute.Tensor, mWinMask: cute.Tensor, mWinCount: cute.Tensor, w: Int32,
                    start: Int32, s: Int32, t0: Int32, lane: Int32):
        """Lane l's two entries of window ``w`` among the CTA's keys: (key - t0, query mask) at
        positions start + l and start + 32 + l (key -1 / mask 0 when outside), and the OR of all
        64 masks over the warp (which window queries select any of these keys). Keys are sorted and
        distinct, so those in [t0, t0 + 64) are at most the 64 positions from ``start``."""
        cnt = mWinCount[s, w]
        key0 = Int32(-1)
        key1 = Int32(-1)
        mask0 = Int32(0)
        mask1 = Int32(0)
        pos = start + lane
        if pos < cnt:
            key = mWinKey[s, w, pos]
            if key < t0 + KEYS:
                key0 = key - t0
                mask0 = mWinMask[s, w, pos]
        if pos + 32 < cnt:
            key = mWinKey[s, w, pos + 32]
            if key < t0 + KEYS:
                key1 = key - t0
                mask1 = mWinMask[s, w, pos + 32]
        keys = [key0, key1]
        masks = [mask0, mask1]
        qsel = C.row_allreduce(mask0 | mask1, 32, operator.or_)
        return keys, masks, qsel

    @cute.jit
    def load_window(self, mQ: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mDelta: cute.Tensor,
                    tQsQ: cute.Tensor, tQsdO: cute.Tensor, tQcQ: cute.Tensor, g2s: cute.TiledCopy,
                    sKeyMask: cute.Tensor, sLSE: cute.Tensor, sDelta: cute.Tensor, sCtl: cute.Tensor, w: Int32,
                    keys: list, masks: list, qsel: Int32, stage: Int32, h: Int32, b: Int32, t0: Int32,
                    ptid: Int32):
        """Stage ``stage`` <- window ``w``: Q / dO rows of the queries in ``qsel`` (cp.async; zeros for
        the other rows), and with plain stores the query bitmask of each of the CTA's keys and which
        key halves are selected at all (warp 0), the rows' LSE in log2 units and delta (warps 2-3).

        Note [rows of selecting queries only]: a (CTA, window) pair typically touches a few 4-token
        blocks of the CTA's 64 keys, chosen by some of the window's queries; the rows of the other
        queries only ever meet P = dS = 0, so they are written as zeros instead of read from global
        memory (the pass is bound by these reads at long contexts). Zeros, not stale rows: 0 * x
        must stay 0 for every x the previous window held."""
        G = self.g
        D = self.d
        q0 = w * self.wq
        rows_valid = cutlass.min(mQ.shape[1] - q0, self.wq) * G
        C.gather_window_rows(g2s, mQ, mdO, tQsQ[None, None, None, stage], tQsdO[None, None, None, stage], tQcQ,
                             rows_valid, G, D, h, b, q0, qsel)
        warp = ptid // 32
        lane = ptid % 32
        if warp == 0:
            sKeyMask[lane, stage] = Int32(0)
            sKeyMask[lane + KEY_TILE, stage] = Int32(0)
            cute.arch.sync_warp()
            in0 = Int32(0)
            in1 = Int32(0)
            for j in cutlass.range_constexpr(2):
                key = keys[j]
                if key >= 0:
                    sKeyMask[key, stage] = masks[j]
                    if key < KEY_TILE:
                        in0 = Int32(1)
                    else:
                        in1 = Int32(1)
            any0 = cute.arch.vote_ballot_sync(in0 != 0)
            any1 = cute.arch.vote_ballot_sync(in1 != 0)
            if lane == 0:
                sCtl[CTL_GO, stage] = Int32(1)
                sCtl[CTL_HALF0, stage] = any0
                sCtl[CTL_HALF1, stage] = any1
        elif warp >= 2:
            r = ptid - 2 * 32
            lse2, delta = C.window_row_stats(mLSE, mDelta, r, rows_valid, G, h, b, q0)
            sLSE[r, stage] = lse2
            sDelta[r, stage] = delta

    # ------------------------------------------------------------------ consumers
    @cute.jit
    def consume(self, mK: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, sQ: cute.Tensor, sdO: cute.Tensor,
                sK: cute.Tensor, sV: cute.Tensor, sP: cute.Tensor, sdS: cute.Tensor, sKeyMask: cute.Tensor,
                sLSE: cute.Tensor, sDelta: cute.Tensor, sCtl: cute.Tensor, full, empty,
                plain: cute.TiledCopy, scale_log2: Float32, softmax_scale: Float32, h: Int32, b: Int32,
                t0: Int32, wg: Int32, ctid: Int32):
        D = self.d
        bf16 = cutlass.BFloat16
        mma_s = sm90_utils.make_trivial_tiled_mma(
            bf16, bf16, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, Float32,
            atom_layout_mnk=(1, 1, 1), tiler_mn=(TILE_M, KEY_TILE))
        mma_kv = sm90_utils.make_trivial_tiled_mma(
            bf16, bf16, warpgroup.OperandMajorMode.MN, warpgroup.OperandMajorMode.K, Float32,
            atom_layout_mnk=(1, 1, 1), tiler_mn=(64, KEY_TILE))
        thr_s = mma_s.get_slice(ctid)
        thr_kv = mma_kv.get_slice(ctid)
        sK_w = sK[None, None, wg]
        sV_w = sV[None, None, wg]
        sP_w = sP[None, None, wg]
        sdS_w = sdS[None, None, wg]
        # S / dP: A = Q / dO rows (64, D), B = this half's K / V (32, D), both K-major.
        tSrQ = thr_s.make_fragment_A(thr_s.partition_A(sQ))  # (.., .., k, stage)
        tSrdO = thr_s.make_fragment_A(thr_s.partition_A(sdO))
        tSrK = thr_s.make_fragment_B(thr_s.partition_B(sK_w))
        tSrV = thr_s.make_fragment_B(thr_s.partition_B(sV_w))
        # dV^T / dK^T (D, 32): A = dO^T / Q^T read MN-major from the same tiles, B = P / dS (32, 64).
        tKrdOt = thr_kv.make_fragment_A(thr_kv.partition_A(transpose_view(sdO)))  # (.., .., k, stage)
        tKrQt = thr_kv.make_fragment_A(thr_kv.partition_A(transpose_view(sQ)))
        tKrP = thr_kv.make_fragment_B(thr_kv.partition_B(sP_w))
        tKrdS = thr_kv.make_fragment_B(thr_kv.partition_B(sdS_w))
        acc_dV = cute.make_rmem_tensor(thr_kv.partition_shape_C((D, KEY_TILE)), Float32)
        acc_dK = cute.make_rmem_tensor(thr_kv.partition_shape_C((D, KEY_TILE)), Float32)
        acc_dV.fill(0.0)
        acc_dK.fill(0.0)
        acc_shape_S = thr_s.partition_shape_C((TILE_M, KEY_TILE))
        tScS = acc_mn_view(thr_s.partition_C(cute.make_identity_tensor((TILE_M, KEY_TILE))))

        i = Int32(0)
        go = Int32(1)
        while go != 0:
            stage = i % STAGES
            cute.arch.mbarrier_wait(full + stage, (i // STAGES) % 2)
            if sCtl[CTL_GO, stage] == 0:
                go = Int32(0)
            else:
                if sCtl[CTL_HALF0 + wg, stage] != 0:
                    # cp.async and plain smem writes -> visible to the wgmma (async proxy)
                    cute.arch.fence_view_async_shared()
                    self.window_step(mma_s, mma_kv, tSrQ, tSrdO, tSrK, tSrV, tKrdOt, tKrQt, tKrP, tKrdS,
                                     acc_dV, acc_dK, acc_shape_S, tScS, sP_w, sdS_w, sKeyMask, sLSE, sDelta,
                                     scale_log2, stage, wg)
                cute.arch.mbarrier_arrive(empty + stage)
                i = i + 1

        # Epilogue: dK * scale, dV -> bf16 -> this half's sK / sV rows (no wgmma of this warpgroup
        # reads them any more; the other half is another region) -> 16-byte row stores.
        rdK = cute.make_fragment_like(acc_dK, bf16)
        rdK.store((acc_dK.load() * softmax_scale).to(bf16))
        rdV = cute.make_fragment_like(acc_dV, bf16)
        rdV.store(acc_dV.load().to(bf16))
        rdK_mn = acc_mn_view(rdK)
        rdV_mn = acc_mn_view(rdV)
        tKcC = acc_mn_view(thr_kv.partition_C(cute.make_identity_tensor((D, KEY_TILE))))
        for r in cutlass.range_constexpr(cute.size(rdK_mn, mode=[0])):
            d = tKcC[r, 0][0]
            for cc in cutlass.range_constexpr(cute.size(rdK_mn, mode=[1])):
                key = tKcC[0, cc][1]
                sK_w[key, d] = rdK_mn[r, cc]
                sV_w[key, d] = rdV_mn[r, cc]
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER + wg, number_of_threads=WG_THREADS)
        kv_len = mK.shape[1]
        thr_plain = plain.get_slice(ctid)
        tKsdK = thr_plain.partition_S(sK_w)
        tKsdV = thr_plain.partition_S(sV_w)
        tKcK = thr_plain.partition_S(cute.make_identity_tensor((KEY_TILE, D)))
        for m in cutlass.range_constexpr(cute.size(tKsdK, mode=[1])):
            key = t0 + wg * KEY_TILE + tKcK[0, m, 0][0]
            if key < kv_len:
                C.copy_row(plain, C.row_ptr(mdK, (b, key, h, 0)), tKsdK, tKcK, m, D, to_gmem=True)
                C.copy_row(plain, C.row_ptr(mdV, (b, key, h, 0)), tKsdV, tKcK, m, D, to_gmem=True)

    @cute.jit
    def window_step(self, mma_s: cute.TiledMma, mma_kv: cute.TiledMma, tSrQ: cute.Tensor, tSrdO: cute.Tensor,
                    tSrK: cute.Tensor, tSrV: cute.Tensor, tKrdOt: cute.Tensor, tKrQt: cute.Tensor,
                    tKrP: cute.Tensor, tKrdS: cute.Tensor, acc_dV: cute.Tensor, acc_dK: cute.Tensor,
                    acc_shape_S: cutlass.Constexpr, tScS: cute.Tensor, sP_w: cute.Tensor, sdS_w: cute.Tensor,
                    sKeyMask: cute.Tensor, sLSE: cute.Tensor, sDelta: cute.Tensor, scale_log2: Float32,
                    stage: Int32, wg: Int32):
        """One window for this warpgroup's 32 keys: S, dP; P, dS -> smem; dV^T, dK^T += ..."""
        G = self.g
        acc_S = cute.make_rmem_tensor(acc_shape_S, Float32)
        acc_dP = cute.make_rmem_tensor(acc_shape_S, Float32)
        wgmma_gemm(mma_s, acc_S, tSrQ[None, None, None, stage], tSrK, True)
        wgmma_gemm(mma_s, acc_dP, tSrdO[None, None, None, stage], tSrV, True)
        warpgroup.wait_group(0)
        S = acc_mn_view(acc_S)
        dP = acc_mn_view(acc_dP)
        for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
            row = tScS[r, 0][0]
            qbit = row // G
            lse2 = sLSE[row, stage]
            delta = sDelta[row, stage]
            for cc in cutlass.range_constexpr(cute.size(S, mode=[1])):
                msk = sKeyMask[wg * KEY_TILE + tScS[0, cc][1], stage]
                p_val = Float32(0.0)
                ds = Float32(0.0)  # unselected keys may hold anything (even NaN): select, not scale
                if C.selected(msk, qbit, self.wq):
                    p_val = cute.math.exp2(S[r, cc] * scale_log2 - lse2, fastmath=True)
                    ds = p_val * (dP[r, cc] - delta)
                S[r, cc] = p_val
                dP[r, cc] = ds
        rP = cute.make_fragment_like(acc_S, cutlass.BFloat16)
        rP.store(acc_S.load().to(cutlass.BFloat16))
        rdS = cute.make_fragment_like(acc_dP, cutlass.BFloat16)
        rdS.store(acc_dP.load().to(cutlass.BFloat16))
        rP_mn = acc_mn_view(rP)
        rdS_mn = acc_mn_view(rdS)
        for r in cutlass.range_constexpr(cute.size(rP_mn, mode=[0])):
            row = tScS[r, 0][0]
            for cc in cutlass.range_constexpr(cute.size(rP_mn, mode=[1])):
                key = tScS[0, cc][1]
                sP_w[key, row] = rP_mn[r, cc]
                sdS_w[key, row] = rdS_mn[r, cc]
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER + wg, number_of_threads=WG_THREADS)
        wgmma_gemm(mma_kv, acc_dV, tKrdOt[None, None, None, stage], tKrP, False)
        wgmma_gemm(mma_kv, acc_dK, tKrQt[None, None, None, stage], tKrdS, False)
        warpgroup.wait_group(0)
