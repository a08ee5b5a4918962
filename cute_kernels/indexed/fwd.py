"""Windowed indexed-attention forward: one program per (window, kv head, batch).

    out[b, q, hq] = sum_k softmax_k(scale * q . K[k]) V[k]  over the distinct valid keys k of q's row
    lse[b, hq, q] = natural log of the softmax normaliser (-inf for an empty row, whose out is 0)

Tensors: mQ/mO [B, Lq, Hq, D] bf16, mK/mV [B, Lkv, Hkv, D] bf16, mLSE [B, Hq, Lq] fp32, and the plan's
mWinKey/mWinMask [S, NW, CAP], mWinCount [S, NW] int32 (see ``plan.py``).

The 64 MMA rows are the window's WQ queries x G heads of kv head h (row r = query r // G, head
h * G + r % G). The program walks the window's sorted key union in chunks of TILE_N keys:

    prologue: cp.async Q rows, K rows of chunk 0 (+ their query masks into sMask[0])
    per chunk n:  wait K(n) | issue V(n) | S = Q K^T | wait V(n) | issue K(n+1) |
                  mask S[r, j] = -inf unless bit r // G of mask[j] | online softmax (base 2) |
                  O += P V
    epilogue: O /= rowsum (0 for empty rows), LSE, rows stored to their (query, head) places

Keys are visited in ascending order whatever the order of the index row, so the result does not
depend on it. Chunk slots past the window's key count are zero rows with an all-zero mask.
Warp-level mma.sync m16n8k16 (4 warps x 16 rows).

Note [scrubbed value chunks] (NaN / Inf in values a row did not select; common/nonfinite.py): the chunk's
keys are the window's union, so the PV multiplies P = 0 of the rows that did not select a key by its value
row, and IEEE 0 * NaN = NaN. Once a chunk's V rows landed, the 128 threads zero its non-finite elements in
shared memory and flag their keys (``nonfinite.scrub_rows``; one byte per key, one per warp for "some key
flagged"), in the wait for the next chunk's K loads; after the barrier before the PV, a row whose 16-bit P is
non-zero on a flagged key gets NaN in acc_O (what the unscrubbed PV gave it). Every chunk is scanned: in a
window of queries that each select their own keys nearly every key is unselected by some row. Non-finite K
rows need nothing: their NaN scores are replaced by -inf where the row did not select the key.

Note [empty rows]: a row none of whose chunk keys is selected has S = -inf throughout; while its
running max is still -inf the exponents use 0 as reference, so p = exp2(-inf) = 0 and the rescale
factor exp2(-inf - 0) = 0 -- never NaN. A row with no selected key at all ends with sum 0: out 0,
lse -inf. Rows past the window's queries and the 64 - WQ * G idle rows select nothing (their mask
bits do not exist), so they take this path and are never stored.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cute_kernels.common import nonfinite as nf

from . import common as C
from .config import TILE_M, AttnConfig

THREADS = 128


def fwd_tile_n(head_dim: int, group: int = 12) -> int:
    """Keys per chunk next to the 64 x D fp32 O accumulator: 64 up to D = 128; 32 at D = 256,
    except 16 for G in {1, 4, 8, 16}, where 32 spills 8 bytes on sm_90a (ptxas, cutlass-dsl 4.8.1,
    2026-11-29; G = 2 and the production G = 12 do not)."""
    if head_dim <= 128:
        return 64
    return 32 if group in (2, 12) else 16


class IndexedFwd:
    def __init__(self, cfg: AttnConfig):
        self.cfg = cfg
        self.d = cfg.head_dim
        self.g = cfg.group
        self.wq = cfg.window_queries
        self.tile_n = fwd_tile_n(cfg.head_dim, cfg.group)
        self.meta_ahead = cfg.meta_ahead

    @staticmethod
    def smem_bytes(cfg: AttnConfig) -> int:
        tn = fwd_tile_n(cfg.head_dim, cfg.group)
        return (TILE_M + 2 * tn) * cfg.head_dim * 2 + 2 * tn * 4 + tn + 16

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mWinKey: cute.Tensor,
                 mWinMask: cute.Tensor, mWinCount: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 softmax_scale: Float32, stream):
        bf16 = cutlass.BFloat16
        sQ_layout = C.smem_layout(bf16, TILE_M, self.d)
        sKV_layout = C.smem_layout(bf16, self.tile_n, self.d)

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sKV_layout)], 1024]
            sMask: cute.struct.Align[cute.struct.MemRange[Int32, 2 * self.tile_n], 16]
            sFlag: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, self.tile_n], 16]  # Note [scrubbed ...]
            sAny: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, THREADS // 32], 4]

        g2s, plain = C.gmem_copies(bf16, THREADS, self.d)
        tiled_mma = C.mma_bf16(THREADS // 32, 1)
        grid = [mWinCount.shape[1], self.cfg.num_kv_heads, mQ.shape[0]]
        self.kernel(mQ, mK, mV, mWinKey, mWinMask, mWinCount, mO, mLSE, softmax_scale * C.LOG2_E,
                    softmax_scale, sQ_layout, sKV_layout, g2s, plain, tiled_mma, SharedStorage).launch(
            grid=grid, block=[THREADS, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mWinKey: cute.Tensor,
               mWinMask: cute.Tensor, mWinCount: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
               scale_log2: Float32, softmax_scale: Float32, sQ_layout: cute.ComposedLayout,
               sKV_layout: cute.ComposedLayout, g2s: cute.TiledCopy, plain: cute.TiledCopy,
               tiled_mma: cute.TiledMma, SharedStorage: cutlass.Constexpr):
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
        sK = storage.sK.get_tensor(sKV_layout)
        sV = storage.sV.get_tensor(sKV_layout)
        sMask = storage.sMask.get_tensor(cute.make_layout((TN, 2), stride=(1, TN)))  # (key slot, parity)
        sVt = C.transposed_view(sV, TN, D)
        sFlag = storage.sFlag.get_tensor(cute.make_layout(TN))
        sAny = storage.sAny.get_tensor(cute.make_layout(THREADS // 32))
        v_per_row = nf.threads_per_row(TN, D, THREADS, cutlass.BFloat16)

        # ---- gmem -> smem partitions (row-gathered) ----
        thr_g2s = g2s.get_slice(tidx)
        tQsQ = thr_g2s.partition_D(sQ)
        tQcQ = thr_g2s.partition_S(cute.make_identity_tensor((TILE_M, D)))
        tKsK = thr_g2s.partition_D(sK)
        tVsV = thr_g2s.partition_D(sV)
        tKcK = thr_g2s.partition_S(cute.make_identity_tensor((TN, D)))

        # ---- MMA partitions ----
        thr_mma = tiled_mma.get_slice(tidx)
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK))
        tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt))
        acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((TILE_M, D)), Float32)
        acc_O.fill(0.0)
        copy_A, copy_B, copy_Bt = C.ldmatrix_copies(tiled_mma)
        thr_cA = copy_A.get_slice(tidx)
        thr_cB = copy_B.get_slice(tidx)
        thr_cBt = copy_Bt.get_slice(tidx)
        tSsQ = thr_cA.partition_S(sQ)
        tSrQ_v = thr_cA.retile(tSrQ)
        tSsK = thr_cB.partition_S(sK)
        tSrK_v = thr_cB.retile(tSrK)
        tOsVt = thr_cBt.partition_S(sVt)
        tOrVt_v = thr_cBt.retile(tOrVt)

        # accumulator coordinates: which window query each of this thread's rows is
        tScS = C.mn_view(thr_mma.partition_C(cute.make_identity_tensor((TILE_M, TN))))
        n_rows = cute.size(tScS, mode=[0])
        row_q = cute.make_rmem_tensor((n_rows,), Int32)
        for r in cutlass.range_constexpr(n_rows):
            row_q[r] = tScS[r, 0][0] // G

        # ---- prologue: Q rows, K rows of chunk 0 ----
        for m in cutlass.range_constexpr(cute.size(tQsQ, mode=[1])):
            r = tQcQ[0, m, 0][0]
            if r < rows_valid:
                qi = r // G
                C.copy_row(g2s, C.row_ptr(mQ, (b, q0 + qi, h * G + r - qi * G, 0)), tQsQ, tQcQ, m, D)
            else:
                tQsQ[None, m, None].fill(0)
        n_slots = cute.size(tKsK, mode=[1])
        rKey = cute.make_rmem_tensor((n_slots,), Int32)  # key rows of the chunk whose V is next
        rKeyNext = cute.make_rmem_tensor((n_slots,), Int32)  # key rows / masks of the chunk after
        rMaskNext = cute.make_rmem_tensor((n_slots,), Int32)
        if cutlass.const_expr(self.meta_ahead):
            # Note [metadata ahead]: chunk n+2's key indices and masks are read into registers while
            # chunk n computes, so no cp.async issue waits on a global read of the plan.
            self.fetch_keys(mWinKey, mWinMask, tKcK, s, win, count, 0, rKey, rMaskNext)
            self.issue_keys(mK, g2s, tKsK, tKcK, rKey, h, b)
            self.store_masks(sMask, tKcK, rMaskNext, 0)
            self.fetch_keys(mWinKey, mWinMask, tKcK, s, win, count, 1, rKeyNext, rMaskNext)
        elif num_chunks > 0:
            self.load_keys(mK, mWinKey, mWinMask, sMask, g2s, tKsK, tKcK, s, win, h, b, count, 0, True)
        cute.arch.cp_async_commit_group()

        row_max = cute.make_rmem_tensor((n_rows,), Float32)
        row_sum = cute.make_rmem_tensor((n_rows,), Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)

        for n in range(num_chunks):
            parity = n % 2
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()
            if cutlass.const_expr(self.meta_ahead):
                self.issue_keys(mV, g2s, tVsV, tKcK, rKey, h, b)
            else:
                self.load_keys(mV, mWinKey, mWinMask, sMask, g2s, tVsV, tKcK, s, win, h, b, count, n, False)
            cute.arch.cp_async_commit_group()

            acc_S = cute.make_rmem_tensor(thr_mma.partition_shape_C((TILE_M, TN)), Float32)
            acc_S.fill(0.0)
            C.gemm_ss(tiled_mma, acc_S, tSrQ, tSrK, copy_A, tSsQ, tSrQ_v, copy_B, tSsK, tSrK_v)

            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()
            if cutlass.const_expr(self.meta_ahead):
                if n + 1 < num_chunks:
                    self.issue_keys(mK, g2s, tKsK, tKcK, rKeyNext, h, b)
                    self.store_masks(sMask, tKcK, rMaskNext, 1 - parity)
                cute.arch.cp_async_commit_group()
                for m in cutlass.range_constexpr(n_slots):
                    rKey[m] = rKeyNext[m]
                self.fetch_keys(mWinKey, mWinMask, tKcK, s, win, count, n + 2, rKeyNext, rMaskNext)
            else:
                if n + 1 < num_chunks:
                    self.load_keys(mK, mWinKey, mWinMask, sMask, g2s, tKsK, tKcK, s, win, h, b, count,
                                   n + 1, True)
                cute.arch.cp_async_commit_group()

            # Note [scrubbed value chunks]: V(n) landed (the wait above)
            found = nf.scrub_rows(sV, sFlag, tidx, THREADS, v_per_row, batch=nf.batch_for(D, v_per_row, cutlass.BFloat16))
            ballot = cute.arch.vote_ballot_sync(found != 0)
            if tidx % 32 == 0:
                sAny[tidx // 32] = cutlass.Uint8(1) if ballot != 0 else cutlass.Uint8(0)

            # masked online softmax (base 2); see Note [empty rows] in the module docstring
            S = C.mn_view(acc_S)
            O = C.mn_view(acc_O)
            for c in cutlass.range_constexpr(cute.size(S, mode=[1])):
                msk = sMask[tScS[0, c][1], parity]
                for r in cutlass.range_constexpr(n_rows):
                    if not C.selected(msk, row_q[r], self.wq):
                        S[r, c] = -Float32.inf
            for r in cutlass.range_constexpr(n_rows):
                srow = S[r, None].load()
                m_new = quad_max_row(srow, row_max[r])
                m_use = m_new
                if m_new == -Float32.inf:
                    m_use = Float32(0.0)
                p = cute.math.exp2(srow * scale_log2 - m_use * scale_log2, fastmath=True)
                corr = cute.math.exp2(row_max[r] * scale_log2 - m_use * scale_log2, fastmath=True)
                row_sum[r] = row_sum[r] * corr + p.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                row_max[r] = m_new
                O[r, None] = O[r, None].load() * corr
                S[r, None] = p
            rP = cute.make_fragment_like(acc_S, cutlass.BFloat16)
            rP.store(acc_S.load().to(cutlass.BFloat16))
            cute.arch.barrier()  # Note [scrubbed value chunks]: every thread's zeros and flags
            if cute.recast_tensor(sAny, cutlass.Uint32)[0] != cutlass.Uint32(0):
                self.poison_rows(rP, tScS, sFlag, O, n_rows)
            C.gemm_rs(tiled_mma, acc_O, C.as_a_operand(rP), tOrVt, copy_Bt, tOsVt, tOrVt_v)

        # ---- epilogue ----
        O = C.mn_view(acc_O)
        lane = tidx % 32
        for r in cutlass.range_constexpr(n_rows):
            total = C.quad_sum(row_sum[r])
            inv = Float32(0.0)
            lse = -Float32.inf
            if total > 0.0:
                inv = cute.arch.rcp_approx(total)
                lse = (row_max[r] * scale_log2 + cute.math.log2(total, fastmath=True)) * C.LN_2
            O[r, None] = O[r, None].load() * inv
            row = tScS[r, 0][0]
            if lane % 4 == 0 and row < rows_valid:
                qi = row // G
                mLSE[b, h * G + row - qi * G, q0 + qi] = lse
        cute.arch.barrier()  # every warp is done reading sQ
        rO = cute.make_fragment_like(acc_O, cutlass.BFloat16)
        rO.store(acc_O.load().to(cutlass.BFloat16))
        sO = sQ
        r2s = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.BFloat16),
                                     tiled_mma)
        thr_r2s = r2s.get_slice(tidx)
        cute.copy(r2s, thr_r2s.retile(rO), thr_r2s.partition_D(sO))
        cute.arch.barrier()
        thr_plain = plain.get_slice(tidx)
        tOsO = thr_plain.partition_S(sO)
        for m in cutlass.range_constexpr(cute.size(tOsO, mode=[1])):
            r = tQcQ[0, m, 0][0]
            if r < rows_valid:
                qi = r // G
                C.copy_row(plain, C.row_ptr(mO, (b, q0 + qi, h * G + r - qi * G, 0)), tOsO, tQcQ, m, D,
                           to_gmem=True)

    @cute.jit
    def poison_rows(self, rP: cute.Tensor, tScS: cute.Tensor, sFlag: cute.Tensor, O: cute.Tensor,
                    n_rows: cutlass.Constexpr):
        """Note [scrubbed value chunks]: NaN into acc_O's rows (``O``, its (row, col) view) whose 16-bit P is
        non-zero on a key the chunk's scrub flagged (the columns by their coordinates in ``tScS``); the quad's
        lanes share a row (``nonfinite.row_poison_bits``). Warp-uniform call."""
        P = C.mn_view(rP)
        ncols = cute.size(P, mode=[1])
        flagged = cutlass.Uint32(0)
        for c in cutlass.range_constexpr(ncols):
            if sFlag[tScS[0, c][1]] != cutlass.Uint8(0):
                flagged = flagged | (cutlass.Uint32(1) << cutlass.Uint32(c))
        vis = []
        for r in cutlass.range_constexpr(n_rows):
            w = cutlass.Uint32(0)
            for c in cutlass.range_constexpr(ncols):
                if P[r, c].to(Float32) != Float32(0.0):
                    w = w | (cutlass.Uint32(1) << cutlass.Uint32(c))
            vis.append(w)
        bits = nf.row_poison_bits(vis, flagged, 4)
        if bits != 0:
            nf.poison_acc(O, bits)

    @cute.jit
    def load_keys(self, mX: cute.Tensor, mWinKey: cute.Tensor, mWinMask: cute.Tensor, sMask: cute.Tensor,
                  g2s: cute.TiledCopy, tXsX: cute.Tensor, tXcX: cute.Tensor, s: Int32, win: Int32,
                  h: Int32, b: Int32, count: Int32, n: Int32, with_mask: cutlass.Constexpr):
        """cp.async the K or V rows of chunk ``n`` of the window's key union into smem."""
        for m in cutlass.range_constexpr(cute.size(tXsX, mode=[1])):
            j = tXcX[0, m, 0][0]
            pos = n * self.tile_n + j
            if pos < count:
                key = mWinKey[s, win, pos]
                C.copy_row(g2s, C.row_ptr(mX, (b, key, h, 0)), tXsX, tXcX, m, self.d)
                if cutlass.const_expr(with_mask):
                    if tXcX[0, m, 0][1] == 0:
                        sMask[j, n % 2] = mWinMask[s, win, pos]
            else:
                tXsX[None, m, None].fill(0)
                if cutlass.const_expr(with_mask):
                    if tXcX[0, m, 0][1] == 0:
                        sMask[j, n % 2] = Int32(0)

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
    def issue_keys(self, mX: cute.Tensor, g2s: cute.TiledCopy, tXsX: cute.Tensor, tXcX: cute.Tensor,
                   rKey: cute.Tensor, h: Int32, b: Int32):
        """cp.async the K or V rows named by ``rKey`` (zero rows for -1)."""
        for m in cutlass.range_constexpr(cute.size(rKey)):
            if rKey[m] >= 0:
                C.copy_row(g2s, C.row_ptr(mX, (b, rKey[m], h, 0)), tXsX, tXcX, m, self.d)
            else:
                tXsX[None, m, None].fill(0)

    @cute.jit
    def store_masks(self, sMask: cute.Tensor, tXcX: cute.Tensor, rMask: cute.Tensor, parity: Int32):
        for m in cutlass.range_constexpr(cute.size(rMask)):
            if tXcX[0, m, 0][1] == 0:
                sMask[tXcX[0, m, 0][0], parity] = rMask[m]


@cute.jit
def quad_max_row(srow, prev: Float32) -> Float32:
    m = srow.reduce(cute.ReductionOp.MAX, -Float32.inf, 0)
    return cute.arch.fmax(C.quad_max(m), prev)
