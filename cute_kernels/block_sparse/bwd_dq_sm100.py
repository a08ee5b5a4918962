"""BlockSparseBwdDQSm100: Blackwell (sm_100a / sm_103a) dQ of block-sparse attention, query-major, no atomics.

    P   = exp2(S scale log2e - lse log2e),  S = Q K^T          (the forward's plan, blocks and masks)
    dS  = P (dP - delta),   dP = dO V^T,    delta = rowsum(dO * O)  (fp32; written out for the dK/dV kernel)
    dq  = scale * sum over the row tile's blocks of dS K

the math of ``bwd_dq_sm90.py``, on the block-sparse SM100 forward's frame (``fwd_sm100.py``, itself on the dense
SM100 forward's ``run_roles``: the same warps, pipelines and TMEM allocation; Note [SM100 dQ roles]).

* Row tile (one work tile of the persistent schedule): one 128-lane stage of the forward's row tile -- its
  window's ``QS = 128 // GC`` queries x ``GC`` heads of stage ``half`` (the forward runs ``q_stages_sm100``
  stages per window; here each is a work tile of its own, walking the window's whole block list, so the plan
  is the forward's). Q and dO take the two 128-row "Q stage" buffers (one TMA box of (GC, D) per query each).
* Key step = two listed blocks, one (64, D) box each into the halves of a 128-key ring buffer, K then V, as
  the forward loads them (``load_step``; the odd tail repeats the block and masks it).
* TMEM (Note [SM100 dQ TMEM]): two S buffers, dP, dQ. S(n + 1) and dP(n + 1) are computed while the two
  softmax warpgroups (warpgroup w: the step's block w) turn S(n), dP(n) into dS(n), written 16-bit over S(n)'s
  columns each warpgroup read itself; dQ += dS(n) K(n) then takes A from TMEM in two K halves. B of the dQ GEMM
  is K read MN-major: the ring buffer's bytes through the forward's V view (K and V boxes share one geometry,
  ``check_row_slots``).

Masks are the forward's (``mask_block``, Note [block masks] in fwd_sm90.py), rows with lse -inf (no key, no
sink) and idle rows take lse +inf (P = 0, dS = 0, as the SM90 kernel). dq rows are written once each, in the
plan's block order: bitwise reproducible. ``lse`` includes the sink, which needs nothing here.

With ``exact_delta`` delta = rowsum(P dP) from the kernel's own fp32 P and dP instead (Note [SM100 exact delta]).

Note [non-finite keys, SM100 dQ] (NaN / Inf in keys and values a row cannot see; bwd_dq_sm90.py's Note
[non-finite keys a row cannot see]): dS = 0 wherever P = 0 (not P (dP - delta) = 0 * NaN from a non-finite value
row or delta), and before the dQ GEMM multiplies dS = 0 by every K row of the step, each softmax warpgroup zeroes
the non-finite elements of its own block's 64 K rows in shared memory where that block needs masks (the S GEMM
that read them completed: s was committed after dP), fenced for the tensor core before its ds commit, which the
MMA warp waits for before that GEMM; K is released only after it. The ring index of the step's K is counted as
the load warp fills the ring (K, V per step; both sweeps with exact_delta). Flags go to the forward's sScale
buffer, unused here.

Compile-verified only: no Blackwell GPU was available (its math and plan are those of the SM90 dQ kernel, which
runs on the H200; its pipelines those of the SM100 forward). Not supported: the latent.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import tcgen05

from cute_kernels.attention import fwd_sm100 as dense
from cute_kernels.attention.bwd_pre import vec_ptr
from cute_kernels.attention.fwd_sm100 import NUM_THREADS, TILE_M, TILE_N, _slot_state
from cute_kernels.common import nonfinite as nf
from cute_kernels.common.utils import LOG2_E

from .config import BLOCK_SIZE, BwdConfig, FwdConfig, q_stages_sm100, stage_queries_sm100
from .fwd_sm100 import BlockSparseFwdSm100, RowTile, RowTileScheduler

# Note [SM100 dQ roles]
# The dense forward's roles and pipelines (attention/fwd_sm100.py, Note [SM100 handshakes]) with other work:
# * load warp: per row tile Q (q slot 0), K(0), dO (q slot 1), V(0), then K(n), V(n) of each further step.
# * MMA warp, per row tile of n steps (S(n) goes to S buffer n % 2, Note [SM100 dQ TMEM]):
#     S(0); [acquire s] dP(0); commit s; [acquire o: dQ free]
#     per step n < n - 1:  S(n + 1); [acquire s: dP(n) read] dP(n + 1); commit s, release V(n + 1);
#                          [ds full: dS(n) written] dQ += dS(n) K(n), release K(n)
#     release Q, dO; [ds full] dQ += dS(n - 1) K(n - 1), release K(n - 1); commit o
#   so S(n + 1) and dP(n + 1) run while the softmax WGs turn S(n) and dP(n) into dS(n). S(n + 1) needs no
#   acquire: its buffer last held dS(n - 1), which the dQ GEMM issued before it read (tcgen05 MMAs of one
#   thread run in issue order), and the softmax WGs wrote dS(n - 1) before the ds wait that precedes that
#   dQ GEMM. dP has one buffer: dP(n + 1) waits until both softmax WGs released s(n) after loading dP(n).
#   s and o use slot 0 only (states advance by 2: same slot, next phase).
# * softmax warpgroups 0 and 1 (the forward's two Q-stage roles): WG w takes block w of every step (key
#   columns [64 w, 64 w + 64) of S and dP): [s full] loads its S and dP columns, [s release] (256 arrivals, the
#   forward's s count), masks, P, dS; writes dS over its S columns [64 w, 64 w + 32) and arrives on the ds
#   pipeline (the forward's "scale" pipeline, counted 256 here; nobody releases it: a WG's next commit needs
#   s(n + 1) full, committed after the MMA waited for this one, so at most one round is open). Each reads its
#   rows' lse and, from the stats pipeline, delta once per tile.
# * correction warpgroup: each row's delta = rowsum(dO * O) (thread = row) to global memory (every row) and into
#   a stats slot (sRowSum: two slots, one per tile in turn) one tile ahead: the next tile's before this tile's
#   epilogue, so the softmax WGs start a tile without waiting for the previous epilogue; then [o full] dQ *
#   scale from TMEM to the row's (query, head) (zeros for a tile without blocks), [o release]. The MMA acquires
#   o just before a tile's first dQ GEMM, after its S(1) and dP(1).
# * TMEM is freed as in the forward (the correction warps read it last).
#
# Note [SM100 dQ TMEM]: S buffer 0 [0, 128), dP [128, 256), dQ [256, 256 + D), S buffer 1 [384, 512). dS(n) is
# written over S(n)'s buffer, 16-bit pairs, WG w at columns [64 w, 64 w + 32) of it -- columns it read itself,
# so no thread waits for another; the dQ GEMM takes its K dimension in two halves with A from columns [0, 32)
# and [64, 96) of the buffer (``dq_gemm``, ``check_ds_columns``).


# Note [SM100 exact delta]: ``exact_delta`` (why: Note [exact delta] in bwd_dq_sm90.py) walks each row tile's key
# steps twice. The load warp loads K, V of steps 0 .. n - 1 and then again (Q and dO once). First sweep: the MMA
# warp issues S(step) into S buffer step % 2 and dP(step), releasing K and V as soon as they are read (no dQ GEMM);
# S(step) needs no acquire of its own (its buffer's S(step - 2) was read before s(step - 2) was released, which
# the acquire before dP(step - 1) waited for). The softmax WGs wait / release s as in the second sweep, mask,
# take P and add P * dP over their block's 64 columns (key order) into a per-row partial; no dS, no ds commit.
# Then each WG writes its partial to its column of a (128, 2) fp32 buffer (the forward's sRowMax, unused here),
# both WGs pass a named barrier (DELTA_BARRIER, 256 threads), each sums WG 0's + WG 1's, and pass it again before
# the buffer may be reused; WG 0 stores the row's delta (the dK/dV kernel reads it). The second sweep's S(0) is
# issued after an acquire of s (the first sweep's last S / dP read); from there the sweep is the plain one with
# that delta. The correction WG reads no O and computes no delta (the stats pipeline is not used); it writes
# delta 0 for the rows of a tile without blocks. Sums in a fixed order: bitwise reproducible. Two more GEMMs per
# step (S and dP again), as on SM90.


def ring_tiles(sweeps, n_steps):
    """K / V tiles the load warp puts through the ring for a row tile of ``n_steps`` key steps: K, V per step, per
    sweep (Note [SM100 exact delta])."""
    return 2 * n_steps * sweeps


def k_ring_position(kv_count, sweeps, n_steps, step):
    """Position in the ring's fill order of K(step) of the last sweep of a row tile whose first tile is the
    ``kv_count``-th (Note [non-finite keys, SM100 dQ]; ``load``'s order: K(0), V(0), then K, V of each further step
    of each sweep). Plain arithmetic: ints here, Int32 in the kernel (tests/cpu/test_block_sparse_sm100_ring.py
    checks it against the load order)."""
    return kv_count + 2 * ((sweeps - 1) * n_steps + step)


DELTA_UNROLL = 4  # row_delta: 16-byte load pairs in flight per thread (the correction WG's registers are few)
S1_OFFSET = 3 * TILE_N  # TMEM column of S buffer 1 (Note [SM100 dQ TMEM])
#: The forward's pipelines with the dQ kernel's use of "s" (both softmax WGs release), "scale" (ds: both softmax
#: WGs commit, the MMA waits; no releases) and "stats" (delta: the correction WG writes a slot per tile, both
#: softmax WGs release it); the others as the forward's (Note [SM100 dQ roles]).
DQ_PIPES = dict(dense.PIPES, s=("mma", ("softmax", "softmax")), scale=(("softmax", "softmax"), "mma"),
                stats=("correction", ("softmax", "softmax")))
DQ_ARRIVALS = dict(dense.ARRIVALS, scale=(2 * TILE_M, 1), stats=(TILE_M, 2 * TILE_M))
DS_CHUNK = 32  # S / dP columns per TMEM load
#: Named barrier of the two softmax WGs around the exact delta's exchange (Note [SM100 exact delta]); 1 is the
#: dense forward's TmemFree.
DELTA_BARRIER = 2
#: setmaxnreg (softmax 0, softmax 1, correction, other warps), summing to 4 x 128 as the forward's REGS.
DQ_REGS = (176, 176, 88, 72)


@dataclass(frozen=True)
class DqTile(RowTile):
    """A forward row tile's stage ``half`` (``nq``, ``q0``, ``count``: the window's, as the plan has them)."""

    half: Int32


class DqTileScheduler(RowTileScheduler):
    """The forward's schedule with each window split into its ``halves`` stages: (window fastest, stage, kv
    head x head chunk, batch)."""

    def __init__(self, cfg: FwdConfig, tile_m: int, halves: int, *values):
        super().__init__(cfg, tile_m, *values)
        self.halves = halves

    def __new_from_mlir_values__(self, values):
        return DqTileScheduler(self.cfg, self.tile_m, self.halves, *cutlass.new_from_mlir_values(self.values, values))

    @cute.jit
    def work_tile(self, work_idx: Int32) -> DqTile:
        w = work_idx % self.num_tiles
        rest = work_idx // self.num_tiles
        half = rest % self.halves
        t = RowTileScheduler.work_tile(self, (rest // self.halves) * self.num_tiles + w)
        has_rows = half * stage_queries_sm100(self.cfg.group) < t.nq
        return DqTile(t.m_tile, t.keys, has_rows, t.has_keys & has_rows, t.s, t.h, t.b, t.w, t.q0, t.nq, t.count,
                      t.head0, half)


class BlockSparseBwdDQSm100(BlockSparseFwdSm100):
    ARRIVALS = DQ_ARRIVALS
    PIPES = DQ_PIPES
    # The forward's V scrub does not apply: this kernel scrubs K before dQ += dS K (Note [non-finite keys, SM100 dQ]).
    SCRUB_V = False

    def __init__(self, cfg: BwdConfig, sm_count: int = 148):
        if cfg.latent or cfg.head_dim != cfg.head_dim_v:
            raise ValueError(f"{type(self).__name__}: Dk == Dv, no latent (got {cfg})")
        super().__init__(FwdConfig(arch=cfg.arch, dtype=cfg.dtype, head_dim=cfg.head_dim, head_dim_v=cfg.head_dim_v,
                                   group=cfg.group, per_kv_head=cfg.per_kv_head, has_sink=False), sm_count)
        self.bwd = cfg
        self.halves = q_stages_sm100(cfg.group, cfg.head_dim_v)  # the forward's stages per window
        self.sweeps = 2 if cfg.exact_delta else 1  # passes over a tile's steps (Note [SM100 exact delta])
        # The forward's two Q-stage slots hold Q (0) and dO (1); both softmax WGs run (DQ_REGS).
        self.q_stage = 2
        self.tile_m_total = TILE_M
        self.tmem_s_offset = [0, TILE_N]  # S, dP
        self.tmem_o_offset = [2 * TILE_N, 2 * TILE_N + cfg.head_dim]  # dQ (the second is never used)
        assert 2 * TILE_N + cfg.head_dim <= S1_OFFSET and S1_OFFSET + TILE_N <= self.tmem_cols, cfg

    def role_regs(self) -> tuple:
        return DQ_REGS

    @staticmethod
    def kv_stages(cfg) -> int:
        stages = 6
        while stages > 2 and dense._smem_bytes(cfg.head_dim, 2, stages) > dense.SMEM_BYTES_MAX_SM100:
            stages -= 1
        return stages

    @staticmethod
    def smem_bytes(cfg) -> int:
        return dense._smem_bytes(cfg.head_dim, 2, BlockSparseBwdDQSm100.kv_stages(cfg))

    # ------------------------------------------------------------------ host (jit) side
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mdO: cute.Tensor,
                 mLSE: cute.Tensor, mDelta: cute.Tensor, mTileStart: cute.Tensor, mTileMask: cute.Tensor,
                 mTileCount: cute.Tensor, mQLimit: cute.Tensor, mdQ: cute.Tensor, softmax_scale: Float32, stream):
        ops = self.host_operands(mQ, mK, mV, mdO)  # dO rows take Q's boxes
        (tiled_mma_qk, tiled_mma_pv, sQ_layout, sK_layout, sV_layout, tP_layout), q_box, kv_box = ops[:3]
        (atom_q, tma_q), (atom_do, tma_do), (atom_k, tma_k), (atom_v, tma_v) = ops[3:]

        num_tiles = mTileCount.shape[1]
        num_hc = mK.shape[2] * (self.bs.group // self.gc)
        total = num_tiles * self.halves * num_hc * mQ.shape[0]
        grid_x = cutlass.max(cutlass.min(total, Int32(self.sm_count)), Int32(1))
        self.kernel(tiled_mma_qk, tiled_mma_pv, atom_q, tma_q, atom_do, tma_do, atom_k, tma_k, atom_v, tma_v, q_box,
                    kv_box, mO, mdO, mLSE, mDelta, mTileStart, mTileMask, mTileCount, mQLimit, mdQ, sQ_layout,
                    sK_layout, sV_layout, tP_layout, softmax_scale, num_tiles, num_hc, total).launch(
            grid=[grid_x, 1, 1], block=[NUM_THREADS, 1, 1], stream=stream, min_blocks_per_mp=1)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, atom_q: cute.CopyAtom,
               tma_q: cute.Tensor, atom_do: cute.CopyAtom, tma_do: cute.Tensor, atom_k: cute.CopyAtom,
               tma_k: cute.Tensor, atom_v: cute.CopyAtom, tma_v: cute.Tensor, q_box: cute.ComposedLayout,
               kv_box: cute.ComposedLayout, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mDelta: cute.Tensor,
               mTileStart: cute.Tensor, mTileMask: cute.Tensor, mTileCount: cute.Tensor, mQLimit: cute.Tensor,
               mdQ: cute.Tensor, sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, tP_layout: cute.ComposedLayout, softmax_scale: Float32,
               num_tiles: Int32, num_hc: Int32, total: Int32):
        sched = DqTileScheduler(self.bs, self.tile_m_total, self.halves, mTileCount, mQLimit.shape[1], num_tiles,
                                num_hc, total, mTileStart, mTileMask, mQLimit)
        self.kv_box = kv_box  # Note [non-finite keys, SM100 dQ]: a block's (64, D) view of a ring buffer
        self.run_roles(tiled_mma_qk, tiled_mma_pv, sQ_layout, sK_layout, sV_layout, tP_layout, sched, None,
                       (atom_q, atom_do, atom_k, atom_v),
                       (atom_q, tma_q, atom_do, tma_do, atom_k, tma_k, atom_v, tma_v, q_box, kv_box, mTileStart),
                       (mTileStart, mTileMask, mQLimit, mLSE, mDelta, softmax_scale * Float32(LOG2_E)),
                       (mO, mdO, mDelta, mdQ, softmax_scale))

    # ------------------------------------------------------------------ load warp
    @cute.jit
    def load(self, thr_mma_qk, thr_mma_pv, sQ, sK, sV, pipe_q, pipe_kv, sched, args: tuple):
        atom_q, tma_q, atom_do, tma_do, atom_k, tma_k, atom_v, tma_v, q_box, kv_box, mTileStart = args
        d = self.head_dim
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stage)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.kv_stage)
        sQ_base = sQ.iterator
        sKV_base = sK.iterator
        kv_stage_elems = TILE_N * d
        work_idx = sched.first()
        while work_idx < sched.total:
            tile = sched.work_tile(work_idx)
            if tile.has_keys:
                mK_cur = tma_k[None, None, tile.h, tile.b]
                mV_cur = tma_v[None, None, tile.h, tile.b]
                query0 = tile.q0 + tile.half * self.qs
                nq = cutlass.max(cutlass.min(tile.nq - tile.half * self.qs, self.qs), 0)
                # Order (the MMA warp's): Q, K(0), dO, V(0), then K, V of each further step.
                for atom, tma, atom_kv, mKV_cur in ((atom_q, tma_q, atom_k, mK_cur), (atom_do, tma_do, atom_v, mV_cur)):
                    pipe_q.producer_acquire(q_state, expected_tx=nq * self.gc * d * 2)
                    self.load_rows(atom, tma, sQ_base + q_state.index * (TILE_M * d), q_box, tile, query0, nq,
                                   pipe_q.producer_get_barrier(q_state))
                    q_state.advance()
                    self.load_step(atom_kv, mKV_cur, mTileStart, tile, Int32(0), sKV_base, kv_box, kv_stage_elems,
                                   pipe_kv, kv_state)
                    kv_state.advance()
                # then K, V of each further step (exact_delta: of both sweeps, Note [SM100 exact delta])
                for j in cutlass.range(1, tile.keys.n_max * self.sweeps, unroll=1):
                    step = j
                    if const_expr(self.sweeps == 2):
                        if j >= tile.keys.n_max:
                            step = j - tile.keys.n_max
                    self.load_step(atom_k, mK_cur, mTileStart, tile, step, sKV_base, kv_box, kv_stage_elems, pipe_kv,
                                   kv_state)
                    kv_state.advance()
                    self.load_step(atom_v, mV_cur, mTileStart, tile, step, sKV_base, kv_box, kv_stage_elems, pipe_kv,
                                   kv_state)
                    kv_state.advance()
            work_idx = sched.next(work_idx)
        pipe_q.producer_tail(q_state)
        pipe_kv.producer_tail(kv_state)

    # ------------------------------------------------------------------ MMA warp
    def ds_operands(self, thr_mma_pv, tStS, tP_layout):
        """The dQ GEMM's A operand (dS, 16-bit in TMEM) layout, checked for the two K halves (Note [SM100 dQ
        TMEM]); ``ds_views`` places it in a buffer."""
        tP = cute.make_tensor(tStS[0].iterator, tP_layout.outer)
        layout = thr_mma_pv.make_fragment_A(tP)[None, None, None, 0].layout
        check_ds_columns(layout)
        return layout

    def ds_views(self, tmem_ptr, layout, parity):
        """dS of S buffer ``parity`` as the dQ GEMM's A: keys [0, 64) from its columns [0, 32), keys [64, 128)
        from [64, 96)."""
        base = tmem_ptr + self.tmem_s_offset[0] + parity * S1_OFFSET
        return [cute.make_tensor(cute.recast_ptr(base + BLOCK_SIZE * w, dtype=self.dtype), layout) for w in range(2)]

    @cute.jit
    def mma(self, tiled_mma_qk, tiled_mma_pv, thr_mma_qk, thr_mma_pv, sQ, sK, sV, tP_layout, tmem_ptr, tStS, tOtO,
            pipe_q, pipe_kv, pipe_s, pipe_o, sched, pipe_scale=None):
        pipe_ds = pipe_scale  # Note [SM100 dQ roles]
        tSrQ = thr_mma_qk.make_fragment_A(sQ)  # slot 0: Q, slot 1: dO
        tSrK = thr_mma_qk.make_fragment_B(sK)  # K, and V (same geometry), of a ring buffer, K-major
        tQrK = thr_mma_pv.make_fragment_B(sV)  # K of a ring buffer read MN-major (B of dQ += dS K)
        ds_layout = self.ds_operands(thr_mma_pv, tStS, tP_layout)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stage)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stage)
        ds_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stage)
        # s / o: slot 0 only (a producer's first acquire is free)
        s_state = _slot_state(self.q_stage, 0, producer=True)
        o_state = _slot_state(self.q_stage, 0, producer=True)
        work_idx = sched.first()
        while work_idx < sched.total:
            tile = sched.work_tile(work_idx)
            if tile.has_keys:
                q_release = q_state.clone()
                # S(0) into buffer 0, dP(0)
                pipe_q.consumer_wait(q_state)
                q_state.advance()
                pipe_kv.consumer_wait(kv_state)
                k_state = kv_state.clone()
                kv_state.advance()
                self.gemm(tiled_mma_qk, tStS[0], tSrQ[None, None, None, 0], tSrK[None, None, None, k_state.index],
                          False)
                pipe_q.consumer_wait(q_state)
                q_state.advance()
                # dP(0); its acquire: the previous tile's last dP read
                self.dp_gemm(tiled_mma_qk, tStS, tSrQ, tSrK, pipe_kv, kv_state, pipe_s, s_state, True)
                s_state.advance(self.q_stage)
                kv_state.advance()
                if const_expr(self.sweeps == 2):
                    # Note [SM100 exact delta]: the first sweep computes S(step), dP(step) only, and K(step) is
                    # released once read; S(step) goes to buffer step % 2 (that buffer's S(step - 2) was read:
                    # the acquire before dP(step - 1) waited for its release)
                    pipe_kv.consumer_release(k_state)
                    for step in cutlass.range(1, tile.keys.n_max, unroll=1):
                        pipe_kv.consumer_wait(kv_state)  # K(step)
                        acc_s1 = cute.make_tensor(tStS[0].iterator + (step % 2) * S1_OFFSET, tStS[0].layout)
                        self.gemm(tiled_mma_qk, acc_s1, tSrQ[None, None, None, 0],
                                  tSrK[None, None, None, kv_state.index], False)
                        pipe_kv.consumer_release(kv_state)
                        kv_state.advance()
                        # dP(step)
                        self.dp_gemm(tiled_mma_qk, tStS, tSrQ, tSrK, pipe_kv, kv_state, pipe_s, s_state, True)
                        s_state.advance(self.q_stage)
                        kv_state.advance()
                    # the second sweep's S(0) and dP(0), once the softmax WGs read the first sweep's last S / dP
                    pipe_kv.consumer_wait(kv_state)  # K(0) again
                    k_state = kv_state.clone()
                    kv_state.advance()
                    pipe_s.producer_acquire(s_state)
                    self.gemm(tiled_mma_qk, tStS[0], tSrQ[None, None, None, 0], tSrK[None, None, None, k_state.index],
                              False)
                    self.dp_gemm(tiled_mma_qk, tStS, tSrQ, tSrK, pipe_kv, kv_state, pipe_s, s_state, False)  # V(0)
                    s_state.advance(self.q_stage)
                    kv_state.advance()
                for step in cutlass.range(tile.keys.n_max - 1, unroll=1):
                    # S(step + 1) into the other buffer, dP(step + 1) once dP(step) was read
                    parity = step % 2
                    pipe_kv.consumer_wait(kv_state)  # K(step + 1)
                    k_next = kv_state.clone()
                    kv_state.advance()
                    acc_s = cute.make_tensor(tStS[0].iterator + (1 - parity) * S1_OFFSET, tStS[0].layout)
                    self.gemm(tiled_mma_qk, acc_s, tSrQ[None, None, None, 0], tSrK[None, None, None, k_next.index],
                              False)
                    self.dp_gemm(tiled_mma_qk, tStS, tSrQ, tSrK, pipe_kv, kv_state, pipe_s, s_state, True)
                    s_state.advance(self.q_stage)
                    kv_state.advance()
                    # dQ += dS(step) K(step)
                    pipe_ds.consumer_wait(ds_state)
                    ds_state.advance()
                    if step == 0:
                        pipe_o.producer_acquire(o_state)  # dQ free: the previous tile's epilogue read it
                    self.dq_gemm(tiled_mma_pv, tOtO[0], self.ds_views(tmem_ptr, ds_layout, parity),
                                 tQrK[None, None, None, k_state.index], step > 0)
                    pipe_kv.consumer_release(k_state)
                    k_state = k_next
                # Q and dO are no longer read once the last dP completes
                for i in cutlass.range_constexpr(self.q_stage):
                    pipe_q.consumer_release(q_release)
                    q_release.advance()
                pipe_ds.consumer_wait(ds_state)
                ds_state.advance()
                if tile.keys.n_max == 1:
                    pipe_o.producer_acquire(o_state)
                self.dq_gemm(tiled_mma_pv, tOtO[0], self.ds_views(tmem_ptr, ds_layout, (tile.keys.n_max - 1) % 2),
                             tQrK[None, None, None, k_state.index], tile.keys.n_max > 1)
                pipe_kv.consumer_release(k_state)
                pipe_o.producer_commit(o_state)
                o_state.advance(self.q_stage)
            work_idx = sched.next(work_idx)

    @cute.jit
    def dp_gemm(self, tiled_mma_qk, tStS, tSrQ, tSrK, pipe_kv, kv_state, pipe_s, s_state, acquire: cutlass.Constexpr):
        """dP = dO V^T of the step whose V is ``kv_state``'s stage: wait for V, (``acquire``: for the release of the
        previous dP,) issue the GEMM into the dP buffer, commit s (S and dP of the step complete) and release V once
        read. The caller advances both states."""
        pipe_kv.consumer_wait(kv_state)
        if const_expr(acquire):
            pipe_s.producer_acquire(s_state)
        self.gemm(tiled_mma_qk, tStS[1], tSrQ[None, None, None, 1], tSrK[None, None, None, kv_state.index], False)
        pipe_s.producer_commit(s_state)
        pipe_kv.consumer_release(kv_state)

    @cute.jit
    def dq_gemm(self, tiled_mma_pv: cute.TiledMma, acc: cute.Tensor, tQrdS: list, tCrB: cute.Tensor, accumulate):
        """acc (+)= dS K over the step's 128 keys: k-blocks of keys [0, 64) take A from ``tQrdS[0]``, those of
        [64, 128) from ``tQrdS[1]`` (their k-block 0 is the 64th key)."""
        mma = cute.make_tiled_mma(tiled_mma_pv.op)
        per_half = cute.size(tCrB.shape[2]) // 2
        for k in cutlass.range(per_half, unroll=1):
            mma.set(tcgen05.Field.ACCUMULATE, accumulate | (k != 0))
            cute.gemm(mma, acc, tQrdS[0][None, None, k], tCrB[None, None, k], acc)
        for k in cutlass.range(per_half, unroll=1):
            mma.set(tcgen05.Field.ACCUMULATE, True)
            cute.gemm(mma, acc, tQrdS[1][None, None, k], tCrB[None, None, per_half + k], acc)

    # ------------------------------------------------------------------ softmax warpgroups: dS
    def ds_tmem(self, thr_mma_qk, tStS, tidx, block: Int32):
        """This thread's TMEM copies (thread = lane = row): loads of DS_CHUNK fp32 columns of S / dP of the step's
        block ``block`` (chunk c at + DS_CHUNK c), stores of DS_CHUNK // 2 packed 16-bit columns over S."""
        tSAcc = tStS[0][(None, None), 0, 0]  # (128, 128) fp32 at S
        ld = cute.composition(tSAcc, cute.make_layout((TILE_M, DS_CHUNK)))
        st = cute.composition(tSAcc, cute.make_layout((TILE_M, DS_CHUNK // 2)))
        thr_t2r = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(DS_CHUNK)), Float32), ld).get_slice(tidx)
        thr_r2t = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(DS_CHUNK // 2)), Float32),
            st).get_slice(tidx)
        cS = thr_mma_qk.partition_C(cute.make_identity_tensor((TILE_M, TILE_N)))[(None, None), 0, 0]
        ld_shape = thr_t2r.partition_D(cute.composition(cS, cute.make_layout((TILE_M, DS_CHUNK)))).shape
        st_shape = thr_r2t.partition_S(cute.make_identity_tensor((TILE_M, DS_CHUNK // 2))).shape
        src = thr_t2r.partition_S(ld)
        dst = thr_r2t.partition_D(st)
        col = block * BLOCK_SIZE
        return (thr_t2r, cute.make_tensor(src.iterator + self.tmem_s_offset[0] + col, src.layout),
                cute.make_tensor(src.iterator + self.tmem_s_offset[1] + col, src.layout), ld_shape,
                thr_r2t, cute.make_tensor(dst.iterator + self.tmem_s_offset[0] + col, dst.layout), st_shape)

    @cute.jit
    def load_block_cols(self, thr_t2r, src, ld_shape, regs: cute.Tensor):
        """The block's 64 fp32 columns of this thread's row (S or dP) into ``regs`` (64 registers, key order)."""
        for c in cutlass.range_constexpr(BLOCK_SIZE // DS_CHUNK):
            cute.copy(thr_t2r, cute.make_tensor(src.iterator + c * DS_CHUNK, src.layout),
                      cute.make_tensor(regs.iterator + c * DS_CHUNK, cute.make_layout(ld_shape)))

    @cute.jit
    def softmax(self, stage: Int32, thr_mma_qk, tStS, sScale, sRowSum, sRowMax, pipe_s, pipe_scale, pipe_stats,
                sched, args: tuple):
        mTileStart, mTileMask, mQLimit, mLSE, mDelta, scale_log2 = args
        block = stage  # this WG's block of each step
        tidx = cute.arch.thread_idx()[0] % TILE_M
        thr_t2r, src_s, src_dp, ld_shape, thr_r2t, dst_ds, st_shape = self.ds_tmem(thr_mma_qk, tStS, tidx, block)
        s_state = _slot_state(self.q_stage, 0, producer=False)
        ds_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stage)
        pipe_ds = pipe_scale  # Note [SM100 dQ roles]
        stats_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stage)
        seqlen = mQLimit.shape[1]
        # Note [non-finite keys, SM100 dQ]: K / V tiles the ring has taken before this tile; this WG's flag bytes
        kv_count = Int32(0)
        flags = cute.make_tensor(cute.recast_ptr(sScale.iterator + block * (BLOCK_SIZE // 4), dtype=cutlass.Uint8),
                                 cute.make_layout(BLOCK_SIZE))
        k_per_row = nf.threads_per_row(BLOCK_SIZE, self.head_dim, TILE_M, self.dtype)
        work_idx = sched.first()
        while work_idx < sched.total:
            tile = sched.work_tile(work_idx)
            delta = Float32(0.0)
            if const_expr(self.sweeps == 1):
                if tile.has_rows:  # the correction WG's delta slot of every tile with rows
                    pipe_stats.consumer_wait(stats_state)
                    delta = sRowSum[tidx, stats_state.index]
                    pipe_stats.consumer_release(stats_state)
                    stats_state.advance()
            if tile.has_keys:
                ctx = self.row_context(tile, tile.half, tidx, mQLimit, seqlen)
                lse_log2 = Float32.inf  # idle rows: P = 0
                if ctx.bit != 0:
                    v = mLSE[tile.b, tile.head0 + tidx % self.gc, tile.q0 + tile.half * self.qs + tidx // self.gc]
                    if v != -Float32.inf:
                        lse_log2 = v * Float32(LOG2_E)
                if const_expr(self.sweeps == 2):
                    # Note [SM100 exact delta]: the first sweep, this WG's share of each row's sum P * dP
                    part = Float32(0.0)
                    for step in cutlass.range(tile.keys.n_max, unroll=1):
                        start1, bits1, need_mask1 = self.block_facts(ctx, tile, step, block, mTileStart, mTileMask)
                        pipe_s.consumer_wait(s_state)
                        rS1 = cute.make_rmem_tensor((BLOCK_SIZE,), Float32)
                        self.load_block_cols(thr_t2r, cute.make_tensor(src_s.iterator + (step % 2) * S1_OFFSET,
                                                                       src_s.layout), ld_shape, rS1)
                        rdP1 = cute.make_rmem_tensor((BLOCK_SIZE,), Float32)
                        self.load_block_cols(thr_t2r, src_dp, ld_shape, rdP1)
                        cute.arch.fence_view_async_tmem_load()
                        pipe_s.consumer_release(s_state)
                        s_state.advance(self.q_stage)
                        if need_mask1:
                            self.mask_block(rS1.iterator, start1, bits1, ctx)
                        p1 = cute.math.exp2(rS1.load() * scale_log2 - lse_log2, fastmath=True)
                        part = part + (p1 * rdP1.load()).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                    delta = self.exchange_delta(part, block, tidx, sRowMax, tile, mDelta)
                for step in cutlass.range(tile.keys.n_max, unroll=1):
                    start, bits, need_mask = self.block_facts(ctx, tile, step, block, mTileStart, mTileMask)
                    buf = (step % 2) * S1_OFFSET  # S(step)'s buffer (Note [SM100 dQ TMEM])
                    pipe_s.consumer_wait(s_state)
                    rS = cute.make_rmem_tensor((BLOCK_SIZE,), Float32)
                    self.load_block_cols(thr_t2r, cute.make_tensor(src_s.iterator + buf, src_s.layout), ld_shape, rS)
                    rdP = cute.make_rmem_tensor((BLOCK_SIZE,), Float32)
                    self.load_block_cols(thr_t2r, src_dp, ld_shape, rdP)
                    cute.arch.fence_view_async_tmem_load()
                    pipe_s.consumer_release(s_state)  # dP(step) read: dP(step + 1) may be issued
                    s_state.advance(self.q_stage)
                    if need_mask:
                        self.mask_block(rS.iterator, start, bits, ctx)
                    rS.store(cute.math.exp2(rS.load() * scale_log2 - lse_log2, fastmath=True))  # P
                    for k in cutlass.range_constexpr(BLOCK_SIZE):  # dS, 0 where P = 0 (Note [non-finite keys, ...])
                        rdP[k] = Float32(0.0) if rS[k] == Float32(0.0) else rS[k] * (rdP[k] - delta)
                    rdS = cute.make_rmem_tensor((BLOCK_SIZE // 2,), Float32)  # 16-bit pairs
                    rdS_h = cute.make_tensor(cute.recast_ptr(rdS.iterator, dtype=self.dtype),
                                             cute.make_layout(BLOCK_SIZE))
                    rdS_h.store(rdP.load().to(self.dtype))
                    for c in cutlass.range_constexpr(BLOCK_SIZE // DS_CHUNK):
                        cute.copy(thr_r2t, cute.make_tensor(rdS.iterator + c * (DS_CHUNK // 2), cute.make_layout(st_shape)),
                                  cute.make_tensor(dst_ds.iterator + buf + c * (DS_CHUNK // 2), dst_ds.layout))
                    cute.arch.fence_view_async_tmem_store()  # dS visible to the tensor core
                    if need_mask:
                        # Note [non-finite keys, SM100 dQ]: this block's K rows, for the dQ GEMM
                        k_pos = k_ring_position(kv_count, self.sweeps, tile.keys.n_max, step)
                        self.scrub_k_block(k_pos % self.kv_stage, block, flags, tidx, k_per_row)
                    pipe_ds.producer_commit(ds_state)
                    ds_state.advance()
                kv_count += ring_tiles(self.sweeps, tile.keys.n_max)
            work_idx = sched.next(work_idx)

    @cute.jit
    def scrub_k_block(self, stage: Int32, block: Int32, flags: cute.Tensor, tidx: Int32, per_row: cutlass.Constexpr):
        """Note [non-finite keys, SM100 dQ]: zero the non-finite elements of block ``block`` (64 keys) of ring
        buffer ``stage``'s K tile in shared memory, by this warpgroup's 128 threads (the block's (64, D) view the
        load warp's TMA box wrote, ``kv_box``), fenced for the tensor core's async proxy."""
        d = self.head_dim
        base = self.kv_ring.iterator + stage * (TILE_N * d) + block * (BLOCK_SIZE * 64)
        sKb = cute.make_tensor(cute.recast_ptr(base, self.kv_box.inner), self.kv_box.outer)
        nf.scrub_rows(sKb, flags, tidx, TILE_M, per_row)
        cute.arch.fence_view_async_shared()

    @cute.jit
    def block_facts(self, ctx, tile: DqTile, step: Int32, block: Int32, mTileStart: cute.Tensor,
                    mTileMask: cute.Tensor):
        """Block ``block`` of key step ``step``: its start, its query bits (0 past the listed blocks: the odd
        tail's repeated block) and whether it needs masks (Note [block masks] in fwd_sm90.py)."""
        slot = step * 2 + block
        start = mTileStart[tile.s, tile.w, cutlass.min(slot, tile.count - 1)]
        bits = Int32(0)
        if slot < tile.count:
            bits = mTileMask[tile.s, tile.w, slot]
        return start, bits, ((bits & ctx.all_bits) != ctx.all_bits) | (start + BLOCK_SIZE > ctx.min_limit)

    @cute.jit
    def exchange_delta(self, part: Float32, block: Int32, tidx: Int32, sSlots: cute.Tensor, tile: DqTile,
                       mDelta: cute.Tensor) -> Float32:
        """Note [SM100 exact delta]: the row's delta = the two softmax WGs' partial sums (block 0's first), through
        ``sSlots`` (a (TILE_M, 2) fp32 buffer the dQ kernel does not use otherwise) between two barriers of both
        WGs; WG 0 stores it to ``mDelta`` for the row's (query, head) if the row is real."""
        sSlots[tidx, block] = part
        cute.arch.barrier(barrier_id=DELTA_BARRIER, number_of_threads=2 * TILE_M)
        delta = sSlots[tidx, 0] + sSlots[tidx, 1]
        cute.arch.barrier(barrier_id=DELTA_BARRIER, number_of_threads=2 * TILE_M)  # slots free for the next tile
        if block == 0:
            self.store_row_delta(tile, tidx, delta, mDelta)
        return delta

    @cute.jit
    def store_row_delta(self, tile: DqTile, tidx: Int32, delta: Float32, mDelta: cute.Tensor):
        """``delta`` to ``mDelta`` at row ``tidx``'s (query, head) of ``tile``, if the row is real."""
        j = tidx // self.gc
        qi = tile.half * self.qs + j
        if (j < self.qs) & (qi < tile.nq):
            mDelta[tile.b, tile.head0 + tidx % self.gc, tile.q0 + qi] = delta

    # ------------------------------------------------------------------ correction warpgroup: delta, dq
    @cute.jit
    def row_delta(self, mO: cute.Tensor, mdO: cute.Tensor, b: Int32, q: Int32, head: Int32) -> Float32:
        """rowsum(dO * O) of one (query, head) in fp32, 16-byte loads."""
        copy16 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        vec = cute.make_layout((8,))
        acc = Float32(0.0)
        for c in cutlass.range(self.head_dim_v // 8, unroll=DELTA_UNROLL):  # loads in flight vs the WG's registers
            ro = cute.make_rmem_tensor((8,), self.dtype)
            rdo = cute.make_rmem_tensor((8,), self.dtype)
            cute.copy(copy16, cute.make_tensor(vec_ptr(mO, (b, q, head, c * 8)), vec), ro)
            cute.copy(copy16, cute.make_tensor(vec_ptr(mdO, (b, q, head, c * 8)), vec), rdo)
            acc = acc + (ro.load().to(Float32) * rdo.load().to(Float32)).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        return acc

    @cute.jit
    def tile_delta(self, tile: DqTile, tidx: Int32, mO: cute.Tensor, mdO: cute.Tensor, mDelta: cute.Tensor) -> Float32:
        """This thread's row of ``tile``: its delta (0 for an idle row), also stored to ``mDelta``."""
        j = tidx // self.gc
        qi = tile.half * self.qs + j
        q = tile.q0 + qi
        head = tile.head0 + tidx % self.gc
        delta = Float32(0.0)
        if (j < self.qs) & (qi < tile.nq):
            delta = self.row_delta(mO, mdO, tile.b, q, head)
            mDelta[tile.b, head, q] = delta
        return delta

    @cute.jit
    def publish_delta(self, tile: DqTile, tidx: Int32, mO: cute.Tensor, mdO: cute.Tensor, mDelta: cute.Tensor,
                      sRowSum: cute.Tensor, pipe_stats, stats_state):
        """``tile``'s delta of this thread's row (``tile_delta``, also to ``mDelta``) into the stats slot of
        ``stats_state`` for the softmax WGs (Note [SM100 dQ roles]); the caller advances the state."""
        delta = self.tile_delta(tile, tidx, mO, mdO, mDelta)
        pipe_stats.producer_acquire(stats_state)
        sRowSum[tidx, stats_state.index] = delta
        pipe_stats.producer_commit(stats_state)

    @cute.jit
    def correction(self, thr_mma_pv, tOtO, sScale, sRowSum, sRowMax, pipe_s, pipe_scale, pipe_o, pipe_stats, sched,
                   args: tuple):
        mO, mdO, mDelta, mdQ, softmax_scale = args
        tidx = cute.arch.thread_idx()[0] % TILE_M
        tOt_t2r, _, num_chunks = self.o_tmem_copies(thr_mma_pv, tOtO, tidx)
        o_state = _slot_state(self.q_stage, 0, producer=False)
        stats_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stage)
        work_idx = sched.first()
        if const_expr(self.sweeps == 1):
            if work_idx < sched.total:  # the first tile's delta
                first = sched.work_tile(work_idx)
                if first.has_rows:
                    self.publish_delta(first, tidx, mO, mdO, mDelta, sRowSum, pipe_stats, stats_state)
                    stats_state.advance()
        while work_idx < sched.total:
            nxt = sched.next(work_idx)
            if const_expr(self.sweeps == 1):
                if nxt < sched.total:  # the next tile's delta, while this one runs (Note [SM100 dQ roles])
                    ahead = sched.work_tile(nxt)
                    if ahead.has_rows:
                        self.publish_delta(ahead, tidx, mO, mdO, mDelta, sRowSum, pipe_stats, stats_state)
                        stats_state.advance()
            tile = sched.work_tile(work_idx)
            if tile.has_rows:
                j = tidx // self.gc
                qi = tile.half * self.qs + j
                row_ok = (j < self.qs) & (qi < tile.nq)
                if const_expr(self.sweeps == 2):
                    if tile.count == 0:  # no blocks: delta 0 (the softmax WGs write it for tiles with blocks)
                        self.store_row_delta(tile, tidx, Float32(0.0), mDelta)
                if tile.has_keys:
                    pipe_o.consumer_wait(o_state)
                self.store_o_row(tOt_t2r[0], mdQ[tile.b, tile.q0 + qi, tile.head0 + tidx % self.gc, None],
                                 softmax_scale, tile.has_keys, row_ok, num_chunks)
                if tile.has_keys:
                    pipe_o.consumer_release(o_state)  # after the TMEM loads completed
                    o_state.advance(self.q_stage)
            work_idx = nxt


def check_ds_columns(layout) -> None:
    """Trace-time check of ``dq_gemm``'s split: the dS operand's k-block k (16 keys) starts 8 TMEM columns
    (16 16-bit values) after k-block 0, so keys [64, 128) of a view based 64 columns in are that view's k-blocks
    0-3 and the softmax WG of block 1 writes them at columns [64, 96)."""
    blocks = cute.size(layout, mode=[2])
    assert blocks * 16 == TILE_N, f"dS operand: {blocks} k-blocks for {TILE_N} keys ({layout})"
    for k in range(blocks):
        off = cute.crd2idx(((0, 0), 0, k), layout)
        assert off == 16 * k, f"dS operand k-block {k} at 16-bit offset {off}, not {16 * k} ({layout})"
