"""BlockSparseBwdDKDVSm100: Blackwell (sm_100a / sm_103a) dK / dV of block-sparse attention, key-major, no atomics.

    dv_c = sum_rows P[row, c] dO[row],   dk_c = scale * sum_rows dS[row, c] q[row]

over the rows (query, head) that see key c, with P and dS as in ``bwd_dq_sm100.py``; the plan walk of the SM90
kernel (``bwd_dkdv_sm90.py``: one CTA per segment of a selected key block and kv head, the plan's key-major
transpose in ascending tile order, Note [key block segments], the CTAs in the plan's query-tile order, Note
[tile-ordered segments]; its ``key_block`` and ``segment_ids`` this class calls), with the
row tiles of the SM100 plan: a step is one 128-row stage (``half``) of a listed query tile (the forward's window,
``q_stages_sm100`` stages of ``QS`` queries x ``GC`` heads) for one head chunk.

Keys as the M dimension would need M = 64 tcgen05 MMAs, so the accumulators are transposed (Note [SM100 dK/dV
transposed]): S = Q K^T and dP = dO V^T (M = 128 rows, N = 64 keys), then dV^T += dO^T P and dK^T += Q^T dS
(M = the head dim, N = 64 keys, K = the 128 rows) with P and dS from shared memory. 384 threads:

    warps 0-7   compute, two warpgroups; WG w owns keys [32 w, 32 w + 32) of the block (thread = TMEM lane =
                tile row): its S and dP columns -> P, dS (16-bit) into its half of the shared tiles; after the
                last step the epilogue (thread = head dim: dK^T / dV^T rows = columns of dK / dV, its 32 keys)
    warp 8      MMA (one elected thread issues tcgen05)
    warp 9      TMA: K and V of the block once; per step the stage's Q and dO rows (one (GC, D) box per query)
    warp 10     row facts: per step, each row's lse (log2 units), delta and key limit into the step's stage of
                a pipeline of their own (Note [row facts in shared memory] in bwd_dkdv_sm90.py)
    warp 11     idle

TMEM (columns): S / dP of step parity k at [128 k, 128 k + 64) / [128 k + 64, 128 k + 128), dV^T [256, 320),
dK^T [320, 384). Shared memory: Q and dO (2 stages of 128 rows each), K and V (64 rows), P and dS (128 x 64).

Every element of dK / dV is a sum in the plan's fixed order (per segment, then the segments in turn): bitwise
reproducible. Compile-verified only: no Blackwell GPU was available (the plan walk, masks and math are the SM90
kernel's, which runs on the H200). Not supported: head dims other than 128 (M = 64 accumulators), the latent.
"""

from __future__ import annotations

from enum import IntEnum

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.tensor_utils import LayoutEnum

from cute_kernels.attention.bwd_sm100 import check_operand_aliases, tmem_chunk_copy
from cute_kernels.attention.fwd_sm100 import FlashFwdSm100
from cute_kernels.common.barriers import check_arrivals, pipeline_counts
from cute_kernels.common.utils import LOG2_E, ld_acquire_gpu, red_release_add_gpu, select_modes
from cute_kernels.dtypes import cutlass_dtype

from .bwd_dkdv_sm90 import SEGMENTS, BlockSparseBwdDKDVSm90
from .config import BLOCK_SIZE, BwdConfig, head_chunk, q_stages_sm100, stage_queries_sm100
from .fwd_sm100 import check_row_slots, row_slots

# Note [SM100 dK/dV transposed]
# Per step i (stage i % STAGES of the rows pipeline, S / dP buffer i % 2):
#   MMA: [rows full(i)] [s acquire(i)] S(i) = Q(i) K^T, dP(i) = dO(i) V^T -> [s full(i)];
#        then for step i - 1: [p full] dV^T += dO(i-1)^T P, dK^T += Q(i-1)^T dS -> [p release, rows release(i-1)]
#   compute: [facts full(i)] lse, delta, key limit [facts release(i)]; [s full(i)] S, dP rows -> registers, [s release(i)]; P, dS; [p acquire] P, dS
#        -> smem, fence, [p commit]
# so S(i + 1) and dP(i + 1) run while the compute warps turn S(i) into P(i), and the dV / dK GEMMs of step i
# while they wait for S(i + 1). Both compute warpgroups take every step (WG w: keys [32 w, 32 w + 32)): s is
# released and p committed by their 256 threads. After the last step's GEMMs the MMA commits dkv; the compute warps read dV^T /
# dK^T from TMEM (lane = head dim) and write keys [start, end) of dK / dV (Note [key block segments]).
# * A = Q^T / dO^T is the MN-major view of the Q / dO stage the TMA wrote K-major, B = P / dS the MN-major (N =
#   key) view of the row-major (row, key) tile the compute warps store: both pairs are checked to place every
#   element at the same byte (``check_operand_aliases``).
# * Rows that do not count (past the window's queries, idle lanes past QS * GC, queries that did not select the
#   block) get key limit 0, so P = dS = 0 there (selected, not multiplied: their S / dP may be stale); their Q /
#   dO rows hold finite data (the buffers are zeroed once, and a stage row is only ever overwritten by a real
#   query's row), so 0 * row stays 0 in the GEMMs.

