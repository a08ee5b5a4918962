"""BlockSparseBwdDQSm90: Hopper dQ of block-sparse attention, query-major (no atomics).

    P   = exp(scale * q . k_c - lse)       over the keys the forward saw (same plan, same masks)
    dS  = P * (dO . v_c - delta),   delta = rowsum(dO * O)  (fp32, computed here from O and dO
                                                            and written out for the dK/dV kernel)
    dq  = scale * sum_c dS k_c

    exact delta (``BwdConfig.exact_delta``):  delta = sum_c P dP = rowsum(P * (dO V^T))  instead, from
    this kernel's own fp32 P and dP (Note [exact delta])

One CTA per row tile, as the forward (``fwd_sm90.py``, whose producer / row / mask methods this class
inherits), 256 threads:

    WG 0, warp 0   producer: K and V of block 0, then Q and dO (one TMA box of GC head rows per tile
                   query each), then K[n], V[n] per listed block (2 stages)
    WG 1           first each row's delta (the 4 lanes of a row each read a quarter of its O and dO
                   with 16-byte loads and sum; one lane stores it), then
                   per block: S = Q K^T and dP = dO V^T (wgmma, smem x smem), masks, P from lse,
                   dS, dQ += dS K (A = dS from registers, B = K read MN-major); dQ * scale stored
                   once to each row's (query, head)

Note [exact delta]. ``rowsum(dO * O)`` equals ``sum_c P dP`` only in exact arithmetic: O was rounded to 16 bits
and the forward's PV GEMM took 16-bit P, so on a row whose weight sits on one key (an attention sink, P ~
0.99 and up) the error of delta exceeds dS = P (dP - delta) itself (docs/api.md, "Gradients of peaked rows":
dq 36 % off at weight 0.995). With ``exact_delta`` the producer walks the tile's blocks twice: in the first
sweep the consumer computes S and dP of every block, masks them as below, and sums P * dP per row (fp32, in
block order: reproducible); the second sweep is the one described above with that delta, which is also what
the dK / dV kernel reads. O is not read. Two more GEMMs per block (five instead of three).

Note [non-finite keys a row cannot see] (common/nonfinite.py): a NaN / Inf in a key or value row a tile row
did not select (or past its limit) must not reach that row's dq. S = Q K^T and dP = dO V^T read K and V as
loaded: a non-finite K row gives NaN scores, which the block masks replace by -inf where the row cannot see the
key, and NaN P (hence dS, dq) where it can, as it should; a non-finite V row gives NaN dP, so dS is taken as 0
wherever P is 0 (``ds_where_seen``: not P (dP - delta) = 0 * NaN), which also keeps a row's non-finite delta
(a row that saw a NaN) out of the keys it did not see. Only dQ += dS K multiplies dS = 0 by every K row: so in a
block that needs masks the consumer zeroes the non-finite elements of the K stage in shared memory once the S
GEMM that read them completed (``scrub_k_block``, before the dq GEMM; a visible key's NaN has already made its
rows' dS NaN). Blocks every row sees in full are used as loaded.

The blocks are visited in the plan's ascending order, so dq is bitwise reproducible. Rows with lse
-inf (no key, no sink) and idle rows take lse = +inf: P = 0, dS = 0, dq = 0. ``lse`` includes the
sink, so the sink needs nothing here (its gradient is ``-sum exp(sink - lse) delta``, a reduction
the caller does).
"""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync

from cute_kernels.attention.bwd_pre import vec_ptr
from cute_kernels.common import nonfinite as nf
from cute_kernels.common.utils import (LOG2_E, acc_as_operand_a, acc_mn_view, convert_to_16bit, row_allreduce,
                                       transpose_view, wgmma_smem_layout)

from .common import shared_storage, smem_tensors
from .config import TILE_M
from .fwd_sm90 import (CONSUMER_REGS, KV_STAGES, O_STAGED_WG, PRODUCER_REGS, SCRUB_WG, THREADS_PER_WG,
                       BlockSparseFwdSm90)


