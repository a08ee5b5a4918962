"""FlashFwdSm100: Blackwell (sm_100a) attention forward with fused block_logit.

    S = Q K^T (fp32, TMEM)        P = exp(softmax_scale * S - lse)       O = P V
    lse[i]            = log sum_t exp(logit[i, t])                    (natural log, fp32)
    block_logit[i, j] = max_{t in key block j} logit[i, t]            (-inf: no visible key)
    logit[i, t]       = softmax_scale * q_i.k_t, or softcap * tanh(softmax_scale * q_i.k_t / softcap)

Tensors, shapes and the mask convention (bottom-right causal / window) are those of
``cute_kernels/attention/config.py``; the rules (window bounds, key-tile ranges, masks, sequence
offsets, the online-softmax row rules, softcap) are the ones in ``cute_kernels/common/`` that the SM90
kernel uses too. block_logit columns are relative to each sequence.

One CTA = 512 threads, warp-specialised, persistent over work tiles of ``q_stage * 128`` query rows
of one (batch, head), which every role takes from one ``TileScheduler`` as ``WorkTile`` objects:

    warps 0-3    softmax WG 0: thread t owns query row t of Q stage 0 (TMEM lane t) for all key tiles
    warps 4-7    softmax WG 1: the same for Q stage 1 (idle when q_stage == 1)
    warps 8-11   correction WG: rescales O in TMEM when a row max moved, then the epilogue
                 (O / row_sum -> bf16/fp16 -> global, and lse); warp 8 owns the TMEM allocation
    warp 12      MMA: single-thread tcgen05 issue of S_i = Q_i K^T and O_i += P_i V
    warp 13      load: TMA of Q (once per tile) and of K, V (ring of kv_stage buffers)
    warps 14-15  scrub: zero non-finite values of masked V tiles before their PV (Note [scrubbed value
                 tiles, SM100]); registers given back

    TMEM columns: S_i at 128*i (P_i written over its upper half as 16-bit), O_i at 128*q_stage + dv*i.
    q_stage = 2 for head_dim_v <= 128 (two 128-row Q tiles ping-pong through S_0 / S_1: while the
    softmax WG of one stage works, the tensor core runs the other stage's GEMMs), 1 above.

Cross-role edges, each a ``cutlass.pipeline`` object (slot i = Q stage i; Note [SM100 handshakes]):

    q, kv    load --TMA--> MMA                  (PipelineTmaUmma; K and V tiles share the kv ring)
    s        MMA --S_i full--> softmax_i;  softmax_i + correction --P_i written, O_i ready--> MMA
                                                (PipelineUmmaAsync)
    scale    softmax_i --row rescale factor (smem)--> correction          (PipelineAsync)
    vready   MMA --V tile landed--> scrub                                 (PipelineAsync, every V tile)
    scrub    scrub --V tile scrubbed, key flags--> MMA + softmax_i       (PipelineAsync)
    o        MMA --O_i final--> correction;  correction --O_i read--> MMA  (PipelineUmmaAsync)
    stats    softmax_i --row sum / max (smem)--> correction                (PipelineAsync)

and one named barrier (``FwdBarrier``); arrival counts are checked at trace time against the roles
(``check_arrivals``, common/barriers.py).

Head dims: (64, 64), (128, 128), (192, 192), (256, 256) and (192, 128) (MLA-style prefill: Q / K 192
wide, V / O 128; two Q stages fit TMEM, and K / V tiles share ring buffers sized for K).
Not supported (``unsupported_reason``): other head dims, pack_gqa (query heads are never folded into
M), 2-CTA MMA, split-KV, paged KV.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Boolean, Float32, Int32, Int64, Uint32, const_expr
from cutlass.cute.nvgpu import cpasync, tcgen05

from cute_kernels import arch as _arch
from cute_kernels.common import block_logit as blk
from cute_kernels.common.barriers import check_arrivals, pipeline_counts
from cute_kernels.common import flashmask as fm
from cute_kernels.common import nonfinite as nf
from cute_kernels.common.mask import apply_mask
from cute_kernels.common.math_sm100 import exp2_poly, max_tree
from cute_kernels.common.seqlen import SeqlenInfo
from cute_kernels.common.softmax import OnlineSoftmax, conditional_max, exp2_reference, softcap_logit
from cute_kernels.common.tile_range import TileRange, normalize_window
from cute_kernels.common.trace import EdgeTrace, edge_names, traced_pipes
from cute_kernels.common.utils import LOG2_E

from .config import FwdConfig

# Note [SM100 handshakes]
# Every role walks the same work tiles (TileScheduler) and the same key tiles of each (WorkTile.keys),
# so each pipeline slot sees as many arrivals as waits. Per Q stage i and key step j of a work tile
# with k key tiles (descending key order):
# * s, slot i: the MMA commits S_i(j) (full); softmax_i waits it, loads S, writes P_i(j) and
#   releases; the correction WG releases once per step too ("O_i ready for PV_i(j)": nothing to do at
#   j = 0, O_i rescaled by step j's factor after). So the empty side counts 256 arrivals, and the MMA
#   acquires it before PV_i(j), which reads P_i(j) and accumulates into O_i. Each acquire is the one
#   of the slot's next commit (S_i(j+1), or S_i(0) of the next work tile): S_i(j+1) overwrites S_i / P_i
#   after PV_i(j) in issue order (tcgen05 MMAs of one thread run in order). The MMA's acquire state
#   therefore runs one round ahead of its commit state; the first round of each slot is free.
# * scale, slot i: softmax_i sends one factor per step (1 at j = 0) after S_i(j) full. S_i(j) was
#   committed after PV_i(j-1) was issued and tcgen05.commit tracks all earlier MMAs, so O_i is stable
#   while the correction WG rescales it for step j. The correction WG releases the slot as soon as it
#   has read the factor; softmax_i acquires it before writing the next one.
# * o, slot i: the MMA acquires it (O_i free: the correction WG read O_i of the previous work tile)
#   before PV_i(0) zero-initialises O_i, and commits after PV_i(k-1); the correction WG waits it for
#   the epilogue and releases after its TMEM loads completed (tcgen05.wait::ld). The acquire never
#   waits in practice: s's step-0 arrival of the correction WG comes after that epilogue.
# * stats, slot i: softmax_i writes the row sum / max after its last step, the epilogue reads them.
#   A slot of its own: S_i(0) of the next tile is issued without waiting for the correction WG.
# * Tails: the load warp's producer_tail on q and kv waits for the MMA's last releases, which are
#   tcgen05.commit arrivals landing asynchronously; without it the CTA could exit with an arrival in
#   flight into shared memory the next CTA on the SM already uses. Every other arrival is waited for
#   before the CTA ends (S and O commits by their consumers, thread arrivals are synchronous), so no
#   other tail is needed. The MMA's last acquire on s is the one before its final PV.
# * TMEM is freed after the correction warps (the last TMEM readers: their final wait was on the last
#   PV, which follows every softmax access) meet at FwdBarrier.TmemFree.
# * A role that owns one slot (softmax_i) advances its state by q_stage: same slot, next phase.

# Note [block_logit of unvisited blocks]
# Key tiles outside WorkTile.keys are never loaded: every key in them is masked for every row of the
# tile (causal future, left of the window, past this sequence's keys), so their blocks are -inf by
# definition. The softmax WG writes those entries itself after its key loop (fill_unvisited_by_row,
# coalesced: the flat fill_unvisited spills at head_dim 256 here), and writes all nb entries of rows
# that see no key at all. Visited tiles store every block they cover (fully masked blocks come out
# -inf from the mask), so each entry of [0, nb) of a valid row is written exactly once and no
# pre-fill is needed.
# block_bos builds (document-relative blocks): each row's block grid starts at its own origin, so a
# visited tile stores the blocks that START in it (the row split at its block starts, the part below
# the lowest start carried to the next key tile: common/block_logit.row_relative_maxima in step 4,
# store_relative_row in step 6, where the plain path stores), the last
# visited tile also the carried one, and fill_unvisited_relative writes the blocks no visited key
# tile meets, per row. The same exactly-once argument holds (tests/cpu/test_block_bos_row_plan.py
# replays it); S is split once per entry at the row's start column, so the SM100 path needs no
# per-entry block ids and no cross-lane reduction.

# Conditional rescaling (common/softmax.conditional_max): the running row max only moves when the new
# tile max exceeds it by more than RESCALE_THRESHOLD_LOG2 (log2 units), so most tiles need no O rescale
# and P stays <= 2^8, far inside bf16/fp16 range.
RESCALE_THRESHOLD_LOG2 = 8.0
# exp2 on the FMA pipe (math_sm100.exp2_poly) for EXP2_POLY_OF of every EXP2_POLY_EVERY
# columns of the two middle 32-column chunks of a row (12.5 % of all exp2), MUFU for the rest, so
# both pipes work. FA4 b36 does the same at a similar ratio (freq 16, 4 emulated, first and last
# fragment on MUFU). Not tuned on hardware: no Blackwell GPU was available. 0 disables.
EXP2_POLY_EVERY, EXP2_POLY_OF = 16, 4

SMEM_BYTES_MAX_SM100 = 232_448
TILE_M = 128  # query rows per Q stage (one TMEM lane per row)
TILE_N = 128  # keys per key tile
NUM_THREADS = 512
# Registers per thread after setmaxnreg, per warpgroup (softmax 0, softmax 1, correction, other).
# The sum stays <= 4 * 128 (65,536 registers per SM at 512 threads). With one Q stage the second
# softmax WG idles at the minimum and gives its registers to the softmax and correction WGs; it
# lowers them as the very last statement of the kernel (code after a setmaxnreg.dec branch must
# fit the smaller budget, which made ptxas spill). One Q stage: the softmax WG at 240 (at 232 the CUDA 13 ptxas
# spilled 8 B there for d 256 + causal + softcap + block_logit, bf16; CUDA 12 did not; docs/benchmarks.md, Runs AP).
REGS = {2: (192, 192, 72, 56), 1: (240, 32, 176, 64)}
# d 256 with softcap and document-relative block_logit on blocks of under 32 keys (block_bos, block 16): the softmax
# WG holds the row's 128 scores with their tanh and the 8 + 1 maxima of the row's own block grid at once. At 240
# registers ptxas spilled 32 B (sm_103a, the DSL's CUDA 12 build) and 16 B (sm_100a, CUDA 13), and those two
# compile clean at 256 (the correction WG at 160), where sm_100a under CUDA 12 spills 8 B instead (2026-12-07).
# So the split depends on the (target, ptxas) pair: REGS_BOS_FINE where it is the one that fits
# (``role_regs``), REGS[1] (clean there) on sm_100a CUDA 12 and sm_103a CUDA 13.
REGS_BOS_FINE = (256, 32, 160, 64)
REGS_BOS_FINE_BUILDS = ((100, 13), (103, 12))  # (compute capability, the DSL's CUDA major)
O_CHUNK = 16  # O columns the correction WG moves per TMEM load/store (16 fp32 registers)
HEAD_DIMS = ((64, 64), (128, 128), (192, 192), (256, 256), (192, 128))

_WARPS_SOFTMAX = ((0, 1, 2, 3), (4, 5, 6, 7))
_WARPS_CORRECTION = (8, 9, 10, 11)
_WARP_MMA, _WARP_LOAD = 12, 13


class FwdBarrier(IntEnum):
    """Named barrier ids (0 is __syncthreads)."""

    TmemFree = 1  # the correction threads: every TMEM read done before warp 8 frees the columns


_WARPS_SCRUB = (14, 15)
# Note [scrubbed value tiles, SM100] (NaN / Inf in values a row cannot see; common/nonfinite.py). Inside a
# partially masked key tile the PV multiplies P = 0 by every value row, and 0 * NaN = NaN. So a V tile some
# row of the work tile cannot wholly see (past the first row's causal / window limit, before the last row's
# window start, the sequence's key tail, a FlashMask tile its bounds cut: ``v_tile_masked``) is scrubbed
# before its PV. Every V tile goes through two edges, two slots deep: the MMA warp, once the tile has landed,
# hands it to the scrub warps 14-15 (``vready``; they were idle); they zero a masked tile's non-finite elements
# in shared memory (common/nonfinite.scrub_rows, its flat loop: loading a row's chunks together spilled in their
# 56 registers), fence the async proxy, publish the flagged keys as a bit mask (bit k of word k // 32; zero for
# an unmasked tile) and hand the tile on (``scrub``) to the MMA warp, which waits for it before the tile's PV,
# and to the softmax WGs, which wait for it before storing P and, when a key of the tile is flagged (rare: one
# uniform test per step), store P through a copy of their loop that makes NaN, in the packed 16-bit P, the
# entries that are non-zero on a flagged key: what the unscrubbed tile gives the rows that see it. Compile-verified only (no Blackwell GPU here); the SM90
# forward's scrub (fwd_sm90.py) is the same rule and runs on Hopper. Tried and dropped for registers: reading P
# back from TMEM after storing it, poisoning the fp32 scores (both spilled beside block_bos), loading a row's
# chunks together in the scan (spilled in the scrub warps).
SCRUB_SLOTS = 2

# Roles (common/barriers.py): the threads one signal of each role arrives with. A softmax role is the
# warpgroup of one Q stage; the MMA and load warps signal through one elected thread, except on the
# scrub edges, where the MMA warp's 32 threads arrive ("mma_warp").
ROLE_THREADS = {"softmax": 32 * len(_WARPS_SOFTMAX[0]), "correction": 32 * len(_WARPS_CORRECTION),
                "mma": 1, "load": 1, "mma_warp": 32, "scrub": 32 * len(_WARPS_SCRUB)}
# pipeline -> (roles arriving on its full barrier, roles arriving on its empty barrier)
PIPES = {"q": ("load", "mma"), "kv": ("load", "mma"), "s": ("mma", ("softmax", "correction")),
         "scale": ("softmax", "correction"), "o": ("mma", "correction"), "stats": ("softmax", "correction")}
BARRIERS = {FwdBarrier.TmemFree: ("correction",)}
# The counts the kernel initialises its barriers with, (full, empty) per pipeline slot, and the
# threads of each named barrier; check_arrivals compares them with ROLE_THREADS / PIPES at trace time.
ARRIVALS = {"q": (1, 1), "kv": (1, 1), "s": (1, 2 * TILE_M), "scale": (TILE_M, TILE_M),
            "o": (1, TILE_M), "stats": (TILE_M, TILE_M)}
NAMED_THREADS = {FwdBarrier.TmemFree: 4 * 32}
# The scrub edges (Note [scrubbed value tiles, SM100]); the consumers of ``scrub``: the MMA warp and every
# softmax WG (one per Q stage).
SCRUB_PIPES = {"vready": ("mma_warp", "scrub")}


def scrub_pipes(q_stage: int) -> dict:
    return dict(SCRUB_PIPES, scrub=("scrub", ("mma_warp",) + ("softmax",) * q_stage))


def scrub_arrivals(q_stage: int) -> dict:
    return {"vready": (32, 32 * len(_WARPS_SCRUB)),
            "scrub": (32 * len(_WARPS_SCRUB), 32 + q_stage * TILE_M)}


# Edge trace of a traced build (common/trace.py): role slots and the edges they wait on.
TRACE_ROLES = ("softmax0", "softmax1", "correction", "mma", "load", "scrub")
TRACE_EDGES = edge_names(PIPES) + ["tmem_free"] + edge_names(scrub_pipes(2))


def _q_stage(cfg: FwdConfig) -> int:
    # TMEM has 512 columns: q_stage * (TILE_N + head_dim_v) must fit.
    return 2 if cfg.head_dim_v <= 128 else 1


def _smem_bytes(head_dim: int, q_stage: int, kv_stage: int) -> int:
    """Upper bound of the SharedStorage size: barriers and row stats, then sQ and the K/V ring
    (each 1024-B aligned; a ring buffer holds a K tile, V tiles are no wider), plus 1024 B in case
    the dynamic smem base needs aligning."""
    small = 8 * (2 * q_stage + 2 * kv_stage + 8 * q_stage) + 4 + 3 * q_stage * TILE_M * 4
    small += 8 * 4 * SCRUB_SLOTS + 16 + SCRUB_SLOTS * (TILE_N + 4)  # scrub barriers, flags (Note [scrubbed ...])
    q_bytes = q_stage * TILE_M * head_dim * 2
    kv_bytes = kv_stage * TILE_N * head_dim * 2
    return 1024 + ((small + 1023) // 1024) * 1024 + q_bytes + kv_bytes


def _kv_stage(cfg: FwdConfig) -> int:
    """Most K/V ring buffers (K and V tiles share it) that fit, between 2 and 6."""
    stages = 6
    while stages > 2 and _smem_bytes(cfg.head_dim, _q_stage(cfg), stages) > SMEM_BYTES_MAX_SM100:
        stages -= 1
    return stages


# Note [FlashMask gap tiles, SM100]
# fm_meta's row for a work tile (FmQueryRanges, built with this kernel's q_stage x 128 rows) holds the first and
# last live key tile, the prefix counts of live tiles and their ascending list. The scheduler narrows every work
# tile to [first, last + 1); without block_logit every role (load, MMA, softmax, correction, scrub) then walks
# only the live tiles of that range, highest first (``key_steps`` / ``key_tile``), so key tiles the column
# bounds skip inside it (a share-question or multi-segment prefix-LM mask leaves such gaps) are neither loaded
# nor computed. With block_logit the whole range is walked: the softmax fills the blocks of unvisited tiles by
# range (Note [block_logit of unvisited blocks]), and a skipped tile's blocks come out -inf from the mask. The
# SM90 forward does the same (``fm_gap_skip`` there, run on an H100); here compile-verified only.


def fm_gap_skip(cfg: FwdConfig) -> bool:
    """Note [FlashMask gap tiles, SM100]: whether the roles walk only fm_meta's live key tiles."""
    return cfg.has_startend and not cfg.has_block_logit


