"""BlockSparseFwdSm90: Hopper forward of block-sparse attention over per-query selected key blocks.

    out[b, t, hq] = sum_c softmax_c(scale * q . k_c [, sink[hq]]) v_c
    lse[b, hq, t] = log(sum_c exp(scale * q . k_c) [+ exp(sink[hq])])     (natural log; -inf: no key)

over the keys c of the live blocks the plan lists for query t's row tile, ``c < q_limit[b, t]``
(causal: ``t + 1``; else its document's end) and selected by t's bit (plan and block rule:
``paddle_fa4/_plan/block_sparse.py``; row-tile geometry: ``config.py``).

One CTA per (query tile w, kv head h x head chunk c, batch b), 256 threads:

    WG 0, warp 0   producer: K of block 0, then Q (one TMA box of GC head rows per tile query,
                   Note [query rows by TMA] in indexed/bwd_dkdv_sm90.py), then K[n] with V[n-1]
                   per listed block (one 64 x D box each at the block's start row; rows past S
                   are zero-filled by TMA), then V of the last block; 2 stages
    WG 1           consumer, 64 rows: S = Q K^T (wgmma; Q from registers at D <= 128, Note [Q in
                   registers]), masks (below), online softmax
                   (common/softmax.py), O += P V (P from registers); the QK^T of block n is in
                   flight while the PV of block n-1 runs (intra-warpgroup overlap, as the dense
                   forward attention/fwd_sm90.py); sink folded in before the epilogue; O staged in
                   Q's buffer and stored by TMA, one box per tile query (Note [staged O] at
                   ``epilogue``); lse by plain stores to each row's (query, head)

    producer ──K,V (mbarrier pipelines), Q (one mbarrier)──▶ consumer ──▶ out, lse

Masks (Note [block masks]): a block is skipped by no row; rows whose query did not select it, and
keys ``>= q_limit`` of rows that did, are -inf. Both are one ``common/mask.apply_mask`` call with a
per-row key limit (``q_limit`` or 0), run only when some row needs it: the block is not selected by
every tile query, or it reaches past the smallest ``q_limit`` of the tile (the diagonal block of
causal rows, a document's tail block). Every other block is used as loaded.

Note [scrubbed value blocks] (NaN / Inf in values a row cannot see; common/nonfinite.py, the dense
forward's Note [scrubbed value tiles]): where a block needs masks (above), the PV multiplies P = 0 of the rows
that cannot see a key by its value row, and IEEE 0 * NaN = NaN. So before the PV of such a block the consumer
warpgroup zeroes the non-finite elements of its V stage in shared memory (``nonfinite.scrub_rows``, 128
threads, while the next block's QK^T runs) and flags their keys (one byte per key and stage, one byte per warp
and stage for "some key flagged"); after a named barrier a row whose P is non-zero on a flagged key gets NaN in
acc_O (what the unscrubbed PV gave it). Blocks every tile row sees in full are not scanned. The flags of a
stage are rewritten only after the producer refilled it, which waits for every warp's release of the PV that
read them.

Note [Q in registers]: a block is 64 keys, so S = Q K^T is a wgmma of N = 64, and with both operands in
shared memory each m64n64k16 reads 4 KiB for 32 cycles of math: as much shared-memory bandwidth (128 B per
cycle) as the SM has, shared with PV's reads, the TMA's writes and a second CTA on the SM. Q is the same for
every block of the tile, so at D <= 128 (32 registers per thread at d 128) the consumer loads it once into
the wgmma's A-operand registers (ldmatrix) after it arrives, and each S GEMM reads only K from shared memory.
At d 256 (O alone is 128 registers) and in the latent kernels Q stays in shared memory.

Idle rows (past S, or the 64 - WQ * GC rows of a G that does not divide 64) are never loaded,
never selected (no bit) and never stored: whatever their shared memory holds stays in their rows.
Blocks are visited in ascending start order whatever the order of the ids, so out and lse do not
depend on it, and nothing is accumulated across CTAs: bitwise reproducible.

Not supported (``config.unsupported_reason``): block_size != 64, Dk != Dv or Dk not in (64, 128,
256), G > 64 not a multiple of 64. The absorbed-MLA latent (v=None, Dk 576 / 512) has its own
kernel, ``fwd_latent_sm90.py``, built on this one.
"""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warp, warpgroup

