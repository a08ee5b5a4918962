"""BlockSparseBwdDKDVSm90: Hopper dK / dV of block-sparse attention, key-major, deterministic.

    dv_c = sum_rows P[row, c] dO[row],   dk_c = scale * sum_rows dS[row, c] q[row]

over the rows (query, head) that see key c, with P and dS as in ``bwd_dq_sm90.py``. One CTA per
(selected key block r of index set s, kv head h, batch b): the block's rows ``[key_start,
key_end)`` (clipped at its document's end) stay in shared memory while the CTA walks the block's
(query tile, slot) pairs of the plan's key-major transpose in ascending tile order (x the head
chunks for G > 64), so every dK / dV element is summed in one fixed order and written once:
bitwise reproducible, no atomics. Keys no query selects are not visited: the caller passes dk / dv
zero-filled.

    WG 0, warp 0   producer: K, V of the block once; per pair the tile's Q and dO rows (one TMA box
                   of GC head rows per tile query each; queries past S repeat the last one, whose
                   columns are masked) into one of 2 stages
    WG 1 ("dV")    S^T = K Q^T (wgmma m64n64, keys as M: Note [keys as the M dimension] in
                   indexed/bwd_dkdv_sm90.py), P^T, dV += P^T dO (A = P^T from registers)
    WG 2 ("dK")    S^T and P^T again (instead of an exchange through shared memory), dP^T = V dO^T,
                   dS^T = P^T (dP^T - delta), dK += dS^T Q; both store their rows at the end

Columns (tile rows) of S^T are masked per pair: a column counts iff it is a real row (not past the
tile's queries, not one of the 64 - WQ * GC idle rows, which are zeroed once so that 0 * row stays 0)
whose query selected the block (its bit), and key c < that query's ``q_limit``.
"""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from cute_kernels.common.utils import (LOG2_E, acc_as_operand_a, acc_mn_view, convert_to_16bit, sm90_thread0_cols,
                                       transpose_view, wgmma_gemm, wgmma_smem_layout)

from .common import THREADS_PER_WG, BlockSparseSm90, shared_storage, smem_tensors
from .config import BLOCK_SIZE, TILE_M, BwdConfig

STAGES = 2
# setmaxnreg split over 384 threads: 128 * (24 + 2 * 240) <= 64K.
PRODUCER_REGS, CONSUMER_REGS = 24, 240


