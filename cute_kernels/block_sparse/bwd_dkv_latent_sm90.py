"""BlockSparseLatentBwdDKVSm90: Hopper key-side backward of block-sparse attention over the absorbed-MLA latent.

    dkv[key, c] = sum_rows P[row, key] dO[row, c]  (c < Dv)  +  scale * sum_rows dS[row, key] q[row, c]  (c < Dk)

K is one latent tensor ``k [B, S, Hkv, Dk]`` and V its leading Dv columns (``config.LATENT_DIMS``: (576, 512),
(512, 448)), so dK and dV land in the same columns and the kernel writes their sum, one 16-bit ``dkv``
[B, S, Hkv, Dk]. P, dS, the plan, the rows, the masks, the segments and the determinism are those of
``bwd_dkdv_sm90.py`` (this class inherits its producer, row, mask and key-store methods); what changes is
the width, which does not fit one warpgroup (Note [latent key split]), and that there is one output.

One CTA per (segment of selected key block r of index set s, kv head h, batch b), 384 threads:

    WG 0, warp 0   producer: the (64, Dk) latent rows of the block once (K, and V as their leading Dv
                   columns), then per step (pair x head chunk) the tile's dO rows, then its Q rows (one TMA
                   box of GC head rows per tile query each) into their one stage each (Note [one row stage])
    WG 0, warp 1   row producer: the step's 64 rows' lse (log2 units), delta and key limit, which ride with
                   dO (Note [row facts in shared memory] in bwd_dkdv_sm90.py), walking the steps in order
    WG 1 ("A")     dP^T = V dO^T and S^T = K Q^T (wgmma m64n64, keys as M, smem x smem), P^T, dS^T =
                   P^T (dP^T - delta) * scale; hands P^T and dS^T to WG 2 (Note [dS hand-off]); then its
                   columns: dkv[:, :128] += P^T dO[:, :128] + dS^T Q[:, :128] and dkv[:, Dv:] += dS^T Q[:, Dv:]
                   (A from registers)
    WG 2 ("B")     dkv[:, 128:Dv] += P^T dO[:, 128:Dv] + dS^T Q[:, 128:Dv] in pieces of <= 192 columns
                   (smem x smem)

    producer ──K once; dO rows + row facts, Q rows (1 stage each, mbarriers)──▶ WG 1, WG 2
                                   WG 1 ──P^T, dS^T (sPt, sdSt, 2 named barriers)──▶ WG 2

Note [latent key split]: the dkv partial of 64 keys is 64 x Dk fp32, 288 registers per thread at Dk 576:
two warpgroups. S^T and dP^T (the larger GEMMs, Dk and Dv deep) run once, in WG 1, which also keeps the
columns it can feed from registers (P^T and dS^T are the A operands straight from its accumulators,
Note [keys as the M dimension] in indexed/bwd_dkdv_sm90.py); WG 2 reads them from shared memory. WG 1
holds S^T, dP^T, P^T and dS^T (96 registers) beside 192 dkv columns ([0, 128) and the rope columns
[Dv, Dk)), WG 2 holds the other Dv - 128 (384 or 320 columns, 192 / 160 registers) as two accumulators of
N <= 192 (wgmma N <= 256, and each piece a whole number of 64-column chunks, so that its B operands are
sub-views of sQ / sdO: ``columns_operand``, checked at trace time). The two warpgroups own
disjoint columns, so each adds and stores its own (segments included): no exchange between them.

Note [dS hand-off]: sPt and sdSt hold one step's P^T and dS^T (64 keys x 64 rows, 16-bit, the wgmma K-major
layout of WG 2's A operand). WG 1 waits on DsEmpty (WG 2's GEMMs of the previous step have completed; not
at the first step), writes both by stmatrix from its accumulator layout, fences them for the wgmma's async
proxy and arrives on DsFull; WG 2 waits on DsFull, issues its GEMMs, waits for them and arrives on
DsEmpty (not after its last step: every arrival is waited for, none is pending at exit). dS^T leaves WG 1
already scaled by ``softmax_scale``: the P^T dO and dS^T Q terms then share one accumulator and one store.
Each warpgroup sums its columns over the steps in the plan's order: bitwise reproducible, as before.

Note [one row stage]: shared memory holds the block's latent rows (72 KiB at Dk 576), one stage of Q and dO
rows (72 + 64 KiB) and sPt / sdSt (16 KiB): 225 KiB of the 227 (below), no room for a second stage. So Q and
dO have a pipeline each (one stage, both warpgroups release it: 8 warps' arrivals), released at their last
read, and the GEMMs of a step are ordered to read dO early (Note [split row stages]). One row warp walks the
steps in order (the two-warp parity argument of Note [row warps and parity waits] holds for 4 stages only; one
producer walking in order never runs a round ahead). No wgmma is in flight across a loop back-edge (ptxas would
serialize every wgmma of the kernel).

Note [split row stages]: with one stage for Q and dO together (the first version) a step's 136 KiB of loads
started only after both warpgroups' last GEMMs of the previous step and nothing overlapped them. dO is read by
dP^T and the P^T dO GEMMs, Q by S^T and the dS^T Q GEMMs, so per step: WG 1 issues dP^T first (K and dO; Q of
the step may still be loading), then S^T once Q is in; WG 2 issues all its P^T dO pieces before its dS^T Q
pieces; each warpgroup waits for its P^T dO GEMMs (wgmma.wait_group with the dS^T Q groups still pending) and
releases dO, then for the rest and releases Q. dO of step n + 1 (and its row facts, read by WG 1 before that
release) loads while the dS^T Q GEMMs of step n run, Q of step n + 1 while dP^T of step n + 1 runs. Each
accumulator still takes its terms in the first version's order (P^T dO, then dS^T Q, step by step): the same
bits.

Segments (Note [key block segments] in bwd_dkdv_sm90.py) as there: fp32 partials in ``dkv_part``
[B, S, Hkv, Dk], turn counters ``seg_sem`` [NS, KCAP, Hkv] (zeroed by the caller); keys no query selects
are not written (the caller zero-fills ``dkv``).

Shared memory at (Dk, Dv) = (576, 512): barriers and row facts 1 KiB, Q 72 KiB, dO 64 KiB, K 72 KiB,
sPt + sdSt 16 KiB = 230,400 B of the 232,448 (205,824 B at (512, 448)).
"""