class BlockSparseBwdDQSm90(BlockSparseFwdSm90):
    @property
    def sweeps(self) -> int:
        """Passes of the producer over a tile's blocks: 2 with ``exact_delta`` (Note [exact delta])."""
        return 2 if self.cfg.exact_delta else 1

    @staticmethod
    def smem_bytes(cfg) -> int:
        rows = TILE_M * (cfg.head_dim + cfg.head_dim_v) * 2
        kv = 64 * (cfg.head_dim + cfg.head_dim_v) * 2 * KV_STAGES
        return rows + kv + 4 * 1024 + 8 * (1 + 4 * KV_STAGES) + 64 * KV_STAGES

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mdO: cute.Tensor,
                 mLSE: cute.Tensor, mDelta: cute.Tensor, mTileStart: cute.Tensor, mTileMask: cute.Tensor, mTileCount: cute.Tensor,
                 mQLimit: cute.Tensor, mdQ: cute.Tensor, softmax_scale: Float32, stream):
        sQ_layout = wgmma_smem_layout(self.dtype, (TILE_M, self.dk, 1))
        sdO_layout = wgmma_smem_layout(self.dtype, (TILE_M, self.dv, 1))
        sK_layout = wgmma_smem_layout(self.dtype, (self.tile_n, self.dk, KV_STAGES))
        sV_layout = wgmma_smem_layout(self.dtype, (self.tile_n, self.dv, KV_STAGES))
        tma_atom_Q, tma_Q, rows_q = self.rows_tma(mQ, self.dk)
        tma_atom_dO, tma_dO, rows_do = self.rows_tma(mdO, self.dv)
        (tma_atom_K, tma_K), (tma_atom_V, tma_V) = self.kv_tmas(mK, mV, sK_layout, sV_layout)
        tma_atom_dQ, tma_dQ, rows_dq = self.rows_tma(mdQ, self.dk, store=True)  # Note [staged O] (fwd_sm90.py)
        self.shared_storage = shared_storage(self.dtype, self.MBARS, {"k_flags": (cutlass.Uint8, 64 * KV_STAGES)},
                                             sQ=sQ_layout, sdO=sdO_layout, sK=sK_layout, sV=sV_layout)
        grid = (mTileCount.shape[1], mK.shape[2] * self.chunks, mQ.shape[0])
        atoms = (tma_atom_Q, tma_atom_dO, tma_atom_K, tma_atom_V, tma_atom_dQ)
        self.kernel(tma_Q, tma_dO, tma_K, tma_V, mO, mdO, mLSE, mDelta, mTileStart, mTileMask, mTileCount, mQLimit,
                    tma_dQ, atoms, sQ_layout, sdO_layout, sK_layout, sV_layout, rows_q, rows_do, rows_dq,
                    softmax_scale).launch(
            grid=grid, block=[2 * THREADS_PER_WG, 1, 1], smem=self.shared_storage.size_in_bytes(), stream=stream,
            min_blocks_per_mp=2 if self.dk <= 128 else 1, preferred_smem_carveout=100)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mdO: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
               mdOg: cute.Tensor, mLSE: cute.Tensor, mDelta: cute.Tensor, mTileStart: cute.Tensor, mTileMask: cute.Tensor, mTileCount: cute.Tensor,
               mQLimit: cute.Tensor, mdQ: cute.Tensor, atoms: tuple, sQ_layout: cute.ComposedLayout,
               sdO_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
               rows_q: cute.ComposedLayout, rows_do: cute.ComposedLayout, rows_dq: cute.ComposedLayout,
               softmax_scale: Float32):
        warp_idx, tidx, storage, mbar_q, pipeline_k, pipeline_v = self.prologue(atoms)
        sQ, sdO, sK, sV = smem_tensors(storage, sQ=sQ_layout, sdO=sdO_layout, sK=sK_layout, sV=sV_layout)
        tile = self.tile_of(mQ, mK, mTileCount)
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp_idx == 0:
                self.load_bwd(mQ, mdO, mK, mV, mTileStart, sK, sV, atoms, rows_q, rows_do, storage.sQ.data_ptr(),
                              storage.sdO.data_ptr(), mbar_q, pipeline_k, pipeline_v, tile)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            out = SimpleNamespace(mdQ=mdQ, atom=atoms[4], rows=rows_dq, sQ_base=storage.sQ.data_ptr(),
                                  sQ_layout=sQ_layout, storage=storage)
            self.consume_dq(mO, mdOg, mLSE, mDelta, mTileStart, mTileMask, mQLimit, out, sQ, sdO, sK, sV, mbar_q,
                            pipeline_k, pipeline_v, tile, tidx - THREADS_PER_WG, softmax_scale)

    # ------------------------------------------------------------------ producer
    @cute.jit
    def load_bwd(self, mQ, mdO, mK, mV, mTileStart, sK, sV, atoms, rows_q, rows_do, sQ_base, sdO_base, mbar_q,
                 pipeline_k, pipeline_v, tile):
        tma_atom_Q, tma_atom_dO, tma_atom_K, tma_atom_V = atoms[:4]
        mK_cur = mK[None, None, tile.h, tile.b]  # (S, Dk)
        mV_cur = mV[None, None, tile.h, tile.b]  # (S, Dv)
        w = tile.q0 // self.wq
        if tile.count > 0:
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, KV_STAGES)
            # 1. K and V of the first block, then the tile's Q and dO rows.
            self.load_block(tma_atom_K, mK_cur, sK, mTileStart[tile.s, w, 0], self.dk, pipeline_k, kv_state)
            self.load_block(tma_atom_V, mV_cur, sV, mTileStart[tile.s, w, 0], self.dv, pipeline_v, kv_state)
            self.load_q_do_rows(mQ, mdO, tma_atom_Q, tma_atom_dO, rows_q, rows_do, sQ_base, sdO_base, mbar_q, tile)
            # 2. K[n] and V[n] of the other blocks (Note [exact delta]: every block twice)
            for n in cutlass.range(1, tile.count * self.sweeps, unroll=1):
                kv_state.advance()
                j = n
                if cutlass.const_expr(self.sweeps == 2):
                    j = n % tile.count
                start = mTileStart[tile.s, w, j]
                self.load_block(tma_atom_K, mK_cur, sK, start, self.dk, pipeline_k, kv_state)
                self.load_block(tma_atom_V, mV_cur, sV, start, self.dv, pipeline_v, kv_state)

    @cute.jit
    def load_q_do_rows(self, mQ, mdO, tma_atom_Q, tma_atom_dO, rows_q, rows_do, sQ_base, sdO_base, mbar_q, tile):
        """The tile's Q and dO rows (one (GC, D) box per tile query each) completing on ``mbar_q``."""
        if cute.arch.lane_idx() == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(mbar_q, tile.nq * self.gc * (self.dk + self.dv) * 2)
        for j in cutlass.range(tile.nq, unroll=1):
            for atom, mX, base, box, d in ((tma_atom_Q, mQ, sQ_base, rows_q, self.dk),
                                           (tma_atom_dO, mdO, sdO_base, rows_do, self.dv)):
                dst = cute.make_tensor(cute.recast_ptr(base + j * self.gc * 64, box.inner), box.outer)
                src = cute.local_tile(mX[None, None, tile.q0 + j, tile.b], (self.gc, d), (tile.head0 // self.gc, 0))
                tS, tG = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(dst, 0, 2),
                                               cute.group_modes(src, 0, 2))
                cute.copy(atom, tG, tS, tma_bar_ptr=mbar_q)

    # ------------------------------------------------------------------ consumer
    @cute.jit
    def consume_dq(self, mO, mdOg, mLSE, mDelta, mTileStart, mTileMask, mQLimit, out, sQ, sdO, sK, sV, mbar_q,
                   pipeline_k, pipeline_v, tile, ctidx: Int32, softmax_scale: Float32):
        tiled_mma_s, tiled_mma_dq, thr_mma_s, thr_mma_dq, wg_s, wg_dq, tSrQ, tSrdO, tSrK = self.s_operands(
            self.dk, sQ, sdO, sK, ctidx)
        tSrV = wg_s.make_fragment_B(wg_s.partition_B(sV))
        tQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(transpose_view(sK)))
        tQrdS = wg_dq.make_fragment_A(wg_dq.partition_shape_A((TILE_M, self.tile_n)))
        acc_S_shape = wg_s.partition_shape_C((TILE_M, self.tile_n))
        acc_dQ = cute.make_rmem_tensor(wg_dq.partition_shape_C((TILE_M, self.dk)), Float32)
        acc_dQ.fill(0.0)
        ctx = self.row_context(thr_mma_s, mTileStart, mTileMask, mQLimit, tile)
        ctx.sK, ctx.storage, ctx.ctidx = sK, out.storage, ctidx
        self.row_stats(ctx, mO, mdOg, mLSE, mDelta, tile, ctidx, softmax_scale)
        if tile.count > 0:
            cute.arch.mbarrier_wait(mbar_q, 0)
            self.load_row_operand(tiled_mma_s, sQ, tSrQ, ctidx)
            self.load_row_operand(tiled_mma_s, sdO, tSrdO, ctidx)
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, KV_STAGES)
            if cutlass.const_expr(self.sweeps == 2):  # Note [exact delta]: the first sweep
                for n in cutlass.range(tile.count, unroll=1):
                    self.delta_step(ctx, n, kv_state, tiled_mma_s, tSrQ, tSrdO, tSrK, tSrV, acc_S_shape,
                                    pipeline_k, pipeline_v)
                    kv_state.advance()
                self.finish_delta(ctx)
            for n in cutlass.range(tile.count, unroll=1):
                self.dq_step(ctx, n, kv_state, tiled_mma_s, tiled_mma_dq, tSrQ, tSrdO, tSrK, tSrV, tQrKt, tQrdS,
                             acc_dQ, acc_S_shape, pipeline_k, pipeline_v)
                kv_state.advance()
        if cutlass.const_expr(self.sweeps == 2):
            self.store_delta(ctx, mDelta, tile, ctidx)
        acc_dQ_mn = acc_mn_view(acc_dQ)
        for r in cutlass.range_constexpr(2):
            acc_dQ_mn[r, None].store(acc_dQ_mn[r, None].load() * softmax_scale)
        # dq staged in Q's buffer (free: every S GEMM has completed) and stored by TMA, one box per tile query
        self.stage_columns(acc_dQ, out.sQ_base, out.sQ_layout, tiled_mma_dq, ctidx, 0, self.dk)
        cute.arch.barrier(barrier_id=O_STAGED_WG, number_of_threads=THREADS_PER_WG)
        if ctidx == 0:
            self.store_row_boxes(out.atom, out.rows, out.mdQ, out.sQ_base, tile, self.dk)

    def s_operands(self, dq_cols: int, sQ, sdO, sK, ctidx: Int32):
        """The S / dP wgmma and the dq one (``row_mmas(dq_cols)``), their thread and warpgroup slices, and the S /
        dP operands: Q and dO (A: registers with ``q_in_regs``, filled by ``load_row_operand`` once they
        arrived, else smem; Note [Q in registers] in fwd_sm90.py) and K (B, (.., .., k, stage))."""
        tiled_mma_s, tiled_mma_dq = self.row_mmas(dq_cols)
        wg_s = tiled_mma_s.get_slice(0)
        return (tiled_mma_s, tiled_mma_dq, tiled_mma_s.get_slice(ctidx), tiled_mma_dq.get_slice(ctidx), wg_s,
                tiled_mma_dq.get_slice(0), self.row_operand(tiled_mma_s, sQ), self.row_operand(tiled_mma_s, sdO),
                wg_s.make_fragment_B(wg_s.partition_B(sK)))

    @cute.jit
    def row_stats(self, ctx, mO, mdOg, mLSE, mDelta, tile, ctidx: Int32, softmax_scale: Float32):
        """ctx.lse_log2 / ctx.delta / ctx.scale_log2 of this thread's two rows; delta also to ``mDelta``. With
        ``exact_delta`` delta starts at 0 and O is not read (Note [exact delta]: the first sweep sums it)."""
        # per row: lse (log2 units; +inf where P must be 0) and delta = rowsum(dO * O), summed by the 4
        # lanes that hold the row (lane % 4 takes columns [quarter * Dv / 4, ...)) and stored by one
        lse_log2 = cute.make_rmem_tensor((2,), Float32)
        delta = cute.make_rmem_tensor((2,), Float32)
        quarter = ctidx % 4
        cols = self.dv // 4
        copy16 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        vec = cute.make_layout((8,))
        for r in cutlass.range_constexpr(2):
            lse_log2[r] = Float32.inf
            part = Float32(0.0)
            t = tile.q0 + ctx.row[r] // self.gc
            head = tile.head0 + ctx.row[r] % self.gc
            if ctx.row[r] < ctx.rows_valid:
                v = mLSE[tile.b, head, t]
                lse_log2[r] = Float32.inf if v == -Float32.inf else v * LOG2_E
                for c in cutlass.range_constexpr(0 if self.sweeps == 2 else cols // 8):
                    coord = (tile.b, t, head, quarter * cols + c * 8)
                    ro = cute.make_rmem_tensor((8,), self.dtype)
                    rdo = cute.make_rmem_tensor((8,), self.dtype)
                    cute.copy(copy16, cute.make_tensor(vec_ptr(mO, coord), vec), ro)
                    cute.copy(copy16, cute.make_tensor(vec_ptr(mdOg, coord), vec), rdo)
                    prod = ro.load().to(Float32) * rdo.load().to(Float32)
                    for e in cutlass.range_constexpr(8):
                        part = part + prod[e]
            if cutlass.const_expr(self.sweeps == 2):
                delta[r] = part
            else:
                delta[r] = row_allreduce(part, 4, lambda x, y: x + y)
                if ctx.row[r] < ctx.rows_valid:
                    if quarter == 0:
                        mDelta[tile.b, head, t] = delta[r]
        ctx.lse_log2 = lse_log2
        ctx.delta = delta
        ctx.scale_log2 = softmax_scale * LOG2_E

    @cute.jit
    def delta_step(self, ctx, n: Int32, kv_state, tiled_mma_s, tSrQ, tSrdO, tSrK, tSrV, acc_S_shape, pipeline_k,
                   pipeline_v):
        """Note [exact delta], block n of the first sweep: S and dP, the block masks, P, and this thread's
        share of each row's sum P * dP added to ``ctx.delta``. ``pipeline_v`` None: V is in K's stage (the
        latent; ``tSrV`` is then K's operand, whose first Dv / 16 k-blocks the dP GEMM takes)."""
        meta = self.block_meta(ctx, n)
        acc_S = cute.make_rmem_tensor(acc_S_shape, Float32)
        acc_dP = cute.make_rmem_tensor(acc_S_shape, Float32)
        pipeline_k.consumer_wait(kv_state)
        self.gemm(tiled_mma_s, acc_S, tSrQ, tSrK[None, None, None, kv_state.index], True, -1)
        if cutlass.const_expr(pipeline_v is not None):
            pipeline_v.consumer_wait(kv_state)
        self.gemm(tiled_mma_s, acc_dP, tSrdO, tSrV[None, None, None, kv_state.index], True, 0)
        pipeline_k.consumer_release(kv_state)
        if cutlass.const_expr(pipeline_v is not None):
            pipeline_v.consumer_release(kv_state)
        self.add_delta(ctx, acc_S, acc_dP, meta)

    @cute.jit
    def add_delta(self, ctx, acc_S, acc_dP, meta):
        """``ctx.delta[r] += sum_c P[r, c] dP[r, c]`` over this thread's columns (masked as ``scores_to_ds``)."""
        acc_S_mn = acc_mn_view(acc_S)
        acc_dP_mn = acc_mn_view(acc_dP)
        self.mask_block(ctx, acc_S_mn, meta)
        for r in cutlass.range_constexpr(2):
            acc_S_mn[r, None].store(self.row_probs(ctx, acc_S_mn, r))
            for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                # Note [non-finite keys a row cannot see]: P dP = 0 where P = 0 (not 0 * NaN)
                acc_S_mn[r, c] = self.ds_where_seen(acc_S_mn[r, c], acc_dP_mn[r, c], Float32(0.0))
            part = acc_S_mn[r, None].load().reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            ctx.delta[r] = ctx.delta[r] + part

    @cute.jit
    def finish_delta(self, ctx):
        """Note [exact delta]: each row's delta summed over the 4 lanes that hold its columns."""
        for r in cutlass.range_constexpr(2):
            ctx.delta[r] = row_allreduce(ctx.delta[r], 4, lambda x, y: x + y)

    @cute.jit
    def store_delta(self, ctx, mDelta, tile, ctidx: Int32):
        """The exact delta of the tile's real rows to ``mDelta`` (0 for a tile without blocks)."""
        for r in cutlass.range_constexpr(2):
            if ctx.row[r] < ctx.rows_valid:
                if ctidx % 4 == 0:
                    mDelta[tile.b, tile.head0 + ctx.row[r] % self.gc, tile.q0 + ctx.row[r] // self.gc] = ctx.delta[r]

    def row_probs(self, ctx, acc_S_mn, r: int):
        """P of row ``r`` of the masked scores: exp2(S scale log2e - lse) (0 where masked, and on rows with lse
        +inf); the one rule ``scores_to_ds`` and the exact delta's ``add_delta`` use."""
        return cute.math.exp2(acc_S_mn[r, None].load() * ctx.scale_log2 - ctx.lse_log2[r], fastmath=True)

    @cute.jit
    def scores_to_ds(self, ctx, acc_S, acc_dP, meta, tQrdS):
        """Block masks on S, P = exp2(S scale log2e - lse), dS = P (dP - delta), as 16-bit into ``tQrdS`` (the dq
        GEMM's A operand)."""
        acc_S_mn = acc_mn_view(acc_S)
        acc_dP_mn = acc_mn_view(acc_dP)
        self.mask_block(ctx, acc_S_mn, meta)
        for r in cutlass.range_constexpr(2):
            acc_S_mn[r, None].store(self.row_probs(ctx, acc_S_mn, r))
            for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                acc_S_mn[r, c] = self.ds_where_seen(acc_S_mn[r, c], acc_dP_mn[r, c], ctx.delta[r])
        convert_to_16bit(acc_as_operand_a(acc_S), tQrdS)

    @cute.jit
    def ds_where_seen(self, p: Float32, dp: Float32, delta: Float32) -> Float32:
        """dS = P (dP - delta), 0 where P = 0 (Note [non-finite keys a row cannot see]: not 0 * NaN from a
        non-finite value row or delta the row did not see)."""
        return Float32(0.0) if p == Float32(0.0) else p * (dp - delta)

    @cute.jit
    def scrub_k_block(self, ctx, kv_state, meta):
        """Note [non-finite keys a row cannot see]: in a block that needs masks, zero the non-finite elements of
        K's stage in shared memory (the S GEMM that read it completed) for the dq GEMM, fenced for the async
        proxy; the caller meets on SCRUB_WG before that GEMM (``scrub_k_barrier``)."""
        flags = ctx.storage.k_flags.get_tensor(cute.make_layout((64, KV_STAGES)))
        if self.block_masked(ctx, meta) != 0:
            nf.scrub_rows(ctx.sK[None, None, kv_state.index], flags[None, kv_state.index], ctx.ctidx,
                          THREADS_PER_WG, self.k_per_row,
                          batch=1 if self.sweeps == 2 else self.k_batch)  # exact_delta: batch 2 spilled 32 B
            cute.arch.fence_view_async_shared()

    @cute.jit
    def scrub_k_barrier(self, ctx, meta):
        """The consumer warpgroup meets after ``scrub_k_block`` (the same blocks: the test is uniform)."""
        if self.block_masked(ctx, meta) != 0:
            cute.arch.barrier(barrier_id=SCRUB_WG, number_of_threads=THREADS_PER_WG)

    @cute.jit
    def dq_step(self, ctx, n: Int32, kv_state, tiled_mma_s, tiled_mma_dq, tSrQ, tSrdO, tSrK, tSrV, tQrKt, tQrdS,
                acc_dQ, acc_S_shape, pipeline_k, pipeline_v):
        """Block n: S and dP in flight together, then P, dS and dQ += dS K."""
        meta = self.block_meta(ctx, n)
        acc_S = cute.make_rmem_tensor(acc_S_shape, Float32)
        acc_dP = cute.make_rmem_tensor(acc_S_shape, Float32)
        pipeline_k.consumer_wait(kv_state)
        self.gemm(tiled_mma_s, acc_S, tSrQ, tSrK[None, None, None, kv_state.index], True, -1)
        pipeline_v.consumer_wait(kv_state)
        self.gemm(tiled_mma_s, acc_dP, tSrdO, tSrV[None, None, None, kv_state.index], True, 0)
        pipeline_v.consumer_release(kv_state)
        self.scrub_k_block(ctx, kv_state, meta)
        self.scores_to_ds(ctx, acc_S, acc_dP, meta, tQrdS)
        self.scrub_k_barrier(ctx, meta)
        self.gemm(tiled_mma_dq, acc_dQ, tQrdS, tQrKt[None, None, None, kv_state.index], False, 0)
        pipeline_k.consumer_release(kv_state)