def _slot_state(q_stage: int, slot, producer: bool) -> pipeline.PipelineState:
    """State of a role that owns one slot of a q_stage-slot pipeline (softmax_i: slot i). Advance it
    by q_stage: the same slot, the next phase. Producers start at phase 1 (the first acquire is free)."""
    return pipeline.PipelineState(q_stage, Int32(0), Int32(slot), Int32(1 if producer else 0))


# ---------------------------------------------------------------------------------- work tiles
@dataclass(frozen=True)
class WorkTile:
    """One work tile, ``q_stage * 128`` query rows of one (batch, head): the facts every role reads."""

    m_tile: Int32
    head: Int32
    batch: Int32
    seqlen: SeqlenInfo
    left: Int32  # window reach from normalize_window (the unbounded side covers the sequence)
    right: Int32
    keys: TileRange  # key tiles [n_min, n_max) that some row of the tile sees, and the mask limits
    has_rows: Boolean  # the tile starts inside its sequence
    has_keys: Boolean  # ... and sees a key: only these tiles load and compute (others: empty rows)
    fm_bounds: object = None  # FlashMask: the mask head's column bounds (Sk, n), else None
    fm_minmax: object = None  # ... and their per key tile min / max (NT, 2n) (attention/fm_meta.py)
    # Note [FlashMask gap tiles, SM100] (no block_logit): the work tile's fm_meta row, the index in it of the
    # highest live key tile of [n_min, n_max) and how many live tiles there are (the roles' key steps)
    fm_ranges: object = None
    fm_top: object = None
    fm_steps: object = None


class TileScheduler:
    """Static persistent schedule: CTA b runs work indices b, b + grid, ... below ``total``. Index ->
    (m_tile fastest, head, batch); with a causal mask the longest query tiles of a (batch, head) run
    first. Built once in the kernel; every role calls ``work_tile`` on the same indices."""

    _FIELDS = ("mCuSeqlensQ", "mCuSeqlensK", "seqlen_q_static", "seqlen_k_static", "window_left",
               "window_right", "num_m_tiles", "num_heads", "total", "mStartend", "mFmMinMax", "mFmRanges",
               "fm_head_div")

    def __init__(self, cfg: FwdConfig, tile_m: int, *values):
        self.cfg = cfg
        self.tile_m = tile_m
        self.values = values  # the runtime fields, in _FIELDS order
        for name, v in zip(self._FIELDS, values, strict=True):
            setattr(self, name, v)
        self.mask_right = cfg.causal or cfg.has_window
        self.mask_left = cfg.has_window
        self.fm_gap_skip = fm_gap_skip(cfg)

    # The roles' persistent loops carry the scheduler: the DSL rebuilds it from its runtime values.
    def __extract_mlir_values__(self):
        return cutlass.extract_mlir_values(self.values)

    def __new_from_mlir_values__(self, values):
        return TileScheduler(self.cfg, self.tile_m, *cutlass.new_from_mlir_values(self.values, values))

    def first(self) -> Int32:
        return Int32(cute.arch.block_idx()[0])

    def next(self, work_idx: Int32) -> Int32:
        return work_idx + Int32(cute.arch.grid_dim()[0])

    @cute.jit
    def work_tile(self, work_idx: Int32) -> WorkTile:
        m_tile = work_idx % self.num_m_tiles
        bh = work_idx // self.num_m_tiles
        head = bh % self.num_heads
        batch = bh // self.num_heads
        if const_expr(self.cfg.causal):
            m_tile = self.num_m_tiles - 1 - m_tile
        seqlen = SeqlenInfo.create(batch, self.seqlen_q_static, self.seqlen_k_static, self.mCuSeqlensQ,
                                   self.mCuSeqlensK)
        left, right = normalize_window(self.window_left, self.window_right, seqlen.seqlen_q, seqlen.seqlen_k,
                                       self.cfg.causal, self.cfg.has_window)
        m_start = m_tile * self.tile_m
        keys = TileRange.create(m_start, seqlen.seqlen_q, seqlen.seqlen_k, left, right, self.tile_m, TILE_N,
                                self.mask_right, self.mask_left)
        fm_bounds = fm_minmax = fm_ranges = fm_top = fm_steps = None
        if const_expr(self.cfg.has_startend):
            # FlashMask: every role walks the key tiles the column bounds do not skip for the tile's rows
            # (fm_meta.FmQueryRanges with this kernel's tile_m), so load, MMA and softmax stay in step.
            mh = head // self.fm_head_div
            rng = self.mFmRanges[batch, mh, m_tile, None]
            keys = fm.narrow_tile_range(keys, rng[0], rng[1])
            fm_bounds = self.mStartend[batch, mh, None, None]
            fm_minmax = self.mFmMinMax[batch, mh, None, None]
            if const_expr(self.fm_gap_skip):
                # Note [FlashMask gap tiles, SM100]: the live tiles of [n_min, n_max) from the row's prefix
                # counts (rng[2 + n]: live tiles below n) and its ascending list (from rng[3 + NT])
                p_lo = rng[2 + cutlass.min(keys.n_min, keys.n_max)]
                p_hi = rng[2 + keys.n_max]
                fm_ranges = rng
                fm_steps = cutlass.max(p_hi - p_lo, 0)
                fm_top = 3 + self.mFmMinMax.shape[2] + p_hi - 1
        has_rows = m_start < seqlen.seqlen_q
        has_keys = has_rows & (keys.n_min < keys.n_max)
        if const_expr(self.fm_gap_skip):
            has_keys = has_rows & (fm_steps > 0)
        return WorkTile(m_tile, head, batch, seqlen, left, right, keys, has_rows, has_keys, fm_bounds, fm_minmax,
                        fm_ranges, fm_top, fm_steps)

    @cute.jit
    def stage_keys(self, tile: WorkTile, stage: Int32) -> TileRange:
        """The key-tile range and mask limits of Q stage ``stage`` (its 128 rows) of ``tile``."""
        return TileRange.create(tile.m_tile * self.tile_m + stage * TILE_M, tile.seqlen.seqlen_q,
                                tile.seqlen.seqlen_k, tile.left, tile.right, TILE_M, TILE_N,
                                self.mask_right, self.mask_left)