class BlockSparseBwdDKDVSm90(BlockSparseSm90):
    @staticmethod
    def smem_bytes(cfg: BwdConfig) -> int:
        rows = STAGES * TILE_M * (cfg.head_dim + cfg.head_dim_v) * 2
        kv = BLOCK_SIZE * (cfg.head_dim + cfg.head_dim_v) * 2
        return rows + kv + 5 * 1024 + 8 * (2 + 2 * STAGES)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
                 mDelta: cute.Tensor, mTileMask: cute.Tensor, mQLimit: cute.Tensor, mKeyStart: cute.Tensor,
                 mKeyEnd: cute.Tensor, mKeyCount: cute.Tensor, mKeyPtr: cute.Tensor, mKeyTile: cute.Tensor,
                 mKeySlot: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, softmax_scale: Float32, stream):
        sQ_layout = wgmma_smem_layout(self.dtype, (TILE_M, self.dk, STAGES))
        sdO_layout = wgmma_smem_layout(self.dtype, (TILE_M, self.dv, STAGES))
        sK_layout = wgmma_smem_layout(self.dtype, (self.tile_n, self.dk))
        sV_layout = wgmma_smem_layout(self.dtype, (self.tile_n, self.dv))
        tma_atom_Q, tma_Q, rows_q = self.rows_tma(mQ, self.dk, sQ_layout)
        tma_atom_dO, tma_dO, rows_do = self.rows_tma(mdO, self.dv, sdO_layout)
        tma_atom_K, tma_K = self.kv_tma(mK, sK_layout, self.dk)
        tma_atom_V, tma_V = self.kv_tma(mV, sV_layout, self.dv)
        self.tx_bytes_kv = self.tile_n * (self.dk + self.dv) * 2
        self.tx_bytes_rows = self.wq * self.gc * (self.dk + self.dv) * 2
        self.shared_storage = shared_storage(self.dtype, {"mbar_kv": 1, "mbar_rows": 2 * STAGES}, sQ=sQ_layout,
                                             sdO=sdO_layout, sK=sK_layout, sV=sV_layout)
        grid = (mKeyStart.shape[1], mK.shape[2], mQ.shape[0])
        atoms = (tma_atom_Q, tma_atom_dO, tma_atom_K, tma_atom_V)
        plan = (mTileMask, mQLimit, mKeyStart, mKeyEnd, mKeyCount, mKeyPtr, mKeyTile, mKeySlot)
        self.kernel(tma_Q, tma_dO, tma_K, tma_V, mLSE, mDelta, plan, mdK, mdV, atoms, sQ_layout, sdO_layout,
                    sK_layout, sV_layout, rows_q, rows_do, softmax_scale).launch(
            grid=grid, block=[3 * THREADS_PER_WG, 1, 1], smem=self.shared_storage.size_in_bytes(), stream=stream,
            min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mdO: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mLSE: cute.Tensor,
               mDelta: cute.Tensor, plan: tuple, mdK: cute.Tensor, mdV: cute.Tensor, atoms: tuple,
               sQ_layout: cute.ComposedLayout, sdO_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, rows_q: cute.ComposedLayout, rows_do: cute.ComposedLayout,
               softmax_scale: Float32):
        mTileMask, mQLimit, mKeyStart, mKeyEnd, mKeyCount, mKeyPtr, mKeyTile, mKeySlot = plan
        warp_idx, tidx, storage = self.allocate(atoms)
        sQ, sdO, sK, sV = smem_tensors(storage, sQ=sQ_layout, sdO=sdO_layout, sK=sK_layout, sV=sV_layout)
        # Idle rows (past WQ * GC) are never loaded: zero them once (0 * row must stay 0).
        used = self.wq * self.gc
        if const_expr(used < TILE_M):
            for i in cutlass.range(tidx, (TILE_M - used) * self.dk * STAGES, 3 * THREADS_PER_WG):
                sQ[used + i % (TILE_M - used), (i // (TILE_M - used)) % self.dk,
                   i // ((TILE_M - used) * self.dk)] = self.dtype(0.0)
            for i in cutlass.range(tidx, (TILE_M - used) * self.dv * STAGES, 3 * THREADS_PER_WG):
                sdO[used + i % (TILE_M - used), (i // (TILE_M - used)) % self.dv,
                    i // ((TILE_M - used) * self.dv)] = self.dtype(0.0)
            cute.arch.fence_view_async_shared()
        mbar_kv = storage.mbar_kv.data_ptr()
        if tidx == 0:
            cute.arch.mbarrier_init(mbar_kv, 1)
        cute.arch.mbarrier_init_fence()
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, 2 * THREADS_PER_WG // 32)
        pipeline_rows = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_rows.data_ptr(), num_stages=STAGES, producer_group=producer,
            consumer_group=consumers, tx_count=self.tx_bytes_rows, defer_sync=False)

        r, h, b = cute.arch.block_idx()
        s = b
        if const_expr(self.cfg.per_kv_head):
            s = b * mK.shape[2] + h
        kcap = mKeyStart.shape[1]
        blk = SimpleNamespace(s=s, h=h, b=b, seqlen=mQ.shape[2], live=r < mKeyCount[s],
                              start=mKeyStart[s, r], end=mKeyEnd[s, r], p0=mKeyPtr[s * kcap + r],
                              p1=mKeyPtr[s * kcap + r + 1])
        if blk.live:
            if warp_idx < 4:
                cute.arch.setmaxregister_decrease(PRODUCER_REGS)
                if warp_idx == 0:
                    self.load(mQ, mdO, mK, mV, mKeyTile, sK, sV, atoms, rows_q, rows_do, storage.sQ.data_ptr(),
                              storage.sdO.data_ptr(), mbar_kv, pipeline_rows, blk)
            else:
                cute.arch.setmaxregister_increase(CONSUMER_REGS)
                self.consume(mLSE, mDelta, mTileMask, mQLimit, mKeyTile, mKeySlot, mdK, mdV, sQ, sdO, sK, sV,
                             mbar_kv, pipeline_rows, blk, warp_idx // 4 - 1, tidx % THREADS_PER_WG, softmax_scale)

    # ------------------------------------------------------------------ producer
    @cute.jit
    def load(self, mQ, mdO, mK, mV, mKeyTile, sK, sV, atoms, rows_q, rows_do, sQ_base, sdO_base, mbar_kv,
             pipeline_rows, blk):
        tma_atom_Q, tma_atom_dO, tma_atom_K, tma_atom_V = atoms
        # 1. K and V of the block, once.
        if cute.arch.lane_idx() == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(mbar_kv, self.tx_bytes_kv)
        for atom, mX, sX, d in ((tma_atom_K, mK, sK, self.dk), (tma_atom_V, mV, sV, self.dv)):
            gX = cute.local_tile(cute.domain_offset((blk.start, 0), mX[None, None, blk.h, blk.b]), (self.tile_n, d),
                                 (0, 0))
            tXsX, tXgX = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2),
                                               cute.group_modes(gX, 0, 2))
            cute.copy(atom, tXgX, tXsX, tma_bar_ptr=mbar_kv)
        # 2. Per (pair, head chunk): the tile's Q and dO rows into the next stage.
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES)
        for i in cutlass.range((blk.p1 - blk.p0) * self.chunks, unroll=1):
            q0 = mKeyTile[blk.p0 + i // self.chunks] * self.wq
            head0 = blk.h * self.cfg.group + (i % self.chunks) * self.gc
            pipeline_rows.producer_acquire(state)
            bar = pipeline_rows.producer_get_barrier(state)
            for j in cutlass.range(self.wq, unroll=1):
                t = cutlass.min(q0 + j, blk.seqlen - 1)  # past S: the last query again (masked columns)
                for atom, mX, base, box, d in ((tma_atom_Q, mQ, sQ_base, rows_q, self.dk),
                                               (tma_atom_dO, mdO, sdO_base, rows_do, self.dv)):
                    off = state.index * (TILE_M * d) + j * self.gc * 64
                    dst = cute.make_tensor(cute.recast_ptr(base + off, box.inner), box.outer)
                    src = cute.local_tile(mX[None, None, t, blk.b], (self.gc, d), (head0 // self.gc, 0))
                    tS, tG = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(dst, 0, 2),
                                                   cute.group_modes(src, 0, 2))
                    cute.copy(atom, tG, tS, tma_bar_ptr=bar)
            state.advance()

    # ------------------------------------------------------------------ consumers
    @cute.jit
    def consume(self, mLSE, mDelta, mTileMask, mQLimit, mKeyTile, mKeySlot, mdK, mdV, sQ, sdO, sK, sV, mbar_kv,
                pipeline_rows, blk, wg: Int32, ctidx: Int32, softmax_scale: Float32):
        mma_s = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, Float32,
            atom_layout_mnk=(1, 1, 1), tiler_mn=(64, TILE_M))
        thr_s = mma_s.get_slice(ctidx)
        wg_s = mma_s.get_slice(0)
        tSrK = wg_s.make_fragment_A(wg_s.partition_A(sK))
        tSrV = wg_s.make_fragment_A(wg_s.partition_A(sV))
        tSrQ = wg_s.make_fragment_B(wg_s.partition_B(sQ))  # (.., .., k, stage)
        tSrdO = wg_s.make_fragment_B(wg_s.partition_B(sdO))
        acc_shape = wg_s.partition_shape_C((self.tile_n, TILE_M))
        tScS_mn = acc_mn_view(thr_s.partition_C(cute.make_identity_tensor((self.tile_n, TILE_M))))
        ctx = SimpleNamespace(key=[blk.start + tScS_mn[i, 0][0] for i in range(2)], thr_col=tScS_mn[0, 0][1],
                              cols=sm90_thread0_cols(TILE_M), scale_log2=softmax_scale * LOG2_E,
                              mLSE=mLSE, mDelta=mDelta, mTileMask=mTileMask, mQLimit=mQLimit, mKeyTile=mKeyTile,
                              mKeySlot=mKeySlot, blk=blk)
        cute.arch.mbarrier_wait(mbar_kv, 0)
        n = (blk.p1 - blk.p0) * self.chunks
        if wg == 0:
            self.consume_dv(ctx, n, mma_s, tSrK, tSrQ, tSrdO, acc_shape, sdO, mdV, pipeline_rows, ctidx)
        else:
            self.consume_dk(ctx, n, mma_s, tSrK, tSrV, tSrQ, tSrdO, acc_shape, sQ, mdK, pipeline_rows, ctidx,
                            softmax_scale)

    def _mma_rs(self, cols: int):
        return sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN, Float32,
            atom_layout_mnk=(1, 1, 1), tiler_mn=(64, cols), a_source=warpgroup.OperandSource.RMEM)

    @cute.jit
    def consume_dv(self, ctx, n: Int32, mma_s, tSrK, tSrQ, tSrdO, acc_shape, sdO, mdV, pipeline_rows, ctidx: Int32):
        mma_dv = self._mma_rs(self.dv)
        wg_dv = mma_dv.get_slice(0)
        tVrdOt = wg_dv.make_fragment_B(wg_dv.partition_B(transpose_view(sdO)))  # (.., .., k, stage)
        tVrP = wg_dv.make_fragment_A(wg_dv.partition_shape_A((self.tile_n, TILE_M)))
        acc_dV = cute.make_rmem_tensor(wg_dv.partition_shape_C((self.tile_n, self.dv)), Float32)
        acc_dV.fill(0.0)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
        for i in cutlass.range(n, unroll=1):
            col = self.columns(ctx, i)
            acc_S = cute.make_rmem_tensor(acc_shape, Float32)
            pipeline_rows.consumer_wait(state)
            self.gemm(mma_s, acc_S, tSrK, tSrQ[None, None, None, state.index], True, 0)
            self.probs(ctx, acc_mn_view(acc_S), col)
            convert_to_16bit(acc_as_operand_a(acc_S), tVrP)
            self.gemm(mma_dv, acc_dV, tVrP, tVrdOt[None, None, None, state.index], False, 0)
            pipeline_rows.consumer_release(state)
            state.advance()
        self.store_keys(ctx, acc_dV, mdV, mma_dv.get_slice(ctidx), self.dv, Float32(1.0))

    @cute.jit
    def consume_dk(self, ctx, n: Int32, mma_s, tSrK, tSrV, tSrQ, tSrdO, acc_shape, sQ, mdK, pipeline_rows,
                   ctidx: Int32, softmax_scale: Float32):
        mma_dk = self._mma_rs(self.dk)
        wg_dk = mma_dk.get_slice(0)
        tKrQt = wg_dk.make_fragment_B(wg_dk.partition_B(transpose_view(sQ)))  # (.., .., k, stage)
        tKrdS = wg_dk.make_fragment_A(wg_dk.partition_shape_A((self.tile_n, TILE_M)))
        acc_dK = cute.make_rmem_tensor(wg_dk.partition_shape_C((self.tile_n, self.dk)), Float32)
        acc_dK.fill(0.0)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
        for i in cutlass.range(n, unroll=1):
            col = self.columns(ctx, i)
            acc_S = cute.make_rmem_tensor(acc_shape, Float32)
            acc_dP = cute.make_rmem_tensor(acc_shape, Float32)
            pipeline_rows.consumer_wait(state)
            self.gemm(mma_s, acc_S, tSrK, tSrQ[None, None, None, state.index], True, -1)
            self.gemm(mma_s, acc_dP, tSrV, tSrdO[None, None, None, state.index], True, 0)
            acc_S_mn = acc_mn_view(acc_S)
            acc_dP_mn = acc_mn_view(acc_dP)
            self.probs(ctx, acc_S_mn, col)
            for k in cutlass.range_constexpr(2):
                for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                    acc_S_mn[k, c] = acc_S_mn[k, c] * (acc_dP_mn[k, c] - col.delta[c])  # dS^T
            convert_to_16bit(acc_as_operand_a(acc_S), tKrdS)
            self.gemm(mma_dk, acc_dK, tKrdS, tKrQt[None, None, None, state.index], False, 0)
            pipeline_rows.consumer_release(state)
            state.advance()
        self.store_keys(ctx, acc_dK, mdK, mma_dk.get_slice(ctidx), self.dk, softmax_scale)

    @cute.jit
    def gemm(self, tiled_mma, acc, tCrA, tCrB, zero_init: cutlass.Constexpr, wait: cutlass.Constexpr):
        wgmma_gemm(tiled_mma, acc, tCrA, tCrB, zero_init)
        if const_expr(wait >= 0):
            warpgroup.wait_group(wait)

    @cute.jit
    def columns(self, ctx, i: Int32):
        """Per register column (a tile row) of step ``i``: exclusive key limit (0 for a column that
        does not count), lse in log2 units, delta."""
        blk = ctx.blk
        p = blk.p0 + i // self.chunks
        w = ctx.mKeyTile[p]
        bits = ctx.mTileMask[blk.s, w, ctx.mKeySlot[p]]
        q0 = w * self.wq
        head0 = blk.h * self.cfg.group + (i % self.chunks) * self.gc
        ncol = len(ctx.cols)
        col = SimpleNamespace(limit=cute.make_rmem_tensor((ncol,), Int32),
                              lse=cute.make_rmem_tensor((ncol,), Float32),
                              delta=cute.make_rmem_tensor((ncol,), Float32))
        for c in cutlass.range_constexpr(ncol):
            row = ctx.thr_col + ctx.cols[c]
            qi = row // self.gc
            t = cutlass.min(q0 + qi, blk.seqlen - 1)
            head = head0 + row % self.gc
            live = row < self.wq * self.gc and q0 + qi < blk.seqlen
            live = live and ((bits >> qi) & 1) != 0
            col.limit[c] = ctx.mQLimit[blk.b, t] if live else Int32(0)
            col.lse[c] = ctx.mLSE[blk.b, head, t] * LOG2_E
            col.delta[c] = ctx.mDelta[blk.b, head, t]
        return col

    @cute.jit
    def probs(self, ctx, acc_mn, col):
        """P^T in place: exp2(S^T scale log2e - lse) where the column counts and key < its limit, else 0."""
        for k in cutlass.range_constexpr(2):
            for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                keep = ctx.key[k] < col.limit[c]
                p = cute.math.exp2(acc_mn[k, c] * ctx.scale_log2 - col.lse[c], fastmath=True)
                acc_mn[k, c] = p if keep else Float32(0.0)

    @cute.jit
    def store_keys(self, ctx, acc, mX, thr_mma, cols: cutlass.Constexpr, scale: Float32):
        """acc * scale (64 keys x cols) as 16-bit rows [start, end) of ``mX [B, S, Hkv, cols]``."""
        blk = ctx.blk
        acc_mn = acc_mn_view(acc)
        for k in cutlass.range_constexpr(2):
            acc_mn[k, None].store(acc_mn[k, None].load() * scale)
        rX = cute.make_rmem_tensor_like(acc, self.dtype)
        convert_to_16bit(acc, rX)
        rX_mn = acc_mn_view(rX)
        tXcX_mn = acc_mn_view(thr_mma.partition_C(cute.make_identity_tensor((self.tile_n, cols))))
        for k in cutlass.range_constexpr(2):
            key = blk.start + tXcX_mn[k, 0][0]
            if key < blk.end:
                gX = mX[blk.b, key, blk.h, None]
                for c in cutlass.range_constexpr(cute.size(rX_mn, mode=[1])):
                    gX[tXcX_mn[k, c][1]] = rX_mn[k, c]
