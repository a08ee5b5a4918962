"""BlockSparseFwdSm100: Blackwell (sm_100a / sm_103a) forward of block-sparse attention, built on the
dense SM100 forward (``attention/fwd_sm100.py``) -- same warp roles, TMEM plan, pipelines, conditional
rescale and P-in-TMEM PV; what differs is where rows and keys come from:

    out[b, t, hq] = sum_c softmax_c(scale * q . k_c [, sink[hq]]) v_c,    lse as in fwd_sm90.py

* Row tile (one work tile of the persistent schedule): ``stages`` Q stages of 128 TMEM lanes, stage ``i``
  holding queries ``q0 + i * QS + j`` (``QS = 128 // GC``, ``j < QS``) x the ``GC`` query heads of one kv
  head chunk, row ``j * GC + head`` (config.py: ``stage_queries_sm100``, ``q_stages_sm100``; the plan's
  window is ``tile_queries(G, arch, Dv)``). Q arrives by one TMA box of (GC, Dk) per query (the row-slot
  layout of the SM90 kernels, Note [query rows by TMA] in indexed/bwd_dkdv_sm90.py, on a 128-row stage).
* Key tile = two listed blocks: the plan lists the union of the tile queries' blocks in ascending start
  order; step ``n`` loads blocks ``2n`` and ``2n + 1`` into the two 64-row halves of one 128-key K (then V)
  ring buffer, one (64, D) TMA box each at the block's start row (rows past S are zero-filled). An odd last
  step loads block ``2n`` into both halves and masks the second one for every row (its V must be finite:
  P = 0 there, and 0 * NaN would not be 0).
* Masks (Note [block masks] in fwd_sm90.py, the same ``common/mask.apply_mask`` call per half): -inf
  where the row's query did not select the block, and on keys ``>= q_limit`` of rows that did; a step
  runs them only when some half needs them (not selected by every tile query, reaching past the tile's
  smallest ``q_limit``, or the odd tail's empty half).
* Epilogue (correction warpgroup): the sink folded into each row's statistics (``fold_sink_row``, shared
  with the SM90 kernel), O / l and lse stored to the row's (query, head); idle rows (past S, past
  ``QS * GC`` of a stage, or past the tile's queries) are never stored.

Note [scrubbed value steps, SM100] (NaN / Inf in values a row cannot see): the dense kernel's scrub (Note
[scrubbed value tiles, SM100] in attention/fwd_sm100.py: warps 14-15 zero a masked V tile's non-finite elements
in shared memory, the softmax makes NaN the P of a row that sees a flagged key) runs on this kernel's steps: a
step is scanned where it needs masks (``needs_mask``, the rule the softmax's ``step_meta`` applies too),
which also covers the odd tail's duplicated block. The scrub warps read the plan from the scheduler.

Blocks are visited in ascending start order and nothing is accumulated across CTAs: out and lse do not
depend on the order of the ids and are bitwise reproducible.

Compile-verified only: no Blackwell GPU was available to run it (its rules are those of the SM90 kernel,
which runs on the H200; its pipelines those of the dense SM100 forward). Not supported
(``config.unsupported_reason``): as the SM90 kernel, and the absorbed-MLA latent (Dk 576 / 512 is wider
than the SM100 Q / K tiles take).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Boolean, Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from cute_kernels.attention.config import FwdConfig as DenseFwdConfig
from cute_kernels.attention.fwd_sm100 import (NUM_THREADS, TILE_M, TILE_N, FlashFwdSm100, TileScheduler,
                                              _slot_state)
from cute_kernels.common.mask import apply_mask
from cute_kernels.common.softmax import OnlineSoftmax
from cute_kernels.common.utils import LOG2_E, select_modes
from cute_kernels.dtypes import cutlass_dtype

from .common import fold_sink_row
from .config import BLOCK_SIZE, FwdConfig, head_chunk, q_stages_sm100, stage_queries_sm100

#: Listed blocks per key step (one 128-key tile of the dense kernel).
BLOCKS_PER_STEP = TILE_N // BLOCK_SIZE


def row_slots(swizzle, rows: int, d: int):
    """Composed layout of ``rows`` consecutive rows of a 128-row SM100 operand buffer (Q stage, or a K / V
    ring buffer: rows 64 elements apart, 64-column chunks 128 * 64 apart; ``check_row_slots``): one TMA box
    (a query's GC head rows, or a 64-key block)."""
    return cute.make_composed_layout(swizzle, 0, cute.make_layout((rows, (64, d // 64)), stride=(64, (1, 64 * TILE_M))))


def check_row_slots(layout, d: int, stages: int, v_major: bool = False):
    """Trace-time check that the tcgen05 buffer ``layout`` (K-major Q / K stages; ``v_major``: the MN-major
    V buffer of the dense kernel, keys along K) places (row, column, stage) at ``row * 64 + column % 64 +
    (column // 64) * 128 * 64 + stage * 128 * d``, the geometry ``row_slots`` assumes."""
    chunks = d // 64
    outer = layout.outer
    for st in range(stages):
        for r in (0, 1, 7, 8, 63, 64, 65, 127):
            for c in sorted({0, 1, 15, 16, 63, d // 2, d - 1}):
                if v_major:
                    n = c % 64 if chunks == 1 else (c % 64, c // 64)
                    crd = ((n, r % 16), 0, r // 16, st)
                else:
                    k = (c // 16) % 4 if chunks == 1 else ((c // 16) % 4, c // 64)
                    crd = ((r, c % 16), 0, k, st)
                want = r * 64 + c % 64 + (c // 64) * 64 * TILE_M + st * TILE_M * d
                assert cute.crd2idx(crd, outer) == want, f"SM100 buffer layout is not the row-slot layout at {(r, c, st)}"


@dataclass(frozen=True)
class StepRange:
    """The key steps of a row tile as the dense roles read a key-tile range: ``n_max - n_min`` steps."""

    n_min: Int32
    n_max: Int32


@dataclass(frozen=True)
class RowTile:
    """One work tile: what the dense MMA / correction roles read (``m_tile`` 0: rows count from the tile's
    first; ``keys``, ``has_rows``, ``has_keys``) and the block-sparse facts."""

    m_tile: Int32
    keys: StepRange
    has_rows: Boolean
    has_keys: Boolean
    s: Int32  # index set of the plan
    h: Int32  # kv head
    b: Int32
    w: Int32  # query tile
    q0: Int32  # first query
    nq: Int32  # real queries of the tile
    count: Int32  # listed blocks
    head0: Int32  # first query head of the chunk


class RowTileScheduler(TileScheduler):
    """Static persistent schedule over (query tile fastest, kv head x head chunk, batch); ``cfg`` is the
    block-sparse FwdConfig."""

    _FIELDS = ("mTileCount", "seqlen", "num_tiles", "num_hc", "total", "mTileStart", "mTileMask", "mQLimit")

    def __init__(self, cfg: FwdConfig, tile_m: int, *values):
        self.cfg = cfg
        self.tile_m = tile_m
        self.values = values
        for name, v in zip(self._FIELDS, values, strict=True):
            setattr(self, name, v)

    def __new_from_mlir_values__(self, values):
        return RowTileScheduler(self.cfg, self.tile_m, *cutlass.new_from_mlir_values(self.values, values))

    @cute.jit
    def work_tile(self, work_idx: Int32) -> RowTile:
        bs = self.cfg  # the block-sparse FwdConfig
        chunks = bs.group // head_chunk(bs.group)
        w = work_idx % self.num_tiles
        hc = (work_idx // self.num_tiles) % self.num_hc
        b = work_idx // (self.num_tiles * self.num_hc)
        h = hc // chunks
        s = b
        if const_expr(bs.per_kv_head):
            s = b * (self.num_hc // chunks) + h
        wq = bs.window_queries
        count = self.mTileCount[s, w]
        return RowTile(Int32(0), StepRange(Int32(0), (count + BLOCKS_PER_STEP - 1) // BLOCKS_PER_STEP), Boolean(True),
                       count > 0, s, h, b, w, w * wq, cutlass.min(self.seqlen - w * wq, wq), count,
                       h * bs.group + (hc - h * chunks) * head_chunk(bs.group))


#: setmaxnreg (softmax 0, softmax 1, correction, other) with two Q stages and a power-of-two head chunk: 8 more per
#: softmax thread than the dense kernel's REGS[2], from the correction warpgroup (the rows' plan facts beside the
#: scrub's wait spilled 16 B at 192 on sm_103a under CUDA 12, d 128, G 8 / 128). G 12 keeps the dense split: its
#: correction warpgroup (rows of 12 heads: divisions by 12) spilled 8-16 B at 56 under CUDA 12.
REGS_TWO_STAGES = (200, 200, 56, 56)


class BlockSparseFwdSm100(FlashFwdSm100):
    # Note [scrubbed value steps, SM100]: the dense kernel's V scrub over this kernel's steps
    SCRUB_V = True

    def role_regs(self) -> tuple:
        if self.q_stage == 2 and self.gc & (self.gc - 1) == 0:
            return REGS_TWO_STAGES
        return super().role_regs()

    def __init__(self, cfg: FwdConfig, sm_count: int = 148):
        if cfg.arch // 10 != 10:
            raise ValueError(f"{type(self).__name__} is the SM100 kernel, got arch {cfg.arch}")
        if cfg.latent or cfg.head_dim != cfg.head_dim_v:
            raise ValueError(f"{type(self).__name__}: Dk == Dv and no latent (got {cfg})")
        dense = DenseFwdConfig(arch=cfg.arch, dtype=cfg.dtype, head_dim=cfg.head_dim, head_dim_v=cfg.head_dim_v,
                               qhead_per_kvhead=1, causal=False, has_window=False, has_softcap=False, block_size=0,
                               varlen=False)
        super().__init__(dense, sm_count)
        self.bs = cfg
        self.gc = head_chunk(cfg.group)
        self.qs = stage_queries_sm100(cfg.group)
        self.wq = cfg.window_queries
        # Q stages: the parent's rule (2 when Dv <= 128), and 1 where a second stage would idle (G <= 4).
        self.q_stage = q_stages_sm100(cfg.group, cfg.head_dim_v)
        self.tile_m_total = self.q_stage * TILE_M
        self.tmem_s_offset = [TILE_N * i for i in range(self.q_stage)]
        self.tmem_o_offset = [TILE_N * self.q_stage + cfg.head_dim_v * i for i in range(self.q_stage)]
        assert self.wq <= self.q_stage * self.qs, (self.wq, self.q_stage, self.qs)

    @staticmethod
    def smem_bytes(cfg: FwdConfig) -> int:
        from cute_kernels.attention import fwd_sm100 as dense

        return dense._smem_bytes(cfg.head_dim, q_stages_sm100(cfg.group, cfg.head_dim_v),
                                 BlockSparseFwdSm100.kv_stages(cfg))

    @staticmethod
    def kv_stages(cfg: FwdConfig) -> int:
        from cute_kernels.attention import fwd_sm100 as dense

        stages = 6
        q_stage = q_stages_sm100(cfg.group, cfg.head_dim_v)
        while stages > 2 and dense._smem_bytes(cfg.head_dim, q_stage, stages) > dense.SMEM_BYTES_MAX_SM100:
            stages -= 1
        return stages

    # ------------------------------------------------------------------ host (jit) side
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mTileStart: cute.Tensor,
                 mTileMask: cute.Tensor, mTileCount: cute.Tensor, mQLimit: cute.Tensor, mSink,
                 mO: cute.Tensor, mLSE: cute.Tensor, softmax_scale: Float32, stream):
        ops = self.host_operands(mQ, mK, mV)
        (tiled_mma_qk, tiled_mma_pv, sQ_layout, sK_layout, sV_layout, tP_layout), q_box, kv_box = ops[:3]
        (atom_q, tma_q), (atom_k, tma_k), (atom_v, tma_v) = ops[3:]

        num_tiles = mTileCount.shape[1]
        num_hc = mK.shape[2] * (self.bs.group // self.gc)
        total = num_tiles * num_hc * mQ.shape[0]
        grid_x = cutlass.max(cutlass.min(total, Int32(self.sm_count)), Int32(1))
        self.kernel(tiled_mma_qk, tiled_mma_pv, atom_q, tma_q, atom_k, tma_k, atom_v, tma_v, q_box, kv_box,
                    mTileStart, mTileMask, mTileCount, mQLimit, mSink, mO, mLSE, sQ_layout, sK_layout, sV_layout,
                    tP_layout, softmax_scale * Float32(LOG2_E), num_tiles, num_hc, total).launch(
            grid=[grid_x, 1, 1], block=[NUM_THREADS, 1, 1], stream=stream, min_blocks_per_mp=1)

    def host_operands(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, *row_tensors):
        """The launch's MMAs and smem layouts (``mmas_and_layouts``, row-slot geometry checked), the Q row box and
        K / V block box, and the TMA (atom, tensor) of mQ and each of ``row_tensors`` (one (GC, D) box per query
        from the (H, D, S, B) view), then of mK and mV (one (64, D) box per block from the (S, D, H, B) views, into
        a half of a 128-key buffer). Sets the dtype, K/V stages, tile byte counts and the shared storage."""
        self.dtype = cutlass_dtype(self.bs.dtype)
        self.kv_stage = self.kv_stages(self.bs)
        d = self.head_dim
        mmas = self.mmas_and_layouts()
        sQ_layout, sK_layout, sV_layout = mmas[2:5]
        check_row_slots(sQ_layout, d, self.q_stage)
        check_row_slots(sK_layout, d, self.kv_stage)
        check_row_slots(sV_layout, d, self.kv_stage, v_major=True)
        q_box = row_slots(sQ_layout.inner, self.gc, d)
        kv_box = row_slots(sK_layout.inner, BLOCK_SIZE, d)
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        rows = [cpasync.make_tiled_tma_atom(g2s, select_modes(m, (2, 3, 1, 0)), q_box, (self.gc, d))
                for m in (mQ, *row_tensors)]
        keys = [cpasync.make_tiled_tma_atom(g2s, select_modes(m, (1, 3, 2, 0)), kv_box, (BLOCK_SIZE, d))
                for m in (mK, mV)]
        self.q_tile_bytes = cute.size_in_bytes(self.dtype, cute.select(sQ_layout, mode=[0, 1, 2]))
        self.k_tile_bytes = cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1, 2]))
        self.v_tile_bytes = self.k_tile_bytes
        self.shared_storage = self.storage_struct(sQ_layout, sK_layout)
        return (mmas, q_box, kv_box, *rows, *keys)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, atom_q: cute.CopyAtom,
               tma_q: cute.Tensor, atom_k: cute.CopyAtom, tma_k: cute.Tensor, atom_v: cute.CopyAtom,
               tma_v: cute.Tensor, q_box: cute.ComposedLayout, kv_box: cute.ComposedLayout, mTileStart: cute.Tensor,
               mTileMask: cute.Tensor, mTileCount: cute.Tensor, mQLimit: cute.Tensor, mSink, mO: cute.Tensor,
               mLSE: cute.Tensor, sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, tP_layout: cute.ComposedLayout, scale_log2: Float32,
               num_tiles: Int32, num_hc: Int32, total: Int32):
        sched = RowTileScheduler(self.bs, self.tile_m_total, mTileCount, mQLimit.shape[1], num_tiles, num_hc, total,
                                 mTileStart, mTileMask, mQLimit)
        self.run_roles(tiled_mma_qk, tiled_mma_pv, sQ_layout, sK_layout, sV_layout, tP_layout, sched, None,
                       (atom_q, atom_k, atom_v), (atom_q, tma_q, atom_k, tma_k, atom_v, tma_v, q_box, kv_box, mTileStart),
                       (mTileStart, mTileMask, mQLimit, scale_log2), (mO, mLSE, mSink, scale_log2))

    # ------------------------------------------------------------------ load warp
    @cute.jit
    def load(self, thr_mma_qk, thr_mma_pv, sQ, sK, sV, pipe_q, pipe_kv, sched, args: tuple):
        atom_q, tma_q, atom_k, tma_k, atom_v, tma_v, q_box, kv_box, mTileStart = args
        d = self.head_dim
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stage)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.kv_stage)
        sQ_base = sQ.iterator
        sKV_base = sK.iterator
        kv_stage_elems = TILE_N * d  # one ring buffer (K and V tiles alike: Dk == Dv)
        work_idx = sched.first()
        while work_idx < sched.total:
            tile = sched.work_tile(work_idx)
            if tile.has_keys:
                mK_cur = tma_k[None, None, tile.h, tile.b]  # (S, D)
                mV_cur = tma_v[None, None, tile.h, tile.b]
                # Order (the MMA warp's): Q0, K(step 0), Q1, V(step 0), then K, V of each further step.
                for i in cutlass.range_constexpr(self.q_stage):
                    nq_i = cutlass.max(cutlass.min(tile.nq - i * self.qs, self.qs), 0)
                    pipe_q.producer_acquire(q_state, expected_tx=nq_i * self.gc * d * 2)
                    self.load_rows(atom_q, tma_q, sQ_base + q_state.index * (TILE_M * d), q_box, tile,
                                   tile.q0 + i * self.qs, nq_i, pipe_q.producer_get_barrier(q_state))
                    q_state.advance()
                    if const_expr(i == 0):
                        self.load_step(atom_k, mK_cur, mTileStart, tile, Int32(0), sKV_base, kv_box, kv_stage_elems,
                                       pipe_kv, kv_state)
                        kv_state.advance()
                self.load_step(atom_v, mV_cur, mTileStart, tile, Int32(0), sKV_base, kv_box, kv_stage_elems, pipe_kv,
                               kv_state)
                kv_state.advance()
                for step in cutlass.range(1, tile.keys.n_max, unroll=1):
                    self.load_step(atom_k, mK_cur, mTileStart, tile, step, sKV_base, kv_box, kv_stage_elems, pipe_kv,
                                   kv_state)
                    kv_state.advance()
                    self.load_step(atom_v, mV_cur, mTileStart, tile, step, sKV_base, kv_box, kv_stage_elems, pipe_kv,
                                   kv_state)
                    kv_state.advance()
            work_idx = sched.next(work_idx)
        # Note [SM100 handshakes] (attention/fwd_sm100.py): wait for the MMA's last tcgen05.commit releases.
        pipe_q.producer_tail(q_state)
        pipe_kv.producer_tail(kv_state)

    @cute.jit
    def load_rows(self, atom, tma_x, s_base, box, tile: RowTile, query0: Int32, nq: Int32, bar):
        """Queries ``query0 .. query0 + nq`` of the tile's head chunk into the 128-row stage at ``s_base``: one
        (GC, D) TMA box per query (row-slot layout, ``row_slots``), completing on ``bar``."""
        d = self.head_dim
        for j in cutlass.range(nq, unroll=1):
            dst = cute.make_tensor(cute.recast_ptr(s_base + j * self.gc * 64, box.inner), box.outer)
            src = cute.local_tile(tma_x[None, None, query0 + j, tile.b], (self.gc, d), (tile.head0 // self.gc, 0))
            tS, tG = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(dst, 0, 2),
                                           cute.group_modes(src, 0, 2))
            cute.copy(atom, tG, tS, tma_bar_ptr=bar)

    @cute.jit
    def load_step(self, atom, mX_cur, mTileStart, tile: RowTile, step: Int32, sKV_base, kv_box, kv_stage_elems: int,
                  pipe_kv, kv_state):
        """K or V of key step ``step``: blocks 2 step and 2 step + 1 (the odd tail: block 2 step again, masked)
        into the halves of the state's ring buffer; the two boxes fill the pipeline's full tile byte count."""
        pipe_kv.producer_acquire(kv_state)
        first = step * BLOCKS_PER_STEP
        for half in cutlass.range_constexpr(BLOCKS_PER_STEP):
            slot = cutlass.min(first + half, tile.count - 1)
            start = mTileStart[tile.s, tile.w, slot]
            dst = cute.make_tensor(
                cute.recast_ptr(sKV_base + kv_state.index * kv_stage_elems + half * BLOCK_SIZE * 64, kv_box.inner),
                kv_box.outer)
            src = cute.local_tile(cute.domain_offset((start, 0), mX_cur), (BLOCK_SIZE, self.head_dim), (0, 0))
            tS, tG = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(dst, 0, 2),
                                           cute.group_modes(src, 0, 2))
            cute.copy(atom, tG, tS, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))

    # ------------------------------------------------------------------ softmax warpgroups
    @cute.jit
    def softmax(self, stage: Int32, thr_mma_qk, tStS, sScale, sRowSum, sRowMax, pipe_s, pipe_scale, pipe_stats,
                sched, args: tuple, scrub=None):
        """``scrub``: the dense softmax's (scrub pipeline, flags, mask), Note [scrubbed value steps, SM100]."""
        mTileStart, mTileMask, mQLimit, scale_log2 = args
        scrub_step = None
        if const_expr(scrub is not None):
            scrub_step = (scrub[0], None, scrub[1], scrub[2])
        tidx, tmem = self.softmax_tmem(stage, thr_mma_qk, tStS)
        s_state = _slot_state(self.q_stage, stage, producer=False)
        scale_state = _slot_state(self.q_stage, stage, producer=True)
        stats_state = _slot_state(self.q_stage, stage, producer=True)
        seqlen = mQLimit.shape[1]
        work_idx = sched.first()
        while work_idx < sched.total:
            tile = sched.work_tile(work_idx)
            if tile.has_keys:
                ctx = self.row_context(tile, stage, tidx, mQLimit, seqlen)
                row_max = Float32(-Float32.inf)
                row_sum = Float32(0.0)
                for step in cutlass.range(tile.keys.n_max, unroll=1):
                    meta, need_mask = self.step_meta(ctx, tile, step, mTileStart, mTileMask)
                    row_max, row_sum = self.softmax_step(
                        step, need_mask, meta, ctx, Int32(0), row_max, row_sum, None, None, stage, tmem, sScale,
                        pipe_s, s_state, pipe_scale, scale_state, scale_log2, Float32(0.0), Float32(0.0),
                        Float32(1.0), tidx, None, scrub_step)
                    s_state.advance(self.q_stage)
                    scale_state.advance(self.q_stage)
                self.publish_row_stats(pipe_stats, stats_state, sRowSum, sRowMax, tidx, stage, row_sum, row_max)
                stats_state.advance(self.q_stage)
            work_idx = sched.next(work_idx)

    @cute.jit
    def row_context(self, tile: RowTile, stage: Int32, tidx: Int32, mQLimit: cute.Tensor, seqlen: Int32):
        """This thread's row of Q stage ``stage``: its query's bit and key limit (0 / 0 for an idle row), and
        the tile's mask facts (Note [block masks] in fwd_sm90.py)."""
        j = tidx // self.gc
        qi = stage * self.qs + j
        live = (j < self.qs) & (qi < tile.nq)
        bit = Int32(0)
        limit = Int32(0)
        if live:
            bit = Int32(1) << qi
            limit = mQLimit[tile.b, tile.q0 + qi]
        all_bits = Int32(-1)
        if tile.nq < 32:
            all_bits = (Int32(1) << tile.nq) - 1
        return SimpleNamespace(bit=bit, limit=limit, min_limit=mQLimit[tile.b, tile.q0], all_bits=all_bits,
                               seqlen=seqlen)

    @cute.jit
    def step_meta(self, ctx, tile: RowTile, step: Int32, mTileStart: cute.Tensor, mTileMask: cute.Tensor):
        """((start, query bits) of the step's two blocks in registers; the odd tail's second block has no
        bits), and whether the step needs masks (some block not selected by every tile query, or reaching
        past the tile's smallest key limit)."""
        meta = cute.make_rmem_tensor((2 * BLOCKS_PER_STEP,), Int32)
        for half in cutlass.range_constexpr(BLOCKS_PER_STEP):
            slot = step * BLOCKS_PER_STEP + half
            start = mTileStart[tile.s, tile.w, cutlass.min(slot, tile.count - 1)]
            bits = Int32(0)
            if slot < tile.count:
                bits = mTileMask[tile.s, tile.w, slot]
            meta[2 * half] = start
            meta[2 * half + 1] = bits
        return meta, self.needs_mask(meta, ctx.all_bits, ctx.min_limit)

    @cute.jit
    def needs_mask(self, meta: cute.Tensor, all_bits: Int32, min_limit: Int32):
        """Note [block masks] for a step's (start, bits) pairs: some block not selected by every tile query
        (``all_bits``) or reaching past the tile's smallest key limit."""
        need = Boolean(False)
        for half in cutlass.range_constexpr(BLOCKS_PER_STEP):
            need = need | ((meta[2 * half + 1] & all_bits) != all_bits) | (meta[2 * half] + BLOCK_SIZE > min_limit)
        return need

    def key_tile(self, tile, step: Int32) -> Int32:
        """This kernel walks its steps in ascending order (the scrub warps' step index)."""
        return step

    @cute.jit
    def v_tile_masked(self, tile: RowTile, n_tile: Int32, sched=None):
        """Note [scrubbed value steps, SM100]: whether step ``n_tile`` needs masks for some row of the tile (the
        scrub warps' test; the plan from ``sched``)."""
        all_bits = Int32(-1)
        if tile.nq < 32:
            all_bits = (Int32(1) << tile.nq) - 1
        ctx = SimpleNamespace(all_bits=all_bits, min_limit=sched.mQLimit[tile.b, tile.q0])
        _meta, need = self.step_meta(ctx, tile, n_tile, sched.mTileStart, sched.mTileMask)
        return need

    @cute.jit
    def mask_scores(self, tSrS: cute.Tensor, meta: cute.Tensor, ctx, row: Int32):
        """Note [block masks] per half of the key tile: keep key c of block (start, bits) iff this row's query
        selected it and start + c < the row's q_limit (and < S); the rule and call of fwd_sm90.mask_block."""
        halves = cute.logical_divide(tSrS, cute.make_layout(BLOCK_SIZE))
        for half in cutlass.range_constexpr(BLOCKS_PER_STEP):
            self.mask_block(halves[None, half].iterator, meta[2 * half], meta[2 * half + 1], ctx)

    @cute.jit
    def mask_block(self, regs, start: Int32, bits: Int32, ctx):
        """One block's 64 scores of this thread's row (registers from ``regs`` on, key order): -inf unless the
        row's query selected the block (``bits``) and start + c < its q_limit (and < S)."""
        last = Int32(-1)
        if (bits & ctx.bit) != 0:
            last = ctx.limit - 1
        view = cute.make_tensor(regs, cute.make_layout((1, BLOCK_SIZE)))
        apply_mask(view, list(range(BLOCK_SIZE)), [last], start, ctx.seqlen, Int32(0), Int32(0), Int32(0), True,
                   True, False)

    # ------------------------------------------------------------------ correction warpgroup
    @cute.jit
    def epilogue_row(self, t2r, args: tuple, row_sum: Float32, row_max: Float32, tile: RowTile, row: Int32,
                     num_chunks: cutlass.Constexpr):
        """Row ``row`` of the tile (stage row0 + lane): the sink folded in, O / l and lse to its (query, head);
        the TMEM loads run in every lane (warp-collective), the stores only for live rows. Ends with
        tcgen05.wait::ld (O may be overwritten after it returns)."""
        mO, mLSE, mSink, scale_log2 = args
        lane = row % TILE_M
        j = lane // self.gc
        qi = (row // TILE_M) * self.qs + j
        head = tile.head0 + lane % self.gc
        row_ok = (j < self.qs) & (qi < tile.nq)
        final = OnlineSoftmax(scale_log2, 1, 1)
        keyless = Int32(0)
        if const_expr(self.bs.has_sink):
            sink = Float32(0.0)
            if row_ok:
                sink = mSink[head]
            row_max, row_sum, keyless = fold_sink_row(row_max, row_sum, sink, scale_log2, Float32(1.0))
        final.row_sum[0] = row_sum
        final.row_max[0] = row_max
        row_scale, row_lse = final.finalize()
        inv_sum = row_scale[0]
        lse = row_lse[0]
        if const_expr(self.bs.has_sink):
            if keyless != 0:
                lse = mSink[head]  # exactly (as fwd_sm90.finish_rows)
        q = tile.q0 + qi
        if row_ok:
            mLSE[tile.b, head, q] = lse
        self.store_o_row(t2r, mO[tile.b, q, head, None], inv_sum, tile.has_keys, row_ok, num_chunks)

