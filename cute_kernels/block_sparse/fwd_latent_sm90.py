"""BlockSparseLatentFwdSm90: the block-sparse forward for the absorbed-MLA latent on Hopper.

    out[b, t, hq] = sum_c softmax_c(scale * q . k_c [, sink[hq]]) k_c[:Dv]     (V = the leading Dv columns of K)
    lse[b, hq, t] = as in fwd_sm90.py

PaddleFleet's sparse branch: MQA over one shared latent row per key (kv_lora_rank + rope = Dk 576 or
512 columns, V = its first Dv = 512 or 448), up to 64 query heads per rank (128 as two head chunks).
Rows, plan, block masks, online softmax, sink and empty-row rules are those of ``fwd_sm90.py``
(this class inherits them); what changes is the width, which does not fit one warpgroup.

Persistent: at most one CTA per SM walks the row tiles (query tile w, head chunk c, batch b) dealt to it
(Note [persistent latent tiles]), 384 threads:

    WG 0, warp 0   producer, per tile: K of block 0, the tile's Q rows (one (GC, Dk) box per query) once
                   WG 1 is done with the previous tile's, then K[n] per listed block: one (64, Dk) box
                   of latent rows, which is K and V at once; 2 stages, each released when both
                   consumers' PV on it completed (the tile's last: once its outputs are stored)
    WG 1 ("S")     S = Q K^T over all Dk columns (wgmma, smem x smem), block masks, online softmax,
                   hands P and the O rescale of each block to WG 2 (Note [P hand-off]), then
                   O[:, :256] += P V[:, :256] (P from registers), issued ahead of the next block's
                   QK^T (Note [latent schedule]); sink, 1 / l and lse at the end, its O columns
                   staged in the last block's key stage, then the TMA stores of out (Note [staged
                   latent O])
    WG 2 ("V")     O[:, 256:Dv] = rescaled O + P V[:, 256:Dv] with P read from shared memory
                   (wgmma, smem x smem); its O columns staged beside WG 1's at the end

    producer ──K = V blocks, Q (mbarriers)──▶ WG 1 ──P, row rescale (sP, sScale, 2 named barriers)──▶ WG 2

Note [latent split]. O is 64 x Dv fp32: 128 registers per thread per 256 columns, so Dv > 256 needs
two warpgroups. Splitting the O columns and letting each warpgroup compute S itself would do the
QK^T (the larger GEMM at Dk 576) twice; here S, the masks and the softmax run once, in WG 1, and
WG 2 only rescales its O columns and runs its PV. Both warpgroups hold the same accumulator rows
per thread index (m64 accumulators), so the rescale crosses as a plain (thread, row) array. Tried and
rejected (Run AM6): both warpgroups computing S for alternate blocks (the running max passed along, P in
the 64 key columns past V, row sums added at the end), which balances the GEMMs: correct, 0.90-0.96x.

Note [P hand-off]. sP holds one block's P (64 x 64 bf16, the wgmma K-major layout WG 2's PV reads
as its A operand). WG 1 waits on P_EMPTY (WG 2's PV of the previous P has completed; WG 2 arrives
once at the start, and after taking each tile's 1 / l but the CTA's last), writes P (stmatrix from its accumulator layout) and its two row rescales,
fences the stores for the wgmma's async proxy and arrives on P_FULL; WG 2 waits on P_FULL, reads the
rescales, issues its PV and arrives on P_EMPTY when it completed. After the last block the same
round carries 1 / l (no P). Every block is handed over in order, so WG 2's O sees exactly the
sequence of rescales and P tiles WG 1's does, whatever the timing: out is bitwise reproducible.

Note [latent schedule]. A key stage is K and V at once, so it is free only when both PVs on it have
completed; with two stages (all that fits beside the 72 KiB of Q) block n + 1's load waits for block
n - 1's PVs. WG 1 issues block n - 1's PV at the top of step n, ahead of block n's QK^T, so the stage
is released a QK^T earlier than in fwd_sm90.py's order (QK^T first, the PV behind it), and it hands P
over before rescaling its own O. Measured on the H200 against that order (docs/benchmarks.md, Run AE):
1.01-1.02x, outputs bitwise equal. (The PV is issued at the top of the next step, not at the end of this
one: a wgmma still in flight at the loop's back-edge made ptxas serialize every wgmma of the kernel.)
What bounds the loop now is not measured; two suspects: the stage count (block n + 1's load starts only
when the PVs of block n - 1 have completed, so its latency recurs every block) and the traffic (each tile
re-reads its blocks, 72 KiB each at Dk 576, for 64 query rows and 8.9 MFLOP: ~4.4 TB/s from L2 into the
SMs at 16K, estimated from Run AM1's time).

Note [persistent latent tiles]. A CTA per tile paid a fixed ~6.9 us each (Run AE3: the Q and first-block
loads before any MMA, the lone first QK^T, the epilogue, one CTA per SM so nothing overlapped them). Now
``min(tiles, SMs)`` CTAs deal the tiles round-robin, CTA x taking work indices x, x + gridDim.x, ... of the
order w + T (c + C b) (query tile fastest, as the one-CTA-per-tile grid ran), and the roles carry their pipeline states and phases across tiles: block 0
of the next tile loads into the stage freed by block count - 2 while this tile finishes, and its Q as soon
as WG 1's last QK^T of this tile has completed (``mbar_q_free``, one arrival per tile that loaded Q; the
producer waits for completion k before its (k + 1)-th Q). The tile's outputs are staged in the stage of
its last block (Note [staged latent O]), so Q's buffer is never in the way. A tile without blocks gets a
stand-in: the producer loads the key rows [0, 64) of its head into the next stage (never read as K;
out-of-range rows are zero-filled by the TMA) so that the epilogue has a stage of its own, and no Q.
The sP hand-off counts rounds per tile (count P tiles and the 1 / l); WG 2 frees sP once after the start
and after each 1 / l but the CTA's last. Measured against the one-CTA-per-tile kernel (Run AM1, H200):
1.03x at 16K and 64K, outputs bitwise equal.

Note [staged latent O]. At the end each warpgroup writes its O columns (q's dtype) by stmatrix into the key
stage of the tile's last block (or its stand-in), in the (64, Dk) wgmma layout Q's buffer has too: the
stage is free of reads once both PVs on it have completed, which the last hand-offs order (WG 1 stages
after its 1 / l hand-off, which waits for WG 2's last PV; WG 2 after taking that hand-off, which WG 1
makes after its own last PV). Both meet on O_STAGED (WG 2 arrives, WG 1 waits) and one thread of WG 1
stores one (GC, Dv) box per real query of the tile (the row-slot box the Q rows were loaded with,
rows_tma), so padding rows past the sequence are never written, and waits until the boxes are read; the
stage is released by WG 2 and WG 1's warps 1-3 at once and by warp 0 after that wait, so the producer
refills it only then. (Until Run AM1 the staging used Q's buffer, which kept the next tile's Q waiting for
the store; before Run AH3 each thread stored its fragments with 4-byte stores, 128 per thread at Dv 512.)

Note [scrubbed latent blocks] (NaN / Inf in keys a row cannot see; common/nonfinite.py): in a block that needs
masks (fwd_sm90.py, Note [block masks]) the PVs multiply P = 0 of the rows that cannot see a key by its latent
row, and IEEE 0 * NaN = NaN. V is K's stage, which the block's QK^T has read by then: it made S NaN (so P NaN)
for a row that sees a non-finite key and -inf (P 0) where the masks cut. So once that QK^T completed WG 1 zeroes
the stage's non-finite elements in shared memory (``nonfinite.scrub_rows``) and fences them before its hand-off
of P: both PVs read the scrubbed stage, a seeing row stays NaN through its P, every other row gets what finite
values give. No flags are needed (the unscrubbed K already poisoned the seeing rows' S).

Shared memory at Dk 576: Q 72 KiB, two 72 KiB key stages, sP 8 KiB, sScale 1 KiB: 225 KiB of the 227.
"""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum

from cute_kernels.common import nonfinite as nf
from cute_kernels.common.softmax import OnlineSoftmax
from cute_kernels.common.utils import LOG2_E, acc_as_operand_a, acc_mn_view, convert_to_16bit, wgmma_smem_layout

from .common import THREADS_PER_WG, check_setmaxnreg, shared_storage, smem_tensors, two_wg_pipeline
from .config import BLOCK_SIZE, TILE_M, FwdConfig
from .fwd_sm90 import KV_STAGES, BlockSparseFwdSm90

# setmaxnreg split: 128 * (24 + 2 * 240) = 64,512 of the SM's 65,536 registers (one CTA per SM).
PRODUCER_REGS, CONSUMER_REGS = 24, 240
#: Named barriers (0 is the CTA barrier), Note [P hand-off]; O_STAGED: Note [staged latent O].
P_FULL, P_EMPTY, O_STAGED = 1, 2, 3
#: O columns of WG 1; WG 2 takes the other Dv - 256 (a multiple of 64: whole 64-column chunks).
V_SPLIT = 256


class BlockSparseLatentFwdSm90(BlockSparseFwdSm90):
    def __init__(self, cfg: FwdConfig, sm_count: int = 132):
        if not cfg.latent:
            raise ValueError("BlockSparseLatentFwdSm90 is the latent (v=None) forward")
        super().__init__(cfg)
        self.sm_count = int(sm_count)  # the persistent grid's CTAs at most (Note [persistent latent tiles])
        self.dv_parts = (V_SPLIT, self.dv - V_SPLIT)
        check_setmaxnreg(PRODUCER_REGS, CONSUMER_REGS, 2)
        assert 0 < self.dv_parts[1] <= 256 and self.dv % 64 == 0 and self.dk % 64 == 0 and self.dk >= self.dv

    @staticmethod
    def smem_bytes(cfg: FwdConfig) -> int:
        # the struct of common.shared_storage: barriers, then sScale (16-aligned), then the 1024-aligned
        # buffers (each a multiple of 1024 bytes)
        head = -(-(8 * (2 + 2 * KV_STAGES)) // 16) * 16 + 2 * THREADS_PER_WG * 4
        q = TILE_M * cfg.head_dim * 2
        k = BLOCK_SIZE * cfg.head_dim * 2 * KV_STAGES
        p = TILE_M * BLOCK_SIZE * 2
        return -(-head // 1024) * 1024 + q + k + p

    MBARS = {"mbar_q": 1, "mbar_q_free": 1, "mbar_k": 2 * KV_STAGES}

    # ------------------------------------------------------------------ host launch
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mTileStart: cute.Tensor,
                 mTileMask: cute.Tensor, mTileCount: cute.Tensor, mQLimit: cute.Tensor, mSink,
                 mO: cute.Tensor, mLSE: cute.Tensor, softmax_scale: Float32, stream):
        # mV is k itself (the launcher's contract for the latent); V is read from K's shared memory.
        sQ_layout = wgmma_smem_layout(self.dtype, (TILE_M, self.dk, 1))
        sK_layout = wgmma_smem_layout(self.dtype, (self.tile_n, self.dk, KV_STAGES))
        sP_layout = wgmma_smem_layout(self.dtype, (TILE_M, self.tile_n))
        tma_atom_Q, tma_Q, rows = self.rows_tma(mQ, self.dk)
        self.tx_bytes_k = cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1]))
        tma_atom_K, tma_K = self.kv_tma(mK, cute.select(sK_layout, mode=[0, 1]), self.dk)
        tma_atom_O, tma_O, rows_o = self.rows_tma(mO, self.dv, store=True)
        self.shared_storage = shared_storage(self.dtype, self.MBARS, {"scale": (Float32, 2 * THREADS_PER_WG),
                                                                      "k_flags": (cutlass.Uint8, BLOCK_SIZE)},
                                             sQ=sQ_layout, sK=sK_layout, sP=sP_layout)
        assert self.shared_storage.size_in_bytes() == self.smem_bytes(self.cfg), "smem_bytes is the struct's size"
        # Note [persistent latent tiles]: row tiles (query tile fastest, then kv head x head chunk, then batch)
        # dealt round-robin to at most one CTA per SM.
        num_tiles = mTileCount.shape[1]
        num_hc = mK.shape[2] * self.chunks
        total = num_tiles * num_hc * mQ.shape[0]
        grid_x = cutlass.max(cutlass.min(total, Int32(self.sm_count)), Int32(1))
        self.kernel(tma_Q, tma_K, mTileStart, mTileMask, mTileCount, mQLimit, mSink, tma_O, mLSE, tma_atom_Q,
                    tma_atom_K, tma_atom_O, sQ_layout, sK_layout, sP_layout, rows, rows_o, softmax_scale, num_tiles,
                    num_hc, total).launch(
            grid=[grid_x, 1, 1], block=[3 * THREADS_PER_WG, 1, 1], smem=self.shared_storage.size_in_bytes(),
            stream=stream, min_blocks_per_mp=1, preferred_smem_carveout=100)

    # ------------------------------------------------------------------ device
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mTileStart: cute.Tensor, mTileMask: cute.Tensor,
               mTileCount: cute.Tensor, mQLimit: cute.Tensor, mSink, mO: cute.Tensor, mLSE: cute.Tensor,
               tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom, tma_atom_O: cute.CopyAtom,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, sP_layout: cute.ComposedLayout,
               rows: cute.ComposedLayout, rows_o: cute.ComposedLayout, softmax_scale: Float32, num_tiles: Int32,
               num_hc: Int32, total: Int32):
        warp_idx, tidx, storage = self.allocate((tma_atom_Q, tma_atom_K, tma_atom_O))
        mbar_q = storage.mbar_q.data_ptr()
        mbar_q_free = storage.mbar_q_free.data_ptr()  # Note [persistent latent tiles]: WG 1 done with Q
        if tidx == 0:
            cute.arch.mbarrier_init(mbar_q, 1)
            cute.arch.mbarrier_init(mbar_q_free, 1)
        cute.arch.mbarrier_init_fence()
        # Both consumer warpgroups release every stage (V is K's buffer): 8 warps' arrivals.
        pipeline_k = two_wg_pipeline(storage.mbar_k.data_ptr(), KV_STAGES, 1, self.tx_bytes_k)
        sQ, sK, sP = smem_tensors(storage, sQ=sQ_layout, sK=sK_layout, sP=sP_layout)
        sScale = cute.make_tensor(storage.scale.data_ptr(),
                                  cute.make_layout((THREADS_PER_WG, 2), stride=(1, THREADS_PER_WG)))
        sched = SimpleNamespace(mQ=mQ, mK=mK, mTileCount=mTileCount, num_tiles=num_tiles, num_hc=num_hc,
                                total=total)
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp_idx == 0:
                self.load_latent(mQ, mK, mTileStart, sK, tma_atom_Q, tma_atom_K, rows, storage.sQ.data_ptr(),
                                 mbar_q, mbar_q_free, pipeline_k, sched)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            ctidx = tidx - THREADS_PER_WG
            wg = cute.arch.make_warp_uniform(ctidx // THREADS_PER_WG)
            sK_base = storage.sK.data_ptr()
            out = SimpleNamespace(mO=mO, atom=tma_atom_O, rows=rows_o, sK_base=sK_base, stage_layout=sQ_layout,
                                  storage=storage)
            if wg == 0:
                self.consume_s(mTileStart, mTileMask, mQLimit, mSink, out, mLSE, sQ, sK, sK_base, sK_layout, sP,
                               sScale, mbar_q, mbar_q_free, pipeline_k, sched, ctidx, softmax_scale)
            else:
                self.consume_v(out, sK_base, sK_layout, sP, sScale, pipeline_k, sched, ctidx - THREADS_PER_WG)

    # ------------------------------------------------------------------ schedule
    @cute.jit
    def tile_of_work(self, sched, work: Int32):
        """Work tile ``work`` of Note [persistent latent tiles]: ``tile_at``'s fields."""
        w = work % sched.num_tiles
        hc = (work // sched.num_tiles) % sched.num_hc
        b = work // (sched.num_tiles * sched.num_hc)
        return self.tile_at(w, hc, b, sched.mQ, sched.mK, sched.mTileCount)

    def epilogue_stage(self, out, kv_state):
        """Pointer to the key stage of ``kv_state`` that holds the tile's outputs (Note [staged latent O])."""
        stage_elems = self.tile_n * self.dk  # a multiple of 512 elements: 1024-byte aligned like the buffer
        return out.sK_base + cute.assume(kv_state.index * stage_elems, divby=stage_elems)

    # ------------------------------------------------------------------ producer
    @cute.jit
    def load_latent(self, mQ, mK, mTileStart, sK, tma_atom_Q, tma_atom_K, rows, sQ_base, mbar_q, mbar_q_free,
                    pipeline_k, sched):
        """Per work tile: its first block (an empty tile: the stand-in of Note [persistent latent tiles]), Q once
        WG 1 is done with the previous tile's, then the other blocks."""
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, KV_STAGES)
        q_loads = Int32(0)
        for work in cutlass.range(cute.arch.block_idx()[0], sched.total, cute.arch.grid_dim()[0], unroll=1):
            tile = self.tile_of_work(sched, work)
            mK_cur = mK[None, None, tile.h, tile.b]  # (S, Dk)
            w = tile.q0 // self.wq
            start = Int32(0)
            if tile.count > 0:
                start = mTileStart[tile.s, w, 0]
            self.load_block(tma_atom_K, mK_cur, sK, start, self.dk, pipeline_k, kv_state)
            kv_state.advance()
            if tile.count > 0:
                if q_loads > 0:
                    cute.arch.mbarrier_wait(mbar_q_free, (q_loads - 1) % 2)
                self.load_q_rows(mQ, tma_atom_Q, rows, sQ_base, mbar_q, tile)
                q_loads += 1
                for n in cutlass.range(1, tile.count, unroll=1):
                    self.load_block(tma_atom_K, mK_cur, sK, mTileStart[tile.s, w, n], self.dk, pipeline_k, kv_state)
                    kv_state.advance()

    # ------------------------------------------------------------------ consumers
    def v_operand(self, mma_slice, sK_base, sK_layout, part: int):
        """The B fragment (.., .., k, stage) of V part ``part`` (WG 1's or WG 2's O columns) for a PV wgmma."""
        c0 = 0 if part == 0 else V_SPLIT
        return self.key_columns_operand(mma_slice, sK_base, sK_layout, c0, self.dv_parts[part], KV_STAGES)

    @cute.jit
    def consume_s(self, mTileStart, mTileMask, mQLimit, mSink, out, mLSE, sQ, sK, sK_base, sK_layout, sP, sScale,
                  mbar_q, mbar_q_free, pipeline_k, sched, ctidx: Int32, softmax_scale: Float32):
        """WG 1, per work tile: S, masks, softmax, O[:, :256], the hand-off of P and the rescales; lse; the
        tile's out from its epilogue stage (Note [persistent latent tiles])."""
        dv0 = self.dv_parts[0]
        tiled_mma_qk, tiled_mma_pv = self.row_mmas(dv0)
        thr_mma_qk = tiled_mma_qk.get_slice(ctidx)
        thr_mma_pv = tiled_mma_pv.get_slice(ctidx)
        wg_mma_qk = tiled_mma_qk.get_slice(0)
        wg_mma_pv = tiled_mma_pv.get_slice(0)
        tSrQ = wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ[None, None, 0]))
        tSrK = wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK))  # (.., .., k, stage)
        tOrVt = self.v_operand(wg_mma_pv, sK_base, sK_layout, 0)
        tOrP = wg_mma_pv.make_fragment_A(wg_mma_pv.partition_shape_A((TILE_M, self.tile_n)))
        acc_S_shape = wg_mma_qk.partition_shape_C((TILE_M, self.tile_n))
        acc_O = cute.make_rmem_tensor(wg_mma_pv.partition_shape_C((TILE_M, dv0)), Float32)
        acc_O_mn = acc_mn_view(acc_O)
        # P -> sP by stmatrix from the S accumulator's layout (Note [P hand-off]).
        st_copy = cute.make_tiled_copy_C(sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.dtype, Float32),
                                         tiled_mma_qk)
        thr_st = st_copy.get_slice(ctidx)
        hand = SimpleNamespace(st_copy=st_copy, thr_st=thr_st, tPsP=thr_st.partition_D(sP), sScale=sScale,
                               ctidx=ctidx)

        warp = cute.arch.make_warp_uniform(ctidx // 32)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, KV_STAGES)
        q_phase = Int32(0)
        for work in cutlass.range(cute.arch.block_idx()[0], sched.total, cute.arch.grid_dim()[0], unroll=1):
            tile = self.tile_of_work(sched, work)
            acc_O.fill(0.0)
            softmax = OnlineSoftmax(softmax_scale * LOG2_E, 2, 4)
            softmax.reset()
            ctx = self.row_context(thr_mma_qk, mTileStart, mTileMask, mQLimit, tile)
            ctx.softmax = softmax
            ctx.sK, ctx.storage, ctx.ctidx = sK, out.storage, ctidx
            if tile.count > 0:
                kv_state = self.mainloop_s(ctx, tile.count, mbar_q, q_phase, mbar_q_free, tiled_mma_qk, tiled_mma_pv,
                                           tSrQ, tSrK, tOrVt, tOrP, acc_O, acc_O_mn, acc_S_shape, pipeline_k, hand,
                                           kv_state)
                q_phase ^= 1
            else:
                pipeline_k.consumer_wait(kv_state)  # the empty tile's stand-in stage has landed

            # Sink, 1 / l (also to WG 2), lse; only the rows of real (query, head) pairs are written.
            rows_valid = ctx.rows_valid
            row_scale, lse = self.finish_rows(softmax, mSink, tile, ctx.row, ctidx)
            self.hand_over(hand, None, row_scale)
            softmax.rescale(acc_O_mn, row_scale)
            o_stage = self.epilogue_stage(out, kv_state)
            self.stage_columns(acc_O, o_stage, out.stage_layout, tiled_mma_pv, ctidx, 0, dv0)
            self.store_lse(lse, mLSE, thr_mma_pv, dv0, tile, rows_valid)
            cute.arch.barrier(barrier_id=O_STAGED, number_of_threads=2 * THREADS_PER_WG)
            # the stage is refilled only once its boxes are read: warp 0, whose thread 0 stores them, releases last
            if warp != 0:
                pipeline_k.consumer_release(kv_state)
            if ctidx == 0:
                self.store_row_boxes(out.atom, out.rows, out.mO, o_stage, tile, self.dv)
            if warp == 0:
                pipeline_k.consumer_release(kv_state)
            kv_state.advance()

    @cute.jit
    def mainloop_s(self, ctx, count: Int32, mbar_q, q_phase: Int32, mbar_q_free, tiled_mma_qk, tiled_mma_pv, tSrQ,
                   tSrK, tOrVt, tOrP, acc_O, acc_O_mn, acc_S_shape, pipeline_k, hand, kv_state):
        """WG 1's blocks in order (Note [latent schedule]): QK^T, softmax, hand-off of P and the rescales;
        the block's PV is issued first thing in the next step, ahead of that step's QK^T. Returns the state of
        the last block's stage, not released: the tile's epilogue stage."""
        cute.arch.mbarrier_wait(mbar_q, q_phase)
        # 1. First block.
        meta = self.block_meta(ctx, 0)
        acc_S = cute.make_rmem_tensor(acc_S_shape, Float32)
        pipeline_k.consumer_wait(kv_state)
        self.gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv_state.index], True, 0)
        self.scrub_latent(ctx, kv_state, meta)
        row_scale = self.process_scores(ctx, acc_S, meta, True)
        convert_to_16bit(acc_as_operand_a(acc_S), tOrP)
        self.hand_over(hand, tOrP, row_scale)
        # 2. The rest: PV of block n - 1, then QK^T of block n behind it.
        for n in cutlass.range(1, count, unroll=1):
            kv_state = self.step_s(ctx, n, kv_state, tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt, tOrP, acc_O,
                                   acc_O_mn, acc_S_shape, pipeline_k, hand)
        # Every QK^T of the tile has completed (each warp waited for its own before the last hand-off's
        # barrier): Q may be refilled with the next tile's.
        if hand.ctidx == 0:
            cute.arch.mbarrier_arrive(mbar_q_free)
        # 3. The last block's PV.
        self.gemm(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, kv_state.index], False, 0)
        return kv_state

    @cute.jit
    def step_s(self, ctx, n: Int32, kv_state, tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt, tOrP, acc_O, acc_O_mn,
               acc_S_shape, pipeline_k, hand):
        """PV of block n - 1 (P(n - 1) handed over and in tOrP), QK^T of block n behind it, then block n's
        softmax and hand-off. No wgmma is in flight across steps: ptxas serializes every wgmma of a
        kernel whose accumulator crosses a loop back-edge in flight (a register move of it there)."""
        v_state = kv_state.clone()
        kv_state.advance()
        meta = self.block_meta(ctx, n)
        acc_S = cute.make_rmem_tensor(acc_S_shape, Float32)
        self.gemm(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, v_state.index], False, -1)
        pipeline_k.consumer_wait(kv_state)
        self.gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv_state.index], True, -1)
        warpgroup.wait_group(1)  # PV of block n - 1 done: its stage is free of WG 1
        pipeline_k.consumer_release(v_state)
        warpgroup.wait_group(0)
        self.scrub_latent(ctx, kv_state, meta)
        row_scale = self.process_scores(ctx, acc_S, meta, False)
        convert_to_16bit(acc_as_operand_a(acc_S), tOrP)
        self.hand_over(hand, tOrP, row_scale)  # first: WG 2's PV starts while this WG rescales its O
        ctx.softmax.rescale(acc_O_mn, row_scale)
        return kv_state

    @cute.jit
    def scrub_latent(self, ctx, kv_state, meta):
        """Note [scrubbed latent blocks]: WG 1 zeroes the non-finite elements of the stage of ``kv_state`` (its
        QK^T completed) where the block needs masks, fenced for the PVs' async proxy; the hand-off's barriers
        order it before both PVs."""
        flags = ctx.storage.k_flags.get_tensor(cute.make_layout(BLOCK_SIZE))  # written, not read
        if self.block_masked(ctx, meta) != 0:
            nf.scrub_rows(ctx.sK[None, None, kv_state.index], flags, ctx.ctidx, THREADS_PER_WG, self.k_per_row,
                          batch=self.k_batch)
            cute.arch.fence_view_async_shared()

    @cute.jit
    def hand_over(self, hand, tOrP, row_scale):
        """Note [P hand-off], WG 1's side: P (unless None) and this thread's two row rescales."""
        cute.arch.barrier(barrier_id=P_EMPTY, number_of_threads=2 * THREADS_PER_WG)
        if const_expr(tOrP is not None):
            cute.copy(hand.st_copy, hand.thr_st.retile(tOrP), hand.tPsP)
        for r in cutlass.range_constexpr(2):
            hand.sScale[hand.ctidx, r] = row_scale[r]
        cute.arch.fence_view_async_shared()
        cute.arch.barrier_arrive(barrier_id=P_FULL, number_of_threads=2 * THREADS_PER_WG)

    @cute.jit
    def take_over(self, sScale, ctidx: Int32, acc_O_mn):
        """Note [P hand-off], WG 2's side: wait for the next hand-off and rescale O's rows by it."""
        cute.arch.barrier(barrier_id=P_FULL, number_of_threads=2 * THREADS_PER_WG)
        for r in cutlass.range_constexpr(2):
            acc_O_mn[r, None].store(acc_O_mn[r, None].load() * sScale[ctidx, r])

    @cute.jit
    def consume_v(self, out, sK_base, sK_layout, sP, sScale, pipeline_k, sched, ctidx: Int32):
        """WG 2, per work tile: O[:, 256:Dv] from WG 1's P and rescales; its columns staged for out."""
        dv1 = self.dv_parts[1]
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN, Float32,
            atom_layout_mnk=(1, 1, 1), tiler_mn=(64, dv1))  # A (P) from shared memory
        wg_mma = tiled_mma.get_slice(0)
        tOrP = wg_mma.make_fragment_A(wg_mma.partition_A(sP))
        tOrVt = self.v_operand(wg_mma, sK_base, sK_layout, 1)
        acc_O = cute.make_rmem_tensor(wg_mma.partition_shape_C((TILE_M, dv1)), Float32)
        acc_O_mn = acc_mn_view(acc_O)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, KV_STAGES)
        cute.arch.barrier_arrive(barrier_id=P_EMPTY, number_of_threads=2 * THREADS_PER_WG)  # sP starts free
        for work in cutlass.range(cute.arch.block_idx()[0], sched.total, cute.arch.grid_dim()[0], unroll=1):
            tile = self.tile_of_work(sched, work)
            acc_O.fill(0.0)
            if tile.count > 0:
                # blocks 0 .. count - 2, each stage released after its PV; the last one's stage is kept
                for n in cutlass.range(tile.count - 1, unroll=1):
                    self.block_v(tiled_mma, tOrP, tOrVt, acc_O, acc_O_mn, sScale, pipeline_k, kv_state, ctidx)
                    pipeline_k.consumer_release(kv_state)
                    kv_state.advance()
                self.block_v(tiled_mma, tOrP, tOrVt, acc_O, acc_O_mn, sScale, pipeline_k, kv_state, ctidx)
            else:
                pipeline_k.consumer_wait(kv_state)  # the empty tile's stand-in stage has landed
            self.take_over(sScale, ctidx, acc_O_mn)  # 1 / l
            if work + cute.arch.grid_dim()[0] < sched.total:
                # sScale read: the next tile's first hand-off may overwrite it
                cute.arch.barrier_arrive(barrier_id=P_EMPTY, number_of_threads=2 * THREADS_PER_WG)
            self.stage_columns(acc_O, self.epilogue_stage(out, kv_state), out.stage_layout, tiled_mma, ctidx, V_SPLIT,
                               dv1)
            cute.arch.barrier_arrive(barrier_id=O_STAGED, number_of_threads=2 * THREADS_PER_WG)
            pipeline_k.consumer_release(kv_state)  # WG 1's warp 0 releases it after the store has read it
            kv_state.advance()

    @cute.jit
    def block_v(self, tiled_mma, tOrP, tOrVt, acc_O, acc_O_mn, sScale, pipeline_k, kv_state, ctidx: Int32):
        """WG 2's block in ``kv_state``'s stage: take the hand-off, PV from sP, free sP (the stage is the
        caller's to release)."""
        self.take_over(sScale, ctidx, acc_O_mn)
        pipeline_k.consumer_wait(kv_state)
        self.gemm(tiled_mma, acc_O, tOrP, tOrVt[None, None, None, kv_state.index], False, 0)
        cute.arch.barrier_arrive(barrier_id=P_EMPTY, number_of_threads=2 * THREADS_PER_WG)
