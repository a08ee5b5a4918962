"""Windowed indexed-attention backward, dK/dV part: key-major, deterministic, no atomics.

One program per (32-key tile t, kv head h, batch b). The tile's K and V rows stay in shared memory;
the program walks the windows that select any of its keys, in ascending window order (the plan's
transpose ``mTileWin[mTilePtr[row] : mTilePtr[row + 1]]``, row = s * NT + t), and per window:

    1. cp.async the window's Q and dO rows (64 = WQ queries x G heads), its LSE and delta rows, and
       the window queries' bitmask of each of the tile's 32 keys (from the window's sorted key list,
       starting at ``mTileStart``)
    2. S^T = K Q^T, dP^T = V dO^T                     (32 x 64, mma.sync, 8 warps as 2 x 4)
    3. P^T = exp2(S^T * scale * log2 e - lse * log2 e) on selected pairs, 0 elsewhere;
       dS^T = P^T * (dP^T - delta)                    -> bf16 in shared memory
    4. dV += P^T dO, dK += dS^T Q                     (32 x D fp32 accumulators in registers)

then writes dK * scale and dV once, as bf16. Tiles no window selects write exact zeros. The
summation order is fixed by the plan, so dK/dV are bitwise reproducible.
Tensors: mQ/mdO [B, Lq, Hq, D] bf16, mK/mV/mdK/mdV [B, Lkv, Hkv, D] bf16, mLSE/mDelta [B, Hq, Lq] fp32.
"""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from . import common as C
from .config import KEY_TILE, TILE_M, AttnConfig

THREADS = 256