from __future__ import annotations

from enum import IntEnum
from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum

from cute_kernels.common.utils import (acc_as_operand_a, acc_mn_view, convert_to_16bit, ld_acquire_gpu,
                                       red_release_add_gpu, wgmma_smem_layout)

from .bwd_dkdv_sm90 import SEGMENTS, BlockSparseBwdDKDVSm90
from .common import THREADS_PER_WG, check_setmaxnreg, shared_storage, smem_tensors, two_wg_pipeline
from .config import BLOCK_SIZE, LATENT_DIMS, TILE_M, BwdConfig

# setmaxnreg split: 128 * (40 + 2 * 232) = 64,512, the registers a 384-thread launch holds (168 per thread;
# an increase past that never returns: Run AG3 hung at 48 / 232). Not the 24 / 240 of bwd_dkdv_sm90.py: with one
# row stage the stage index is a constant 0, and the compiler hoists the producer loops' shared-memory addresses
# (TMA destinations, barriers) out of the loops into registers (seen in the PTX of bwd_dkdv_sm90.py built with one
# stage, whose producer then spilled too). Here the producer warps spilled 60 B at 24 registers and 116 B at 32
# with G 16; at 40, 60-64 B with per-kv-head ids (G 16 at Dk 576, G 128 at 512) until the row warp took its two
# rows one after the other (now always: Note [row fact chain] in bwd_dkdv_sm90.py); the consumers spill at 224 and
# fit in 232.
PRODUCER_REGS, CONSUMER_REGS = 40, 232
#: Q / dO row stages (Note [one row stage]).
ROW_STAGES = 1
#: dkv columns [0, A_COLS) of WG 1 (besides [Dv, Dk)); WG 2 takes [A_COLS, Dv) in pieces of <= B_PIECE
#: columns (Note [latent key split]).
A_COLS = 128
B_PIECE = 192


class LatentBarrier(IntEnum):
    """Named barrier ids (0 is __syncthreads); each meets both consumer warpgroups."""

    Reduce = 1  # the segment turn (Note [key block segments])
    DsFull = 2  # P^T and dS^T of the step are in sPt / sdSt (Note [dS hand-off])
    DsEmpty = 3  # WG 2's GEMMs on them completed


BARRIER_THREADS = 2 * THREADS_PER_WG