from cute_kernels.common import nonfinite as nf
from cute_kernels.common.mask import apply_mask
from cute_kernels.common.softmax import OnlineSoftmax
from cute_kernels.common.utils import (LOG2_E, acc_as_operand_a, acc_mn_view, convert_to_16bit,
                                       sm90_thread0_cols, transpose_view, wgmma_gemm, wgmma_smem_layout)

from .common import THREADS_PER_WG, BlockSparseSm90, fold_sink_row, shared_storage, smem_tensors
from .config import BLOCK_SIZE, TILE_M, FwdConfig

KV_STAGES = 2
# setmaxnreg split; 128 * (24 + 232) = 32K registers per CTA, so two CTAs fit an SM (D <= 128).
PRODUCER_REGS, CONSUMER_REGS = 24, 232
#: Named barrier of the consumer warpgroup before the O store (Note [staged O]; 0 is the CTA barrier).
O_STAGED_WG = 1
#: Named barrier of the consumer warpgroup after a V stage's scrub (Note [scrubbed value blocks]).
SCRUB_WG = 2
#: Shared bytes of the scrub's flags: one per key and stage, one per consumer warp and stage.
SCRUB_BYTES = (BLOCK_SIZE + THREADS_PER_WG // 32) * KV_STAGES


class BlockSparseFwdSm90(BlockSparseSm90):
    @staticmethod
    def smem_bytes(cfg: FwdConfig) -> int:
        q = TILE_M * cfg.head_dim * 2
        kv = BLOCK_SIZE * (cfg.head_dim + cfg.head_dim_v) * 2 * KV_STAGES
        return q + kv + 3 * 1024 + 8 * (1 + 4 * KV_STAGES) + SCRUB_BYTES

    # ------------------------------------------------------------------ host launch
    MBARS = {"mbar_q": 1, "mbar_k": 2 * KV_STAGES, "mbar_v": 2 * KV_STAGES}

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mTileStart: cute.Tensor,
                 mTileMask: cute.Tensor, mTileCount: cute.Tensor, mQLimit: cute.Tensor, mSink,
                 mO: cute.Tensor, mLSE: cute.Tensor, softmax_scale: Float32, stream):
        # Q: one (GC, Dk) box per tile query from the (Hq, Dk, S, B) row view; K/V: (S, D, H, B)
        sQ_layout = wgmma_smem_layout(self.dtype, (TILE_M, self.dk, 1))
        sK_layout = wgmma_smem_layout(self.dtype, (self.tile_n, self.dk, KV_STAGES))
        sV_layout = wgmma_smem_layout(self.dtype, (self.tile_n, self.dv, KV_STAGES))
        tma_atom_Q, tma_Q, rows = self.rows_tma(mQ, self.dk)  # stage 0 of its layout is laid out as sQ
        (tma_atom_K, tma_K), (tma_atom_V, tma_V) = self.kv_tmas(mK, mV, sK_layout, sV_layout)
        tma_atom_O, tma_O, rows_o = self.rows_tma(mO, self.dv, store=True)  # Note [staged O]
        self.shared_storage = shared_storage(self.dtype, self.MBARS, self.scrub_words(), sQ=sQ_layout,
                                             sK=sK_layout, sV=sV_layout)
        grid = (mTileCount.shape[1], mK.shape[2] * self.chunks, mQ.shape[0])
        self.kernel(tma_Q, tma_K, tma_V, mTileStart, mTileMask, mTileCount, mQLimit, mSink, tma_O, mLSE,
                    tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O, sQ_layout, sK_layout, sV_layout, rows, rows_o,
                    softmax_scale).launch(grid=grid, block=[2 * THREADS_PER_WG, 1, 1],
                                          smem=self.shared_storage.size_in_bytes(), stream=stream,
                                          min_blocks_per_mp=2 if self.dk <= 128 else 1,
                                          preferred_smem_carveout=100)

    # ------------------------------------------------------------------ device
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mTileStart: cute.Tensor,
               mTileMask: cute.Tensor, mTileCount: cute.Tensor, mQLimit: cute.Tensor, mSink,
               mO: cute.Tensor, mLSE: cute.Tensor, tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom,
               tma_atom_V: cute.CopyAtom, tma_atom_O: cute.CopyAtom, sQ_layout: cute.ComposedLayout,
               sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout, rows: cute.ComposedLayout,
               rows_o: cute.ComposedLayout, softmax_scale: Float32):
        warp_idx, tidx, storage, mbar_q, pipeline_k, pipeline_v = self.prologue(
            (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O))
        sQ, sK, sV = smem_tensors(storage, sQ=sQ_layout, sK=sK_layout, sV=sV_layout)

        tile = self.tile_of(mQ, mK, mTileCount)
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp_idx == 0:
                self.load(mQ, mK, mV, mTileStart, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V, rows,
                          storage.sQ.data_ptr(), mbar_q, pipeline_k, pipeline_v, tile)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            out = SimpleNamespace(mO=mO, atom=tma_atom_O, rows=rows_o, sQ_base=storage.sQ.data_ptr(),
                                  sQ_layout=sQ_layout, storage=storage)
            self.consume(mTileStart, mTileMask, mQLimit, mSink, out, mLSE, sQ, sK, sV, mbar_q, pipeline_k,
                         pipeline_v, tile, tidx - THREADS_PER_WG, softmax_scale)

    def scrub_words(self) -> dict:
        """Note [scrubbed value blocks]: the flag bytes in the shared storage (``shared_storage``'s words)."""
        return {"v_flags": (cutlass.Uint8, BLOCK_SIZE * KV_STAGES),
                "v_any": (cutlass.Uint8, THREADS_PER_WG // 32 * KV_STAGES)}

    def scrub_flags(self, storage):
        """(per-warp "found" bytes [warp, stage], per-key flags [key, stage]), made where used."""
        return (storage.v_any.get_tensor(cute.make_layout((THREADS_PER_WG // 32, KV_STAGES))),
                storage.v_flags.get_tensor(cute.make_layout((BLOCK_SIZE, KV_STAGES))))

    def kv_tmas(self, mK, mV, sK_layout, sV_layout):
        """K / V block atoms (one stage of the staged layouts) and their stage byte counts."""
        self.tx_bytes_k = cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1]))
        self.tx_bytes_v = cute.size_in_bytes(self.dtype, cute.select(sV_layout, mode=[0, 1]))
        return (self.kv_tma(mK, cute.select(sK_layout, mode=[0, 1]), self.dk),
                self.kv_tma(mV, cute.select(sV_layout, mode=[0, 1]), self.dv))

    @cute.jit
    def prologue(self, atoms: tuple):
        """Warp 0 prefetches the TMA descriptors; the shared storage, the Q barrier (one arrival) and the
        K / V pipelines (one producer thread, the consumer warpgroup's warps)."""
        warp_idx, tidx, storage = self.allocate(atoms)
        mbar_q = storage.mbar_q.data_ptr()
        if tidx == 0:
            cute.arch.mbarrier_init(mbar_q, 1)
        cute.arch.mbarrier_init_fence()
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, THREADS_PER_WG // 32)
        pipeline_k = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_k.data_ptr(), num_stages=KV_STAGES, producer_group=producer,
            consumer_group=consumers, tx_count=self.tx_bytes_k, defer_sync=True)
        pipeline_v = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_v.data_ptr(), num_stages=KV_STAGES, producer_group=producer,
            consumer_group=consumers, tx_count=self.tx_bytes_v, defer_sync=False)
        return warp_idx, tidx, storage, mbar_q, pipeline_k, pipeline_v

    @cute.jit
    def tile_of(self, mQ: cute.Tensor, mK: cute.Tensor, mTileCount: cute.Tensor):
        """This CTA's row tile (grid (query tile, kv head x head chunk, batch)): ``tile_at``'s fields."""
        w, hc, b = cute.arch.block_idx()
        return self.tile_at(w, hc, b, mQ, mK, mTileCount)

    @cute.jit
    def tile_at(self, w: Int32, hc: Int32, b: Int32, mQ: cute.Tensor, mK: cute.Tensor, mTileCount: cute.Tensor):
        """Row tile ``w`` of kv head x head chunk ``hc`` and batch ``b``: index set, kv head, batch, first query,
        block count, real queries, first query head; from the (Hq, D, S, B) Q row view and the (S, D, H, B) K
        view."""
        h = hc // self.chunks
        s = b
        if const_expr(self.cfg.per_kv_head):
            s = b * mK.shape[2] + h
        seqlen = mQ.shape[2]
        return SimpleNamespace(s=s, h=h, b=b, q0=w * self.wq, count=mTileCount[s, w],
                               nq=cutlass.min(seqlen - w * self.wq, self.wq),
                               head0=h * self.cfg.group + (hc - h * self.chunks) * self.gc, seqlen=seqlen)

    # ------------------------------------------------------------------ producer
    @cute.jit
    def load_block(self, atom, mX_cur, sX, start: Int32, cols: cutlass.Constexpr, pipe, state):
        """One block: the (64, cols) box of rows [start, start + 64) into the state's stage."""
        gX = cute.local_tile(cute.domain_offset((start, 0), mX_cur), (self.tile_n, cols), (0, 0))
        tXsX, tXgX = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2),
                                           cute.group_modes(gX, 0, 2))
        pipe.producer_acquire(state)
        cute.copy(atom, tXgX, tXsX[None, state.index], tma_bar_ptr=pipe.producer_get_barrier(state))

    @cute.jit
    def load_q_rows(self, mQ, tma_atom_Q, rows, sQ_base, mbar_q, tile):
        """The tile's Q rows: one (GC, Dk) box per tile query into its row slots of sQ, completing on
        ``mbar_q`` (expected bytes announced first)."""
        if cute.arch.lane_idx() == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(mbar_q, tile.nq * self.gc * self.dk * 2)
        for j in cutlass.range(tile.nq, unroll=1):
            dst = cute.make_tensor(cute.recast_ptr(sQ_base + j * self.gc * 64, rows.inner), rows.outer)
            src = cute.local_tile(mQ[None, None, tile.q0 + j, tile.b], (self.gc, self.dk),
                                  (tile.head0 // self.gc, 0))
            tS, tG = cpasync.tma_partition(tma_atom_Q, 0, cute.make_layout(1), cute.group_modes(dst, 0, 2),
                                           cute.group_modes(src, 0, 2))
            cute.copy(tma_atom_Q, tG, tS, tma_bar_ptr=mbar_q)

    @cute.jit
    def load(self, mQ, mK, mV, mTileStart, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V, rows,
             sQ_base, mbar_q, pipeline_k, pipeline_v, tile):
        mK_cur = mK[None, None, tile.h, tile.b]  # (S, Dk)
        mV_cur = mV[None, None, tile.h, tile.b]  # (S, Dv)
        if tile.count > 0:
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, KV_STAGES)
            # 1. K of the first block, then the tile's Q rows (one box per query, GC head rows).
            self.load_block(tma_atom_K, mK_cur, sK, mTileStart[tile.s, tile.q0 // self.wq, 0], self.dk,
                            pipeline_k, kv_state)
            self.load_q_rows(mQ, tma_atom_Q, rows, sQ_base, mbar_q, tile)
            # 2. K[n] with V[n - 1]: the consumer runs QK^T of block n next to PV of block n - 1.
            w = tile.q0 // self.wq
            for n in cutlass.range(1, tile.count, unroll=1):
                prev_state = kv_state.clone()
                kv_state.advance()
                self.load_block(tma_atom_K, mK_cur, sK, mTileStart[tile.s, w, n], self.dk, pipeline_k, kv_state)
                self.load_block(tma_atom_V, mV_cur, sV, mTileStart[tile.s, w, n - 1], self.dv, pipeline_v,
                                prev_state)
            # 3. V of the last block.
            self.load_block(tma_atom_V, mV_cur, sV, mTileStart[tile.s, w, tile.count - 1], self.dv, pipeline_v,
                            kv_state)

    # ------------------------------------------------------------------ consumer
    @cute.jit
    def gemm(self, tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor,
             zero_init: cutlass.Constexpr, wait: cutlass.Constexpr):
        wgmma_gemm(tiled_mma, acc, tCrA, tCrB, zero_init)
        if const_expr(wait >= 0):
            warpgroup.wait_group(wait)

    @property
    def q_in_regs(self) -> bool:
        """Note [Q in registers]: the S GEMM's A operand (Q; in the dQ kernel also dO) from registers."""
        return not self.cfg.latent and self.dk <= 128

    def row_mmas(self, d: int):
        """The consumer's two wgmmas: S = Q K^T (64 x 64, K-major; A from registers with ``q_in_regs``, else
        from smem) and the second GEMM's (64 x d, A from registers, B read MN-major)."""
        return (sm90_utils.make_trivial_tiled_mma(
                    self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, Float32,
                    atom_layout_mnk=(1, 1, 1), tiler_mn=(64, self.tile_n),
                    a_source=warpgroup.OperandSource.RMEM if self.q_in_regs else warpgroup.OperandSource.SMEM),
                sm90_utils.make_trivial_tiled_mma(
                    self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN, Float32,
                    atom_layout_mnk=(1, 1, 1), tiler_mn=(64, d), a_source=warpgroup.OperandSource.RMEM))

    @cute.jit
    def consume(self, mTileStart, mTileMask, mQLimit, mSink, out, mLSE, sQ, sK, sV, mbar_q, pipeline_k,
                pipeline_v, tile, ctidx: Int32, softmax_scale: Float32):
        tiled_mma_qk, tiled_mma_pv = self.row_mmas(self.dv)
        thr_mma_qk = tiled_mma_qk.get_slice(ctidx)
        thr_mma_pv = tiled_mma_pv.get_slice(ctidx)
        wg_mma_qk = tiled_mma_qk.get_slice(0)
        wg_mma_pv = tiled_mma_pv.get_slice(0)
        tSrQ = self.row_operand(tiled_mma_qk, sQ)
        tSrK = wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK))  # (.., .., k, stage)
        tOrVt = wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(transpose_view(sV)))
        tOrP = wg_mma_pv.make_fragment_A(wg_mma_pv.partition_shape_A((TILE_M, self.tile_n)))
        acc_S_shape = wg_mma_qk.partition_shape_C((TILE_M, self.tile_n))
        acc_O = cute.make_rmem_tensor(wg_mma_pv.partition_shape_C((TILE_M, self.dv)), Float32)
        acc_O_mn = acc_mn_view(acc_O)
        acc_O.fill(0.0)

        scale_log2 = softmax_scale * LOG2_E
        softmax = OnlineSoftmax(scale_log2, 2, 4)
        softmax.reset()
        ctx = self.row_context(thr_mma_qk, mTileStart, mTileMask, mQLimit, tile)
        ctx.softmax = softmax
        ctx.sV, ctx.storage, ctx.ctidx = sV, out.storage, ctidx
        row = ctx.row
        rows_valid = ctx.rows_valid

        if tile.count > 0:
            cute.arch.mbarrier_wait(mbar_q, 0)
            self.load_row_operand(tiled_mma_qk, sQ, tSrQ, ctidx)
            self.mainloop(ctx, tile.count, tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt, tOrP, acc_O,
                          acc_O_mn, acc_S_shape, pipeline_k, pipeline_v)

        # 4. Sink, O /= l, lse; only the rows of real (query, head) pairs are written.
        row_scale, lse = self.finish_rows(softmax, mSink, tile, row, ctidx)
        softmax.rescale(acc_O_mn, row_scale)
        self.epilogue(acc_O, lse, out, mLSE, tiled_mma_pv, thr_mma_pv, tile, rows_valid, ctidx)

    @cute.jit
    def finish_rows(self, softmax: OnlineSoftmax, mSink, tile, row: list, ctidx: Int32):
        """(O scale = 1 / l, lse) of this thread's two rows, the sink folded in (``fold_sink``)."""
        heads = [tile.head0 + row[r] % self.gc for r in range(2)]
        keyless = None
        if const_expr(self.cfg.has_sink):
            keyless = self.fold_sink(softmax, mSink, heads, ctidx % 4 == 0)
        row_scale, lse = softmax.finalize()
        if const_expr(self.cfg.has_sink):
            # a row without keys: lse is exactly sink[h] (finalize's (m * scale_log2 + log2 1) * ln 2
            # with m = sink * log2(e) / scale_log2 rounds three times)
            for r in cutlass.range_constexpr(2):
                if keyless[r] != 0:
                    lse[r] = mSink[heads[r]]
        return row_scale, lse

    @cute.jit
    def row_context(self, thr_mma_qk, mTileStart, mTileMask, mQLimit, tile):
        """This thread's two S rows: row index, query bit, key limit; the tile's mask facts."""
        tScS_mn = acc_mn_view(thr_mma_qk.partition_C(cute.make_identity_tensor((TILE_M, self.tile_n))))
        row = [tScS_mn[r, 0][0] for r in range(2)]
        rows_valid = tile.nq * self.gc
        bit = cute.make_rmem_tensor((2,), Int32)
        limit = cute.make_rmem_tensor((2,), Int32)
        for r in cutlass.range_constexpr(2):
            bit[r] = Int32(0)
            limit[r] = Int32(0)
            if row[r] < rows_valid:
                qi = row[r] // self.gc
                bit[r] = Int32(1) << qi
                limit[r] = mQLimit[tile.b, tile.q0 + qi]
        # Note [block masks]: a block needs masks unless every tile query selected it and it ends
        # at or below the smallest key limit of the tile, the first query's (limits do not decrease
        # along S: t + 1, or the end of t's document).
        min_limit = mQLimit[tile.b, tile.q0]
        all_bits = Int32(-1)
        if tile.nq < 32:
            all_bits = (Int32(1) << tile.nq) - 1
        return SimpleNamespace(row=row, rows_valid=rows_valid, bit=bit, limit=limit, min_limit=min_limit,
                               all_bits=all_bits, thr_col=tScS_mn[0, 0][1], cols=sm90_thread0_cols(self.tile_n),
                               seqlen=tile.seqlen, mTileStart=mTileStart, mTileMask=mTileMask, s=tile.s,
                               w=tile.q0 // self.wq)

    def row_operand(self, tiled_mma_qk, sX):
        """The S GEMM's A operand over the row buffer ``sX`` (Q, or dO in the dQ kernel): a register fragment
        with ``q_in_regs`` (filled by ``load_row_operand``), else the smem descriptor view."""
        wg = tiled_mma_qk.get_slice(0)
        if const_expr(self.q_in_regs):
            return wg.make_fragment_A(wg.partition_shape_A((TILE_M, cute.size(sX, mode=[1]))))
        return wg.make_fragment_A(wg.partition_A(sX[None, None, 0]))

    @cute.jit
    def load_row_operand(self, tiled_mma_qk, sX, tXrX, ctidx: Int32):
        """Note [Q in registers]: ``tXrX`` (``row_operand``) from stage 0 of ``sX`` by ldmatrix, once its load
        completed; nothing without ``q_in_regs``."""
        if const_expr(self.q_in_regs):
            atom = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
            tiled = cute.make_tiled_copy_A(atom, tiled_mma_qk)
            thr = tiled.get_slice(ctidx)
            cute.copy(tiled, thr.partition_S(sX[None, None, 0]), thr.retile(tXrX))

    @cute.jit
    def mainloop(self, ctx, count: Int32, tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt, tOrP, acc_O,
                 acc_O_mn, acc_S_shape, pipeline_k, pipeline_v):
        """The listed blocks in order (Q complete): QK^T of block n in flight with PV of block n - 1."""
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, KV_STAGES)
        # Note [scrubbed value blocks]: whether the block whose PV comes next needs masks, carried over the loop
        v_masked = cute.make_rmem_tensor((1,), Int32)
        # 1. First block: QK^T alone.
        meta = self.block_meta(ctx, 0)
        acc_S = cute.make_rmem_tensor(acc_S_shape, Float32)
        pipeline_k.consumer_wait(kv_state)
        self.gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv_state.index], True, 0)
        pipeline_k.consumer_release(kv_state)
        self.process_scores(ctx, acc_S, meta, True)
        v_masked[0] = self.block_masked(ctx, meta)
        convert_to_16bit(acc_as_operand_a(acc_S), tOrP)
        # 2. QK^T of block n in flight with PV of block n - 1.
        for n in cutlass.range(1, count, unroll=1):
            kv_state = self.overlap_step(ctx, n, kv_state, tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt, tOrP,
                                         acc_O, acc_O_mn, acc_S_shape, pipeline_k, pipeline_v, v_masked)
        # 3. PV of the last block.
        pipeline_v.consumer_wait(kv_state)
        self.scrub_v_block(ctx, kv_state, v_masked[0], tOrP, acc_O_mn)
        self.gemm(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, kv_state.index], False, 0)
        pipeline_v.consumer_release(kv_state)

    @cute.jit
    def overlap_step(self, ctx, n: Int32, kv_state, tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt, tOrP, acc_O,
                     acc_O_mn, acc_S_shape, pipeline_k, pipeline_v, v_masked):
        """QK^T of block n in flight with PV of block n - 1 (its V scrubbed first where ``v_masked[0]``, while the
        QK^T runs: Note [scrubbed value blocks]); then softmax of block n and O rescale."""
        v_state = kv_state.clone()
        kv_state.advance()
        meta = self.block_meta(ctx, n)  # read before the MMAs: its latency hides behind them
        acc_S = cute.make_rmem_tensor(acc_S_shape, Float32)
        pipeline_k.consumer_wait(kv_state)
        self.gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv_state.index], True, -1)
        pipeline_v.consumer_wait(v_state)
        self.scrub_v_block(ctx, v_state, v_masked[0], tOrP, acc_O_mn)
        self.gemm(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, v_state.index], False, -1)
        warpgroup.wait_group(1)
        pipeline_k.consumer_release(kv_state)
        row_scale = self.process_scores(ctx, acc_S, meta, False)
        v_masked[0] = self.block_masked(ctx, meta)
        warpgroup.wait_group(0)
        pipeline_v.consumer_release(v_state)
        ctx.softmax.rescale(acc_O_mn, row_scale)
        convert_to_16bit(acc_as_operand_a(acc_S), tOrP)
        return kv_state

    @cute.jit
    def block_meta(self, ctx, n: Int32) -> cute.Tensor:
        """(start row, query bits) of listed block ``n``, in registers."""
        meta = cute.make_rmem_tensor((2,), Int32)
        meta[0] = ctx.mTileStart[ctx.s, ctx.w, n]
        meta[1] = ctx.mTileMask[ctx.s, ctx.w, n]
        return meta

    @cute.jit
    def process_scores(self, ctx, acc_S: cute.Tensor, meta: cute.Tensor, is_first: cutlass.Constexpr) -> cute.Tensor:
        """Masks and online softmax of a block -> P in acc_S; returns the O rescale."""
        acc_S_mn = acc_mn_view(acc_S)
        self.mask_block(ctx, acc_S_mn, meta)
        return ctx.softmax.update(acc_S_mn, is_first)

    @cute.jit
    def block_masked(self, ctx, meta: cute.Tensor) -> Int32:
        """Note [block masks]: 1 where some row of the tile cannot see some key of the block (meta = (start,
        bits)): a tile query did not select it, or it reaches past the tile's smallest key limit."""
        masked = Int32(0)
        if (meta[1] & ctx.all_bits) != ctx.all_bits or meta[0] + self.tile_n > ctx.min_limit:
            masked = Int32(1)
        return masked

    @cute.jit
    def scrub_v_block(self, ctx, v_state, v_masked: Int32, tOrP, acc_O_mn):
        """Note [scrubbed value blocks]: with V of ``v_state`` landed and ``v_masked``, the consumer warpgroup
        zeroes its non-finite values and flags their keys, meets on SCRUB_WG, and gives NaN in acc_O to the rows
        whose P (still in ``tOrP``) is non-zero on a flagged key. No PV may be in flight (acc_O is written)."""
        if v_masked != 0:
            words, flags = self.scrub_flags(ctx.storage)
            found = nf.scrub_rows(ctx.sV[None, None, v_state.index], flags[None, v_state.index], ctx.ctidx,
                                  THREADS_PER_WG, self.v_per_row, batch=self.v_batch)
            cute.arch.fence_view_async_shared()
            ballot = cute.arch.vote_ballot_sync(found != 0)
            if ctx.ctidx % 32 == 0:
                words[ctx.ctidx // 32, v_state.index] = cutlass.Uint8(1) if ballot != 0 else cutlass.Uint8(0)
            cute.arch.barrier(barrier_id=SCRUB_WG, number_of_threads=THREADS_PER_WG)
            # the four warps' bytes of the stage as one word
            if cute.recast_tensor(words, cutlass.Uint32)[v_state.index] != cutlass.Uint32(0):
                vis = nf.visible_bits_sm90(tOrP)
                flagged = nf.flag_bits_sm90(flags[None, v_state.index], ctx.ctidx % 32, self.tile_n)
                bits = nf.row_poison_bits(vis, flagged, 4)
                if bits != 0:
                    nf.poison_acc(acc_O_mn, bits)

    @cute.jit
    def mask_block(self, ctx, acc_S_mn: cute.Tensor, meta: cute.Tensor):
        """Note [block masks]: -inf where the row's query did not select the block (meta = (start,
        bits)) or the key is at or past its q_limit; skipped when no row of the tile needs it."""
        start = meta[0]
        bits = meta[1]
        if (bits & ctx.all_bits) != ctx.all_bits or start + self.tile_n > ctx.min_limit:
            # key limit of each row for this block: its query's q_limit if selected, else 0 (all masked);
            # apply_mask keeps key c of row r iff c <= rows[r] and c < seqlen
            last = cute.make_rmem_tensor((2,), Int32)
            for r in cutlass.range_constexpr(2):
                last[r] = Int32(-1)
                if (bits & ctx.bit[r]) != 0:
                    last[r] = ctx.limit[r] - 1
            apply_mask(acc_S_mn, ctx.cols, [last[0], last[1]], start + ctx.thr_col, ctx.seqlen, Int32(0), Int32(0),
                       Int32(0), True, True, False)

    @cute.jit
    def fold_sink(self, softmax: OnlineSoftmax, mSink: cute.Tensor, heads: list, leader):
        """The sink column joins each of this thread's two rows (``fold_sink_row``), added once per row (the
        quad's first lane); returns the per-row flags (1: no key) the caller sets lse = sink by."""
        row_max, row_sum = softmax.row_max, softmax.row_sum
        lead = Float32(1.0) if leader else Float32(0.0)
        keyless = cute.make_rmem_tensor((2,), Int32)
        for r in cutlass.range_constexpr(2):
            row_max[r], row_sum[r], keyless[r] = fold_sink_row(row_max[r], row_sum[r], mSink[heads[r]],
                                                               softmax.scale_log2, lead)
        return keyless

    @cute.jit
    def epilogue(self, acc_O, lse, out, mLSE, tiled_mma_pv, thr_mma_pv, tile, rows_valid: Int32, ctidx: Int32):
        """Note [staged O]: O (q's dtype) into Q's buffer (free: the last QK^T has completed), then one TMA box
        per real query of the tile from the first thread (``store_row_boxes``; idle rows are never written);
        lse by plain stores meanwhile. As the latent forward's Note [staged latent O]."""
        self.stage_columns(acc_O, out.sQ_base, out.sQ_layout, tiled_mma_pv, ctidx, 0, self.dv)
        cute.arch.barrier(barrier_id=O_STAGED_WG, number_of_threads=THREADS_PER_WG)
        if ctidx == 0:
            self.store_row_boxes(out.atom, out.rows, out.mO, out.sQ_base, tile, self.dv)
        self.store_lse(lse, mLSE, thr_mma_pv, self.dv, tile, rows_valid)

    @cute.jit
    def store_lse(self, lse, mLSE, thr_mma_pv, cols: cutlass.Constexpr, tile, rows_valid: Int32):
        """Each real row's lse, from the lane holding its column 0 of the (64, cols) accumulator."""
        cO = cute.make_identity_tensor((TILE_M, cols))
        tOcO_mn = acc_mn_view(thr_mma_pv.partition_C(cO))
        for r in cutlass.range_constexpr(2):
            row = tOcO_mn[r, 0][0]
            if row < rows_valid and tOcO_mn[0, 0][1] == 0:
                mLSE[tile.b, tile.head0 + row % self.gc, tile.q0 + row // self.gc] = lse[r]
