"""Windowed indexed-attention backward, dQ part: one program per (window, kv head, batch).

    delta[b, hq, q] = sum_d O . dO                                      (written for the dK/dV pass)
    P = exp(scale * q.k - lse) on selected (query, key) pairs, 0 elsewhere
    dS = P * (dO . v - delta);   dQ = scale * sum_k dS K

Same window geometry and key walk as ``fwd.py`` (64 MMA rows = WQ queries x G heads; chunks of the
window's sorted key union), so dQ is accumulated in registers in a fixed order and written once:
deterministic. Per chunk: cp.async K and V rows (+ masks) | S = Q K^T, dP = dO V^T | P, dS |
dQ += dS K. Tensors: mQ/mO/mdO/mdQ [B, Lq, Hq, D] bf16, mK/mV [B, Lkv, Hkv, D] bf16,
mLSE/mDelta [B, Hq, Lq] fp32, plan tensors as in ``plan.py``.

Note [scrubbed key chunks] (NaN / Inf in keys a row did not select; common/nonfinite.py): dS is 0 on the
pairs a row did not select (a select, so a non-finite dP from an unselected value row stays out), but dQ += dS K
multiplies that 0 by every K row of the chunk, the window's key union. So once a chunk's K rows landed the 128
threads zero their non-finite elements in shared memory and flag their keys (``nonfinite.scrub_rows``), meet
on a barrier, and S = Q K^T reads the scrubbed rows; S is then NaN on a flagged key's column (what the
unscrubbed K gave), so a row that selected it still gets NaN P, dS and dq.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cute_kernels.common import nonfinite as nf

from . import common as C
from .config import TILE_M, AttnConfig

THREADS = 128


def dq_tile_n(head_dim: int) -> int:
    """Keys per chunk: S, dP (64 x tile_n) and dQ (64 x D) fp32 accumulators share the registers."""
    return 32 if head_dim >= 128 else 64


class IndexedBwdDQ:
    def __init__(self, cfg: AttnConfig):
        self.cfg = cfg
        self.d = cfg.head_dim
        self.g = cfg.group
        self.wq = cfg.window_queries
        self.tile_n = dq_tile_n(cfg.head_dim)
        self.stages = cfg.dq_stages
        self.meta_ahead = cfg.meta_ahead and cfg.dq_stages == 1

    @staticmethod
    def smem_bytes(cfg: AttnConfig) -> int:
        tn = dq_tile_n(cfg.head_dim)
        st = cfg.dq_stages
        return (2 * TILE_M + 2 * tn * st) * cfg.head_dim * 2 + tn * st * 4 + 2 * TILE_M * 4 + tn + 16

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mdO: cute.Tensor, mLSE: cute.Tensor, mWinKey: cute.Tensor, mWinMask: cute.Tensor,
                 mWinCount: cute.Tensor, mdQ: cute.Tensor, mDelta: cute.Tensor,
                 softmax_scale: Float32, stream):
        bf16 = cutlass.BFloat16
        sQ_layout = C.smem_layout(bf16, TILE_M, self.d)
        sKV_layout = C.smem_layout(bf16, self.tile_n, self.d, self.stages)

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sKV_layout)], 1024]
            sMask: cute.struct.Align[cute.struct.MemRange[Int32, self.tile_n * self.stages], 16]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, TILE_M], 16]
            sDelta: cute.struct.Align[cute.struct.MemRange[Float32, TILE_M], 16]
            sFlag: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, self.tile_n], 16]  # Note [scrubbed ...]
            sAny: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, THREADS // 32], 4]

        g2s, plain = C.gmem_copies(bf16, THREADS, self.d)
        tiled_mma = C.mma_bf16(THREADS // 32, 1)
        grid = [mWinCount.shape[1], self.cfg.num_kv_heads, mQ.shape[0]]
        self.kernel(mQ, mK, mV, mO, mdO, mLSE, mWinKey, mWinMask, mWinCount, mdQ, mDelta,
                    softmax_scale * C.LOG2_E, softmax_scale, sQ_layout, sKV_layout, g2s, plain,
                    tiled_mma, SharedStorage).launch(
            grid=grid, block=[THREADS, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
               mdO: cute.Tensor, mLSE: cute.Tensor, mWinKey: cute.Tensor, mWinMask: cute.Tensor,
               mWinCount: cute.Tensor, mdQ: cute.Tensor, mDelta: cute.Tensor, scale_log2: Float32,
               softmax_scale: Float32, sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout,
               g2s: cute.TiledCopy, plain: cute.TiledCopy, tiled_mma: cute.TiledMma,
               SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        win, h, b = cute.arch.block_idx()
        G = self.g
        D = self.d
        TN = self.tile_n
        s = b
        if cutlass.const_expr(self.cfg.per_kv_head):
            s = b * self.cfg.num_kv_heads + h
        count = mWinCount[s, win]
        num_chunks = (count + TN - 1) // TN
        q0 = win * self.wq
        rows_valid = cutlass.min(mQ.shape[1] - q0, self.wq) * G

        storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout)
        sdO = storage.sdO.get_tensor(sQ_layout)
        sK_all = storage.sK.get_tensor(sKV_layout)  # (TN, D, stages)
        sV_all = storage.sV.get_tensor(sKV_layout)
        sK = sK_all[None, None, 0]
        sV = sV_all[None, None, 0]
        sMask = storage.sMask.get_tensor(cute.make_layout((TN, self.stages)))
        sLSE = storage.sLSE.get_tensor(cute.make_layout(TILE_M))
        sDelta = storage.sDelta.get_tensor(cute.make_layout(TILE_M))
        sKt_all = C.transposed_view(sK_all, TN, D, self.stages)  # (D, TN, stages)
        sKt = sKt_all[None, None, 0]
        sFlag = storage.sFlag.get_tensor(cute.make_layout(TN))
        sAny = storage.sAny.get_tensor(cute.make_layout(THREADS // 32))
        k_per_row = nf.threads_per_row(TN, D, THREADS, cutlass.BFloat16)

        thr_g2s = g2s.get_slice(tidx)
        cQ = cute.make_identity_tensor((TILE_M, D))
        tQsQ = thr_g2s.partition_D(sQ)
        tQsdO = thr_g2s.partition_D(sdO)
        tQcQ = thr_g2s.partition_S(cQ)
        tKsK = thr_g2s.partition_D(sK_all)  # (CPY, N, K, stages)
        tKsV = thr_g2s.partition_D(sV_all)
        tKcK = thr_g2s.partition_S(cute.make_identity_tensor((TN, D)))

        thr_mma = tiled_mma.get_slice(tidx)
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
        tSrdO = thr_mma.make_fragment_A(thr_mma.partition_A(sdO))
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK))
        tSrV = thr_mma.make_fragment_B(thr_mma.partition_B(sV))
        tQrKt = thr_mma.make_fragment_B(thr_mma.partition_B(sKt))
        acc_dQ = cute.make_rmem_tensor(thr_mma.partition_shape_C((TILE_M, D)), Float32)
        acc_dQ.fill(0.0)
        copy_A, copy_B, copy_Bt = C.ldmatrix_copies(tiled_mma)
        thr_cA = copy_A.get_slice(tidx)
        thr_cB = copy_B.get_slice(tidx)
        thr_cBt = copy_Bt.get_slice(tidx)
        tSsQ, tSrQ_v = thr_cA.partition_S(sQ), thr_cA.retile(tSrQ)
        tSsdO, tSrdO_v = thr_cA.partition_S(sdO), thr_cA.retile(tSrdO)
        tSsK, tSrK_v = thr_cB.partition_S(sK_all), thr_cB.retile(tSrK)
        tSsV, tSrV_v = thr_cB.partition_S(sV_all), thr_cB.retile(tSrV)
        tQsKt, tQrKt_v = thr_cBt.partition_S(sKt_all), thr_cBt.retile(tQrKt)

        tScS = C.mn_view(thr_mma.partition_C(cute.make_identity_tensor((TILE_M, TN))))
        n_rows = cute.size(tScS, mode=[0])

        # ---- prologue: Q, dO rows (cp.async); LSE and delta = rowsum(O * dO) per row ----
        C.gather_window_rows(g2s, mQ, mdO, tQsQ, tQsdO, tQcQ, rows_valid, G, D, h, b, q0)
        cute.arch.cp_async_commit_group()
        self.row_stats(mO, mdO, mLSE, mDelta, sLSE, sDelta, tidx, b, h, q0, rows_valid, scale_log2)

        n_slots = cute.size(tKsK, mode=[1])
        rKey = cute.make_rmem_tensor((n_slots,), Int32)
        rMask = cute.make_rmem_tensor((n_slots,), Int32)
        if cutlass.const_expr(self.meta_ahead):
            self.fetch_keys(mWinKey, mWinMask, tKcK, s, win, count, 0, rKey, rMask)
        if cutlass.const_expr(self.stages == 2):
            if num_chunks > 0:
                self.load_chunk(mK, mV, mWinKey, mWinMask, tKsK, tKsV, tKcK, sMask, g2s, s, win, h, b, count, 0, 0)
            cute.arch.cp_async_commit_group()
        for n in range(num_chunks):
            buf = n % self.stages
            # 1. K, V rows and masks of chunk n (prefetched one chunk ahead with 2 stages)
            if cutlass.const_expr(self.meta_ahead):
                # Note [metadata ahead]: chunk n's indices / masks were read during chunk n - 1;
                # chunk n + 1's are read now and arrive while chunk n computes.
                self.issue_chunk(mK, mV, tKsK, tKsV, tKcK, sMask, g2s, rKey, rMask, h, b)
                cute.arch.cp_async_commit_group()
                self.fetch_keys(mWinKey, mWinMask, tKcK, s, win, count, n + 1, rKey, rMask)
            elif cutlass.const_expr(self.stages == 1):
                self.load_chunk(mK, mV, mWinKey, mWinMask, tKsK, tKsV, tKcK, sMask, g2s, s, win, h, b, count, n, 0)
                cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()
            if cutlass.const_expr(self.stages == 2):
                if n + 1 < num_chunks:
                    self.load_chunk(mK, mV, mWinKey, mWinMask, tKsK, tKsV, tKcK, sMask, g2s, s, win, h, b, count,
                                    n + 1, 1 - buf)
                cute.arch.cp_async_commit_group()
            # Note [scrubbed key chunks]: K(n) landed (the wait above)
            found = nf.scrub_rows(sK_all[None, None, buf], sFlag, tidx, THREADS, k_per_row,
                                  batch=nf.batch_for(D, k_per_row, cutlass.BFloat16))
            ballot = cute.arch.vote_ballot_sync(found != 0)
            if tidx % 32 == 0:
                sAny[tidx // 32] = cutlass.Uint8(1) if ballot != 0 else cutlass.Uint8(0)
            cute.arch.barrier()
            # 2. S = Q K^T, dP = dO V^T
            acc_S = cute.make_rmem_tensor(thr_mma.partition_shape_C((TILE_M, TN)), Float32)
            acc_S.fill(0.0)
            C.gemm_ss(tiled_mma, acc_S, tSrQ, tSrK, copy_A, tSsQ, tSrQ_v, copy_B, tSsK[None, None, None, buf], tSrK_v)
            acc_dP = cute.make_rmem_tensor(thr_mma.partition_shape_C((TILE_M, TN)), Float32)
            acc_dP.fill(0.0)
            C.gemm_ss(tiled_mma, acc_dP, tSrdO, tSrV, copy_A, tSsdO, tSrdO_v, copy_B, tSsV[None, None, None, buf],
                      tSrV_v)
            # 3. dS = P * (dP - delta), P = 0 off the selection
            S = C.mn_view(acc_S)
            dP = C.mn_view(acc_dP)
            if cute.recast_tensor(sAny, cutlass.Uint32)[0] != cutlass.Uint32(0):
                # Note [scrubbed key chunks]: NaN scores on the flagged keys' columns
                for c in cutlass.range_constexpr(cute.size(S, mode=[1])):
                    if sFlag[tScS[0, c][1]] != cutlass.Uint8(0):
                        for r in cutlass.range_constexpr(n_rows):
                            S[r, c] = Float32.nan
            for r in cutlass.range_constexpr(n_rows):
                row = tScS[r, 0][0]
                qbit = row // G
                lse2 = sLSE[row]
                delta = sDelta[row]
                for c in cutlass.range_constexpr(cute.size(S, mode=[1])):
                    msk = sMask[tScS[0, c][1], buf]
                    ds = Float32(0.0)
                    if C.selected(msk, qbit, self.wq):
                        p = cute.math.exp2(S[r, c] * scale_log2 - lse2, fastmath=True)
                        ds = p * (dP[r, c] - delta)
                    S[r, c] = ds
            rdS = cute.make_fragment_like(acc_S, cutlass.BFloat16)
            rdS.store(acc_S.load().to(cutlass.BFloat16))
            # 4. dQ += dS K
            C.gemm_rs(tiled_mma, acc_dQ, C.as_a_operand(rdS), tQrKt, copy_Bt, tQsKt[None, None, None, buf], tQrKt_v)
            if cutlass.const_expr(self.stages == 1):
                cute.arch.barrier()  # sK / sV / sMask are reloaded next chunk

        # ---- epilogue: dQ * scale -> bf16 rows ----
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        rdQ = cute.make_fragment_like(acc_dQ, cutlass.BFloat16)
        rdQ.store((acc_dQ.load() * softmax_scale).to(cutlass.BFloat16))
        r2s = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.BFloat16),
                                     tiled_mma)
        thr_r2s = r2s.get_slice(tidx)
        cute.copy(r2s, thr_r2s.retile(rdQ), thr_r2s.partition_D(sQ))
        cute.arch.barrier()
        thr_plain = plain.get_slice(tidx)
        tQsdQ = thr_plain.partition_S(sQ)
        for m in cutlass.range_constexpr(cute.size(tQsdQ, mode=[1])):
            r = tQcQ[0, m, 0][0]
            if r < rows_valid:
                qi = r // G
                C.copy_row(plain, C.row_ptr(mdQ, (b, q0 + qi, h * G + r - qi * G, 0)), tQsdQ, tQcQ, m, D,
                           to_gmem=True)

    @cute.jit
    def row_stats(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mDelta: cute.Tensor,
                  sLSE: cute.Tensor, sDelta: cute.Tensor, tidx: Int32, b: Int32, h: Int32, q0: Int32,
                  rows_valid: Int32, scale_log2: Float32):
        """sLSE[r] = lse * log2(e), sDelta[r] = rowsum(O * dO) (fp32), delta also to global."""
        G = self.g
        half = self.d // 2
        r = tidx // 2
        part = tidx % 2
        acc = Float32(0.0)
        lse2 = Float32(0.0)
        if r < rows_valid:
            qi = r // G
            hq = h * G + r - qi * G
            o = cute.make_tensor(C.row_ptr(mO, (b, q0 + qi, hq, part * half)), cute.make_layout((half,)))
            do = cute.make_tensor(C.row_ptr(mdO, (b, q0 + qi, hq, part * half)), cute.make_layout((half,)))
            for i in cutlass.range_constexpr(half // 32):
                ov = cute.make_fragment_like(cute.local_tile(o, (32,), (i,)))
                dov = cute.make_fragment_like(ov)
                cute.autovec_copy(cute.local_tile(o, (32,), (i,)), ov)
                cute.autovec_copy(cute.local_tile(do, (32,), (i,)), dov)
                prod = ov.load().to(Float32) * dov.load().to(Float32)
                acc = acc + prod.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            lse = mLSE[b, hq, q0 + qi]
            lse2 = lse * C.LOG2_E * 1.0
            if lse == -Float32.inf:
                lse2 = Float32(0.0)  # empty row: no selected key, P is never evaluated
        acc = acc + cute.arch.shuffle_sync_bfly(acc, offset=1)
        if part == 0:
            sLSE[r] = lse2
            sDelta[r] = acc
            if r < rows_valid:
                qi = r // G
                mDelta[b, h * G + r - qi * G, q0 + qi] = acc
        cute.arch.barrier()

    @cute.jit
    def load_chunk(self, mK: cute.Tensor, mV: cute.Tensor, mWinKey: cute.Tensor, mWinMask: cute.Tensor,
                   tKsK: cute.Tensor, tKsV: cute.Tensor, tKcK: cute.Tensor, sMask: cute.Tensor,
                   g2s: cute.TiledCopy, s: Int32, win: Int32, h: Int32, b: Int32, count: Int32, n: Int32,
                   buf: Int32):
        """Stage ``buf``: cp.async the K and V rows of chunk ``n`` of the window's keys, and their masks."""
        TN = self.tile_n
        tKsK_b = tKsK[None, None, None, buf]
        tKsV_b = tKsV[None, None, None, buf]
        for m in cutlass.range_constexpr(cute.size(tKsK_b, mode=[1])):
            j = tKcK[0, m, 0][0]
            pos = n * TN + j
            if pos < count:
                key = mWinKey[s, win, pos]
                C.copy_row(g2s, C.row_ptr(mK, (b, key, h, 0)), tKsK_b, tKcK, m, self.d)
                C.copy_row(g2s, C.row_ptr(mV, (b, key, h, 0)), tKsV_b, tKcK, m, self.d)
                if tKcK[0, m, 0][1] == 0:
                    sMask[j, buf] = mWinMask[s, win, pos]
            else:
                tKsK_b[None, m, None].fill(0)
                tKsV_b[None, m, None].fill(0)
                if tKcK[0, m, 0][1] == 0:
                    sMask[j, buf] = Int32(0)

    @cute.jit
    def fetch_keys(self, mWinKey: cute.Tensor, mWinMask: cute.Tensor, tXcX: cute.Tensor, s: Int32, win: Int32,
                   count: Int32, n: Int32, rKey: cute.Tensor, rMask: cute.Tensor):
        """Registers: key index (-1 past the window's count) and query mask of this thread's rows of
        chunk ``n``."""
        for m in cutlass.range_constexpr(cute.size(rKey)):
            pos = n * self.tile_n + tXcX[0, m, 0][0]
            rKey[m] = Int32(-1)
            rMask[m] = Int32(0)
            if pos < count:
                rKey[m] = mWinKey[s, win, pos]
                rMask[m] = mWinMask[s, win, pos]

    @cute.jit
    def issue_chunk(self, mK: cute.Tensor, mV: cute.Tensor, tKsK: cute.Tensor, tKsV: cute.Tensor,
                    tKcK: cute.Tensor, sMask: cute.Tensor, g2s: cute.TiledCopy, rKey: cute.Tensor,
                    rMask: cute.Tensor, h: Int32, b: Int32):
        """Stage 0: cp.async the K and V rows named by ``rKey`` (zero rows for -1), store the masks."""
        tKsK_b = tKsK[None, None, None, 0]
        tKsV_b = tKsV[None, None, None, 0]
        for m in cutlass.range_constexpr(cute.size(rKey)):
            if rKey[m] >= 0:
                C.copy_row(g2s, C.row_ptr(mK, (b, rKey[m], h, 0)), tKsK_b, tKcK, m, self.d)
                C.copy_row(g2s, C.row_ptr(mV, (b, rKey[m], h, 0)), tKsV_b, tKcK, m, self.d)
            else:
                tKsK_b[None, m, None].fill(0)
                tKsV_b[None, m, None].fill(0)
            if tKcK[0, m, 0][1] == 0:
                sMask[tKcK[0, m, 0][0], 0] = rMask[m]