class FlashFwdSm100:
    """Blackwell forward kernel for one ``FwdConfig`` (compile key); see the module docstring."""

    #: pipeline -> (full, empty) arrival counts and its roles (module ARRIVALS / PIPES; a kernel built on
    #: this one may give a pipeline another use).
    ARRIVALS = ARRIVALS
    PIPES = PIPES
    #: Note [scrubbed value tiles, SM100] (a kernel built on this one that does not walk key tiles the same
    #: way turns it off)
    SCRUB_V = True

    def __init__(self, cfg: FwdConfig, sm_count: int = 148):
        reason = self.unsupported_reason(cfg)
        if reason is not None:
            raise ValueError(f"FlashFwdSm100: {reason}")
        self.cfg = cfg
        self.sm_count = int(sm_count)
        self.exp2_emulation = _arch.exp2_emulation(cfg.arch)  # off on 10.3 (faster MUFU.EX2)
        self.q_stage = _q_stage(cfg)
        self.kv_stage = _kv_stage(cfg)
        self.head_dim = cfg.head_dim
        self.head_dim_v = cfg.head_dim_v
        self.tile_m_total = self.q_stage * TILE_M
        self.tmem_s_offset = [TILE_N * i for i in range(self.q_stage)]
        self.tmem_o_offset = [TILE_N * self.q_stage + cfg.head_dim_v * i for i in range(self.q_stage)]
        self.tmem_p_offset = TILE_N // 2  # P_i (16-bit, packed in pairs) over the upper half of S_i
        self.tmem_cols = 512
        # block_logit bookkeeping (shared with SM90): one thread owns a whole S row, so
        # rows_per_thread = threads_per_row = 1 and no cross-lane reduction is needed.
        self.bl_shape = blk.BlockLogitShape(TILE_N, cfg.block_size, 1, 1) if cfg.has_block_logit else None
        self.bos_shape = blk.RowRelativeShape(TILE_N, cfg.block_size) if cfg.block_bos else None
        self.fm_gap_skip = fm_gap_skip(cfg)
        if self.SCRUB_V:
            self.PIPES = dict(self.PIPES, **scrub_pipes(self.q_stage))
            self.ARRIVALS = dict(self.ARRIVALS, **scrub_arrivals(self.q_stage))

    # ------------------------------------------------------------------ host-side facts
    @staticmethod
    def unsupported_reason(cfg: FwdConfig) -> str | None:
        if _arch.family(cfg.arch) != 100:
            return f"arch {cfg.arch} is not SM100"
        if cfg.dtype not in ("bfloat16", "float16"):
            return f"dtype {cfg.dtype} (bfloat16/float16 only)"
        if (cfg.head_dim, cfg.head_dim_v) not in HEAD_DIMS:
            if cfg.head_dim == cfg.head_dim_v or cfg.head_dim not in (64, 128, 192, 256):
                return f"head_dim {cfg.head_dim} (SM100 kernel supports 64, 128, 192, 256)"
            return (f"head_dim_v {cfg.head_dim_v} with head_dim {cfg.head_dim} (SM100 kernel: equal head "
                    f"dims, or 192 with head_dim_v 128)")
        if cfg.block_size not in (0, 16, 32, 64, 128, 256):
            return f"block_size {cfg.block_size} (0, 16, 32, 64, 128 or 256)"
        if cfg.qhead_per_kvhead < 1:
            return f"qhead_per_kvhead {cfg.qhead_per_kvhead}"
        if cfg.has_startend and cfg.varlen:
            return "FlashMask startend_row_indices with varlen"
        if cfg.block_bos and (cfg.varlen or not cfg.has_block_logit):
            return "block_bos needs block_logit on a dense (not varlen) call"
        return None

    def role_regs(self) -> tuple:
        """setmaxnreg per warpgroup (softmax 0, softmax 1, correction, other): ``REGS[q_stage]``, or
        ``REGS_BOS_FINE`` for the d 256 softcap block_bos builds on blocks under 32 keys on the targets and DSL
        builds where that split is the one that fits (``REGS_BOS_FINE_BUILDS``)."""
        cfg = self.cfg
        fine = (self.q_stage == 1 and cfg.block_bos and cfg.head_dim == 256 and cfg.has_softcap
                and cfg.block_size < 32)
        if fine and (cfg.arch, _arch.dsl_cuda()) in REGS_BOS_FINE_BUILDS:
            return REGS_BOS_FINE
        return REGS[self.q_stage]

    @staticmethod
    def smem_bytes(cfg: FwdConfig) -> int:
        """Dynamic shared memory of the launch (an upper bound, see ``_smem_bytes``), in bytes."""
        return _smem_bytes(cfg.head_dim, _q_stage(cfg), _kv_stage(cfg))

    def mmas_and_layouts(self):
        """(tiled MMA of S = Q K^T, of O += P V, and the sQ / sK / sV / tP layouts): one Q stage is a 128 x Dk
        K-major tile, a K/V ring buffer a 128-key tile (V MN-major), P the 16-bit TMEM operand of PV."""
        cta_group = tcgen05.CtaGroup.ONE
        mma_tiler_qk = (TILE_M, TILE_N, self.head_dim)
        mma_tiler_pv = (TILE_M, self.head_dim_v, TILE_N)
        tiled_mma_qk = sm100_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
            Float32, cta_group, mma_tiler_qk[:2])
        tiled_mma_pv = sm100_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN,
            Float32, cta_group, mma_tiler_pv[:2], tcgen05.OperandSource.TMEM)

        sQ_layout = sm100_utils.make_smem_layout_a(tiled_mma_qk, mma_tiler_qk, self.dtype, self.q_stage)
        sK_layout = sm100_utils.make_smem_layout_b(tiled_mma_qk, mma_tiler_qk, self.dtype, self.kv_stage)
        sV_layout = sm100_utils.make_smem_layout_b(tiled_mma_pv, mma_tiler_pv, self.dtype, self.kv_stage)
        if const_expr(self.head_dim_v != self.head_dim):
            # K and V tiles take turns in the same ring buffers: V's buffers use K's (larger) stride.
            outer = sV_layout.outer
            k_stride = sK_layout.outer.stride[-1]
            sV_layout = cute.make_composed_layout(
                sV_layout.inner, 0, cute.make_layout((*outer.shape[:-1], self.kv_stage),
                                                     stride=(*outer.stride[:-1], k_stride)))
        tP_layout = sm100_utils.make_smem_layout_a(tiled_mma_pv, mma_tiler_pv, self.dtype, 1)
        return tiled_mma_qk, tiled_mma_pv, sQ_layout, sK_layout, sV_layout, tP_layout

    def storage_struct(self, sQ_layout, sK_layout):
        """The shared-storage struct: barriers, the TMEM address, row stats, sQ and the K/V ring."""
        q_stage, kv_stage = self.q_stage, self.kv_stage
        fields = {f"bar_{name}": cute.struct.MemRange[Int64, 2 * n]
                  for name, n in (("q", q_stage), ("kv", kv_stage), ("s", q_stage), ("scale", q_stage),
                                  ("o", q_stage), ("stats", q_stage))}
        if self.SCRUB_V:  # Note [scrubbed value tiles, SM100]
            fields.update({f"bar_{name}": cute.struct.MemRange[Int64, 2 * SCRUB_SLOTS] for name in ("vready", "scrub")})
            fields["scrub_flags"] = cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, SCRUB_SLOTS * TILE_N], 16]
            fields["scrub_mask"] = cute.struct.Align[cute.struct.MemRange[cutlass.Uint32, SCRUB_SLOTS * 4], 16]
        fields["tmem_holding"] = Int32
        fields.update({name: cute.struct.MemRange[Float32, q_stage * TILE_M] for name in ("sScale", "sRowSum", "sRowMax")})
        fields.update({name: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layout)], 1024]
                       for name, layout in (("sQ", sQ_layout), ("sK", sK_layout))})
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    # ------------------------------------------------------------------ host (jit) side
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, mBlockLogit, mCuSeqlensQ, mCuSeqlensK,
                 softmax_scale: Float32, softcap: Float32, window_left: Int32, window_right: Int32,
                 max_seqlen_q: Int32, stream, trace_addr=None, mStartend=None, mFmMinMax=None, mFmRanges=None,
                 mBlockBos=None):
        """``trace_addr``: the edge-trace array (common/trace.py) of a traced build, else None.
        ``mStartend``/``mFmMinMax``/``mFmRanges``: the FlashMask tensors (config.py) of a ``startend`` build;
        ``mBlockBos``: the row origins [B, Sq] of a ``block_bos`` build."""
        cfg = self.cfg
        self.dtype = mQ.element_type
        varlen = const_expr(mCuSeqlensQ is not None)
        # Re-view as (seq, dim, head[, batch]); V as (dim, seq, head[, batch]) (MN-major B operand).
        qo_modes = [0, 2, 1] if const_expr(varlen) else [1, 3, 2, 0]
        v_modes = [2, 0, 1] if const_expr(varlen) else [3, 1, 2, 0]
        mQ = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=qo_modes))
        mK = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=qo_modes))
        mV = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=v_modes))
        mO = cute.make_tensor(mO.iterator, cute.select(mO.layout, mode=qo_modes))
        # lse -> (seq, head[, batch]); block_logit -> (seq, nb, head[, batch])
        mLSE = cute.make_tensor(mLSE.iterator, cute.select(mLSE.layout, mode=[1, 0] if const_expr(varlen) else [2, 1, 0]))
        if const_expr(mBlockLogit is not None):
            bl_modes = [1, 2, 0] if const_expr(varlen) else [2, 3, 1, 0]
            mBlockLogit = cute.make_tensor(mBlockLogit.iterator, cute.select(mBlockLogit.layout, mode=bl_modes))

        tiled_mma_qk, tiled_mma_pv, sQ_layout, sK_layout, sV_layout, tP_layout = self.mmas_and_layouts()
        mma_tiler_qk = (TILE_M, TILE_N, self.head_dim)
        mma_tiler_pv = (TILE_M, self.head_dim_v, TILE_N)
        cta_group = tcgen05.CtaGroup.ONE
        tma_op = cpasync.CopyBulkTensorTileG2SOp(cta_group)
        cluster_vmnk = (1, 1, 1, 1)
        tma_atom_Q, tma_Q = cute.nvgpu.make_tiled_tma_atom_A(
            tma_op, mQ, cute.select(sQ_layout, mode=[0, 1, 2]), mma_tiler_qk, tiled_mma_qk, cluster_vmnk)
        tma_atom_K, tma_K = cute.nvgpu.make_tiled_tma_atom_B(
            tma_op, mK, cute.select(sK_layout, mode=[0, 1, 2]), mma_tiler_qk, tiled_mma_qk, cluster_vmnk)
        tma_atom_V, tma_V = cute.nvgpu.make_tiled_tma_atom_B(
            tma_op, mV, cute.select(sV_layout, mode=[0, 1, 2]), mma_tiler_pv, tiled_mma_pv, cluster_vmnk)
        self.q_tile_bytes = cute.size_in_bytes(self.dtype, cute.select(sQ_layout, mode=[0, 1, 2]))
        self.k_tile_bytes = cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1, 2]))
        self.v_tile_bytes = cute.size_in_bytes(self.dtype, cute.select(sV_layout, mode=[0, 1, 2]))

        self.shared_storage = self.storage_struct(sQ_layout, sK_layout)

        # Scales: without softcap S stays raw q.k and the scale lives in the exp2 FMA; with softcap
        # the softmax warps turn S into the scaled logit first, so the exp2 scale is log2(e).
        if const_expr(cfg.has_softcap):
            scale_log2 = Float32(LOG2_E)
            softcap_in = softmax_scale / softcap
            logit_scale = Float32(1.0)
        else:
            scale_log2 = softmax_scale * Float32(LOG2_E)
            softcap_in = Float32(0.0)
            logit_scale = softmax_scale

        if const_expr(varlen):
            num_batch = mCuSeqlensQ.shape[0] - 1
        else:
            num_batch = mQ.shape[3]
        num_heads = mQ.shape[2]
        num_m_tiles = (max_seqlen_q + self.tile_m_total - 1) // self.tile_m_total
        total_tiles = num_m_tiles * num_heads * num_batch
        grid_x = cutlass.min(total_tiles, Int32(self.sm_count))
        grid_x = cutlass.max(grid_x, Int32(1))

        fm_head_div = Int32(1)
        if const_expr(cfg.has_startend):
            fm_head_div = num_heads // mStartend.shape[1]  # query heads per mask head
        self.kernel(
            tiled_mma_qk, tiled_mma_pv, tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V,
            mO, mLSE, mBlockLogit, mCuSeqlensQ, mCuSeqlensK,
            sQ_layout, sK_layout, sV_layout, tP_layout,
            scale_log2, softcap_in, softcap, logit_scale, window_left, window_right,
            num_m_tiles, num_heads, total_tiles, trace_addr, mStartend, mFmMinMax, mFmRanges, fm_head_div,
            mBlockBos,
        ).launch(grid=[grid_x, 1, 1], block=[NUM_THREADS, 1, 1], stream=stream, min_blocks_per_mp=1)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
               tma_atom_Q: cute.CopyAtom, mQ: cute.Tensor, tma_atom_K: cute.CopyAtom, mK: cute.Tensor,
               tma_atom_V: cute.CopyAtom, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
               mBlockLogit, mCuSeqlensQ, mCuSeqlensK,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, tP_layout: cute.ComposedLayout,
               scale_log2: Float32, softcap_in: Float32, softcap: Float32, logit_scale: Float32,
               window_left: Int32, window_right: Int32,
               num_m_tiles: Int32, num_heads: Int32, total_tiles: Int32, trace_addr, mStartend, mFmMinMax,
               mFmRanges, fm_head_div: Int32, mBlockBos):
        sched = TileScheduler(self.cfg, self.tile_m_total, mCuSeqlensQ, mCuSeqlensK, mQ.shape[0], mK.shape[0],
                              window_left, window_right, num_m_tiles, num_heads, total_tiles, mStartend,
                              mFmMinMax, mFmRanges, fm_head_div)
        self.run_roles(tiled_mma_qk, tiled_mma_pv, sQ_layout, sK_layout, sV_layout, tP_layout, sched, trace_addr,
                       (tma_atom_Q, tma_atom_K, tma_atom_V), (tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mV),
                       (mBlockLogit, scale_log2, softcap_in, softcap, logit_scale, mBlockBos), (mO, mLSE, scale_log2))

    @cute.jit
    def run_roles(self, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, sQ_layout: cute.ComposedLayout,
                  sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout, tP_layout: cute.ComposedLayout,
                  sched, trace_addr, atoms: tuple, load_args: tuple, softmax_args: tuple, correction_args: tuple):
        """The CTA: shared storage, pipelines and TMEM, then each warp's role over ``sched``'s work tiles.
        ``atoms`` are the TMA descriptors the load warp prefetches; ``*_args`` what ``load`` / ``softmax`` /
        ``correction`` take beyond the shared pieces (a kernel built on this one passes its own)."""
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        trace = None
        if const_expr(trace_addr is not None):
            trace = EdgeTrace(trace_addr, TRACE_EDGES)

        if warp_idx == _WARP_LOAD:
            for atom in atoms:
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        # ---- pipelines (Note [SM100 handshakes]); slot i of s / scale / o / stats is Q stage i
        def make(cls, name, bars, stages, **kw):
            full, empty = self.ARRIVALS[name]
            return cls.create(num_stages=stages, barrier_storage=bars.data_ptr(), defer_sync=True,
                              producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, full),
                              consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, empty), **kw)

        pipes = {
            "q": make(pipeline.PipelineTmaUmma, "q", storage.bar_q, self.q_stage, tx_count=self.q_tile_bytes),
            "kv": make(pipeline.PipelineTmaUmma, "kv", storage.bar_kv, self.kv_stage, tx_count=self.k_tile_bytes),
            "s": make(pipeline.PipelineUmmaAsync, "s", storage.bar_s, self.q_stage),
            "scale": make(pipeline.PipelineAsync, "scale", storage.bar_scale, self.q_stage),
            "o": make(pipeline.PipelineUmmaAsync, "o", storage.bar_o, self.q_stage),
            "stats": make(pipeline.PipelineAsync, "stats", storage.bar_stats, self.q_stage),
        }
        if const_expr(self.SCRUB_V):
            pipes["vready"] = make(pipeline.PipelineAsync, "vready", storage.bar_vready, SCRUB_SLOTS)
            pipes["scrub"] = make(pipeline.PipelineAsync, "scrub", storage.bar_scrub, SCRUB_SLOTS)
        tmem_free = pipeline.NamedBarrier(barrier_id=int(FwdBarrier.TmemFree),
                                          num_threads=NAMED_THREADS[FwdBarrier.TmemFree])
        check_arrivals({name: pipeline_counts(name, p) for name, p in pipes.items()},
                       {FwdBarrier.TmemFree: tmem_free.num_threads},
                       pipes=self.PIPES, barriers=BARRIERS, role_threads=ROLE_THREADS)
        if warp_idx == _WARPS_CORRECTION[0]:
            cute.arch.alloc_tmem(self.tmem_cols, storage.tmem_holding.ptr)
            cute.arch.relinquish_tmem_alloc_permit()
        pipeline.pipeline_init_arrive(is_relaxed=True)
        pipeline.pipeline_init_wait()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        self.kv_ring = sK  # the K / V ring buffers (a kernel built on this one may read them in its softmax roles)
        sV = cute.make_tensor(cute.recast_ptr(sK.iterator, sV_layout.inner), sV_layout.outer)
        sScale = storage.sScale.get_tensor(cute.make_layout((TILE_M, self.q_stage)))
        sRowSum = storage.sRowSum.get_tensor(cute.make_layout((TILE_M, self.q_stage)))
        sRowMax = storage.sRowMax.get_tensor(cute.make_layout((TILE_M, self.q_stage)))
        scrub = None
        if const_expr(self.SCRUB_V):
            scrub = (storage.scrub_flags.get_tensor(cute.make_layout((TILE_N, SCRUB_SLOTS))),
                     storage.scrub_mask.get_tensor(cute.make_layout((TILE_N // 32, SCRUB_SLOTS))))

        tmem_ptr = cute.arch.retrieve_tmem_ptr(Float32, 16, storage.tmem_holding.ptr)
        thr_mma_qk = tiled_mma_qk.get_slice(0)
        thr_mma_pv = tiled_mma_pv.get_slice(0)
        tStS_shape = thr_mma_qk.partition_shape_C((TILE_M, TILE_N))
        tStS_layout = thr_mma_qk.make_fragment_C(tStS_shape).layout
        tOtO_shape = thr_mma_pv.partition_shape_C((TILE_M, self.head_dim_v))
        tOtO_layout = thr_mma_pv.make_fragment_C(tOtO_shape).layout
        tStS = [cute.make_tensor(tmem_ptr + self.tmem_s_offset[i], tStS_layout) for i in range(self.q_stage)]
        tOtO = [cute.make_tensor(tmem_ptr + self.tmem_o_offset[i], tOtO_layout) for i in range(self.q_stage)]

        # One if/elif chain: the roles are sibling branches, so values only one role needs are not
        # live (and holding registers) inside another role's smaller setmaxnreg budget.
        regs_softmax, regs_softmax1, regs_correction, regs_other = self.role_regs()
        # Each role's view of the pipelines (traced builds: every wait marks its edge; slots = TRACE_ROLES;
        # built outside the role branches, which may carry only runtime values).
        sm_slot = Int32(0) if const_expr(self.q_stage == 1) else warp_idx // 4
        tp_softmax = traced_pipes(pipes, trace, sm_slot)
        tp_correction = traced_pipes(pipes, trace, 2)
        tp_mma = traced_pipes(pipes, trace, 3)
        tp_load = traced_pipes(pipes, trace, 4)
        tp_scrub = traced_pipes(pipes, trace, 5)
        if warp_idx < 4 * self.q_stage:
            # ------------------------------------------------------------ SOFTMAX (one WG per Q stage)
            cute.arch.setmaxregister_increase(regs_softmax)
            stage = Int32(0) if const_expr(self.q_stage == 1) else warp_idx // 4
            if const_expr(self.SCRUB_V):
                self.softmax(stage, thr_mma_qk, tStS, sScale, sRowSum, sRowMax, tp_softmax["s"], tp_softmax["scale"],
                             tp_softmax["stats"], sched, softmax_args, scrub=(tp_softmax["scrub"],) + scrub)
            else:
                self.softmax(stage, thr_mma_qk, tStS, sScale, sRowSum, sRowMax, tp_softmax["s"], tp_softmax["scale"],
                             tp_softmax["stats"], sched, softmax_args)
            if const_expr(trace is not None):
                trace.done(stage)
        elif warp_idx < _WARPS_CORRECTION[0]:
            # ------------------------------------------------------------ IDLE softmax WG 1 (q_stage 1)
            if const_expr(regs_softmax1 < 128):
                cute.arch.setmaxregister_decrease(regs_softmax1)
        elif warp_idx <= _WARPS_CORRECTION[-1]:
            # ------------------------------------------------------------ CORRECTION + EPILOGUE
            if const_expr(regs_correction < 128):
                cute.arch.setmaxregister_decrease(regs_correction)
            else:
                cute.arch.setmaxregister_increase(regs_correction)
            self.correction(thr_mma_pv, tOtO, sScale, sRowSum, sRowMax, tp_correction["s"], tp_correction["scale"],
                            tp_correction["o"], tp_correction["stats"], sched, correction_args)
            if const_expr(trace is not None):
                trace.mark(2, "tmem_free", 0)
            tmem_free.arrive_and_wait()
            if const_expr(trace is not None):
                trace.done(2)
            if warp_idx == _WARPS_CORRECTION[0]:
                cute.arch.dealloc_tmem(tmem_ptr, self.tmem_cols)
        elif warp_idx == _WARP_MMA:
            # ------------------------------------------------------------ MMA
            cute.arch.setmaxregister_decrease(regs_other)
            if const_expr(self.SCRUB_V):
                self.mma(tiled_mma_qk, tiled_mma_pv, thr_mma_qk, thr_mma_pv, sQ, sK, sV, tP_layout,
                         tmem_ptr, tStS, tOtO, tp_mma["q"], tp_mma["kv"], tp_mma["s"], tp_mma["o"], sched,
                         tp_mma["scale"], scrub=(tp_mma["vready"], tp_mma["scrub"]))
            else:
                self.mma(tiled_mma_qk, tiled_mma_pv, thr_mma_qk, thr_mma_pv, sQ, sK, sV, tP_layout,
                         tmem_ptr, tStS, tOtO, tp_mma["q"], tp_mma["kv"], tp_mma["s"], tp_mma["o"], sched,
                         tp_mma["scale"])
            if const_expr(trace is not None):
                trace.done(3)
        elif warp_idx == _WARP_LOAD:
            # ------------------------------------------------------------ LOAD
            cute.arch.setmaxregister_decrease(regs_other)
            self.load(thr_mma_qk, thr_mma_pv, sQ, sK, sV, tp_load["q"], tp_load["kv"], sched, load_args)
            if const_expr(trace is not None):
                trace.done(4)
        else:
            # ------------------------------------------------------------ SCRUB warps 14-15 (else idle)
            cute.arch.setmaxregister_decrease(regs_other)
            if const_expr(self.SCRUB_V):
                self.scrub_role(sV, sV_layout, tp_scrub["vready"], tp_scrub["scrub"], scrub, sched)
                if const_expr(trace is not None):
                    trace.done(5)

    # ------------------------------------------------------------------ load warp
    @cute.jit
    def load(self, thr_mma_qk, thr_mma_pv, sQ, sK, sV, pipe_q, pipe_kv, sched: TileScheduler, args: tuple):
        tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mV = args
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stage)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.kv_stage)
        v_bytes = None if const_expr(self.head_dim_v == self.head_dim) else self.v_tile_bytes
        work_idx = sched.first()
        while work_idx < sched.total:
            tile = sched.work_tile(work_idx)
            if tile.has_keys:
                head_kv = tile.head // self.cfg.qhead_per_kvhead
                if const_expr(self.cfg.varlen):
                    mQ_cur = cute.domain_offset((tile.seqlen.offset_q, 0), mQ[None, None, tile.head])
                    mK_cur = cute.domain_offset((tile.seqlen.offset_k, 0), mK[None, None, head_kv])
                    mV_cur = cute.domain_offset((0, tile.seqlen.offset_k), mV[None, None, head_kv])
                else:
                    mQ_cur = mQ[None, None, tile.head, tile.batch]
                    mK_cur = mK[None, None, head_kv, tile.batch]
                    mV_cur = mV[None, None, head_kv, tile.batch]
                gQ = cute.local_tile(mQ_cur, (TILE_M, self.head_dim), (None, 0))  # (128, d, m)
                gK = cute.local_tile(mK_cur, (TILE_N, self.head_dim), (None, 0))  # (128, d, n)
                gV = cute.local_tile(mV_cur, (self.head_dim_v, TILE_N), (0, None))  # (dv, 128, n)
                tQsQ, tQgQ = cpasync.tma_partition(
                    tma_atom_Q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 3),
                    cute.group_modes(thr_mma_qk.partition_A(gQ), 0, 3))
                tKsK, tKgK = cpasync.tma_partition(
                    tma_atom_K, 0, cute.make_layout(1), cute.group_modes(sK, 0, 3),
                    cute.group_modes(thr_mma_qk.partition_B(gK), 0, 3))
                tVsV, tVgV = cpasync.tma_partition(
                    tma_atom_V, 0, cute.make_layout(1), cute.group_modes(sV, 0, 3),
                    cute.group_modes(thr_mma_pv.partition_B(gV), 0, 3))
                # Order: Q0, K(last), Q1, V(last), then K, V of each earlier key tile (descending).
                # It is the order the MMA warp consumes the K/V ring in.
                n_last = self.key_tile(tile, 0)
                for i in cutlass.range_constexpr(self.q_stage):
                    pipe_q.producer_acquire(q_state)
                    cute.copy(tma_atom_Q, tQgQ[None, tile.m_tile * self.q_stage + i], tQsQ[None, q_state.index],
                              tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
                    q_state.advance()
                    if const_expr(i == 0):
                        self.load_kv_tile(tma_atom_K, tKgK, tKsK, n_last, pipe_kv, kv_state, None)
                        kv_state.advance()
                self.load_kv_tile(tma_atom_V, tVgV, tVsV, n_last, pipe_kv, kv_state, v_bytes)
                kv_state.advance()
                for step in cutlass.range(1, self.key_steps(tile), unroll=1):
                    n_tile = self.key_tile(tile, step)
                    self.load_kv_tile(tma_atom_K, tKgK, tKsK, n_tile, pipe_kv, kv_state, None)
                    kv_state.advance()
                    self.load_kv_tile(tma_atom_V, tVgV, tVsV, n_tile, pipe_kv, kv_state, v_bytes)
                    kv_state.advance()
            work_idx = sched.next(work_idx)
        # Note [SM100 handshakes]: the MMA's releases are tcgen05.commit arrivals; wait for all of them.
        pipe_q.producer_tail(q_state)
        pipe_kv.producer_tail(kv_state)

    @cute.jit
    def load_kv_tile(self, tma_atom, tXgX, tXsX, n_tile: Int32, pipe_kv, kv_state, tx_bytes):
        """TMA of one K or V tile into the ring; ``tx_bytes`` for a V tile narrower than K (None: the
        pipeline's K tile size)."""
        pipe_kv.producer_acquire(kv_state, expected_tx=tx_bytes)
        cute.copy(tma_atom, tXgX[None, n_tile], tXsX[None, kv_state.index],
                  tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))

    # ------------------------------------------------------------------ MMA warp
    @cute.jit
    def mma(self, tiled_mma_qk, tiled_mma_pv, thr_mma_qk, thr_mma_pv, sQ, sK, sV, tP_layout,
            tmem_ptr, tStS, tOtO, pipe_q, pipe_kv, pipe_s, pipe_o, sched: TileScheduler, pipe_scale=None,
            scrub=None):
        """``pipe_scale``: not used here (a kernel built on this one may give it another edge). ``scrub``:
        the (vready, scrub) pipelines of Note [scrubbed value tiles, SM100], None when off."""
        tSrQ = thr_mma_qk.make_fragment_A(sQ)
        tSrK = thr_mma_qk.make_fragment_B(sK)
        tOrV = thr_mma_pv.make_fragment_B(sV)
        tP = cute.make_tensor(tStS[0].iterator, tP_layout.outer)
        tOrP_layout = thr_mma_pv.make_fragment_A(tP)[None, None, None, 0].layout
        tOrP = [
            cute.make_tensor(cute.recast_ptr(tmem_ptr + self.tmem_s_offset[i] + self.tmem_p_offset,
                                             dtype=self.dtype), tOrP_layout)
            for i in range(self.q_stage)
        ]
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stage)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stage)
        # s: each acquire is that of the slot's next commit, made before the PV that needs P (one
        # round ahead of the commits); o: acquired at a tile's start, committed at its end.
        s_acquire = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stage)
        s_commit = s_acquire.clone()
        o_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stage)
        for i in cutlass.range_constexpr(self.q_stage):
            pipe_s.producer_acquire(s_acquire)  # first round: free
            s_acquire.advance()
        vr_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, SCRUB_SLOTS)
        sc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, SCRUB_SLOTS)
        work_idx = sched.first()
        while work_idx < sched.total:
            tile = sched.work_tile(work_idx)
            if tile.has_keys:
                n_steps = self.key_steps(tile)
                # 1. S_i = Q_i K(last)^T for every stage
                q_release = q_state.clone()
                for i in cutlass.range_constexpr(self.q_stage):
                    pipe_q.consumer_wait(q_state)
                    q_state.advance()
                    if const_expr(i == 0):
                        pipe_kv.consumer_wait(kv_state)
                    self.gemm(tiled_mma_qk, tStS[i], tSrQ[None, None, None, i],
                              tSrK[None, None, None, kv_state.index], False)
                    pipe_s.producer_commit(s_commit)
                    s_commit.advance()
                pipe_kv.consumer_release(kv_state)
                kv_state.advance()
                # 2. O_i free: the correction WG has read it for the previous work tile
                o_commit = o_state.clone()
                for i in cutlass.range_constexpr(self.q_stage):
                    pipe_o.producer_acquire(o_state)
                    o_state.advance()
                # 3. steady state: PV_i(previous key tile) then S_i(next key tile), per stage
                for step in cutlass.range(n_steps - 1, unroll=1):
                    pipe_kv.consumer_wait(kv_state)  # V of the previous key tile
                    v_state = kv_state.clone()
                    kv_state.advance()
                    if const_expr(scrub is not None):
                        self.v_ready(scrub, vr_state)
                        vr_state.advance()
                    for i in cutlass.range_constexpr(self.q_stage):
                        pipe_s.producer_acquire(s_acquire)  # P_i written, O_i ready
                        s_acquire.advance()
                        if const_expr(i == 0 and scrub is not None):
                            self.v_scrubbed(scrub, sc_state)
                            sc_state.advance()
                        self.gemm(tiled_mma_pv, tOtO[i], tOrP[i], tOrV[None, None, None, v_state.index],
                                  step > 0)
                        if const_expr(i == 0):
                            pipe_kv.consumer_wait(kv_state)  # K of this key tile
                        self.gemm(tiled_mma_qk, tStS[i], tSrQ[None, None, None, i],
                                  tSrK[None, None, None, kv_state.index], False)
                        pipe_s.producer_commit(s_commit)
                        s_commit.advance()
                    pipe_kv.consumer_release(v_state)
                    pipe_kv.consumer_release(kv_state)
                    kv_state.advance()
                # Q is no longer read once the last S GEMMs complete
                for i in cutlass.range_constexpr(self.q_stage):
                    pipe_q.consumer_release(q_release)
                    q_release.advance()
                # 4. PV_i(last key tile), then O_i is final
                pipe_kv.consumer_wait(kv_state)
                if const_expr(scrub is not None):
                    self.v_ready(scrub, vr_state)
                    vr_state.advance()
                for i in cutlass.range_constexpr(self.q_stage):
                    pipe_s.producer_acquire(s_acquire)
                    s_acquire.advance()
                    if const_expr(i == 0 and scrub is not None):
                        self.v_scrubbed(scrub, sc_state)
                        sc_state.advance()
                    self.gemm(tiled_mma_pv, tOtO[i], tOrP[i], tOrV[None, None, None, kv_state.index],
                              n_steps > 1)
                    pipe_o.producer_commit(o_commit)
                    o_commit.advance()
                pipe_kv.consumer_release(kv_state)
                kv_state.advance()
            work_idx = sched.next(work_idx)

    # ------------------------------------------------------------------ key steps
    def key_steps(self, tile) -> Int32:
        """How many key tiles every role walks for ``tile`` (Note [FlashMask gap tiles, SM100])."""
        if const_expr(self.fm_gap_skip):
            return tile.fm_steps
        return tile.keys.n_max - tile.keys.n_min

    def key_tile(self, tile, step: Int32) -> Int32:
        """The key tile of step ``step`` (descending: step 0 is the highest)."""
        if const_expr(self.fm_gap_skip):
            return tile.fm_ranges[tile.fm_top - step]
        return tile.keys.n_max - 1 - step

    # ------------------------------------------------------------------ Note [scrubbed value tiles, SM100]
    @cute.jit
    def v_tile_masked(self, tile: WorkTile, n_tile: Int32, sched=None):
        """Whether the scrub warps scan V of key tile ``n_tile``: some row of ``tile`` cannot see some of its keys
        (past the first row's causal / window limit, before the last row's window start, the sequence's key
        tail, a FlashMask tile the column bounds do not leave whole for the tile's rows). The scrub warps
        evaluate it before their waits: between a wait and the scan its FlashMask loads spilled their 56
        registers (52 B, sm_103a under CUDA 13). ``sched``: the scheduler (a kernel built on this one reads its
        plan there)."""
        keys = tile.keys
        masked = ((n_tile >= keys.n_right_mask) | (n_tile < keys.n_left_mask)
                  | ((n_tile + 1) * TILE_N > tile.seqlen.seqlen_k))
        if const_expr(self.cfg.has_startend):
            m0 = tile.m_tile * self.tile_m_total
            lo, hi = fm.load_tile_minmax(tile.fm_minmax, n_tile, self.cfg.startend)
            _skip, whole = fm.classify_tile(m0, cutlass.min(m0 + self.tile_m_total, tile.seqlen.seqlen_q), lo, hi,
                                            self.cfg.startend)
            masked = masked | (not whole)
        return masked

    @cute.jit
    def v_ready(self, scrub, vr_state):
        """MMA warp, once a V tile has landed: hand it to the scrub warps (the caller advances the state)."""
        scrub[0].producer_acquire(vr_state)
        scrub[0].producer_commit(vr_state)

    @cute.jit
    def v_scrubbed(self, scrub, sc_state):
        """MMA warp, before the PV of a V tile: wait until the scrub warps are done with it."""
        scrub[1].consumer_wait(sc_state)
        scrub[1].consumer_release(sc_state)

    def v_key_major(self, sV_layout):
        """(keys, dv) view of one V ring buffer (the PV operand's (((dv), 16 keys), 1, 8 key groups) layout;
        the swizzle rides on the buffer's pointer)."""
        outer = sV_layout.outer
        (dv_shape, k16), one, kb = outer.shape[0], outer.shape[1], outer.shape[2]
        (dv_stride, k16_stride), _zero, kb_stride = outer.stride[0], outer.stride[1], outer.stride[2]
        assert one == 1 and k16 * kb == TILE_N and cute.size(dv_shape) == self.head_dim_v, outer
        return cute.make_layout(((k16, kb), dv_shape), stride=((k16_stride, kb_stride), dv_stride))

    @cute.jit
    def scrub_role(self, sV, sV_layout, pipe_vready, pipe_scrub, scrub, sched: TileScheduler):
        """Warps 14-15: for each masked key tile (``v_tile_masked``, in the order the MMA warp takes them), once
        the MMA warp hands its V tile over, zero the tile's non-finite elements in shared memory and flag
        their keys (common/nonfinite.scrub_rows: one byte per key), publish them as a bit mask (bit k of word
        k // 32: key k; all 0 for an unmasked tile), then hand the tile to the MMA warp and the softmax WGs. The
        ring buffer of each V tile is counted as the MMA warp counts it (K, then V, per key tile)."""
        flags, mask = scrub
        threads = 32 * len(_WARPS_SCRUB)
        tid = cute.arch.thread_idx()[0] - 32 * _WARPS_SCRUB[0]
        per_row = nf.threads_per_row(TILE_N, self.head_dim_v, threads, self.dtype)
        assert per_row == 1 and TILE_N == 2 * threads, "a scrub thread owns keys tid and tid + threads"
        vk_layout = self.v_key_major(sV_layout)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stage)
        vr_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, SCRUB_SLOTS)
        sc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, SCRUB_SLOTS)
        work_idx = sched.first()
        while work_idx < sched.total:
            tile = sched.work_tile(work_idx)
            if tile.has_keys:
                for step in cutlass.range(self.key_steps(tile), unroll=1):
                    kv_state.advance()  # the key tile's K
                    vm = self.v_tile_masked(tile, self.key_tile(tile, step), sched)
                    pipe_vready.consumer_wait(vr_state)
                    pipe_scrub.producer_acquire(sc_state)
                    bad_lo = Int32(0)
                    bad_hi = Int32(0)
                    if vm:
                        sVk = cute.make_tensor(sV[None, None, None, kv_state.index].iterator, vk_layout)
                        nf.scrub_rows(sVk, flags[None, sc_state.index], tid, threads, per_row)
                        cute.arch.fence_view_async_shared()
                        # this thread's rows are keys tid and tid + 64 (it wrote their flags)
                        bad_lo = Int32(flags[tid, sc_state.index])
                        bad_hi = Int32(flags[tid + threads, sc_state.index])
                    word_lo = cute.arch.vote_ballot_sync(bad_lo != 0)
                    word_hi = cute.arch.vote_ballot_sync(bad_hi != 0)
                    if tid % 32 == 0:
                        mask[tid // 32, sc_state.index] = word_lo
                        mask[tid // 32 + len(_WARPS_SCRUB), sc_state.index] = word_hi
                    pipe_scrub.producer_commit(sc_state)
                    sc_state.advance()
                    pipe_vready.consumer_release(vr_state)
                    vr_state.advance()
                    kv_state.advance()  # its V
            work_idx = sched.next(work_idx)

    @cute.jit
    def gemm(self, tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor,
             accumulate):
        """acc = A B (accumulate False) or acc += A B over the K modes of one tile (tcgen05 MMAs
        are issued by one elected thread of the MMA warp inside cute.gemm)."""
        # A fresh atom per call: the ACCUMULATE field is runtime state of the atom, and mutating the
        # shared tiled MMA inside staged loops/branches would leak values out of their regions.
        # The K-phase loop stays rolled: unrolled, the descriptors of every phase are hoisted out of
        # the persistent loop and the MMA warp runs out of its small register budget.
        mma = cute.make_tiled_mma(tiled_mma.op)
        for k in cutlass.range(cute.size(tCrA.shape[2]), unroll=1):
            mma.set(tcgen05.Field.ACCUMULATE, accumulate | (k != 0))
            cute.gemm(mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)

    # ------------------------------------------------------------------ softmax warpgroups
    @cute.jit
    def softmax(self, stage: Int32, thr_mma_qk, tStS, sScale, sRowSum, sRowMax, pipe_s, pipe_scale, pipe_stats,
                sched: TileScheduler, args: tuple, scrub=None):
        """``scrub``: (the scrub pipeline, its flags, its found bytes) of Note [scrubbed value tiles, SM100]."""
        mBlockLogit, scale_log2, softcap_in, softcap, logit_scale, mBlockBos = args
        tidx, tmem = self.softmax_tmem(stage, thr_mma_qk, tStS)
        s_state = _slot_state(self.q_stage, stage, producer=False)
        scale_state = _slot_state(self.q_stage, stage, producer=True)
        stats_state = _slot_state(self.q_stage, stage, producer=True)
        # B = 2 * TILE_N: max of the odd key tile so far; block_bos: the block carried to the next key tile
        # (common/block_logit.row_relative_maxima / store_relative_row)
        carry = cute.make_rmem_tensor((1,), Float32)
        carry.fill(-Float32.inf)
        work_idx = sched.first()
        while work_idx < sched.total:
            tile = sched.work_tile(work_idx)
            stage_row0 = tile.m_tile * self.tile_m_total + stage * TILE_M
            row = stage_row0 + tidx  # row within the sequence
            rows = sched.stage_keys(tile, stage)  # mask limits of this stage's 128 rows
            gBL = None  # (TILE_M, nb): block_logit rows of this Q stage
            if const_expr(mBlockLogit is not None):
                gBL = self.block_logit_rows(mBlockLogit, tile.seqlen.offset_q + stage_row0, tile.head, tile.batch)
            row_max = Float32(-Float32.inf)
            row_sum = Float32(0.0)
            bos = None  # block_bos: (this row's origin, the blocks it may store: nb, 0 past the sequence)
            if const_expr(self.cfg.block_bos):
                bos_row = Int32(0)
                bos_limit = Int32(0)
                if row < tile.seqlen.seqlen_q:
                    bos_row = mBlockBos[tile.batch, row]
                    bos_limit = gBL.shape[1]
                bos = (bos_row, bos_limit)
            if tile.has_keys:
                for step in cutlass.range(self.key_steps(tile), unroll=1):
                    n_tile = self.key_tile(tile, step)
                    # a tile crossing a row limit of this stage, or the sequence's key tail
                    need_mask = ((n_tile >= rows.n_right_mask) | (n_tile < rows.n_left_mask)
                                 | ((n_tile + 1) * TILE_N > tile.seqlen.seqlen_k))
                    if const_expr(self.cfg.has_startend):
                        # ... or one the column bounds cut for this stage's rows (common/flashmask.py)
                        lo, hi = fm.load_tile_minmax(tile.fm_minmax, n_tile, self.cfg.startend)
                        _skip, whole = fm.classify_tile(
                            stage_row0, cutlass.min(stage_row0 + TILE_M, tile.seqlen.seqlen_q), lo, hi,
                            self.cfg.startend)
                        need_mask = need_mask | (not whole)
                    scrub_step = None
                    if const_expr(scrub is not None):
                        scrub_step = (scrub[0], None, scrub[1], scrub[2])
                    row_max, row_sum = self.softmax_step(
                        step, need_mask, n_tile, tile, row, row_max, row_sum, carry, gBL, stage, tmem, sScale,
                        pipe_s, s_state, pipe_scale, scale_state, scale_log2, softcap_in, softcap, logit_scale,
                        tidx, bos, scrub_step)
                    s_state.advance(self.q_stage)
                    scale_state.advance(self.q_stage)
                self.publish_row_stats(pipe_stats, stats_state, sRowSum, sRowMax, tidx, stage, row_sum, row_max)
                stats_state.advance(self.q_stage)
            if const_expr(mBlockLogit is not None):
                # see Note [block_logit of unvisited blocks]
                if tile.has_rows:
                    stage_rows = cutlass.max(cutlass.min(tile.seqlen.seqlen_q - stage_row0, TILE_M), 0)
                    if const_expr(self.cfg.block_bos):
                        gBos = cute.domain_offset((stage_row0,), mBlockBos[tile.batch, None])
                        key_lo = tile.keys.n_min * TILE_N
                        key_hi = tile.keys.n_max * TILE_N
                        if not tile.has_keys:
                            key_hi = key_lo  # nothing visited: whole rows
                        blk.fill_unvisited_relative(gBL, gBos, stage_rows, gBL.shape[1], key_lo, key_hi,
                                                    self.cfg.block_size, tidx, TILE_M)
                    else:
                        block_lo, block_hi = blk.visited_block_range(self.bl_shape, tile.keys.n_min,
                                                                     tile.keys.n_max)
                        blk.fill_unvisited_by_row(gBL, stage_rows, gBL.shape[1], block_lo, block_hi, tidx, TILE_M)
            work_idx = sched.next(work_idx)

    @cute.jit
    def publish_row_stats(self, pipe_stats, stats_state, sRowSum, sRowMax, tidx: Int32, stage: Int32,
                          row_sum: Float32, row_max: Float32):
        """The row's final sum / max for the correction WG's epilogue (stats slot ``stage``). The caller
        advances the state: a state advanced inside a nested jit function does not reach the caller's loop
        (the stats phase then stayed at its first value: seen in the PTX, 2026-12-03)."""
        pipe_stats.producer_acquire(stats_state)
        sRowSum[tidx, stage] = row_sum
        sRowMax[tidx, stage] = row_max
        pipe_stats.producer_commit(stats_state)

    def softmax_tmem(self, stage: Int32, thr_mma_qk, tStS):
        """(thread's row = TMEM lane, the TMEM copies of one softmax thread: S load, P store, their
        partitions) for Q stage ``stage``."""
        tidx = cute.arch.thread_idx()[0] % TILE_M  # = TMEM lane = query row in the Q stage tile
        tSAcc = tStS[0][(None, None), 0, 0]  # (128, 128) fp32 in TMEM, stage 0 (offset added below)
        t2r_atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), Float32)
        thr_t2r = tcgen05.make_tmem_copy(t2r_atom, tSAcc).get_slice(tidx)
        tStS_t2r = thr_t2r.partition_S(tSAcc)
        cS = cute.make_identity_tensor((TILE_M, TILE_N))
        tScS_t2r = thr_t2r.partition_D(thr_mma_qk.partition_C(cS)[(None, None), 0, 0])
        # P (16-bit pairs as fp32 columns) over the upper half of S
        p_cols = TILE_N * self.dtype.width // 32
        tStP = cute.make_tensor(tSAcc.iterator + self.tmem_p_offset,
                                cute.composition(tSAcc.layout, cute.make_layout((TILE_M, p_cols))))
        r2t_atom = cute.make_copy_atom(
            tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(p_cols // 4)), Float32)
        thr_r2t = tcgen05.make_tmem_copy(r2t_atom, tStP).get_slice(tidx)
        tStP_r2t = thr_r2t.partition_D(tStP)
        tPcP = thr_r2t.partition_S(cute.make_identity_tensor((TILE_M, p_cols)))
        stage_cols = stage * TILE_N  # TMEM column offset of S_stage
        tStS_t2r = cute.make_tensor(tStS_t2r.iterator + stage_cols, tStS_t2r.layout)
        tStP_r2t = cute.make_tensor(tStP_r2t.iterator + stage_cols, tStP_r2t.layout)
        tmem = (thr_t2r, thr_r2t, tStS_t2r, tStP_r2t, tScS_t2r, tPcP)
        return tidx, tmem

    @cute.jit
    def softmax_step(self, step: Int32, need_mask, n_tile: Int32, tile: WorkTile, row: Int32,
                     row_max: Float32, row_sum: Float32, carry: cute.Tensor, gBL, stage: Int32, tmem,
                     sScale, pipe_s, s_state, pipe_scale, scale_state, scale_log2: Float32,
                     softcap_in: Float32, softcap: Float32, logit_scale: Float32, tidx: Int32, bos=None,
                     scrub_step=None):
        """One key tile of one query row: S -> (softcap, mask) -> block maxima, row max -> P, sum.
        ``bos`` (block_bos builds): (the row's origin, the number of blocks it stores: nb, 0 past the
        sequence); ``carry`` then holds the block carried down to the next key tile (common/block_logit.py,
        one row per thread). ``scrub_step``: (the scrub pipeline, None, key flags, key mask), Note
        [scrubbed value tiles, SM100]; its state is derived from ``s_state``."""
        cfg = self.cfg
        thr_t2r, thr_r2t, tStS_t2r, tStP_r2t, tScS_t2r, tPcP = tmem
        # 1. wait for S_stage = Q K^T of this key tile and load the whole row (128 fp32)
        pipe_s.consumer_wait(s_state)
        tSrS = cute.make_rmem_tensor(tScS_t2r.shape, Float32)
        cute.copy(thr_t2r, tStS_t2r, tSrS)
        n = cute.size(tSrS)
        # 2. softcap turns raw q.k into the scaled logit softcap * tanh(scale * q.k / softcap)
        if const_expr(cfg.has_softcap):
            for k in cutlass.range_constexpr(n):
                tSrS[k] = softcap_logit(tSrS[k], softcap_in, softcap)
        # 3. mask (only key tiles crossing a limit)
        if need_mask:
            self.mask_scores(tSrS, n_tile, tile, row)
        # 4. block maxima and the tile max from the same fmax3 tree
        blocks = None
        if const_expr(cfg.block_bos):
            # document-relative blocks: the maxima of the blocks starting in this tile (stored in step 6) and
            # the tile max with them
            blocks, tile_max = blk.row_relative_maxima(self.bos_shape, tSrS, n_tile * TILE_N, bos[0], carry)
        elif const_expr(cfg.has_block_logit):
            bpt = self.bl_shape.blocks_per_tile
            per = n // bpt
            blocks = cute.make_rmem_tensor((bpt,), Float32)
            for b in cutlass.range_constexpr(bpt):
                blocks[b] = max_tree([tSrS[k] for k in range(b * per, (b + 1) * per)])
            tile_max = max_tree([blocks[b] for b in range(bpt)])
        else:
            tile_max = max_tree([tSrS[k] for k in range(n)])
        # 5. running max with conditional rescale; the factor goes to the correction WG (1 at step 0)
        row_max_use = cute.arch.fmax(row_max, tile_max)
        acc_scale = Float32(1.0)
        if step > 0:
            row_max_use, acc_scale = conditional_max(row_max, row_max_use, scale_log2, RESCALE_THRESHOLD_LOG2)
        pipe_scale.producer_acquire(scale_state)
        sScale[tidx, stage] = acc_scale
        pipe_scale.producer_commit(scale_state)
        max_safe = exp2_reference(row_max_use)
        # 6. block_logit: this tile's block maxima, scaled once, plain stores (one writer per entry)
        if const_expr(cfg.block_bos):
            blk.store_relative_row(self.bos_shape, blocks, n_tile * TILE_N, bos[0], carry, gBL[tidx, None], bos[1],
                                   n_tile == tile.keys.n_min, None if const_expr(cfg.has_softcap) else logit_scale)
        if const_expr(cfg.has_block_logit and not cfg.block_bos):
            scale = None if const_expr(cfg.has_softcap) else logit_scale
            gRow = gBL[tidx, None]
            nb = gBL.shape[1]
            row_valid = row < tile.seqlen.seqlen_q
            if const_expr(self.bl_shape.tiles_per_block == 1):
                blk.store_blocks(gRow, blocks, n_tile * self.bl_shape.blocks_per_tile, nb, row_valid, scale)
            else:
                tpb = self.bl_shape.tiles_per_block
                if blk.carry_across_tiles(blocks, carry, n_tile, tile.keys.n_min, tpb):
                    blk.store_blocks(gRow, blocks, n_tile // tpb, nb, row_valid, scale)
        # 7. P = exp2(S * scale_log2 - max * scale_log2), 32 columns at a time, into TMEM
        bias = -max_safe * scale_log2
        if const_expr(scrub_step is None):
            sums = self.p_to_tmem(tSrS, tmem, scale_log2, bias, None)
        else:
            # Note [scrubbed value tiles, SM100]: this key tile's V scrubbed, its flagged keys as bits; a tile with
            # one (rare; the same in every thread) takes a copy of the loop that poisons every chunk (a test per
            # chunk inside the one loop spilled beside block_bos, sm_103a under CUDA 13). The edge's state comes
            # from this WG's key-step count (s_state counts q_stage per step; one V tile per key step, every role
            # walks the same ones): carried through the key loop it took registers beside block_bos.
            nv = s_state.count // self.q_stage
            sc_state = pipeline.PipelineState(SCRUB_SLOTS, nv, nv % SCRUB_SLOTS, (nv // SCRUB_SLOTS) % 2)
            scrub_step[0].consumer_wait(sc_state)
            key_mask = scrub_step[3][None, sc_state.index]
            sums = [Float32(0.0), Float32(0.0)]
            if (key_mask[0] | key_mask[1] | key_mask[2] | key_mask[3]) != Uint32(0):
                sums = self.p_to_tmem(tSrS, tmem, scale_log2, bias, key_mask)
            else:
                sums = self.p_to_tmem(tSrS, tmem, scale_log2, bias, None)
            scrub_step[0].consumer_release(sc_state)
        # 8. P visible to the tensor core, then hand the stage to the MMA warp
        cute.arch.fence_view_async_tmem_store()
        pipe_s.consumer_release(s_state)
        return row_max_use, row_sum * acc_scale + (sums[0] + sums[1])

    @cute.jit
    def p_to_tmem(self, tSrS: cute.Tensor, tmem, scale_log2: Float32, bias: Float32, key_mask):
        """Step 7 of ``softmax_step``: P = exp2(S * scale_log2 + bias) of the row, 32 columns at a time, as 16-bit
        into TMEM; with ``key_mask`` (Note [scrubbed value tiles, SM100]) each chunk's seen flagged keys made NaN
        first. Returns the two partial row sums (fp32, before any poison)."""
        thr_t2r, thr_r2t, tStS_t2r, tStP_r2t, tScS_t2r, tPcP = tmem
        n = cute.size(tSrS)
        rP = cute.make_rmem_tensor(tPcP.shape, Float32)
        rP_h = cute.make_tensor(cute.recast_ptr(rP.iterator, dtype=self.dtype), tSrS.layout)
        sums = [Float32(0.0), Float32(0.0)]
        chunks = cute.size(tStP_r2t.shape[2])
        per_chunk = n // chunks
        assert key_mask is None or per_chunk == 32, per_chunk
        for j in cutlass.range_constexpr(chunks):
            for k0 in cutlass.range_constexpr(j * per_chunk, (j + 1) * per_chunk, 2):
                x0, x1 = cute.arch.fma_packed_f32x2((tSrS[k0], tSrS[k0 + 1]), (scale_log2, scale_log2),
                                                    (bias, bias))
                if const_expr(self.exp2_emulation and EXP2_POLY_EVERY > 0 and k0 % EXP2_POLY_EVERY >= EXP2_POLY_EVERY - EXP2_POLY_OF
                              and 0 < j < chunks - 1):
                    x0 = exp2_poly(x0)
                    x1 = exp2_poly(x1)
                else:
                    x0 = cute.math.exp2(x0, fastmath=True)
                    x1 = cute.math.exp2(x1, fastmath=True)
                tSrS[k0] = x0
                tSrS[k0 + 1] = x1
                sums[0], sums[1] = cute.arch.add_packed_f32x2((sums[0], sums[1]), (x0, x1))
            chunk_s = cute.logical_divide(tSrS, cute.make_layout(per_chunk))[None, j]
            chunk_p = cute.logical_divide(rP_h, cute.make_layout(per_chunk))[None, j]
            chunk_p.store(chunk_s.load().to(self.dtype))
            if const_expr(key_mask is not None):
                words = cute.recast_tensor(rP[None, None, j], Uint32)
                keys = key_mask[j]
                for w in cutlass.range_constexpr(cute.size(words)):
                    words[w] = nf.nan_seen_halves(words[w], keys >> Uint32(2 * w), Uint32)
            cute.copy(thr_r2t, rP[None, None, j], tStP_r2t[None, None, j])
        return sums

    @cute.jit
    def mask_scores(self, tSrS: cute.Tensor, n_tile: Int32, tile: WorkTile, row: Int32):
        """-inf on the keys of key tile ``n_tile`` that query ``row`` does not see (causal / window / past the
        keys). The 32x32b TMEM load gives each thread its row in order: register k is key column k of the
        tile, the column list common/mask.py takes."""
        cfg = self.cfg
        n = cute.size(tSrS)
        apply_mask(cute.make_tensor(tSrS.iterator, cute.make_layout((1, n))), list(range(n)), [row], n_tile * TILE_N,
                   tile.seqlen.seqlen_k, tile.seqlen.seqlen_k - tile.seqlen.seqlen_q, tile.left, tile.right,
                   True, cfg.causal or cfg.has_window, cfg.has_window)
        if const_expr(cfg.has_startend):
            # The warp's 32 rows share the tile's 128 columns: each lane loads the bounds of 4 columns and
            # the others take them by shuffle (each thread loading all 128 columns' bounds spilled, sm_100a).
            fm.apply_startend_mask_row_warp(cute.make_tensor(tSrS.iterator, cute.make_layout((1, n))), n, row,
                                            n_tile * TILE_N, tile.fm_bounds, tile.seqlen.seqlen_k, cfg.startend,
                                            cute.arch.lane_idx())

    # ------------------------------------------------------------------ block_logit
    @cute.jit
    def block_logit_rows(self, mBlockLogit, row0: Int32, head: Int32, batch: Int32):
        """(TILE_M, nb) view of block_logit starting at global row ``row0`` of (head, batch)."""
        if const_expr(self.cfg.varlen):
            return cute.domain_offset((row0, 0), mBlockLogit[None, None, head])
        return cute.domain_offset((row0, 0), mBlockLogit[None, None, head, batch])

    # ------------------------------------------------------------------ correction warpgroup
    def o_tmem_copies(self, thr_mma_pv, tOtO, tidx):
        """The correction WG's TMEM copies of the O accumulators: per Q stage ``(t2r, src, register shape)`` and
        ``(r2t, dst)`` of one O_CHUNK-column chunk (chunk c at column + O_CHUNK c), and the chunks per row."""
        dv = self.head_dim_v
        chunk = O_CHUNK
        # one O_CHUNK-column chunk of O_stage (128 lanes x 16 fp32 columns); chunk c at column +16 c
        tOAcc = tOtO[0][(None, None), 0, 0]
        tOchunk = cute.composition(tOAcc, cute.make_layout((TILE_M, chunk)))
        t2r_atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(chunk)), Float32)
        r2t_atom = cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(chunk)), Float32)
        thr_t2r = tcgen05.make_tmem_copy(t2r_atom, tOchunk).get_slice(tidx)
        thr_r2t = tcgen05.make_tmem_copy(r2t_atom, tOchunk).get_slice(tidx)
        tOt_t2r0 = thr_t2r.partition_S(tOchunk)
        tOcO = thr_mma_pv.partition_C(cute.make_identity_tensor((TILE_M, self.head_dim_v)))
        tOcO_chunk = cute.composition(tOcO[(None, None), 0, 0], cute.make_layout((TILE_M, chunk)))
        rO_shape = thr_t2r.partition_D(tOcO_chunk).shape  # one row, O_CHUNK fp32 columns
        tOt_r2t0 = thr_r2t.partition_D(tOchunk)
        tOt_t2r = []
        tOt_r2t = []
        for i in range(self.q_stage):
            delta = self.tmem_o_offset[i] - self.tmem_o_offset[0]
            tOt_t2r.append((thr_t2r, cute.make_tensor(tOt_t2r0.iterator + delta, tOt_t2r0.layout), rO_shape))
            tOt_r2t.append((thr_r2t, cute.make_tensor(tOt_r2t0.iterator + delta, tOt_r2t0.layout)))
        return tOt_t2r, tOt_r2t, dv // chunk

    @cute.jit
    def correction(self, thr_mma_pv, tOtO, sScale, sRowSum, sRowMax, pipe_s, pipe_scale, pipe_o, pipe_stats,
                   sched: TileScheduler, args: tuple):
        tidx = cute.arch.thread_idx()[0] % TILE_M
        tOt_t2r, tOt_r2t, num_chunks = self.o_tmem_copies(thr_mma_pv, tOtO, tidx)

        # The correction WG visits the slots (Q stages) in order, one state per pipeline.
        s_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stage)
        scale_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stage)
        o_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stage)
        stats_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stage)
        work_idx = sched.first()
        while work_idx < sched.total:
            tile = sched.work_tile(work_idx)
            if tile.has_rows:
                if tile.has_keys:
                    # per key step and stage: the factor, O_i rescaled if any row's max moved, then
                    # "O_i ready" (at step 0 the factor is 1: O_i was read by the previous epilogue)
                    for step in cutlass.range(self.key_steps(tile), unroll=1):
                        for i in cutlass.range_constexpr(self.q_stage):
                            pipe_scale.consumer_wait(scale_state)
                            acc_scale = sScale[tidx, i]
                            pipe_scale.consumer_release(scale_state)
                            scale_state.advance()
                            if cute.arch.vote_any_sync(acc_scale != 1.0):
                                self.rescale_o(tOt_t2r[i], tOt_r2t[i], acc_scale, num_chunks)
                            pipe_s.consumer_release(s_state)
                            s_state.advance()
                for i in cutlass.range_constexpr(self.q_stage):
                    row = tile.m_tile * self.tile_m_total + i * TILE_M + tidx
                    row_sum = Float32(0.0)
                    row_max = Float32(-Float32.inf)
                    if tile.has_keys:
                        pipe_o.consumer_wait(o_state)
                        pipe_stats.consumer_wait(stats_state)
                        row_sum = sRowSum[tidx, i]
                        row_max = sRowMax[tidx, i]
                        pipe_stats.consumer_release(stats_state)
                        stats_state.advance()
                    self.epilogue_row(tOt_t2r[i], args, row_sum, row_max, tile, row, num_chunks)
                    if tile.has_keys:
                        pipe_o.consumer_release(o_state)  # after the TMEM loads completed
                        o_state.advance()
            work_idx = sched.next(work_idx)

    @cute.jit
    def rescale_o(self, t2r, r2t, acc_scale: Float32, num_chunks: cutlass.Constexpr):
        thr_t2r, tOt_src, rO_shape = t2r
        thr_r2t, tOt_dst = r2t
        for c in cutlass.range_constexpr(num_chunks):
            rO = cute.make_rmem_tensor(rO_shape, Float32)
            cute.copy(thr_t2r, cute.make_tensor(tOt_src.iterator + c * O_CHUNK, tOt_src.layout), rO)
            for k in cutlass.range_constexpr(0, cute.size(rO), 2):
                rO[k], rO[k + 1] = cute.arch.mul_packed_f32x2((rO[k], rO[k + 1]), (acc_scale, acc_scale))
            cute.copy(thr_r2t, rO, cute.make_tensor(tOt_dst.iterator + c * O_CHUNK, tOt_dst.layout))
        cute.arch.fence_view_async_tmem_store()

    @cute.jit
    def epilogue_row(self, t2r, args: tuple, row_sum: Float32, row_max: Float32, tile: WorkTile, row: Int32,
                     num_chunks: cutlass.Constexpr):
        """O row = O_acc / row_sum, lse (OnlineSoftmax.finalize of the one row; 0 / -inf for a row with
        no visible key). The TMEM loads run in every thread of the warp (tcgen05.ld is warp-collective);
        only the global stores are predicated on the row being inside the sequence. Ends with
        tcgen05.wait::ld, so O may be overwritten after it returns."""
        mO, mLSE, scale_log2 = args
        final = OnlineSoftmax(scale_log2, 1, 1)
        final.row_sum[0] = row_sum
        final.row_max[0] = row_max
        row_scale, row_lse = final.finalize()
        inv_sum = row_scale[0]
        row_ok = row < tile.seqlen.seqlen_q
        row_g = row
        if const_expr(self.cfg.varlen):
            row_g = tile.seqlen.offset_q + row
        if row_ok:
            if const_expr(self.cfg.varlen):
                mLSE[row_g, tile.head] = row_lse[0]
            else:
                mLSE[row_g, tile.head, tile.batch] = row_lse[0]
        gO_row = None
        if const_expr(self.cfg.varlen):
            gO_row = mO[row_g, None, tile.head]
        else:
            gO_row = mO[row_g, None, tile.head, tile.batch]
        self.store_o_row(t2r, gO_row, inv_sum, tile.has_keys, row_ok, num_chunks)

    @cute.jit
    def store_o_row(self, t2r, gO_row: cute.Tensor, inv_sum: Float32, has_keys, row_ok, num_chunks: cutlass.Constexpr):
        """One O row: TMEM (O_CHUNK columns per load, every lane: tcgen05.ld is warp-collective) times
        ``inv_sum`` (zeros when the tile has no keys), in q's dtype to ``gO_row`` where ``row_ok``; ends with
        tcgen05.wait::ld."""
        thr_t2r, tOt_src, rO_shape = t2r
        for c in cutlass.range_constexpr(num_chunks):
            tOt_c = cute.make_tensor(tOt_src.iterator + c * O_CHUNK, tOt_src.layout)
            rO = cute.make_rmem_tensor(rO_shape, Float32)
            if has_keys:
                cute.copy(thr_t2r, tOt_c, rO)
                for k in cutlass.range_constexpr(0, cute.size(rO), 2):
                    rO[k], rO[k + 1] = cute.arch.mul_packed_f32x2((rO[k], rO[k + 1]), (inv_sum, inv_sum))
            else:
                rO.fill(0.0)
            if row_ok:
                rO_h = cute.make_rmem_tensor(rO.shape, self.dtype)
                rO_h.store(rO.load().to(self.dtype))
                gO_v = cute.make_tensor(
                    cute.make_ptr(self.dtype, (gO_row.iterator + c * O_CHUNK).toint(), cute.AddressSpace.gmem,
                                  assumed_align=16),
                    cute.make_layout(O_CHUNK))
                cute.autovec_copy(cute.make_tensor(rO_h.iterator, cute.make_layout(O_CHUNK)), gO_v)
        cute.arch.fence_view_async_tmem_load()