class BlockSparseLatentBwdDKVSm90(BlockSparseBwdDKDVSm90):
    stages = ROW_STAGES
    row_warps = 1

    def __init__(self, cfg: BwdConfig):
        if not cfg.latent:
            raise ValueError("BlockSparseLatentBwdDKVSm90 is the latent (v=None) dK/dV kernel")
        super().__init__(cfg)
        check_setmaxnreg(PRODUCER_REGS, CONSUMER_REGS, 2)
        if (self.dk, self.dv) not in LATENT_DIMS:
            raise ValueError(f"latent head dims (Dk {self.dk}, Dv {self.dv}) not in {LATENT_DIMS}")
        # WG 2's (first column, width) pieces of [A_COLS, Dv): 192 + 192 at Dv 512, 192 + 128 at Dv 448.
        self.b_parts = tuple((c, min(B_PIECE, self.dv - c)) for c in range(A_COLS, self.dv, B_PIECE))
        assert all(c % 64 == 0 and w % 64 == 0 for c, w in self.b_parts) and (self.dk - self.dv) % 64 == 0

    @staticmethod
    def smem_bytes(cfg: BwdConfig) -> int:
        # the struct of common.shared_storage: barriers, then the row facts (16-aligned), then the
        # 1024-aligned buffers (each a multiple of 1024 bytes)
        head = -(-(8 * (1 + 4 * ROW_STAGES)) // 16) * 16 + 12 * TILE_M * ROW_STAGES
        rows = ROW_STAGES * TILE_M * (cfg.head_dim + cfg.head_dim_v) * 2
        keys = BLOCK_SIZE * cfg.head_dim * 2
        hand = 2 * BLOCK_SIZE * TILE_M * 2
        return -(-head // 1024) * 1024 + rows + keys + hand

    # ------------------------------------------------------------------ host launch
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mDelta: cute.Tensor,
                 mTileMask: cute.Tensor, mQLimit: cute.Tensor, mKeyStart: cute.Tensor, mKeyEnd: cute.Tensor,
                 mKeyCount: cute.Tensor, mKeyPtr: cute.Tensor, mKeyTile: cute.Tensor, mKeySlot: cute.Tensor,
                 mdKV: cute.Tensor, mdKVpart: cute.Tensor, mSegSem: cute.Tensor, softmax_scale: Float32,
                 min_seg: Int32, stream, mOrder: cute.Tensor = None):
        sQ_layout = wgmma_smem_layout(self.dtype, (TILE_M, self.dk, ROW_STAGES))
        sdO_layout = wgmma_smem_layout(self.dtype, (TILE_M, self.dv, ROW_STAGES))
        sK_layout = wgmma_smem_layout(self.dtype, (self.tile_n, self.dk))
        sPt_layout = wgmma_smem_layout(self.dtype, (self.tile_n, TILE_M))  # (keys, rows): K-major A of keys x N x rows
        tma_atom_Q, tma_Q, rows_q = self.rows_tma(mQ, self.dk)
        tma_atom_dO, tma_dO, rows_do = self.rows_tma(mdO, self.dv)
        tma_atom_K, tma_K = self.kv_tma(mK, sK_layout, self.dk)
        self.tx_bytes_kv = self.tile_n * self.dk * 2
        words = {"row_f": (Float32, 2 * TILE_M * ROW_STAGES), "row_lim": (Int32, TILE_M * ROW_STAGES)}
        self.shared_storage = shared_storage(self.dtype, {"mbar_kv": 1, "mbar_do": 2 * ROW_STAGES,
                                                          "mbar_q": 2 * ROW_STAGES}, words,
                                             sQ=sQ_layout, sdO=sdO_layout, sK=sK_layout, sPt=sPt_layout,
                                             sdSt=sPt_layout)
        assert self.shared_storage.size_in_bytes() == self.smem_bytes(self.cfg), "smem_bytes is the struct's size"
        grid = (mKeyStart.shape[1] * SEGMENTS, mK.shape[2], mQ.shape[0])
        plan = (mTileMask, mQLimit, mKeyStart, mKeyEnd, mKeyCount, mKeyPtr, mKeyTile, mKeySlot)
        self.kernel(tma_Q, tma_dO, tma_K, mLSE, mDelta, plan, (mdKV, mdKVpart, mSegSem),
                    (tma_atom_Q, tma_atom_dO, tma_atom_K), sQ_layout, sdO_layout, sK_layout, sPt_layout, rows_q,
                    rows_do, softmax_scale, min_seg, mOrder).launch(
            grid=grid, block=[3 * THREADS_PER_WG, 1, 1], smem=self.shared_storage.size_in_bytes(), stream=stream,
            min_blocks_per_mp=1, preferred_smem_carveout=100)

    # ------------------------------------------------------------------ device
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mdO: cute.Tensor, mK: cute.Tensor, mLSE: cute.Tensor, mDelta: cute.Tensor,
               plan: tuple, outs: tuple, atoms: tuple, sQ_layout: cute.ComposedLayout,
               sdO_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, sPt_layout: cute.ComposedLayout,
               rows_q: cute.ComposedLayout, rows_do: cute.ComposedLayout, softmax_scale: Float32, min_seg: Int32,
               mOrder: cute.Tensor):
        mTileMask, mQLimit, mKeyStart, mKeyEnd, mKeyCount, mKeyPtr, mKeyTile, mKeySlot = plan
        warp_idx, tidx, storage = self.allocate(atoms)
        sQ, sdO, sK, sPt, sdSt = smem_tensors(storage, sQ=sQ_layout, sdO=sdO_layout, sK=sK_layout, sPt=sPt_layout,
                                              sdSt=sPt_layout)
        sRowF, sRowLim, mbar_kv = self.prepare_rows(storage, sQ, sdO, tidx)
        # Note [split row stages]. dO's full barrier: the TMA warp's arrive-and-expect-tx and the row warp's
        # arrival (the row facts ride with dO); Q's: the TMA warp's; empty barriers: both consumer warpgroups (8
        # warps' arrivals, Note [one row stage]).
        rows = self.wq * self.gc * 2
        pipeline_do = two_wg_pipeline(storage.mbar_do.data_ptr(), ROW_STAGES, 2, rows * self.dv)
        pipeline_q = two_wg_pipeline(storage.mbar_q.data_ptr(), ROW_STAGES, 1, rows * self.dk)
        blk = self.key_block(mQ, mK, mKeyStart, mKeyEnd, mKeyCount, mKeyPtr, min_seg, mOrder)
        if blk.live:
            if warp_idx < 4:
                cute.arch.setmaxregister_decrease(PRODUCER_REGS)
                if warp_idx == 0:
                    self.load_split(mQ, mdO, mK, mKeyTile, sK, atoms, rows_q, rows_do, storage.sQ.data_ptr(),
                                    storage.sdO.data_ptr(), mbar_kv, pipeline_q, pipeline_do, blk)
                elif warp_idx == 1:
                    self.load_rows(mLSE, mDelta, mTileMask, mQLimit, mKeyTile, mKeySlot, sRowF, sRowLim,
                                   pipeline_do, blk, warp_idx - 1)
            else:
                cute.arch.setmaxregister_increase(CONSUMER_REGS)
                ctidx = tidx % THREADS_PER_WG
                bufs = SimpleNamespace(q=(storage.sQ.data_ptr(), sQ_layout, self.dk),
                                       do=(storage.sdO.data_ptr(), sdO_layout, self.dv))
                if warp_idx < 8:
                    self.consume_a(outs, bufs, sQ, sdO, sK, sPt, sdSt, sRowF, sRowLim, mbar_kv, (pipeline_q, pipeline_do),
                                   blk, ctidx, softmax_scale)
                else:
                    self.consume_b(outs, bufs, sPt, sdSt, (pipeline_q, pipeline_do), blk, ctidx)

    # ------------------------------------------------------------------ producer
    @cute.jit
    def load_split(self, mQ, mdO, mK, mKeyTile, sK, atoms, rows_q, rows_do, sQ_base, sdO_base, mbar_kv, pipeline_q,
                   pipeline_do, blk):
        """K once, then per step the tile's dO rows into dO's stage and its Q rows into Q's (Note [split row
        stages]); the next step's query tile read one step ahead, as ``load``."""
        tma_atom_Q, tma_atom_dO, tma_atom_K = atoms
        self.load_keys(mK, None, tma_atom_K, None, sK, None, mbar_kv, blk)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, ROW_STAGES)
        do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, ROW_STAGES)
        n = (blk.p1 - blk.p0) * self.chunks
        tile = mKeyTile[blk.p0]
        for i in cutlass.range(n, unroll=1):
            q0, head0, tile = self.step_rows(mKeyTile, blk, i, n, tile)
            self.stage_rows(pipeline_do, do_state, ((tma_atom_dO, mdO, sdO_base, rows_do, self.dv),), q0, head0, blk)
            do_state.advance()
            self.stage_rows(pipeline_q, q_state, ((tma_atom_Q, mQ, sQ_base, rows_q, self.dk),), q0, head0, blk)
            q_state.advance()

    # ------------------------------------------------------------------ consumers
    def columns_operand(self, mma_slice, buf, c0: int, cols: int):
        """The B fragment (.., .., k) of columns [c0, c0 + cols) of the row stage ``buf`` = (base, layout, d)
        (sQ or sdO) for a GEMM whose K dimension runs over the tile rows, read MN-major (``key_columns``:
        whole 64-column chunks, checked against the buffer's layout at trace time)."""
        base, layout, d = buf
        return self.key_columns_operand(mma_slice, base, layout, c0, cols, 1, d)[None, None, None, 0]

    @cute.jit
    def consume_a(self, outs, bufs, sQ, sdO, sK, sPt, sdSt, sRowF, sRowLim, mbar_kv, pipes, blk,
                  ctidx: Int32, softmax_scale: Float32):
        """WG 1: per step S^T, dP^T, P^T, dS^T, the hand-off to WG 2 (Note [dS hand-off]) and dkv columns
        [0, A_COLS) and [Dv, Dk) with P^T / dS^T from registers; then those columns' segment sum."""
        dr = self.dk - self.dv  # the rope columns [Dv, Dk)
        mma_s = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, Float32,
            atom_layout_mnk=(1, 1, 1), tiler_mn=(64, TILE_M))
        mma_lo, mma_hi = self._mma_rs(A_COLS), self._mma_rs(dr)
        thr_s = mma_s.get_slice(ctidx)
        wg_s, wg_lo, wg_hi = mma_s.get_slice(0), mma_lo.get_slice(0), mma_hi.get_slice(0)
        tSrK = wg_s.make_fragment_A(wg_s.partition_A(sK))  # (.., .., Dk / 16); V = its first Dv / 16 k-blocks
        tSrQ = wg_s.make_fragment_B(wg_s.partition_B(sQ[None, None, 0]))
        tSrdO = wg_s.make_fragment_B(wg_s.partition_B(sdO[None, None, 0]))
        tLrdOt = self.columns_operand(wg_lo, bufs.do, 0, A_COLS)
        tLrQt = self.columns_operand(wg_lo, bufs.q, 0, A_COLS)
        tHrQt = self.columns_operand(wg_hi, bufs.q, self.dv, dr)
        # P^T and dS^T as the 16-bit A operand (keys x rows): its layout does not depend on N (lo and hi)
        tLrP = wg_lo.make_fragment_A(wg_lo.partition_shape_A((self.tile_n, TILE_M)))
        tLrdS = wg_lo.make_fragment_A(wg_lo.partition_shape_A((self.tile_n, TILE_M)))
        acc_shape = wg_s.partition_shape_C((self.tile_n, TILE_M))
        acc_lo = cute.make_rmem_tensor(wg_lo.partition_shape_C((self.tile_n, A_COLS)), Float32)
        acc_hi = cute.make_rmem_tensor(wg_hi.partition_shape_C((self.tile_n, dr)), Float32)
        acc_lo.fill(0.0)
        acc_hi.fill(0.0)
        # P^T, dS^T -> sPt, sdSt by stmatrix from the S^T accumulator's layout (Note [dS hand-off]).
        st_copy = cute.make_tiled_copy_C(sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.dtype, Float32),
                                         mma_s)
        thr_st = st_copy.get_slice(ctidx)
        tPsP, tPsdS = thr_st.partition_D(sPt), thr_st.partition_D(sdSt)
        ctx = self.key_context(thr_s, sRowF, sRowLim, blk, softmax_scale)
        cute.arch.mbarrier_wait(mbar_kv, 0)
        pipeline_q, pipeline_do = pipes
        n = (blk.p1 - blk.p0) * self.chunks
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, ROW_STAGES)
        do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, ROW_STAGES)
        for j in cutlass.range(n, unroll=1):
            acc_S = cute.make_rmem_tensor(acc_shape, Float32)
            acc_dP = cute.make_rmem_tensor(acc_shape, Float32)
            # 1. dP^T = V dO^T (Dv deep) as soon as dO and the row facts are in, then S^T = K Q^T (Dk deep) once
            # Q is (Note [split row stages]).
            pipeline_do.consumer_wait(do_state)
            self.gemm_k(mma_s, acc_dP, tSrK, tSrdO, self.dv // 16)
            col = self.columns(ctx, 0)  # while dP^T runs
            pipeline_q.consumer_wait(q_state)
            self.gemm(mma_s, acc_S, tSrK, tSrQ, True, 0)
            # 2. P^T; dkv[:, :A_COLS] += P^T dO runs while dS^T is formed.
            acc_S_mn = acc_mn_view(acc_S)
            # P^T as ``probs`` computes it, but each column's lse read from shared memory where it is used: the 16
            # that ``columns`` would hold over S^T cost the consumers 28-32 B of spills under the CUDA 13 ptxas (the
            # device's; the CUDA 12 one did not spill), Run AO8.
            for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                lse_c = ctx.sRowF[ctx.thr_col + ctx.cols[c], 0, 0]
                for k in cutlass.range_constexpr(2):
                    keep = ((col.keep >> (c + 16 * k)) & 1) != 0
                    p = cute.math.exp2(acc_S_mn[k, c] * ctx.scale_log2 - lse_c, fastmath=True)
                    acc_S_mn[k, c] = p if keep else Float32(0.0)
            convert_to_16bit(acc_as_operand_a(acc_S), tLrP)
            self.gemm(mma_lo, acc_lo, tLrP, tLrdOt, False, -1)
            delta = self.deltas(ctx, 0)
            # 3. dS^T = P^T (dP^T - delta), scaled (Note [dS hand-off]).
            acc_dP_mn = acc_mn_view(acc_dP)
            for k in cutlass.range_constexpr(2):
                for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                    # 0 where P^T = 0, not 0 * NaN (a non-finite latent row or delta the row cannot see)
                    p = acc_S_mn[k, c]
                    acc_dP_mn[k, c] = (Float32(0.0) if p == Float32(0.0)
                                       else (p * softmax_scale) * (acc_dP_mn[k, c] - delta[c]))
            convert_to_16bit(acc_as_operand_a(acc_dP), tLrdS)
            # 4. Hand P^T and dS^T to WG 2.
            if j > 0:
                cute.arch.barrier(barrier_id=int(LatentBarrier.DsEmpty), number_of_threads=BARRIER_THREADS)
            cute.copy(st_copy, thr_st.retile(tLrP), tPsP)
            cute.copy(st_copy, thr_st.retile(tLrdS), tPsdS)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier_arrive(barrier_id=int(LatentBarrier.DsFull), number_of_threads=BARRIER_THREADS)
            # 5. dkv[:, :A_COLS] += dS^T Q, dkv[:, Dv:] += dS^T Q; dO is free of WG 1 once P^T dO completed (the
            # two dS^T Q groups may still run), Q once those did.
            self.gemm(mma_lo, acc_lo, tLrdS, tLrQt, False, -1)
            self.gemm(mma_hi, acc_hi, tLrdS, tHrQt, False, 2)
            pipeline_do.consumer_release(do_state)
            do_state.advance()
            warpgroup.wait_group(0)
            pipeline_q.consumer_release(q_state)
            q_state.advance()
        self.write_keys(ctx, ((acc_lo, mma_lo.get_slice(ctidx), A_COLS, 0),
                              (acc_hi, mma_hi.get_slice(ctidx), dr, self.dv)), outs, True, ctidx)

    @cute.jit
    def consume_b(self, outs, bufs, sPt, sdSt, pipes, blk, ctidx: Int32):
        """WG 2: per step dkv[:, A_COLS:Dv] += P^T dO + dS^T Q with P^T / dS^T from WG 1 (Note [dS hand-off]),
        one accumulator per piece of ``b_parts``; then those columns' segment sum."""
        parts = []
        for c0, cols in self.b_parts:
            mma = sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN, Float32,
                atom_layout_mnk=(1, 1, 1), tiler_mn=(64, cols))  # A (P^T, dS^T) from shared memory
            wg = mma.get_slice(0)
            acc = cute.make_rmem_tensor(wg.partition_shape_C((self.tile_n, cols)), Float32)
            acc.fill(0.0)
            parts.append(SimpleNamespace(
                mma=mma, acc=acc, c0=c0, cols=cols, tBrP=wg.make_fragment_A(wg.partition_A(sPt)),
                tBrdS=wg.make_fragment_A(wg.partition_A(sdSt)), tBrdOt=self.columns_operand(wg, bufs.do, c0, cols),
                tBrQt=self.columns_operand(wg, bufs.q, c0, cols)))
        pipeline_q, pipeline_do = pipes
        n = (blk.p1 - blk.p0) * self.chunks
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, ROW_STAGES)
        do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, ROW_STAGES)
        for j in cutlass.range(n, unroll=1):
            # 1. The step's rows (already complete once WG 1 handed over), then P^T and dS^T.
            pipeline_do.consumer_wait(do_state)
            pipeline_q.consumer_wait(q_state)
            cute.arch.barrier(barrier_id=int(LatentBarrier.DsFull), number_of_threads=BARRIER_THREADS)
            # 2. The GEMMs, every P^T dO piece first (Note [split row stages]): dO is free of WG 2 once those
            # completed, sPt / sdSt and Q once all did.
            for p in parts:
                self.gemm(p.mma, p.acc, p.tBrP, p.tBrdOt, False, -1)
            for p in parts:
                self.gemm(p.mma, p.acc, p.tBrdS, p.tBrQt, False, -1)
            warpgroup.wait_group(len(parts))
            pipeline_do.consumer_release(do_state)
            do_state.advance()
            warpgroup.wait_group(0)
            if j < n - 1:
                cute.arch.barrier_arrive(barrier_id=int(LatentBarrier.DsEmpty), number_of_threads=BARRIER_THREADS)
            pipeline_q.consumer_release(q_state)
            q_state.advance()
        ctx = SimpleNamespace(blk=blk)
        self.write_keys(ctx, tuple((p.acc, p.mma.get_slice(ctidx), p.cols, p.c0) for p in parts), outs, False, ctidx)

    @cute.jit
    def gemm_k(self, tiled_mma, acc, tCrA, tCrB, k_blocks: cutlass.Constexpr):
        """acc = A B over the first ``k_blocks`` k-blocks of A (V as K's leading columns), one wgmma group."""
        warpgroup.fence()
        atom = cute.make_mma_atom(tiled_mma.op)
        atom.set(warpgroup.Field.ACCUMULATE, False)
        for k in cutlass.range_constexpr(k_blocks):
            cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
            atom.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.jit
    def write_keys(self, ctx, parts: tuple, outs: tuple, lead: cutlass.Constexpr, ctidx: Int32):
        """This warpgroup's dkv columns ``parts`` ((acc, thread MMA slice, cols, first column) each): stored, or
        with segments (Note [key block segments]) added to the previous segments' fp32 sum in turn; ``lead``:
        this warpgroup's thread 0 takes the turn for the CTA."""
        mdKV, mdKVpart, mSegSem = outs
        blk = ctx.blk
        if blk.nseg == 1:
            for acc, thr, cols, c0 in parts:
                self.store_keys(ctx, acc, mdKV, thr, cols, Float32(1.0), c0)
        else:
            r, seg = self.segment_ids(blk)
            sem_addr = (mSegSem.iterator + cute.crd2idx((blk.s, r, blk.h), mSegSem.layout)).toint()
            if const_expr(lead):
                if ctidx == 0:
                    cur = ld_acquire_gpu(sem_addr)
                    while cur != seg:
                        cur = ld_acquire_gpu(sem_addr)
            cute.arch.barrier(barrier_id=int(LatentBarrier.Reduce), number_of_threads=BARRIER_THREADS)
            cute.arch.fence_acq_rel_gpu()
            if seg > 0:
                for acc, thr, cols, c0 in parts:
                    self.add_keys(ctx, acc, mdKVpart, thr, cols, c0)
            if seg == blk.nseg - 1:
                for acc, thr, cols, c0 in parts:
                    self.store_keys(ctx, acc, mdKV, thr, cols, Float32(1.0), c0)
            else:
                for acc, thr, cols, c0 in parts:
                    self.store_keys(ctx, acc, mdKVpart, thr, cols, Float32(1.0), c0)
                cute.arch.fence_acq_rel_gpu()
                cute.arch.barrier(barrier_id=int(LatentBarrier.Reduce), number_of_threads=BARRIER_THREADS)
                if const_expr(lead):
                    if ctidx == 0:
                        red_release_add_gpu(sem_addr, Int32(1))
