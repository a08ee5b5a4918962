"""BlockSparseLatentBwdDQSm90: the block-sparse dQ for the absorbed-MLA latent on Hopper, query-major.

    P   = exp(scale * q . k_c - lse),   dS = P * (dO . k_c[:Dv] - delta),   delta = rowsum(dO * O)
    dq  = scale * sum_c dS k_c                                             (V = the leading Dv columns of K)

    (``exact_delta``: delta = sum_c P dP from a first sweep over the blocks, in WG 1; WG 2 only frees that
    sweep's key stages: Note [exact delta] in bwd_dq_sm90.py)

Rows, plan, block masks, lse / delta rules and the delta output are those of ``bwd_dq_sm90.py`` (this
class inherits them); what changes is the width: dq is 64 x Dk fp32 (288 registers per thread at Dk 576),
so two warpgroups share its columns (Note [latent dQ split]).

One CTA per (query tile w, head chunk c, batch b), 384 threads:

    WG 0, warp 0   producer: K of block 0 (K and V at once), the tile's Q and dO rows (one (GC, D) box per
                   tile query each), then K[n] per listed block; one key stage, loaded in three column
                   parts (Note [key column parts])
    WG 1 ("dS")    per block: S = Q K^T (Dk) and dP = dO V^T (V = K's first Dv columns: the first Dv / 16
                   k-blocks of the same K operand), masks, P from lse, dS; hands dS (bf16) to WG 2 through
                   sdS (Note [dS hand-off]); dq[:, :192] += dS K[:, :192] (A = dS from registers)
    WG 2           dq[:, 192:Dk] += dS K[:, 192:Dk] with dS read from sdS (smem x smem), in pieces of <= 192
                   columns (576: 192 + 192, 512: 192 + 128)

    producer ──K blocks, Q, dO (mbarriers)──▶ WG 1 ──dS (sdS, 2 named barriers)──▶ WG 2
    both: their dq columns staged in Q's buffer, then WG 1's first thread stores the tile (Note [staged dq])

Note [latent dQ split]. S and dP are the larger GEMMs (Dk + Dv deep against Dk wide for dq) and need the
rows' lse and delta: they run once, in WG 1, which then keeps the fewest dq columns (192: 96 accumulator
registers next to S, dP and the bf16 dS); WG 2 only multiplies. The column views of K are whole 64-column
chunks of its wgmma layout (``key_columns``, checked at trace time).

Note [dS hand-off]. As the latent forward's Note [P hand-off]: WG 1 waits on DS_EMPTY (WG 2's dq GEMMs
on the previous dS have completed; WG 2 arrives once at the start and after every block but the last),
writes dS by stmatrix from the S accumulator's layout, fences for the async proxy and arrives on DS_FULL.
Every block's dS is handed over in order and each warpgroup sums its own columns in the plan's block
order: dq is bitwise reproducible.

Note [staged dq]. As the latent forward's Note [staged latent O]: at the end each warpgroup writes its dq
columns (scaled, q's dtype) into Q's buffer (Q is free: WG 1's last S GEMM completed before its last dS
hand-off, and WG 2 writes only after its GEMMs on that dS), WG 2 arrives on DQ_STAGED, WG 1 waits there and
its first thread stores one (GC, Dk) box per real query of the tile by TMA.

Note [key column parts]. Q (72 KiB at Dk 576) and dO (64 KiB) stay for the whole tile, so one 72 KiB key
stage and sdS fill the 227 KiB. Loaded as one box, block n + 1 could only start loading once both warpgroups'
GEMMs on block n had completed, and S(n + 1) only once all of it had landed. The stage is loaded instead in
three column parts, each a one-stage pipeline of its own: part 0 = columns [0, 192) (WG 1's dq columns), parts
1, 2 = WG 2's two dq pieces ([192, 384) and the rest). Part 0 is read by WG 1 alone (S, dP, its dq GEMM) and
released after its dq GEMM; parts 1 and 2 by both (WG 1 releases them when its S / dP GEMMs complete, WG 2
each after its own dq piece). WG 1 issues the S and dP GEMMs part by part (``score_gemms``: k-blocks of part p
once part p is full, one accumulator chain in k order, so the sums are those of one box), so block n + 1's S
starts on part 0 while parts 1 and 2 are still loading behind WG 2's GEMMs on block n. H200 (Run AN3, the
kernel alone, 16K, local selection): 1.16x (576 / 512) and 1.14x (512 / 448), 1.11-1.12x with exact_delta, dq
and delta bitwise equal to the one-box kernel. Tried and rejected before (Run AM3): the same 72 KiB as two
stages of 32 key rows, two steps per block: dq bitwise equal, but 0.92-0.99x the speed (0.87x with
exact_delta): its S and dP GEMMs become m64n32 smem x smem wgmmas, which at full rate read 192 bytes of shared
memory per clock (A 2 KiB + B 1 KiB per 16 clocks) against the SM's 128 (m64n64: 4 KiB per 32 clocks, 128),
and the steps double the dS hand-offs.

Shared memory at Dk 576: Q 72 KiB, dO 64 KiB, K 72 KiB, sdS 8 KiB: 217 KiB of the 227.
"""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from cute_kernels.common import nonfinite as nf
from cute_kernels.common.utils import acc_mn_view, wgmma_gemm_k, wgmma_smem_layout