ROWS = 128  # tile rows per step (one TMEM lane each)
STAGES = 2  # Q / dO / row-fact stages
NUM_THREADS = 384
_WARPS_COMPUTE = (0, 1, 2, 3, 4, 5, 6, 7)
_WARP_MMA, _WARP_LOAD, _WARP_ROWS = 8, 9, 10
TMEM_COLS = 512
TMEM_S = (0, 128)  # S of step parity 0 / 1 (dP 64 columns after each)
TMEM_DV, TMEM_DK = 256, 320
DS_CHUNK = 32  # key columns per TMEM load / shared store: one compute warpgroup's keys


class DkdvBarrier(IntEnum):
    Compute = 1  # the compute warps: segment turn, reduction and TMEM free


ROLE_THREADS = {"compute": 2 * ROWS, "mma": 1, "load": 1, "facts": 32}
PIPES = {"rows": ("load", "mma"), "facts": ("facts", "compute"), "s": ("mma", "compute"), "p": ("compute", "mma"),
         "dkv": ("mma", "compute")}
BARRIERS = {DkdvBarrier.Compute: ("compute",)}


class BlockSparseBwdDKDVSm100:
    def __init__(self, cfg: BwdConfig):
        if cfg.arch // 10 != 10:
            raise ValueError(f"{type(self).__name__} is the SM100 kernel, got arch {cfg.arch}")
        reason = self.unsupported_reason(cfg)
        if reason is not None:
            raise ValueError(f"{type(self).__name__}: {reason}")
        self.cfg = cfg
        self.dtype = cutlass_dtype(cfg.dtype)
        self.d = cfg.head_dim
        self.gc = head_chunk(cfg.group)
        self.chunks = cfg.group // self.gc
        self.qs = stage_queries_sm100(cfg.group)
        self.halves = q_stages_sm100(cfg.group, cfg.head_dim_v)
        self.wq = cfg.window_queries
        self.tile_n = BLOCK_SIZE

    @staticmethod
    def unsupported_reason(cfg: BwdConfig) -> str | None:
        if cfg.latent:
            return "the absorbed-MLA latent"
        if cfg.head_dim != 128 or cfg.head_dim_v != 128:
            return f"head dims {cfg.head_dim} / {cfg.head_dim_v} (the SM100 dK/dV kernel takes 128: M = head dim)"
        return None

    @staticmethod
    def smem_bytes(cfg: BwdConfig) -> int:
        d = cfg.head_dim
        rows = STAGES * ROWS * d * 2 * 2
        kv = BLOCK_SIZE * d * 2 * 2
        pds = ROWS * BLOCK_SIZE * 2 * 2
        facts = STAGES * ROWS * 3 * 4
        return 1024 + rows + kv + pds + facts + 8 * (4 * STAGES + 2 * 2 + 2 + 2 + 1) + 4 + 4 * 1024

    def mmas_and_layouts(self):
        dt, d = self.dtype, self.d
        K_, MN_ = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        one = tcgen05.CtaGroup.ONE
        self.tiler_s = (ROWS, BLOCK_SIZE, d)  # S = Q K^T, dP = dO V^T
        self.tiler_kv = (d, BLOCK_SIZE, ROWS)  # dV^T = dO^T P, dK^T = Q^T dS
        mma_s = sm100_utils.make_trivial_tiled_mma(dt, dt, K_, K_, Float32, one, self.tiler_s[:2])
        mma_kv = sm100_utils.make_trivial_tiled_mma(dt, dt, MN_, MN_, Float32, one, self.tiler_kv[:2])
        sQ_layout = sm100_utils.make_smem_layout_a(mma_s, self.tiler_s, dt, STAGES)  # Q and dO stages
        sK_layout = sm100_utils.make_smem_layout_b(mma_s, self.tiler_s, dt, 1)  # K and V
        sQt_layout = sm100_utils.make_smem_layout_a(mma_kv, self.tiler_kv, dt, STAGES)  # Q^T / dO^T views
        sP_layout = sm100_utils.make_smem_layout_b(mma_kv, self.tiler_kv, dt, 1)  # P / dS as B (N = key)
        sP_epi = sm100_utils.make_smem_layout_epi(dt, LayoutEnum.ROW_MAJOR, (ROWS, BLOCK_SIZE), 1)
        return mma_s, mma_kv, sQ_layout, sK_layout, sQt_layout, sP_layout, sP_epi

    def check_layouts(self, sQ_layout, sQt_layout, sP_layout, sP_epi):
        """Trace-time: the Q / dO stages take the row-slot boxes; Q^T / dO^T and the stored P / dS tile alias
        the MMA operand views (Note [SM100 dK/dV transposed])."""
        check_row_slots(sQ_layout, self.d, STAGES)
        check_operand_aliases([("Q / Q^T", sQ_layout, sQt_layout, False)], ROWS, self.d)
        for st in range(STAGES):  # the stages of both views are ROWS * d elements apart
            assert cute.crd2idx(((0, 0), 0, 0, st), sQt_layout.outer) == st * ROWS * self.d, "Q^T stage stride"
        epi_t = cute.make_composed_layout(sP_epi.inner, 0, cute.select(cute.slice_(sP_epi.outer, (None, None, 0)),
                                                                        mode=[1, 0]))
        check_operand_aliases([("P / stored tile", sP_layout, epi_t, True)], BLOCK_SIZE, ROWS)

    # ------------------------------------------------------------------ host (jit) side
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
                 mDelta: cute.Tensor, mTileMask: cute.Tensor, mQLimit: cute.Tensor, mKeyStart: cute.Tensor,
                 mKeyEnd: cute.Tensor, mKeyCount: cute.Tensor, mKeyPtr: cute.Tensor, mKeyTile: cute.Tensor,
                 mKeySlot: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, mdKpart: cute.Tensor,
                 mdVpart: cute.Tensor, mSegSem: cute.Tensor, softmax_scale: Float32, min_seg: Int32, stream,
                 mOrder: cute.Tensor = None):
        d = self.d
        mma_s, mma_kv, sQ_layout, sK_layout, sQt_layout, sP_layout, sP_epi = self.mmas_and_layouts()
        self.check_layouts(sQ_layout, sQt_layout, sP_layout, sP_epi)
        q_box = row_slots(sQ_layout.inner, self.gc, d)
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        atom_q, tma_q = cpasync.make_tiled_tma_atom(g2s, select_modes(mQ, (2, 3, 1, 0)), q_box, (self.gc, d))
        atom_do, tma_do = cpasync.make_tiled_tma_atom(g2s, select_modes(mdO, (2, 3, 1, 0)), q_box, (self.gc, d))
        k_layout = cute.select(sK_layout, mode=[0, 1, 2])
        op = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        atom_k, tma_k = cute.nvgpu.make_tiled_tma_atom_B(op, select_modes(mK, (1, 3, 2, 0)), k_layout, self.tiler_s,
                                                         mma_s, (1, 1, 1, 1))
        atom_v, tma_v = cute.nvgpu.make_tiled_tma_atom_B(op, select_modes(mV, (1, 3, 2, 0)), k_layout, self.tiler_s,
                                                         mma_s, (1, 1, 1, 1))
        self.kv_bytes = 2 * cute.size_in_bytes(self.dtype, k_layout)
        self.rows_bytes_per_query = 2 * self.gc * d * 2  # one Q and one dO box
        dt = self.dtype
        fields = {"bar_rows": cute.struct.MemRange[Int64, 2 * STAGES],
                  "bar_facts": cute.struct.MemRange[Int64, 2 * STAGES], "bar_s": cute.struct.MemRange[Int64, 4],
                  "bar_p": cute.struct.MemRange[Int64, 2], "bar_dkv": cute.struct.MemRange[Int64, 2],
                  "bar_kv": cute.struct.MemRange[Int64, 1], "tmem_holding": Int32,
                  "facts_f": cute.struct.MemRange[Float32, 2 * ROWS * STAGES],
                  "facts_lim": cute.struct.MemRange[Int32, ROWS * STAGES]}
        for name, layout in (("sQ", sQ_layout), ("sdO", sQ_layout), ("sK", sK_layout), ("sV", sK_layout),
                             ("sP", sP_layout), ("sdS", sP_layout)):
            fields[name] = cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(layout)], 1024]
        self.shared_storage = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))
        grid = (mKeyStart.shape[1] * SEGMENTS, mK.shape[2], mQ.shape[0])
        self.kernel(mma_s, mma_kv, atom_q, tma_q, atom_do, tma_do, atom_k, tma_k, atom_v, tma_v, q_box, mLSE, mDelta,
                    (mTileMask, mQLimit, mKeyStart, mKeyEnd, mKeyCount, mKeyPtr, mKeyTile, mKeySlot),
                    (mdK, mdV, mdKpart, mdVpart, mSegSem), sQ_layout, sK_layout, sQt_layout, sP_layout, sP_epi,
                    softmax_scale, min_seg, mOrder).launch(grid=grid, block=[NUM_THREADS, 1, 1], stream=stream,
                                                   min_blocks_per_mp=1)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, mma_s: cute.TiledMma, mma_kv: cute.TiledMma, atom_q: cute.CopyAtom, tma_q: cute.Tensor,
               atom_do: cute.CopyAtom, tma_do: cute.Tensor, atom_k: cute.CopyAtom, tma_k: cute.Tensor,
               atom_v: cute.CopyAtom, tma_v: cute.Tensor, q_box: cute.ComposedLayout, mLSE: cute.Tensor,
               mDelta: cute.Tensor, plan: tuple, outs: tuple, sQ_layout: cute.ComposedLayout,
               sK_layout: cute.ComposedLayout, sQt_layout: cute.ComposedLayout, sP_layout: cute.ComposedLayout,
               sP_epi: cute.ComposedLayout, softmax_scale: Float32, min_seg: Int32, mOrder: cute.Tensor):
        mTileMask, mQLimit, mKeyStart, mKeyEnd, mKeyCount, mKeyPtr, mKeyTile, mKeySlot = plan
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx = cute.arch.thread_idx()[0]
        if warp_idx == _WARP_LOAD:
            for atom in (atom_q, atom_do, atom_k, atom_v):
                cpasync.prefetch_descriptor(atom)
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        def group(n):
            return pipeline.CooperativeGroup(pipeline.Agent.Thread, n)

        rt = ROLE_THREADS
        tx_rows = self.qs * self.rows_bytes_per_query  # upper bound; each step states its own bytes
        pipe_rows = pipeline.PipelineTmaUmma.create(
            num_stages=STAGES, producer_group=group(rt["load"]), consumer_group=group(rt["mma"]),
            tx_count=tx_rows, barrier_storage=storage.bar_rows.data_ptr(), defer_sync=True)
        pipe_facts = pipeline.PipelineAsync.create(
            num_stages=STAGES, producer_group=group(rt["facts"]), consumer_group=group(rt["compute"]),
            barrier_storage=storage.bar_facts.data_ptr(), defer_sync=True)
        pipe_s = pipeline.PipelineUmmaAsync.create(
            num_stages=2, producer_group=group(rt["mma"]), consumer_group=group(rt["compute"]),
            barrier_storage=storage.bar_s.data_ptr(), defer_sync=True)
        pipe_p = pipeline.PipelineAsyncUmma.create(
            num_stages=1, producer_group=group(rt["compute"]), consumer_group=group(rt["mma"]),
            barrier_storage=storage.bar_p.data_ptr(), defer_sync=True)
        pipe_dkv = pipeline.PipelineUmmaAsync.create(
            num_stages=1, producer_group=group(rt["mma"]), consumer_group=group(rt["compute"]),
            barrier_storage=storage.bar_dkv.data_ptr(), defer_sync=True)
        bar_compute = pipeline.NamedBarrier(barrier_id=int(DkdvBarrier.Compute), num_threads=rt["compute"])
        check_arrivals({n: pipeline_counts(n, p) for n, p in (("rows", pipe_rows), ("facts", pipe_facts), ("s", pipe_s),
                                                                ("p", pipe_p), ("dkv", pipe_dkv))},
                       {DkdvBarrier.Compute: bar_compute.num_threads}, pipes=PIPES, barriers=BARRIERS,
                       role_threads=rt)
        mbar_kv = storage.bar_kv.data_ptr()
        if warp_idx == _WARP_MMA:
            if cute.arch.lane_idx() == 0:
                cute.arch.mbarrier_init(mbar_kv, 1)
        if warp_idx == _WARPS_COMPUTE[0]:
            cute.arch.alloc_tmem(TMEM_COLS, storage.tmem_holding.ptr)
            cute.arch.relinquish_tmem_alloc_permit()
        # Q / dO stages zeroed once (Note [SM100 dK/dV transposed]: rows never loaded must be finite)
        words = cute.make_tensor(cute.recast_ptr(storage.sQ.data_ptr(), dtype=Int32),
                                 cute.make_layout(STAGES * ROWS * self.d // 2))
        words_do = cute.make_tensor(cute.recast_ptr(storage.sdO.data_ptr(), dtype=Int32),
                                    cute.make_layout(STAGES * ROWS * self.d // 2))
        for i in cutlass.range(tidx, STAGES * ROWS * self.d // 2, NUM_THREADS, unroll=1):
            words[i] = Int32(0)
            words_do[i] = Int32(0)
        cute.arch.fence_view_async_shared()
        cute.arch.mbarrier_init_fence()
        pipeline.pipeline_init_arrive(is_relaxed=True)
        pipeline.pipeline_init_wait()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sQt = cute.make_tensor(cute.recast_ptr(sQ.iterator, sQt_layout.inner), sQt_layout.outer)
        sdOt = cute.make_tensor(cute.recast_ptr(sdO.iterator, sQt_layout.inner), sQt_layout.outer)
        sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
        sdS = storage.sdS.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
        epi_outer = cute.slice_(sP_epi.outer, (None, None, 0))
        sP_st = cute.make_tensor(cute.recast_ptr(sP.iterator, sP_epi.inner), epi_outer)
        sdS_st = cute.make_tensor(cute.recast_ptr(sdS.iterator, sP_epi.inner), epi_outer)
        facts_f = cute.make_tensor(storage.facts_f.data_ptr(), cute.make_layout((ROWS, 2, STAGES)))
        facts_lim = cute.make_tensor(storage.facts_lim.data_ptr(), cute.make_layout((ROWS, STAGES)))

        tmem_ptr = cute.arch.retrieve_tmem_ptr(Float32, 16, storage.tmem_holding.ptr)
        thr_s = mma_s.get_slice(0)
        thr_kv = mma_kv.get_slice(0)
        acc_s_layout = thr_s.make_fragment_C(thr_s.partition_shape_C((ROWS, BLOCK_SIZE))).layout
        acc_kv_layout = thr_kv.make_fragment_C(thr_kv.partition_shape_C((self.d, BLOCK_SIZE))).layout
        tS = [cute.make_tensor(tmem_ptr + TMEM_S[k], acc_s_layout) for k in range(2)]
        tdP = [cute.make_tensor(tmem_ptr + TMEM_S[k] + BLOCK_SIZE, acc_s_layout) for k in range(2)]
        tdV = cute.make_tensor(tmem_ptr + TMEM_DV, acc_kv_layout)
        tdK = cute.make_tensor(tmem_ptr + TMEM_DK, acc_kv_layout)

        # the SM90 kernel's CTA -> (segment of a key block) rule; its views: tma_q (H, D, S, B), tma_k (S, D, H, B)
        blk = BlockSparseBwdDKDVSm90.key_block(self, tma_q, tma_k, mKeyStart, mKeyEnd, mKeyCount, mKeyPtr, min_seg,
                                               mOrder)
        n_steps = (blk.p1 - blk.p0) * self.chunks * self.halves
        if blk.live:
            if warp_idx == _WARP_LOAD:
                self.load(mma_s, atom_q, tma_q, atom_do, tma_do, atom_k, tma_k, atom_v, tma_v, q_box, sQ, sdO, sK, sV,
                          mbar_kv, pipe_rows, mKeyTile, blk, n_steps)
            elif warp_idx == _WARP_ROWS:
                self.load_facts(mLSE, mDelta, mTileMask, mQLimit, mKeyTile, mKeySlot, facts_f, facts_lim,
                                pipe_facts, blk, n_steps)
            elif warp_idx == _WARP_MMA:
                self.mma(mma_s, mma_kv, sQ, sdO, sK, sV, sQt, sdOt, sP, sdS, tS, tdP, tdV, tdK, mbar_kv, pipe_rows,
                         pipe_s, pipe_p, pipe_dkv, n_steps)
            elif warp_idx <= _WARPS_COMPUTE[-1]:
                self.compute(mma_s, tS, tdP, tdV, tdK, sP_st, sdS_st, facts_f, facts_lim, pipe_facts, pipe_s, pipe_p,
                             pipe_dkv, bar_compute, outs, blk, n_steps, softmax_scale)
        if warp_idx <= _WARPS_COMPUTE[-1]:
            bar_compute.arrive_and_wait()  # every TMEM read done
            if warp_idx == _WARPS_COMPUTE[0]:
                cute.arch.dealloc_tmem(tmem_ptr, TMEM_COLS)

    # ------------------------------------------------------------------ steps
    @cute.jit
    def step_of(self, blk, i: Int32):
        """Step ``i`` of the segment: (pair index, stage ``half`` of its query tile, first query head)."""
        per_pair = self.chunks * self.halves
        rem = i % per_pair
        return blk.p0 + i // per_pair, rem % self.halves, blk.h * self.cfg.group + (rem // self.halves) * self.gc

    # ------------------------------------------------------------------ TMA warp
    @cute.jit
    def load(self, mma_s, atom_q, tma_q, atom_do, tma_do, atom_k, tma_k, atom_v, tma_v, q_box, sQ, sdO, sK, sV,
             mbar_kv, pipe_rows, mKeyTile, blk, n_steps: Int32):
        d = self.d
        if cute.arch.lane_idx() == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(mbar_kv, self.kv_bytes)
        thr_s = mma_s.get_slice(0)
        for atom, tma, sX in ((atom_k, tma_k, sK), (atom_v, tma_v, sV)):
            gX = cute.local_tile(cute.domain_offset((blk.start, 0), tma[None, None, blk.h, blk.b]), (BLOCK_SIZE, d),
                                 (None, 0))
            tXs, tXg = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 3),
                                             cute.group_modes(thr_s.partition_B(gX), 0, 3))
            cute.copy(atom, tXg[None, 0], tXs[None, 0], tma_bar_ptr=mbar_kv)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES)
        for i in cutlass.range(n_steps, unroll=1):
            p, half, head0 = self.step_of(blk, i)
            q0 = mKeyTile[p] * self.wq + half * self.qs
            nload = cutlass.max(cutlass.min(self.qs, self.wq - half * self.qs), 1)
            pipe_rows.producer_acquire(state, expected_tx=nload * self.rows_bytes_per_query)
            bar = pipe_rows.producer_get_barrier(state)
            for j in cutlass.range(nload, unroll=1):
                t = cutlass.min(q0 + j, blk.seqlen - 1)  # a query past S loads the last one (its rows do not count)
                for atom, tma, sX in ((atom_q, tma_q, sQ), (atom_do, tma_do, sdO)):
                    dst = cute.make_tensor(cute.recast_ptr(sX.iterator + state.index * (ROWS * d) + j * self.gc * 64,
                                                           q_box.inner), q_box.outer)
                    src = cute.local_tile(tma[None, None, t, blk.b], (self.gc, d), (head0 // self.gc, 0))
                    tS, tG = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(dst, 0, 2),
                                                   cute.group_modes(src, 0, 2))
                    cute.copy(atom, tG, tS, tma_bar_ptr=bar)
            state.advance()
        pipe_rows.producer_tail(state)  # the MMA's last releases are tcgen05.commit arrivals

    # ------------------------------------------------------------------ row-fact warp
    @cute.jit
    def load_facts(self, mLSE, mDelta, mTileMask, mQLimit, mKeyTile, mKeySlot, facts_f, facts_lim, pipe_facts, blk,
                   n_steps: Int32):
        """Per step, each tile row's lse (log2 units), delta and key limit (keys [0, lim) of the block count; 0
        for a row that does not count) into the step's stage of ``pipe_facts`` (every lane commits)."""
        lane = cute.arch.lane_idx()
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES)
        # Note [row fact chain] in bwd_dkdv_sm90.py: the step's tile and selection bits are read one step ahead,
        # a row's three reads together (``row_fact``).
        p = self.step_of(blk, Int32(0))[0]
        w = mKeyTile[p]
        bits = mTileMask[blk.s, w, mKeySlot[p]]
        for i in cutlass.range(n_steps, unroll=1):
            _, half, head0 = self.step_of(blk, i)
            pn = self.step_of(blk, cutlass.min(i + 1, n_steps - 1))[0]
            w_next, slot_next = mKeyTile[pn], mKeySlot[pn]
            pipe_facts.producer_acquire(state)
            for rr in cutlass.range_constexpr(ROWS // 32):  # 168 registers here: every row's reads at once
                row = lane + 32 * rr
                j = row // self.gc
                qi = half * self.qs + j
                q = w * self.wq + qi
                live = (j < self.qs) & (qi < self.wq) & (q < blk.seqlen) & (((bits >> qi) & 1) != 0)
                lim, lse, delta = BlockSparseBwdDKDVSm90.row_fact(self, mLSE, mDelta, mQLimit, blk, q,
                                                                  head0 + row - j * self.gc, live)
                facts_lim[row, state.index] = lim
                facts_f[row, 0, state.index] = lse
                facts_f[row, 1, state.index] = delta
            pipe_facts.producer_commit(state)
            state.advance()
            w = w_next
            bits = mTileMask[blk.s, w_next, slot_next]

    # ------------------------------------------------------------------ MMA warp
    def gemm(self, tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor, accumulate):
        """The SM100 forward's tcgen05 GEMM over one tile's K modes (``FlashFwdSm100.gemm``)."""
        FlashFwdSm100.gemm(self, tiled_mma, acc, tCrA, tCrB, accumulate)

    @cute.jit
    def mma(self, mma_s, mma_kv, sQ, sdO, sK, sV, sQt, sdOt, sP, sdS, tS, tdP, tdV, tdK, mbar_kv, pipe_rows, pipe_s,
            pipe_p, pipe_dkv, n_steps: Int32):
        thr_s = mma_s.get_slice(0)
        thr_kv = mma_kv.get_slice(0)
        tSrQ = thr_s.make_fragment_A(sQ)
        tSrdO = thr_s.make_fragment_A(sdO)
        tSrK = thr_s.make_fragment_B(sK)
        tSrV = thr_s.make_fragment_B(sV)
        tKrQt = thr_kv.make_fragment_A(sQt)
        tVrdOt = thr_kv.make_fragment_A(sdOt)
        tVrP = thr_kv.make_fragment_B(sP)
        tKrdS = thr_kv.make_fragment_B(sdS)
        rows = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
        s_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 2)
        p_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        dkv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        cute.arch.mbarrier_wait(mbar_kv, 0)
        # step 0: S, dP
        pipe_rows.consumer_wait(rows)
        pipe_s.producer_acquire(s_state)
        self.gemm(mma_s, tS[0], tSrQ[None, None, None, rows.index], tSrK[None, None, None, 0], False)
        self.gemm(mma_s, tdP[0], tSrdO[None, None, None, rows.index], tSrV[None, None, None, 0], False)
        pipe_s.producer_commit(s_state)
        s_state.advance()
        prev = rows.clone()
        rows.advance()
        for i in cutlass.range(1, n_steps, unroll=1):
            # S(i), dP(i) into the other TMEM buffer
            pipe_rows.consumer_wait(rows)
            pipe_s.producer_acquire(s_state)
            acc_S = cute.make_tensor(tS[0].iterator + s_state.index * (TMEM_S[1] - TMEM_S[0]), tS[0].layout)
            acc_dP = cute.make_tensor(tdP[0].iterator + s_state.index * (TMEM_S[1] - TMEM_S[0]), tdP[0].layout)
            self.gemm(mma_s, acc_S, tSrQ[None, None, None, rows.index], tSrK[None, None, None, 0], False)
            self.gemm(mma_s, acc_dP, tSrdO[None, None, None, rows.index], tSrV[None, None, None, 0], False)
            pipe_s.producer_commit(s_state)
            s_state.advance()
            # dV^T, dK^T of step i - 1
            pipe_p.consumer_wait(p_state)
            self.gemm(mma_kv, tdV, tVrdOt[None, None, None, prev.index], tVrP[None, None, None, 0], i > 1)
            self.gemm(mma_kv, tdK, tKrQt[None, None, None, prev.index], tKrdS[None, None, None, 0], i > 1)
            pipe_p.consumer_release(p_state)
            p_state.advance()
            pipe_rows.consumer_release(prev)
            prev = rows.clone()
            rows.advance()
        pipe_p.consumer_wait(p_state)
        self.gemm(mma_kv, tdV, tVrdOt[None, None, None, prev.index], tVrP[None, None, None, 0], n_steps > 1)
        self.gemm(mma_kv, tdK, tKrQt[None, None, None, prev.index], tKrdS[None, None, None, 0], n_steps > 1)
        pipe_p.consumer_release(p_state)
        pipe_rows.consumer_release(prev)
        pipe_dkv.producer_commit(dkv_state)

    # ------------------------------------------------------------------ compute warps
    @cute.jit
    def compute(self, mma_s, tS, tdP, tdV, tdK, sP_st, sdS_st, facts_f, facts_lim, pipe_facts, pipe_s, pipe_p,
                pipe_dkv, bar_compute, outs, blk, n_steps: Int32, softmax_scale: Float32):
        dt = self.dtype
        tidx = cute.arch.thread_idx()[0] % ROWS  # TMEM lane: the tile row (steps), the head dim (epilogue)
        wg = cute.arch.make_warp_uniform(cute.arch.warp_idx()) // 4  # keys [DS_CHUNK wg, DS_CHUNK (wg + 1))
        col0 = wg * DS_CHUNK
        tS_all = tS[0][(None, None), 0, 0]
        chunk = cute.composition(tS_all.layout, cute.make_layout((ROWS, DS_CHUNK)))
        tiled_t2r = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(DS_CHUNK)), Float32),
            cute.make_tensor(tS_all.iterator, chunk))
        thr_t2r = tiled_t2r.get_slice(tidx)
        src0 = thr_t2r.partition_S(cute.make_tensor(tS_all.iterator, chunk))
        ld_shape = thr_t2r.partition_D(cute.make_identity_tensor((ROWS, DS_CHUNK))).shape
        r2s_atom = sm100_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, dt, Float32, tiled_t2r)
        thr_r2s = cute.make_tiled_copy_D(r2s_atom, tiled_t2r).get_slice(tidx)
        dst_p = thr_r2s.partition_D(cute.local_tile(sP_st, (ROWS, DS_CHUNK), (0, wg)))
        dst_ds = thr_r2s.partition_D(cute.local_tile(sdS_st, (ROWS, DS_CHUNK), (0, wg)))
        scale_log2 = softmax_scale * Float32(LOG2_E)
        buf_cols = TMEM_S[1] - TMEM_S[0]
        rows = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
        s_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 2)
        p_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        for i in cutlass.range(n_steps, unroll=1):
            pipe_facts.consumer_wait(rows)
            lse = facts_f[tidx, 0, rows.index]
            delta = facts_f[tidx, 1, rows.index]
            lim = facts_lim[tidx, rows.index]
            pipe_facts.consumer_release(rows)
            rows.advance()
            pipe_s.consumer_wait(s_state)
            rS = cute.make_rmem_tensor(ld_shape, Float32)
            rdP = cute.make_rmem_tensor(ld_shape, Float32)
            base = src0.iterator + s_state.index * buf_cols + col0
            cute.copy(thr_t2r, cute.make_tensor(base, src0.layout), rS)
            cute.copy(thr_t2r, cute.make_tensor(base + BLOCK_SIZE, src0.layout), rdP)
            cute.arch.fence_view_async_tmem_load()
            pipe_s.consumer_release(s_state)
            s_state.advance()
            # P, dS (0 where the key is past the row's limit or the row does not count: selected, not multiplied)
            for k in cutlass.range_constexpr(DS_CHUNK):
                p = cute.math.exp2(rS[k] * scale_log2 - lse, fastmath=True)
                keep = col0 + k < lim
                rS[k] = p if keep else Float32(0.0)
                rdP[k] = p * (rdP[k] - delta) if keep else Float32(0.0)
            pipe_p.producer_acquire(p_state)  # P / dS free: the previous step's dV / dK GEMMs completed
            for src, dst in ((rS, dst_p), (rdP, dst_ds)):
                r16 = cute.make_rmem_tensor(ld_shape, dt)
                r16.store(src.load().to(dt))
                cute.autovec_copy(r16, dst)
            cute.arch.fence_view_async_shared()
            pipe_p.producer_commit(p_state)
            p_state.advance()
        pipe_p.producer_tail(p_state)  # the MMA's last release (a tcgen05.commit arrival)
        # epilogue: this warpgroup's 32 keys of dV^T / dK^T (lane = head dim)
        dkv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipe_dkv.consumer_wait(dkv_state)
        rV = cute.make_rmem_tensor((DS_CHUNK,), Float32)
        rK = cute.make_rmem_tensor((DS_CHUNK,), Float32)
        for acc, regs in ((tdV, rV), (tdK, rK)):
            thr_e, src_e, e_shape = tmem_chunk_copy(acc, self.d, DS_CHUNK, tidx)
            cute.copy(thr_e, cute.make_tensor(src_e.iterator + col0, src_e.layout),
                      cute.make_tensor(regs.iterator, cute.make_layout(e_shape)))
        cute.arch.fence_view_async_tmem_load()
        self.store_keys(outs, rV, rK, blk, tidx, col0, wg, bar_compute, softmax_scale)

    @cute.jit
    def store_keys(self, outs, rV, rK, blk, dim: Int32, key0: Int32, wg: Int32, bar_compute, softmax_scale: Float32):
        """Keys [start + key0, start + key0 + 32) (within [start, end)) of dV and dK (x scale), column ``dim``; with
        segments (Note [key block segments] in bwd_dkdv_sm90.py) segment k waits its turn, adds the fp32 sum of
        segments 0 .. k - 1 and passes it on."""
        mdK, mdV, mdKpart, mdVpart, mSegSem = outs
        n_keys = blk.end - blk.start - key0  # of this warpgroup's keys
        if blk.nseg == 1:
            self.write_keys(mdV, mdK, rV, rK, blk, dim, key0, n_keys, softmax_scale)
        else:
            r, seg = BlockSparseBwdDKDVSm90.segment_ids(self, blk)  # Note [tile-ordered segments]
            sem_addr = (mSegSem.iterator + cute.crd2idx((blk.s, r, blk.h), mSegSem.layout)).toint()
            if dim == 0 and wg == 0:
                cur = ld_acquire_gpu(sem_addr)
                while cur != seg:
                    cur = ld_acquire_gpu(sem_addr)
            bar_compute.arrive_and_wait()
            cute.arch.fence_acq_rel_gpu()
            if seg > 0:
                for k in cutlass.range_constexpr(DS_CHUNK):
                    if k < n_keys:
                        rV[k] = rV[k] + mdVpart[blk.b, blk.start + key0 + k, blk.h, dim]
                        rK[k] = rK[k] + mdKpart[blk.b, blk.start + key0 + k, blk.h, dim]
            if seg == blk.nseg - 1:
                self.write_keys(mdV, mdK, rV, rK, blk, dim, key0, n_keys, softmax_scale)
            else:
                self.write_keys(mdVpart, mdKpart, rV, rK, blk, dim, key0, n_keys, Float32(1.0))
                cute.arch.fence_acq_rel_gpu()
                bar_compute.arrive_and_wait()
                if dim == 0 and wg == 0:
                    red_release_add_gpu(sem_addr, Int32(1))

    @cute.jit
    def write_keys(self, mV, mK, rV, rK, blk, dim: Int32, key0: Int32, n_keys: Int32, k_scale: Float32):
        """rV / rK (x k_scale) to keys [start + key0, start + key0 + n_keys) (at most 32) of ``mV`` / ``mK``
        [B, S, Hkv, D], column ``dim`` (16-bit outputs or the fp32 partials)."""
        for k in cutlass.range_constexpr(DS_CHUNK):
            if k < n_keys:
                mV[blk.b, blk.start + key0 + k, blk.h, dim] = mV.element_type(rV[k])
                mK[blk.b, blk.start + key0 + k, blk.h, dim] = mK.element_type(rK[k] * k_scale)