class IndexedBwdDKDV:
    def __init__(self, cfg: AttnConfig):
        self.cfg = cfg
        self.stages = cfg.dkdv_stages
        # The one-ahead plan reads ride on the double buffer (Note [metadata ahead]).
        self.meta_ahead = cfg.meta_ahead and self.stages == 2
        self.skip_empty = cfg.skip_empty
        self.d = cfg.head_dim
        self.g = cfg.group
        self.wq = cfg.window_queries

    @staticmethod
    def smem_bytes(cfg: AttnConfig) -> int:
        st = cfg.dkdv_stages
        return ((2 * KEY_TILE + 2 * TILE_M * st) * cfg.head_dim + 2 * KEY_TILE * TILE_M) * 2 \
            + st * (KEY_TILE * 4 + 2 * TILE_M * 4)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE: cute.Tensor, mDelta: cute.Tensor, mWinKey: cute.Tensor, mWinMask: cute.Tensor,
                 mWinCount: cute.Tensor, mTilePtr: cute.Tensor, mTileWin: cute.Tensor,
                 mTileStart: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, softmax_scale: Float32,
                 stream):
        bf16 = cutlass.BFloat16
        sQ_layout = C.smem_layout(bf16, TILE_M, self.d, self.stages)
        sKV_layout = C.smem_layout(bf16, KEY_TILE, self.d)
        sP_layout = C.smem_layout(bf16, KEY_TILE, TILE_M)

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sKV_layout)], 1024]
            sPt: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sP_layout)], 1024]
            sdSt: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sP_layout)], 1024]
            sKeyMask: cute.struct.Align[cute.struct.MemRange[Int32, KEY_TILE * self.stages], 16]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, TILE_M * self.stages], 16]
            sDelta: cute.struct.Align[cute.struct.MemRange[Float32, TILE_M * self.stages], 16]

        g2s, plain = C.gmem_copies(bf16, THREADS, self.d)
        tiled_mma = C.mma_bf16(2, 4)
        num_tiles = cute.ceil_div(mK.shape[1], KEY_TILE)
        grid = [num_tiles, self.cfg.num_kv_heads, mK.shape[0]]
        self.kernel(mQ, mK, mV, mdO, mLSE, mDelta, mWinKey, mWinMask, mWinCount, mTilePtr, mTileWin,
                    mTileStart, mdK, mdV, softmax_scale * C.LOG2_E, softmax_scale, sQ_layout,
                    sKV_layout, sP_layout, g2s, plain, tiled_mma, SharedStorage).launch(
            grid=grid, block=[THREADS, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
               mLSE: cute.Tensor, mDelta: cute.Tensor, mWinKey: cute.Tensor, mWinMask: cute.Tensor,
               mWinCount: cute.Tensor, mTilePtr: cute.Tensor, mTileWin: cute.Tensor,
               mTileStart: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, scale_log2: Float32,
               softmax_scale: Float32, sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout,
               sP_layout: cute.ComposedLayout, g2s: cute.TiledCopy, plain: cute.TiledCopy,
               tiled_mma: cute.TiledMma, SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        t, h, b = cute.arch.block_idx()
        G = self.g
        D = self.d
        lane = tidx % 32
        kv_len = mK.shape[1]
        num_q = mQ.shape[1]
        num_tiles = (kv_len + KEY_TILE - 1) // KEY_TILE
        t0 = t * KEY_TILE
        s = b
        if cutlass.const_expr(self.cfg.per_kv_head):
            s = b * self.cfg.num_kv_heads + h
        row = s * num_tiles + t
        p0 = mTilePtr[row]
        p1 = mTilePtr[row + 1]

        storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
        sQ_all = storage.sQ.get_tensor(sQ_layout)  # (64, D, stages)
        sdO_all = storage.sdO.get_tensor(sQ_layout)
        sQ = sQ_all[None, None, 0]  # one stage: the shape MMA fragments are made for
        sdO = sdO_all[None, None, 0]
        sK = storage.sK.get_tensor(sKV_layout)
        sV = storage.sV.get_tensor(sKV_layout)
        sPt = storage.sPt.get_tensor(sP_layout)
        sdSt = storage.sdSt.get_tensor(sP_layout)
        sKeyMask = storage.sKeyMask.get_tensor(cute.make_layout((KEY_TILE, self.stages)))
        sLSE = storage.sLSE.get_tensor(cute.make_layout((TILE_M, self.stages)))
        sDelta = storage.sDelta.get_tensor(cute.make_layout((TILE_M, self.stages)))
        sQt_all = C.transposed_view(sQ_all, TILE_M, D, self.stages)  # (D, 64, stages)
        sdOt_all = C.transposed_view(sdO_all, TILE_M, D, self.stages)
        sQt = sQt_all[None, None, 0]
        sdOt = sdOt_all[None, None, 0]

        thr_g2s = g2s.get_slice(tidx)
        tQsQ = thr_g2s.partition_D(sQ_all)  # (CPY, M, K, stages)
        tQsdO = thr_g2s.partition_D(sdO_all)
        tQcQ = thr_g2s.partition_S(cute.make_identity_tensor((TILE_M, D)))
        tKsK = thr_g2s.partition_D(sK)
        tKsV = thr_g2s.partition_D(sV)
        tKcK = thr_g2s.partition_S(cute.make_identity_tensor((KEY_TILE, D)))

        thr_mma = tiled_mma.get_slice(tidx)
        tSrK = thr_mma.make_fragment_A(thr_mma.partition_A(sK))
        tSrV = thr_mma.make_fragment_A(thr_mma.partition_A(sV))
        tSrQ = thr_mma.make_fragment_B(thr_mma.partition_B(sQ))
        tSrdO = thr_mma.make_fragment_B(thr_mma.partition_B(sdO))
        tdrPt = thr_mma.make_fragment_A(thr_mma.partition_A(sPt))
        tdrdSt = thr_mma.make_fragment_A(thr_mma.partition_A(sdSt))
        tdrdOt = thr_mma.make_fragment_B(thr_mma.partition_B(sdOt))
        tdrQt = thr_mma.make_fragment_B(thr_mma.partition_B(sQt))
        acc_dK = cute.make_rmem_tensor(thr_mma.partition_shape_C((KEY_TILE, D)), Float32)
        acc_dV = cute.make_rmem_tensor(thr_mma.partition_shape_C((KEY_TILE, D)), Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)
        copy_A, copy_B, copy_Bt = C.ldmatrix_copies(tiled_mma)
        thr_cA = copy_A.get_slice(tidx)
        thr_cB = copy_B.get_slice(tidx)
        thr_cBt = copy_Bt.get_slice(tidx)
        tSsK, tSrK_v = thr_cA.partition_S(sK), thr_cA.retile(tSrK)
        tSsV, tSrV_v = thr_cA.partition_S(sV), thr_cA.retile(tSrV)
        tSsQ, tSrQ_v = thr_cB.partition_S(sQ_all), thr_cB.retile(tSrQ)
        tSsdO, tSrdO_v = thr_cB.partition_S(sdO_all), thr_cB.retile(tSrdO)
        tdsPt, tdrPt_v = thr_cA.partition_S(sPt), thr_cA.retile(tdrPt)
        tdsdSt, tdrdSt_v = thr_cA.partition_S(sdSt), thr_cA.retile(tdrdSt)
        tdsdOt, tdrdOt_v = thr_cBt.partition_S(sdOt_all), thr_cBt.retile(tdrdOt)
        tdsQt, tdrQt_v = thr_cBt.partition_S(sQt_all), thr_cBt.retile(tdrQt)
        r2s = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.BFloat16),
                                     tiled_mma)
        thr_r2s = r2s.get_slice(tidx)

        tScS = C.mn_view(thr_mma.partition_C(cute.make_identity_tensor((KEY_TILE, TILE_M))))
        ns = SimpleNamespace(tiled_mma=tiled_mma, thr_mma=thr_mma, copy_A=copy_A, copy_B=copy_B,
                             copy_Bt=copy_Bt, r2s=r2s, thr_r2s=thr_r2s, tScS=tScS, scale_log2=scale_log2,
                             sKeyMask=sKeyMask, sLSE=sLSE, sDelta=sDelta, sPt=sPt, sdSt=sdSt,
                             tSrK=tSrK, tSrV=tSrV, tSrQ=tSrQ, tSrdO=tSrdO, tSsK=tSsK, tSrK_v=tSrK_v,
                             tSsV=tSsV, tSrV_v=tSrV_v, tSsQ=tSsQ, tSrQ_v=tSrQ_v, tSsdO=tSsdO,
                             tSrdO_v=tSrdO_v, tdrPt=tdrPt, tdrdSt=tdrdSt, tdrdOt=tdrdOt, tdrQt=tdrQt,
                             tdsPt=tdsPt, tdrPt_v=tdrPt_v, tdsdSt=tdsdSt, tdrdSt_v=tdrdSt_v,
                             tdsdOt=tdsdOt, tdrdOt_v=tdrdOt_v, tdsQt=tdsQt, tdrQt_v=tdrQt_v,
                             acc_dK=acc_dK, acc_dV=acc_dV)

        # ---- the tile's K and V rows ----
        C.gather_key_rows(g2s, mK, mV, tKsK, tKsV, tKcK, t0, kv_len, D, h, b)
        cute.arch.cp_async_commit_group()

        if cutlass.const_expr(self.meta_ahead):
            # Note [metadata ahead]: every global read the next pair needs before its cp.async or its
            # smem stores is issued one pair earlier into registers: pair p+2's (window, start) at the
            # top of pair p, its window's key count after pair p's GEMMs, and pair p+1's key masks /
            # LSE / delta at the top of pair p, stored to stage 1 - buf only after pair p's GEMMs. The
            # loads' latency hides behind the GEMMs instead of stalling each pair; same arithmetic.
            w_next = Int32(0)
            start_next = Int32(0)
            cnt_next = Int32(0)
            w_far = Int32(0)
            start_far = Int32(0)
            if p0 < p1:
                w0 = mTileWin[p0]
                start0 = mTileStart[p0]
                cnt0 = mWinCount[s, w0]
                self.issue_rows(mQ, mdO, g2s, tQsQ, tQsdO, tQcQ, w0, 0, h, b)
                k0, m0, l0, d0 = self.fetch_meta(mQ, mLSE, mDelta, mWinKey, mWinMask, w0, start0, cnt0, s, h, b, tidx)
                self.store_meta(sKeyMask, sLSE, sDelta, k0, m0, l0, d0, 0, t0, tidx)
                if p0 + 1 < p1:
                    w_next = mTileWin[p0 + 1]
                    start_next = mTileStart[p0 + 1]
                    cnt_next = mWinCount[s, w_next]
            cute.arch.cp_async_commit_group()
            for p in range(p0, p1):
                buf = (p - p0) % 2
                cute.arch.cp_async_wait_group(0)
                cute.arch.barrier()
                key_r = Int32(-1)
                mask_r = Int32(0)
                lse_r = Float32(0.0)
                delta_r = Float32(0.0)
                if p + 1 < p1:
                    self.issue_rows(mQ, mdO, g2s, tQsQ, tQsdO, tQcQ, w_next, 1 - buf, h, b)
                    key_r, mask_r, lse_r, delta_r = self.fetch_meta(mQ, mLSE, mDelta, mWinKey, mWinMask, w_next,
                                                                    start_next, cnt_next, s, h, b, tidx)
                cute.arch.cp_async_commit_group()
                if p + 2 < p1:
                    w_far = mTileWin[p + 2]
                    start_far = mTileStart[p + 2]
                self.compute_pair(ns, buf)
                if p + 1 < p1:
                    self.store_meta(sKeyMask, sLSE, sDelta, key_r, mask_r, lse_r, delta_r, 1 - buf, t0, tidx)
                if p + 2 < p1:
                    w_next = w_far
                    start_next = start_far
                    cnt_next = mWinCount[s, w_far]
        else:
            if cutlass.const_expr(self.stages == 2):
                if p0 < p1:
                    self.load_window(mQ, mdO, mLSE, mDelta, mWinKey, mWinMask, mWinCount, mTileWin, mTileStart,
                                     g2s, tQsQ, tQsdO, tQcQ, sKeyMask, sLSE, sDelta, p0, 0, s, h, b, t0, tidx)
                cute.arch.cp_async_commit_group()
            for p in range(p0, p1):
                buf = (p - p0) % self.stages
                # 1. the window's rows, stats and key masks (prefetched one window ahead with 2 stages)
                if cutlass.const_expr(self.stages == 1):
                    self.load_window(mQ, mdO, mLSE, mDelta, mWinKey, mWinMask, mWinCount, mTileWin, mTileStart,
                                     g2s, tQsQ, tQsdO, tQcQ, sKeyMask, sLSE, sDelta, p, 0, s, h, b, t0, tidx)
                    cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(0)
                cute.arch.barrier()
                if cutlass.const_expr(self.stages == 2):
                    if p + 1 < p1:
                        self.load_window(mQ, mdO, mLSE, mDelta, mWinKey, mWinMask, mWinCount, mTileWin,
                                         mTileStart, g2s, tQsQ, tQsdO, tQcQ, sKeyMask, sLSE, sDelta, p + 1,
                                         1 - buf, s, h, b, t0, tidx)
                    cute.arch.cp_async_commit_group()
                self.compute_pair(ns, buf)
                if cutlass.const_expr(self.stages == 1):
                    cute.arch.barrier()  # sQ, sdO and the stats are rewritten for the next window

        # ---- epilogue: dK * scale, dV -> bf16 rows of the tile ----
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        rdK = cute.make_fragment_like(acc_dK, cutlass.BFloat16)
        rdK.store((acc_dK.load() * softmax_scale).to(cutlass.BFloat16))
        rdV = cute.make_fragment_like(acc_dV, cutlass.BFloat16)
        rdV.store(acc_dV.load().to(cutlass.BFloat16))
        cute.copy(r2s, thr_r2s.retile(rdK), thr_r2s.partition_D(sK))
        cute.copy(r2s, thr_r2s.retile(rdV), thr_r2s.partition_D(sV))
        cute.arch.barrier()
        thr_plain = plain.get_slice(tidx)
        tKsdK = thr_plain.partition_S(sK)
        tKsdV = thr_plain.partition_S(sV)
        for m in cutlass.range_constexpr(cute.size(tKsdK, mode=[1])):
            i = tKcK[0, m, 0][0]
            if t0 + i < kv_len:
                C.copy_row(plain, C.row_ptr(mdK, (b, t0 + i, h, 0)), tKsdK, tKcK, m, D, to_gmem=True)
                C.copy_row(plain, C.row_ptr(mdV, (b, t0 + i, h, 0)), tKsdV, tKcK, m, D, to_gmem=True)

    @cute.jit
    def load_window(self, mQ: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mDelta: cute.Tensor,
                    mWinKey: cute.Tensor, mWinMask: cute.Tensor, mWinCount: cute.Tensor,
                    mTileWin: cute.Tensor, mTileStart: cute.Tensor, g2s: cute.TiledCopy,
                    tQsQ: cute.Tensor, tQsdO: cute.Tensor, tQcQ: cute.Tensor, sKeyMask: cute.Tensor,
                    sLSE: cute.Tensor, sDelta: cute.Tensor, p: Int32, buf: Int32, s: Int32, h: Int32,
                    b: Int32, t0: Int32, tidx: Int32):
        """Stage ``buf``: cp.async the Q / dO rows of pair ``p``'s window; LSE (log2 units), delta and
        the window queries' bitmask of each of the tile's keys with plain stores."""
        G = self.g
        D = self.d
        w = mTileWin[p]
        start = mTileStart[p]
        cnt = mWinCount[s, w]
        q0 = w * self.wq
        rows_valid = cutlass.min(mQ.shape[1] - q0, self.wq) * G
        C.gather_window_rows(g2s, mQ, mdO, tQsQ[None, None, None, buf], tQsdO[None, None, None, buf], tQcQ,
                             rows_valid, G, D, h, b, q0)
        lane = tidx % 32
        if tidx < KEY_TILE:
            sKeyMask[lane, buf] = Int32(0)
            cute.arch.sync_warp()
            pos = start + lane
            if pos < cnt:
                key = mWinKey[s, w, pos]
                if key < t0 + KEY_TILE:
                    sKeyMask[key - t0, buf] = mWinMask[s, w, pos]
        elif tidx >= THREADS - TILE_M:
            r = tidx - (THREADS - TILE_M)
            lse2, delta = C.window_row_stats(mLSE, mDelta, r, rows_valid, G, h, b, q0)
            sLSE[r, buf] = lse2
            sDelta[r, buf] = delta

    @cute.jit
    def compute_pair(self, ns: SimpleNamespace, buf: Int32):
        """One (key tile, window) pair from stage ``buf``: S^T, dP^T, P^T / dS^T (via smem), then
        dV += P^T dO and dK += dS^T Q into the register accumulators."""
        G = self.g
        # Note [skip unselected halves]: with skip_empty, a warp whose 16 keys no query of the window
        # selects skips its MMAs and smem writes; only warps of the same key half read those rows of
        # sPt / sdSt, and they skip too. The skipped terms are exact zeros: same bits.
        active = True
        if cutlass.const_expr(self.skip_empty):
            half0 = (ns.tScS[0, 0][0] // 16) * 16
            any_sel = Int32(0)
            for k in cutlass.range_constexpr(16):
                any_sel = any_sel | ns.sKeyMask[half0 + k, buf]
            active = any_sel != 0
        if active:
            # 2. S^T = K Q^T, dP^T = V dO^T
            acc_S = cute.make_rmem_tensor(ns.thr_mma.partition_shape_C((KEY_TILE, TILE_M)), Float32)
            acc_S.fill(0.0)
            C.gemm_ss(ns.tiled_mma, acc_S, ns.tSrK, ns.tSrQ, ns.copy_A, ns.tSsK, ns.tSrK_v, ns.copy_B,
                      ns.tSsQ[None, None, None, buf], ns.tSrQ_v)
            acc_dP = cute.make_rmem_tensor(ns.thr_mma.partition_shape_C((KEY_TILE, TILE_M)), Float32)
            acc_dP.fill(0.0)
            C.gemm_ss(ns.tiled_mma, acc_dP, ns.tSrV, ns.tSrdO, ns.copy_A, ns.tSsV, ns.tSrV_v, ns.copy_B,
                      ns.tSsdO[None, None, None, buf], ns.tSrdO_v)
            # 3. P^T and dS^T
            S = C.mn_view(acc_S)
            dP = C.mn_view(acc_dP)
            for i in cutlass.range_constexpr(cute.size(S, mode=[0])):
                msk = ns.sKeyMask[ns.tScS[i, 0][0], buf]
                for c in cutlass.range_constexpr(cute.size(S, mode=[1])):
                    r = ns.tScS[0, c][1]
                    p_val = Float32(0.0)
                    ds = Float32(0.0)  # unselected keys of the tile may hold anything (even NaN)
                    if C.selected(msk, r // G, self.wq):
                        p_val = cute.math.exp2(S[i, c] * ns.scale_log2 - ns.sLSE[r, buf], fastmath=True)
                        ds = p_val * (dP[i, c] - ns.sDelta[r, buf])
                    dP[i, c] = ds
                    S[i, c] = p_val
            rP = cute.make_fragment_like(acc_S, cutlass.BFloat16)
            rP.store(acc_S.load().to(cutlass.BFloat16))
            rdS = cute.make_fragment_like(acc_dP, cutlass.BFloat16)
            rdS.store(acc_dP.load().to(cutlass.BFloat16))
            cute.copy(ns.r2s, ns.thr_r2s.retile(rP), ns.thr_r2s.partition_D(ns.sPt))
            cute.copy(ns.r2s, ns.thr_r2s.retile(rdS), ns.thr_r2s.partition_D(ns.sdSt))
        cute.arch.barrier()
        if active:
            # 4. dV += P^T dO, dK += dS^T Q
            C.gemm_ss(ns.tiled_mma, ns.acc_dV, ns.tdrPt, ns.tdrdOt, ns.copy_A, ns.tdsPt, ns.tdrPt_v, ns.copy_Bt,
                      ns.tdsdOt[None, None, None, buf], ns.tdrdOt_v)
            C.gemm_ss(ns.tiled_mma, ns.acc_dK, ns.tdrdSt, ns.tdrQt, ns.copy_A, ns.tdsdSt, ns.tdrdSt_v, ns.copy_Bt,
                      ns.tdsQt[None, None, None, buf], ns.tdrQt_v)

    @cute.jit
    def issue_rows(self, mQ: cute.Tensor, mdO: cute.Tensor, g2s: cute.TiledCopy, tQsQ: cute.Tensor,
                   tQsdO: cute.Tensor, tQcQ: cute.Tensor, w: Int32, buf: Int32, h: Int32, b: Int32):
        """cp.async window ``w``'s Q and dO rows into stage ``buf`` (zero rows past its queries)."""
        G = self.g
        q0 = w * self.wq
        rows_valid = cutlass.min(mQ.shape[1] - q0, self.wq) * G
        C.gather_window_rows(g2s, mQ, mdO, tQsQ[None, None, None, buf], tQsdO[None, None, None, buf], tQcQ,
                             rows_valid, G, self.d, h, b, q0)

    @cute.jit
    def fetch_meta(self, mQ: cute.Tensor, mLSE: cute.Tensor, mDelta: cute.Tensor, mWinKey: cute.Tensor,
                   mWinMask: cute.Tensor, w: Int32, start: Int32, cnt: Int32, s: Int32, h: Int32, b: Int32,
                   tidx: Int32):
        """Register reads for window ``w``: warp 0 lane l -> (key, query mask) of the window's key
        ``start + l`` (key -1 past its count); the last 64 threads -> (LSE in log2 units, delta) of
        row ``tidx - (THREADS - 64)`` (0, 0 past the window's rows or for an empty row's LSE)."""
        G = self.g
        key = Int32(-1)
        mask = Int32(0)
        lse2 = Float32(0.0)
        delta = Float32(0.0)
        if tidx < KEY_TILE:
            pos = start + tidx
            if pos < cnt:
                key = mWinKey[s, w, pos]
                mask = mWinMask[s, w, pos]
        elif tidx >= THREADS - TILE_M:
            q0 = w * self.wq
            rows_valid = cutlass.min(mQ.shape[1] - q0, self.wq) * G
            r = tidx - (THREADS - TILE_M)
            lse2, delta = C.window_row_stats(mLSE, mDelta, r, rows_valid, G, h, b, q0)
        return key, mask, lse2, delta

    @cute.jit
    def store_meta(self, sKeyMask: cute.Tensor, sLSE: cute.Tensor, sDelta: cute.Tensor, key: Int32,
                   mask: Int32, lse2: Float32, delta: Float32, buf: Int32, t0: Int32, tidx: Int32):
        """Publish ``fetch_meta``'s registers into stage ``buf`` (visible after the next barrier)."""
        if tidx < KEY_TILE:
            sKeyMask[tidx, buf] = Int32(0)
            cute.arch.sync_warp()
            if key >= 0 and key < t0 + KEY_TILE:
                sKeyMask[key - t0, buf] = mask
        elif tidx >= THREADS - TILE_M:
            r = tidx - (THREADS - TILE_M)
            sLSE[r, buf] = lse2
            sDelta[r, buf] = delta