from .bwd_dq_sm90 import BlockSparseBwdDQSm90
from .common import THREADS_PER_WG, check_setmaxnreg, shared_storage, smem_tensors
from .config import BLOCK_SIZE, TILE_M, BwdConfig

# setmaxnreg split: 128 * (40 + 2 * 232) = 64,512 of the SM's 65,536 registers (one CTA per SM); the producer
# spilled in 24 (G 128, G 16 with per-kv-head ids).
PRODUCER_REGS, CONSUMER_REGS = 40, 232
#: Named barriers (0 is the CTA barrier), Note [dS hand-off]; DQ_STAGED: Note [staged dq].
DS_FULL, DS_EMPTY, DQ_STAGED = 1, 2, 3
#: dq columns of WG 1 (Note [latent dQ split]); WG 2's pieces are at most this wide.
DQ_SPLIT = 192


def column_pieces(c0: int, c1: int, width: int = DQ_SPLIT) -> tuple:
    """(first column, columns) pieces of [c0, c1), each ``width`` wide but the last."""
    return tuple((c, min(width, c1 - c)) for c in range(c0, c1, width))


class BlockSparseLatentBwdDQSm90(BlockSparseBwdDQSm90):
    def __init__(self, cfg: BwdConfig):
        if not cfg.latent:
            raise ValueError("BlockSparseLatentBwdDQSm90 is the latent (v=None) dQ")
        super().__init__(cfg)
        self.parts = column_pieces(DQ_SPLIT, self.dk)
        self.key_parts = ((0, DQ_SPLIT),) + self.parts  # Note [key column parts]
        assert len(self.key_parts) == 3, self.key_parts  # the kernel names one pipeline state per part
        check_setmaxnreg(PRODUCER_REGS, CONSUMER_REGS, 2)
        assert self.dk % 64 == 0 and self.dv % 64 == 0 and self.dv <= self.dk and len(self.parts) == 2

    @staticmethod
    def smem_bytes(cfg: BwdConfig) -> int:
        # common.shared_storage's struct: 3 barriers, then four 1024-aligned buffers (multiples of 1024 bytes)
        return 1024 + (TILE_M * (2 * cfg.head_dim + cfg.head_dim_v) + TILE_M * BLOCK_SIZE) * 2

    # ------------------------------------------------------------------ host launch
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
                 mDelta: cute.Tensor, mTileStart: cute.Tensor, mTileMask: cute.Tensor, mTileCount: cute.Tensor,
                 mQLimit: cute.Tensor, mdQ: cute.Tensor, softmax_scale: Float32, stream):
        sQ_layout = wgmma_smem_layout(self.dtype, (TILE_M, self.dk, 1))
        sdO_layout = wgmma_smem_layout(self.dtype, (TILE_M, self.dv, 1))
        sK_layout = wgmma_smem_layout(self.dtype, (self.tile_n, self.dk, 1))
        sdS_layout = wgmma_smem_layout(self.dtype, (TILE_M, self.tile_n))
        tma_atom_Q, tma_Q, rows_q = self.rows_tma(mQ, self.dk)
        tma_atom_dO, tma_dO, rows_do = self.rows_tma(mdO, self.dv)
        # Note [key column parts]: one TMA atom per part (a (64, w) box into its columns of the key stage)
        parts_k = [self.kv_tma(mK, wgmma_smem_layout(self.dtype, (self.tile_n, w)), w) for _, w in self.key_parts]
        self.tx_bytes_parts = tuple(self.tile_n * w * 2 for _, w in self.key_parts)
        tma_atom_dQ, tma_dQ, rows_dq = self.rows_tma(mdQ, self.dk, store=True)
        self.shared_storage = shared_storage(self.dtype, {"mbar_q": 1, "mbar_k": 2 * len(self.key_parts)},
                                             {"k_flags": (cutlass.Uint8, BLOCK_SIZE)}, sQ=sQ_layout,
                                             sdO=sdO_layout, sK=sK_layout, sdS=sdS_layout)
        assert self.shared_storage.size_in_bytes() == self.smem_bytes(self.cfg), "smem_bytes is the struct's size"
        grid = (mTileCount.shape[1], mK.shape[2] * self.chunks, mQ.shape[0])
        atoms = (tma_atom_Q, tma_atom_dO, tma_atom_dQ) + tuple(a for a, _ in parts_k)
        self.kernel(tma_Q, tma_dO, tuple(t for _, t in parts_k), mO, mdO, mLSE, mDelta, mTileStart, mTileMask,
                    mTileCount, mQLimit, tma_dQ, atoms, sQ_layout, sdO_layout, sK_layout, sdS_layout, rows_q, rows_do,
                    rows_dq, softmax_scale).launch(
            grid=grid, block=[3 * THREADS_PER_WG, 1, 1], smem=self.shared_storage.size_in_bytes(), stream=stream,
            min_blocks_per_mp=1, preferred_smem_carveout=100)

    # ------------------------------------------------------------------ device
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mdO: cute.Tensor, mK: tuple, mO: cute.Tensor, mdOg: cute.Tensor,
               mLSE: cute.Tensor, mDelta: cute.Tensor, mTileStart: cute.Tensor, mTileMask: cute.Tensor,
               mTileCount: cute.Tensor, mQLimit: cute.Tensor, mdQ: cute.Tensor, atoms: tuple,
               sQ_layout: cute.ComposedLayout, sdO_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sdS_layout: cute.ComposedLayout, rows_q: cute.ComposedLayout, rows_do: cute.ComposedLayout,
               rows_dq: cute.ComposedLayout, softmax_scale: Float32):
        warp_idx, tidx, storage = self.allocate(atoms)
        mbar_q = storage.mbar_q.data_ptr()
        if tidx == 0:
            cute.arch.mbarrier_init(mbar_q, 1)
        cute.arch.mbarrier_init_fence()
        # Note [key column parts]: a one-stage pipeline per part; WG 1 alone releases part 0, both WGs the others
        mbar_k = storage.mbar_k.data_ptr()
        pipes_k = [pipeline.PipelineTmaAsync.create(
                       barrier_storage=mbar_k + 2 * p, num_stages=1,
                       producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
                       consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                                (1 if p == 0 else 2) * THREADS_PER_WG // 32),
                       tx_count=self.tx_bytes_parts[p], defer_sync=False)
                   for p in range(len(self.key_parts))]
        sQ, sdO, sK, sdS = smem_tensors(storage, sQ=sQ_layout, sdO=sdO_layout, sK=sK_layout, sdS=sdS_layout)
        tile = self.tile_of(mQ, mK[0], mTileCount)
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp_idx == 0:
                self.load_latent_bwd(mQ, mdO, mK, mTileStart, storage.sK.data_ptr(), sK_layout, atoms, rows_q, rows_do,
                                     storage.sQ.data_ptr(), storage.sdO.data_ptr(), mbar_q, pipes_k, tile)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            ctidx = tidx - THREADS_PER_WG
            wg = cute.arch.make_warp_uniform(ctidx // THREADS_PER_WG)
            out = SimpleNamespace(mdQ=mdQ, atom=atoms[2], rows=rows_dq, sQ_base=storage.sQ.data_ptr(), storage=storage,
                                  sQ_layout=sQ_layout)
            if wg == 0:
                self.consume_ds(mO, mdOg, mLSE, mDelta, mTileStart, mTileMask, mQLimit, out, sQ, sdO, sK,
                                storage.sK.data_ptr(), sK_layout, sdS, mbar_q, pipes_k, tile, ctidx, softmax_scale)
            else:
                self.consume_cols(out, storage.sK.data_ptr(), sK_layout, sdS, pipes_k, tile,
                                  ctidx - THREADS_PER_WG, softmax_scale)

    # ------------------------------------------------------------------ producer
    @cute.jit
    def load_latent_bwd(self, mQ, mdO, mK, mTileStart, sK_base, sK_layout, atoms, rows_q, rows_do, sQ_base, sdO_base,
                        mbar_q, pipes_k, tile):
        tma_atom_Q, tma_atom_dO = atoms[:2]
        if tile.count > 0:
            w = tile.q0 // self.wq
            # one state per part, as plain locals (the tracer carries locals, not list entries, across loops)
            st0 = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            st1 = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            st2 = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            self.load_key_parts(atoms[3:], mK, sK_base, sK_layout, tile, mTileStart[tile.s, w, 0], pipes_k,
                                (st0, st1, st2))
            self.load_q_do_rows(mQ, mdO, tma_atom_Q, tma_atom_dO, rows_q, rows_do, sQ_base, sdO_base, mbar_q, tile)
            for n in cutlass.range(1, tile.count * self.sweeps, unroll=1):  # Note [exact delta]: twice
                st0.advance()
                st1.advance()
                st2.advance()
                j = n
                if cutlass.const_expr(self.sweeps == 2):
                    j = n % tile.count
                self.load_key_parts(atoms[3:], mK, sK_base, sK_layout, tile, mTileStart[tile.s, w, j], pipes_k,
                                    (st0, st1, st2))

    @cute.jit
    def load_key_parts(self, part_atoms, mK, sK_base, sK_layout, tile, start: Int32, pipes_k, states):
        """Block ``start``'s rows into the key stage, part by part (Note [key column parts]): each part's
        (64, w) box into its columns once that part's pipeline stage is free. The caller advances ``states``."""
        for p in cutlass.range_constexpr(len(self.key_parts)):
            c0, w = self.key_parts[p]
            layout = self.key_columns(sK_layout, c0, w, 1)
            sX = cute.make_tensor(cute.recast_ptr(sK_base + c0 * self.tile_n, layout.inner), layout.outer)
            gX = cute.local_tile(cute.domain_offset((start, c0), mK[p][None, None, tile.h, tile.b]),
                                 (self.tile_n, w), (0, 0))
            tXsX, tXgX = cpasync.tma_partition(part_atoms[p], 0, cute.make_layout(1),
                                               cute.group_modes(sX[None, None, 0], 0, 2), cute.group_modes(gX, 0, 2))
            pipes_k[p].producer_acquire(states[p])
            cute.copy(part_atoms[p], tXgX, tXsX, tma_bar_ptr=pipes_k[p].producer_get_barrier(states[p]))

    @cute.jit
    def score_gemms(self, tiled_mma_s, acc_S, acc_dP, tSrQ, tSrdO, tSrK, pipes_k, states):
        """S = Q K^T over Dk and dP = dO V^T over Dv (V = K's first Dv columns) as the key parts arrive (Note [key
        column parts]): each part's k-blocks are issued once its pipeline stage is full; ends with every GEMM
        complete."""
        dv_k = self.dv // 16
        for p in cutlass.range_constexpr(len(self.key_parts)):
            c0, w = self.key_parts[p]
            k0, k1 = c0 // 16, (c0 + w) // 16
            pipes_k[p].consumer_wait(states[p])
            wgmma_gemm_k(tiled_mma_s, acc_S, tSrQ, tSrK, k0, k1, p == 0)
            if cutlass.const_expr(k0 < dv_k):
                wgmma_gemm_k(tiled_mma_s, acc_dP, tSrdO, tSrK, k0, min(k1, dv_k), p == 0)
        warpgroup.wait_group(0)

    # ------------------------------------------------------------------ consumers
    @cute.jit
    def consume_ds(self, mO, mdOg, mLSE, mDelta, mTileStart, mTileMask, mQLimit, out, sQ, sdO, sK, sK_base,
                   sK_layout, sdS, mbar_q, pipes_k, tile, ctidx: Int32, softmax_scale: Float32):
        """WG 1: delta, S, dP, P, dS per block, the hand-off of dS, dq[:, :DQ_SPLIT]."""
        # tSrK's k-blocks run over all Dk columns; the dP GEMM takes the first Dv / 16 (its A has that many)
        tiled_mma_s, tiled_mma_dq, thr_mma_s, thr_mma_dq, wg_s, wg_dq, tSrQ, tSrdO, tSrK = self.s_operands(
            DQ_SPLIT, sQ, sdO, sK, ctidx)
        tQrKt = self.key_columns_operand(wg_dq, sK_base, sK_layout, 0, DQ_SPLIT, 1)
        tQrdS = wg_dq.make_fragment_A(wg_dq.partition_shape_A((TILE_M, self.tile_n)))
        acc_S_shape = wg_s.partition_shape_C((TILE_M, self.tile_n))
        acc_dQ = cute.make_rmem_tensor(wg_dq.partition_shape_C((TILE_M, DQ_SPLIT)), Float32)
        acc_dQ.fill(0.0)
        st_copy = cute.make_tiled_copy_C(sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.dtype, Float32),
                                         tiled_mma_s)
        thr_st = st_copy.get_slice(ctidx)
        tDsdS = thr_st.partition_D(sdS)
        ctx = self.row_context(thr_mma_s, mTileStart, mTileMask, mQLimit, tile)
        ctx.sK, ctx.storage, ctx.ctidx = sK, out.storage, ctidx
        self.row_stats(ctx, mO, mdOg, mLSE, mDelta, tile, ctidx, softmax_scale)
        if tile.count > 0:
            cute.arch.mbarrier_wait(mbar_q, 0)
            # one state per part, as plain locals (the tracer carries locals, not list entries, across loops)
            st0 = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            st1 = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            st2 = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            tSrK0 = tSrK[None, None, None, 0]  # the one key stage
            if cutlass.const_expr(self.sweeps == 2):  # Note [exact delta] (bwd_dq_sm90.py): the first sweep
                for n in cutlass.range(tile.count, unroll=1):
                    meta1 = self.block_meta(ctx, n)
                    acc_S1 = cute.make_rmem_tensor(acc_S_shape, Float32)
                    acc_dP1 = cute.make_rmem_tensor(acc_S_shape, Float32)
                    self.score_gemms(tiled_mma_s, acc_S1, acc_dP1, tSrQ, tSrdO, tSrK0, pipes_k, (st0, st1, st2))
                    pipes_k[0].consumer_release(st0)
                    pipes_k[1].consumer_release(st1)
                    pipes_k[2].consumer_release(st2)
                    st0.advance()
                    st1.advance()
                    st2.advance()
                    self.add_delta(ctx, acc_S1, acc_dP1, meta1)
                self.finish_delta(ctx)
            for n in cutlass.range(tile.count, unroll=1):
                meta = self.block_meta(ctx, n)
                acc_S = cute.make_rmem_tensor(acc_S_shape, Float32)
                acc_dP = cute.make_rmem_tensor(acc_S_shape, Float32)
                self.score_gemms(tiled_mma_s, acc_S, acc_dP, tSrQ, tSrdO, tSrK0, pipes_k, (st0, st1, st2))
                # Note [non-finite keys a row cannot see] (bwd_dq_sm90.py): the stage zeroed of non-finite elements
                # for both dq GEMMs (WG 2 still holds parts 1 and 2; the hand-off below orders it before them)
                self.scrub_latent_stage(ctx, meta)
                pipes_k[1].consumer_release(st1)  # WG 1's last reads of parts 1 and 2
                pipes_k[2].consumer_release(st2)
                self.scores_to_ds(ctx, acc_S, acc_dP, meta, tQrdS)
                # Note [dS hand-off]
                cute.arch.barrier(barrier_id=DS_EMPTY, number_of_threads=2 * THREADS_PER_WG)
                cute.copy(st_copy, thr_st.retile(tQrdS), tDsdS)
                cute.arch.fence_view_async_shared()
                cute.arch.barrier_arrive(barrier_id=DS_FULL, number_of_threads=2 * THREADS_PER_WG)
                self.gemm(tiled_mma_dq, acc_dQ, tQrdS, tQrKt[None, None, None, 0], False, 0)
                pipes_k[0].consumer_release(st0)  # part 0: read by WG 1 alone
                st0.advance()
                st1.advance()
                st2.advance()
        if cutlass.const_expr(self.sweeps == 2):
            self.store_delta(ctx, mDelta, tile, ctidx)
        acc_dQ_mn = acc_mn_view(acc_dQ)
        for r in cutlass.range_constexpr(2):
            acc_dQ_mn[r, None].store(acc_dQ_mn[r, None].load() * softmax_scale)
        # Note [staged dq]
        self.stage_columns(acc_dQ, out.sQ_base, out.sQ_layout, tiled_mma_dq, ctidx, 0, DQ_SPLIT)
        cute.arch.barrier(barrier_id=DQ_STAGED, number_of_threads=2 * THREADS_PER_WG)
        if ctidx == 0:
            self.store_row_boxes(out.atom, out.rows, out.mdQ, out.sQ_base, tile, self.dk)

    @cute.jit
    def scrub_latent_stage(self, ctx, meta):
        """In a block that needs masks, WG 1 zeroes the non-finite elements of the key stage (its S / dP GEMMs
        completed), fenced for the dq GEMMs' async proxy (bwd_dq_sm90.py's ``scrub_k_block`` on the one stage)."""
        flags = ctx.storage.k_flags.get_tensor(cute.make_layout(BLOCK_SIZE))  # written, not read
        if self.block_masked(ctx, meta) != 0:
            nf.scrub_rows(ctx.sK[None, None, 0], flags, ctx.ctidx, THREADS_PER_WG, self.k_per_row, batch=self.k_batch)
            cute.arch.fence_view_async_shared()

    @cute.jit
    def consume_cols(self, out, sK_base, sK_layout, sdS, pipes_k, tile, ctidx: Int32, softmax_scale: Float32):
        """WG 2: dq[:, DQ_SPLIT:Dk] from WG 1's dS, in ``self.parts``."""
        (c0, w0), (c1, w1) = self.parts
        mmas = [sm90_utils.make_trivial_tiled_mma(
                    self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN, Float32,
                    atom_layout_mnk=(1, 1, 1), tiler_mn=(64, w)) for w in (w0, w1)]  # A (dS) from shared memory
        wgs = [m.get_slice(0) for m in mmas]
        tA = [s.make_fragment_A(s.partition_A(sdS)) for s in wgs]
        tB = [self.key_columns_operand(s, sK_base, sK_layout, c, w, 1) for s, (c, w) in zip(wgs, self.parts)]
        accs = [cute.make_rmem_tensor(s.partition_shape_C((TILE_M, w)), Float32) for s, w in zip(wgs, (w0, w1))]
        for acc in accs:
            acc.fill(0.0)
        cute.arch.barrier_arrive(barrier_id=DS_EMPTY, number_of_threads=2 * THREADS_PER_WG)  # sdS starts free
        if tile.count > 0:
            # Note [key column parts]: WG 2 reads parts 1 and 2 (its dq columns), and releases each after its GEMM
            # parts 1 and 2, one state each (plain locals: see consume_ds)
            st1 = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            st2 = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            if cutlass.const_expr(self.sweeps == 2):  # the first sweep's key stages: WG 1 reads them, WG 2 frees them too
                for n in cutlass.range(tile.count, unroll=1):
                    pipes_k[1].consumer_wait(st1)
                    pipes_k[1].consumer_release(st1)
                    pipes_k[2].consumer_wait(st2)
                    pipes_k[2].consumer_release(st2)
                    st1.advance()
                    st2.advance()
            for n in cutlass.range(tile.count, unroll=1):
                cute.arch.barrier(barrier_id=DS_FULL, number_of_threads=2 * THREADS_PER_WG)
                pipes_k[1].consumer_wait(st1)
                self.gemm(mmas[0], accs[0], tA[0], tB[0][None, None, None, 0], False, -1)
                pipes_k[2].consumer_wait(st2)
                self.gemm(mmas[1], accs[1], tA[1], tB[1][None, None, None, 0], False, 1)
                pipes_k[1].consumer_release(st1)  # the first piece's GEMM completed
                warpgroup.wait_group(0)
                if n + 1 < tile.count:
                    cute.arch.barrier_arrive(barrier_id=DS_EMPTY, number_of_threads=2 * THREADS_PER_WG)
                pipes_k[2].consumer_release(st2)
                st1.advance()
                st2.advance()
        for i in cutlass.range_constexpr(2):
            acc_mn = acc_mn_view(accs[i])
            for r in cutlass.range_constexpr(2):
                acc_mn[r, None].store(acc_mn[r, None].load() * softmax_scale)
            self.stage_columns(accs[i], out.sQ_base, out.sQ_layout, mmas[i], ctidx, self.parts[i][0],
                               self.parts[i][1])
        cute.arch.barrier_arrive(barrier_id=DQ_STAGED, number_of_threads=2 * THREADS_PER_WG)
