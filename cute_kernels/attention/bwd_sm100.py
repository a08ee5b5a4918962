"""FlashBwdSm100: Blackwell (sm_100a) attention backward main kernel (tcgen05 / TMEM), 1-CTA.

Math, tensors and workspace are those of ``cute_kernels/attention/bwd_config.py``:

    P^T  = exp2(S^T * scale_log2 - lse_log2)      S^T = K Q^T (raw, fp32 in TMEM; softcapped first)
    dP^T = V dO^T                                 dS^T = P^T * (dP^T - D) (* (1 - tanh^2) with softcap)
    dV  += P^T dO        dK += dS^T Q (x softmax_scale at the end)        dQ_accum += dS K  (fp32)

One CTA = one 128-key tile of one (kv head, batch); grid (key tiles, Hkv, B), key tile fastest, not
persistent. It loops over the (query head of the group, 128-row query tile) pairs that see the tile,
head-major, so dK / dV of a GQA group accumulate in TMEM across the group's query heads and are
written once, in q's dtype. 512 threads, warp-specialised:

    warps 0-3    dQ reduce: tcgen05.ld dQ (query row = TMEM lane) -> fp32 smem stages of 32 columns -> TMA
                 reduce-add (cp.reduce.async.bulk.tensor add.f32) into dq_accum; deterministic: in key-tile
                 order per (query head, row block), via dq_sem turn counters
    warps 4-11   compute, two warpgroups: WG w owns query columns [64 w, 64 w + 64) of S^T / dP^T for all
                 128 key rows (TMEM lane = key row); P^T -> TMEM (16-bit over S^T), dS^T -> smem;
                 after the loop the dK / dV epilogue (WG w: head-dim columns [d/2 w, d/2 (w + 1)))
    warp 12      MMA: single-thread tcgen05 issue; warp 13: TMA loads (K, V once; Q, dO per query tile)
    warps 14-15  scrub K and V once (Note [scrubbed K / V, SM100])

TMEM columns (512 allocated):  S^T / P^T [0, 128) | dP^T, then dQ [128, 256) | dV | dK  (d <= 128).
Shared memory: K, V (one tile each), Q (2 stages), dO (2 stages if they fit, else 1: d 128, as FA4's
1-CTA kernel), dS (one tile), dQ staging (2 x 128 x 32 fp32).
The MN-major operand views (Q and dO as B of dK / dV, K as B of dQ, dS as A of dQ) alias the K-major
buffers the TMA writes (the canonical SW128 layouts of both majors place the same bytes).

head_dim 192 / 256 and (192, 128) run the wide schedule of Note [SM100 wide schedule]: 64-row query
tiles, dQ^T = K^T dS^T in 128-head-dim chunks (TMEM lane = head dim), and at d 256 two CTAs per key
tile, each owning half of the head dims of dK, dV and dQ.

Every cross-role edge is a ``cutlass.pipeline`` object or a named barrier (ids in ``BwdBarrier``); see
Note [SM100 backward handshakes]. Arrival counts are checked against the role sizes at trace time
(``check_arrivals``).

``FlashBwdSm100(cfg, spt=True)`` (opt-in, like the SM90 kernel's; deterministic causal / window only):
the writers of a query tile go in descending key tile (turn = last_key_tile(m) - n) and blockIdx.x
maps to the highest key tile first (Note [deterministic dQ, descending order] in bwd_sm90.py).

Not supported (``unsupported_reason`` names each): head-dim pairs other than 64, 96, 128, 192, 256
(head_dim_v = head_dim) and (192, 128).
No Blackwell GPU was available: compiled for sm_100a only, never run.
"""

from __future__ import annotations

from enum import IntEnum

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, Int64, Uint32, const_expr
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.tensor_utils import LayoutEnum

from cute_kernels import arch as _arch
from cute_kernels.common.barriers import check_arrivals as _check_arrivals
from cute_kernels.common.barriers import pipeline_counts
from cute_kernels.common import flashmask as fm
from cute_kernels.common import nonfinite as nf
from cute_kernels.common.mask import apply_mask_kv_major
from cute_kernels.common.seqlen import SeqlenInfo
from cute_kernels.common.softmax import softcap_logit
from cute_kernels.common.tile_range import (QueryTileRange, TileRange, first_key_tile, last_key_tile,
                                             normalize_window)
from cute_kernels.common.trace import EdgeTrace, edge_names, traced_pipes
from cute_kernels.common.utils import LN_2, LOG2_E, ld_acquire_gpu, red_release_add_gpu

from .bwd_config import ACCUM_ROW_PAD, DQ_SEM_ROWS, BwdConfig

# Note [SM100 backward handshakes]
# The MMA warp issues, for query tiles t = 0 .. n-1 (prologue: S^T(0), dP^T(0)):
#   [pipe_S acquire: P^T(t) written] dV += P^T(t) dO(t), release dO(t)
#   S^T(t+1) = K Q(t+1)^T -> [pipe_S full]                      (not for t = n-1)
#   [pipe_dS full: dS(t) in smem] dK += dS^T(t) Q(t), release Q(t); dQ(t) = dS(t) K -> [pipe_dQ full];
#   release dS (the smem is free once dK and dQ complete)
#   [pipe_dQ acquire: dQ(t) loaded by the reduce warps][pipe_dP acquire] dP^T(t+1) -> [pipe_dP full]
# while the compute warps, per t: [S full] load S^T, P^T over it, [S release]; [dP full] load dP^T,
# [dP release]; [dS acquire] dS^T -> smem, [dS commit].
# * P^T(t) overwrites S^T(t) columns: every compute thread has loaded its S^T columns before any
#   writes P (named barrier BwdBarrier.Compute; the two warpgroups' P columns overlap the other's S).
# * S^T(t+1) overwrites P^T(t): it is issued after dV(t) and tcgen05 MMAs of one thread execute in
#   issue order. pipe_S is acquired once before S^T(0) and once before each dV, so its empty barrier
#   ("S^T read, P^T written") is waited exactly once per release. S^T(t+1) is issued before dK(t)
#   releases Q(t), so Q needs two stages (Q_STAGE = 2).
# * dQ(t) overwrites dP^T(t) columns: issued after pipe_dS full, which the compute threads signal after
#   loading dP^T(t). dP^T(t+1) waits pipe_dQ empty (dQ(t) loaded) and pipe_dP empty (dP^T(t) read).
# * dK / dV are final after the last iteration's MMAs: pipe_dKV (one commit) -> compute epilogue.
# * TMEM is freed after the compute and reduce warps (its last readers) meet at BwdBarrier.TmemFree.
# * The pipeline states live in the staged loops as loop-carried values (the MMA loop reassigns
#   them from mma_iter; the last iteration is peeled so no state changes inside a runtime branch).

# Note [SM100 wide schedule]
# At head_dim (or head_dim_v) > 128 the narrow TMEM map (S^T 128 | dP^T 128 | dV dv | dK d, dQ over
# dP^T) needs more than 512 columns and dQ (128 rows x d) no longer fits over dP^T. FA4 b36 moves to a
# 2-CTA (cta_group 2) schedule there; this kernel stays 1-CTA and changes three things instead:
# * 64-row query tiles (TILE_M_WIDE): S^T and dP^T take 64 columns each, and each compute warpgroup
#   owns 32 query columns. K / V stay 128 keys (M = 128 for S^T, dP^T, dK, dV).
# * dQ is accumulated transposed, dQ^T = K^T dS^T, M = 128 head dims per MMA ("chunk"), N = 64 queries:
#   64 columns per chunk, TMEM lane = head dim. A = K^T is the MN-major view of the K buffer started at
#   the chunk's first head dim (a whole SW128 repeat, checked at trace time); B = dS^T is the MN-major
#   view of the dS^T buffer. d 192 takes two chunks, dims [0, 128) and [64, 192): the second one's lanes
#   0-63 repeat dims 64-127 and are not reduced (1/3 more dQ MMA work instead of an M = 64 layout).
#   The reduce warps read 16 queries per tcgen05.ld (thread = head dim), stage them unswizzled as two
#   16 x 64 fp32 boxes (lanes 0-63 / 64-127) and TMA-reduce-add each box into dq_accum.
# * head_dim 256: dK + dV alone take 512 columns, so two CTAs share a key tile (grid x = 2 x key
#   tiles, split = blockIdx.x % 2): both compute the full S^T and dP^T (K, V, Q, dO whole in smem), and
#   CTA `split` accumulates dV, dK and dQ only for head dims [128 split, 128 split + 128): Q^T / dO^T /
#   K^T views start 128 columns in. 1.4x the MMA work of one CTA per tile, the price of staying 1-CTA.
#   Deterministic dQ: turn = rank(key tile) * 2 + split (the slices of a key tile add in slice order).
# TMEM (columns): S^T [0, 64) | dP^T [64, 128) | dV | dK | free, and the dQ^T chunks take the free
# columns first, then dP^T's (as the narrow dQ: drained before dP^T(t+1)), then S^T's:
#     (192, 128): dV [128, 256) dK [256, 448) dQ^T [448, 512) + over dP^T
#     192:        dV [128, 320) dK [320, 512) dQ^T over dP^T + over S^T
#     256 / 2:    dV [128, 256) dK [256, 384) dQ^T [384, 448)
# Serial order (``schedule(cfg)["serial"]``): when a dQ^T chunk lies over S^T (d 192) or Q has one smem
# stage (d 256: K + V + Q + dO of 256 columns leave room for one), S^T(t+1) is issued with dP^T(t+1),
# after the reduce warps drained dQ(t) (pipe_dQ empty) instead of right after dV(t); everything else is
# the order of Note [SM100 backward handshakes]. (192, 128) keeps the pipelined order.

# Note [scrubbed K / V, SM100] (NaN / Inf in keys and values a row cannot see; common/nonfinite.py, the rule
# the SM90 kernel's Note [scrubbed K / V] follows too). The CTA's K and V tiles meet every query row of every
# step, masked pairs included: S^T = K Q^T, dP^T = V dO^T and dQ += dS K multiply P = 0 / dS = 0 by every key,
# and 0 * NaN = NaN. So the otherwise idle warps 14-15 wait for the K / V load (they only read its barrier:
# one load per CTA), zero the non-finite elements of both tiles in shared memory, flag their keys (one byte
# per key and tile) and hand them on (``kvs``) to the MMA warp, which waits before its first MMA, and to the
# compute warps, which give back the NaN the unscrubbed tiles give the pairs a row sees: P^T = NaN where
# P^T != 0 on a flagged K row, dS^T = NaN where P^T != 0 on a flagged V row (dV = P^T dO does not read V).
# Two more rules keep a row that saw a NaN (its lse, out and D are NaN) from reaching keys it cannot see: the
# mask zeroes P after the exponential instead of putting -inf into S (exp2(-inf - NaN) is NaN), and dS^T = 0
# where P^T = 0 in columns whose D is NaN (without softcap; softcap_grad already gives 0 where P = 0).
# Compile-verified only (no Blackwell GPU here).

# Note [FlashMask skipped steps, SM100]. A key tile's per-bound min / max tell, in closed form, which query
# tiles every column's interval covers (common/flashmask.skipped_query_tiles): those steps have P = dS = 0 for
# every pair. Before the roles split, one thread writes each query head's skipped ranges, merged and clipped to
# the tile's [m_min, m_min + num_m) (``write_skips``), to shared memory; every role then counts the steps that
# compute (``tile_info``: n_iter) and walks them in the same head-major order (``first_coords`` /
# ``next_coords`` jump past the ranges, past whole heads too), so a skipped step loads nothing and computes
# nothing. With deterministic dQ the reduce warps walk every step of the range instead (n_struct) and a skipped
# one still waits for its turn and passes it on, reducing nothing: the turn counters of the query tile count
# every key tile that reaches it. The SM90 backward's stage B (bwd_sm90.py) is the same rule and runs on an
# H100; here compile-verified only.

TILE_M = 128  # query rows per query tile, head dims <= 128 (= ACCUM_ROW_PAD: one dq_sem counter per tile)
TILE_M_WIDE = 64  # query rows per query tile of the wide schedule (head_dim 192 / 256, (192, 128))
TILE_N = 128  # keys per CTA (TMEM lane = key row)
MMA_M = 128  # rows of every tcgen05 MMA here (cta_group 1, M = 128: TMEM lane = row)
NUM_THREADS = 512
SMEM_BYTES_MAX_SM100 = 232_448
TMEM_COLS = 512
Q_STAGE = 2  # >= 2 in the pipelined order: S^T(t+1) is issued before Q(t) is released (Note [SM100 backward handshakes])

_WARPS_REDUCE = (0, 1, 2, 3)
_WARPS_COMPUTE = (4, 5, 6, 7, 8, 9, 10, 11)
_WARP_MMA, _WARP_LOAD = 12, 13
_WARPS_SCRUB = (14, 15)  # Note [scrubbed K / V, SM100]
# setmaxnreg per warpgroup: reduce, compute (x2 WGs), MMA/load/idle; sum <= 4 * 128.
REGS = (64, 192, 64)
EPI_CHUNK = 16  # dK / dV columns per TMEM load in the epilogue
DQ_CHUNK = 32  # dQ columns per TMEM load, smem stage and TMA reduce-add box (128 rows x 32 fp32 = 16 KiB)
DQ_STAGES = 2  # dQ staging buffers: the reduce warps fill one while the TMA reads the other
DQT_ROWS = 16  # wide schedule: query rows (TMEM columns) per dQ^T load / smem box (Note [SM100 wide schedule])
DQT_BOX = 64  # wide schedule: head-dim columns per dQ^T smem box and TMA reduce-add box
DQT_BOXES = 2  # wide schedule: boxes per dQ^T stage (MMA_M lanes = DQT_BOXES x DQT_BOX head dims)
DS_CHUNK = 16  # dP^T / dS^T columns per TMEM load / smem store in the compute warps
STAT_CHUNK = 16  # lse_log2 / dpsum values per vector load in the compute warps

assert DQT_BOXES * DQT_BOX == MMA_M
assert DS_CHUNK % STAT_CHUNK == 0, "a dP^T / S^T chunk reads whole lse / dpsum chunks"
assert all(ACCUM_ROW_PAD % m == 0 and m % DQ_SEM_ROWS == 0 for m in (TILE_M, TILE_M_WIDE)), \
    "query tiles own whole accumulator / counter blocks"


class BwdBarrier(IntEnum):
    """Named barrier ids (0 is __syncthreads)."""

    Compute = 1  # the 256 compute threads: all S^T loaded before P^T overwrites it
    Reduce = 2  # the 128 dQ-reduce threads: deterministic turn taking
    TmemFree = 3  # compute + reduce threads: last TMEM reads done, then dealloc


# Edge trace of a traced build (common/trace.py): role slots and the edges they wait on (dq_turn: the
# deterministic dQ turn counter of the query tile given as the count).
TRACE_ROLES = ("reduce", "compute", "mma", "load", "scrub")
ROLE_THREADS = {"reduce": 32 * len(_WARPS_REDUCE), "compute": 32 * len(_WARPS_COMPUTE), "mma": 1,
                "load": 1, "mma_warp": 32, "scrub": 32 * len(_WARPS_SCRUB)}
# pipeline name -> (producer role, consumer role). tcgen05 / TMA sides arrive from one elected thread.
PIPES = {"kv": ("load", "mma"), "q": ("load", "mma"), "do": ("load", "mma"), "S": ("mma", "compute"),
         "dP": ("mma", "compute"), "dS": ("compute", "mma"), "dQ": ("mma", "reduce"),
         "dKV": ("mma", "compute")}
BARRIERS = {BwdBarrier.Compute: ("compute",), BwdBarrier.Reduce: ("reduce",),
            BwdBarrier.TmemFree: ("compute", "reduce")}
# Note [scrubbed K / V, SM100]: the scrub warps hand the scrubbed K / V tiles and their key flags to the MMA
# warp (all 32 threads arrive) and the compute warps.
SCRUB_PIPES = {"kvs": ("scrub", ("mma_warp", "compute"))}
TRACE_EDGES = edge_names(PIPES) + ["tmem_free", "dq_turn"] + edge_names(SCRUB_PIPES)


def _sum_tree(vals: list):
    """The sum of ``vals`` as a pairwise tree (plain Python, unrolled where a kernel calls it)."""
    while len(vals) > 1:
        vals = [vals[i] + vals[i + 1] for i in range(0, len(vals), 2)]
    return vals[0]


def check_arrivals(groups: dict, barriers: dict) -> None:
    """Trace-time check (common/barriers.py, the rule the SM100 forward follows too): every pipeline's
    producer / consumer arrival count and every named barrier's thread count equal the threads of
    the roles that arrive (ArrivalCountError, a ValueError, otherwise)."""
    _check_arrivals(groups, barriers, pipes=dict(PIPES, **SCRUB_PIPES), barriers=BARRIERS, role_threads=ROLE_THREADS)


def is_wide(cfg: BwdConfig) -> bool:
    """head_dim or head_dim_v above 128: the wide schedule (Note [SM100 wide schedule])."""
    return max(cfg.head_dim, cfg.head_dim_v) > 128


def schedule(cfg: BwdConfig) -> dict:
    """The static plan of ``cfg``: tile_m, n_split (CTAs per key tile, each owning 1 / n_split of the
    head dims of dK, dV and dQ), q_stage / do_stage (smem stages), serial (Note [SM100 wide schedule])
    and the dQ^T chunks of the wide schedule: (first head dim relative to the CTA's slice, first lane
    that owns a new head dim, TMEM column)."""
    d, dv = cfg.head_dim, cfg.head_dim_v
    if not is_wide(cfg):
        do_stage = 2 if _smem_bytes(d, dv, TILE_M, Q_STAGE, 2, False) <= SMEM_BYTES_MAX_SM100 else 1
        return {"tile_m": TILE_M, "n_split": 1, "q_stage": Q_STAGE, "do_stage": do_stage, "serial": False,
                "dq_chunks": ()}
    tile_m = TILE_M_WIDE
    n_split = 2 if d == 256 else 1  # dK + dV of 256 columns each fill TMEM alone
    dk_cols, dv_cols = d // n_split, dv // n_split
    stages = [(q, o) for q in (2, 1) for o in (2, 1)
              if _smem_bytes(d, dv, tile_m, q, o, True) <= SMEM_BYTES_MAX_SM100]
    q_stage, do_stage = stages[0]
    # TMEM: S^T [0, 64) | dP^T [64, 128) | dV | dK | free; a dQ^T chunk takes 64 columns: the free ones
    # first, then dP^T's (drained before dP^T(t+1), as the narrow schedule's dQ), then S^T's (serial)
    end = 2 * tile_m + dv_cols + dk_cols
    slots = [c for c in range(end, TMEM_COLS - tile_m + 1, tile_m)] + [tile_m, 0]
    chunks, base = [], 0
    while base < dk_cols:
        first = min(base, dk_cols - MMA_M)
        chunks.append((first, base - first, slots[len(chunks)]))
        base += MMA_M
    serial = q_stage == 1 or any(col == 0 for _, _, col in chunks)
    return {"tile_m": tile_m, "n_split": n_split, "q_stage": q_stage, "do_stage": do_stage, "serial": serial,
            "dq_chunks": tuple(chunks)}


def tmem_plan(cfg: BwdConfig) -> dict:
    """TMEM column offsets of each accumulator ("dQ": the narrow schedule's dQ, or the first dQ^T chunk)."""
    sch = schedule(cfg)
    tile_m, n_split = sch["tile_m"], sch["n_split"]
    s, dp = 0, tile_m
    dv = 2 * tile_m
    dk = dv + cfg.head_dim_v // n_split
    end = dk + cfg.head_dim // n_split
    dq = sch["dq_chunks"][0][2] if sch["dq_chunks"] else dp
    if sch["dq_chunks"]:
        end = max([end] + [col + tile_m for _, _, col in sch["dq_chunks"]])
    return {"S": s, "P": s, "dP": dp, "dQ": dq, "dV": dv, "dK": dk, "end": end}


def _smem_bytes(d: int, dv: int, tile_m: int, q_stage: int, do_stage: int, wide: bool) -> int:
    """Upper bound of the SharedStorage: barriers (one 1 KiB block), K, V, Q stages, dO stages, dS, the
    fp32 dQ staging, each 1024-B aligned, plus 1024 B for aligning the dynamic smem base."""
    tile = lambda rows, cols: ((rows * cols * 2 + 1023) // 1024) * 1024  # noqa: E731
    staging = DQ_STAGES * (DQT_BOXES * DQT_ROWS * DQT_BOX if wide else TILE_M * DQ_CHUNK) * 4
    return (1024 + 1024 + tile(TILE_N, d) + tile(TILE_N, dv) + q_stage * tile(tile_m, d)
            + do_stage * tile(tile_m, dv) + tile(TILE_N, tile_m) + staging)


def check_smem_plan(storage_bytes: int, plan_bytes: int) -> None:
    """Trace-time: the SharedStorage (+1024 B base alignment) fits the host-side plan and the arch."""
    if storage_bytes + 1024 > plan_bytes or plan_bytes > SMEM_BYTES_MAX_SM100:
        raise ValueError(f"SharedStorage {storage_bytes} B (+1024 alignment) exceeds the plan {plan_bytes} B "
                         f"or the {SMEM_BYTES_MAX_SM100} B limit")


def _size(shape) -> int:
    if isinstance(shape, tuple):
        out = 1
        for sh in shape:
            out *= _size(sh)
        return out
    return int(shape)


def _crd2idx(coord, shape, stride) -> int:
    """cute.crd2idx for static (nested int tuple) layouts in plain Python (an int coordinate of a
    tuple mode is split colexicographically, as CuTe does)."""
    if isinstance(shape, tuple):
        if isinstance(coord, int):
            out = 0
            for sh, st in zip(shape, stride):
                n = _size(sh)
                out += _crd2idx(coord % n, sh, st)
                coord //= n
            return out
        return sum(_crd2idx(c, sh, st) for c, sh, st in zip(coord, shape, stride))
    return coord * stride


def _mma_offset(shape_stride, row: int, col: int, stage: int = 0) -> int:
    """Pre-swizzle offset of logical element (row, col) = (M or N, K) of an MMA operand smem layout
    ((row_inst, col_inst), MMA_rows, MMA_cols, stages), given as its outer (shape, stride)."""
    shape, stride = shape_stride
    ri, ci = _size(shape[0][0]), _size(shape[0][1])
    return _crd2idx(((row % ri, col % ci), row // ri, col // ci, stage), shape, stride)


def check_operand_aliases(pairs, rows: int, cols: int, step: int = 8, col_off: int = 0) -> int:
    """Trace-time check that two views of one smem buffer place every element at the same byte: for
    each (name, a, b, b_is_2d) the element (r, c + col_off) of ``a`` (MMA operand layout) and (c, r) of
    ``b`` (the transposed MMA operand, started ``col_off`` columns into the buffer), or the (r, c) of a
    2-D row-major epilogue layout, have equal offsets and equal swizzles. Rows and columns are sampled at
    the first and last element of every ``step`` group (8 rows: a swizzle atom's rows; 8 columns: one
    16-byte chunk). Returns the element offset of the view's start (whole 1 KiB swizzle repeats, so the
    swizzle pattern is the same from there)."""
    start = 0
    for name, a, b, b_is_2d in pairs:
        if str(a.inner) != str(b.inner):
            raise ValueError(f"{name}: swizzles differ ({a.inner} vs {b.inner})")
        sa = (a.outer.shape, a.outer.stride)
        sb = (b.outer.shape, b.outer.stride)
        ri, ci = _size(sa[0][0][0]), _size(sa[0][0][1])
        r, c = rows - 1, cols - 1 + col_off
        if _mma_offset(sa, r, c) != cute.crd2idx(((r % ri, c % ci), r // ri, c // ci, 0), a.outer):
            raise ValueError(f"{name}: _crd2idx disagrees with cute.crd2idx")
        start = _mma_offset(sa, 0, col_off)
        if start % 512:  # 512 16-bit elements = 1 KiB, the SW128 repeat
            raise ValueError(f"{name}: a view at column {col_off} starts at element {start}, inside a swizzle repeat")
        samples = lambda n: sorted({x for x0 in range(0, n, step) for x in (x0, min(x0 + step - 1, n - 1))})  # noqa: E731
        for r in samples(rows):
            for c in samples(cols):
                oa = _mma_offset(sa, r, c + col_off)
                ob = _crd2idx((r, c), *sb) if b_is_2d else _mma_offset(sb, c, r)
                if not (isinstance(oa, int) and isinstance(ob, int)):
                    raise TypeError(f"{name}: layouts must be static ({type(oa)}, {type(ob)})")
                if oa != ob + start:
                    raise ValueError(f"{name}: element ({r}, {c + col_off}) at {oa} vs {ob} + {start}")
    return start


# Note [compute warps' registers]
# The compute warps run the query-tile loop in 192 registers (REGS). Under the DSL's CUDA 13 ptxas on sm_103a
# they ran short: the default matrix's d 96 GQA 2 causal softcap config and 41 varlen causal / window configs of
# `--full` spilled 8-60 B, values reloaded in every iteration (the swizzled dS^T store addresses, the smem base of
# the mbarrier waits' retry path). Two changes, no arithmetic changed, make every config fit:
# * S^T by chunks: S^T was read as the warpgroup's 64 columns at once, and ptxas issued all 64 lse loads of the
#   iteration right after it, so 64 S + 64 lse registers were live through softcap / mask / exp2 (the peak of
#   the loop). S^T is now read DS_CHUNK columns at a time, as dP^T already was, each chunk softcapped, masked and
#   exponentiated before the next is read: the same operations on each element, in the same order; P^T is
#   written after the last chunk and the Compute barrier, as before. `s_to_p` does it, called in one branch
#   with the mask and in the other without (the old code's one runtime branch per query tile): with the
#   branch taken per chunk the CUDA 12 ptxas kept the chunks' mask predicates in registers (P2R) and spilled
#   64 B in bf16 d 96 varlen window configs.
# * TMEM copies by warp: a 32x32b tcgen05.ld / st moves TMEM lanes [32 w, 32 w + 32) of warp w % 4 (thread =
#   lane, values = columns): its tiled layout gives the 32 threads of a warp stride 0, so the TMEM address of a
#   thread's slice depends on its warp only. Sliced by threadIdx, ptxas kept such addresses in vector registers
#   (moved to a uniform register at each tcgen05 instruction); sliced by the warp-uniform 32 (warp % 4)
#   (`warp_lane0`, which checks the stride 0 at trace time) the same numbers are computed in uniform registers.
#   The register side of such a copy is the thread's own fragment, the same for every thread.
# Neither alone is enough (S^T by chunks alone: four d 64 configs without a mask newly spilled 16 B under CUDA 13).
# * FlashMask (a `startend` build): a step whose query tile the key tile's bound minima / maxima cut
#   (`fm.classify_tile`: not whole) takes the masked branch as well, where `s_to_p` loads this key's bounds once
#   (n registers, made relative to q0) and masks each chunk after the causal / window mask, compile-time columns
#   against them; whole steps take the unmasked branch. Where only one of the two masks cuts a step, the other
#   masks nothing there (rows >= seqlen_q get P = 0 with or without it), so every P is the one of the separate
#   masks before. The mask head is stepped with the query head (`fm_head`, `fm_head_rem`, from head //
#   fm_head_div of the first head) instead of divided per step: with the division in the loop, ptxas kept the
#   divisor's reciprocal and operands in registers through it and 2 of the 5 FlashMask lines of the default
#   matrix spilled 24-32 B under CUDA 13 on sm_103a (with the bounds applied per chunk inside the old code's
#   per-chunk mask branch, 3 of 5 spilled 16-212 B).
# Headroom (CUDA 13, sm_103a, setmaxnreg 176 instead of 192 for the compute warps): the two configs that spilled
# most before (bf16 d 128 varlen window, the d 96 GQA 2 causal softcap one) compile spill-free (b5747b1; the d 96
# one again with FlashMask's code in, 2026-12-07); the FlashMask lts_lte line (d 128, GQA 4, deterministic)
# spills 40 B there: FlashMask's lines have less than 16 registers to spare.
# Tried and not kept (2026-12-07, the bf16 varlen configs on sm_103a / CUDA 13 unless said): the dS^T stores at one
# swizzled row address XOR 16 piece instead of eight swizzled addresses (ptxas computes the eight XORs before the
# loop anyway; with the two changes above it spilled 16-24 B under CUDA 12 on sm_100a, d 64 with a window);
# setmaxnreg 64 / 200 / 48 instead of 64 / 192 / 64 (13 of 72 spilled, 20-284 B).


def warp_lane0(tiled_copy, tmem_side: str) -> Int32:
    """32 (warp % 4) as a warp-uniform value: the slice index of a 32x32b TMEM copy (Note [compute warps'
    registers]) whose TMEM operand is its ``tmem_side`` ("src": tcgen05.ld, "dst": tcgen05.st). Trace time:
    ValueError unless that side's TV layout gives the threads of one warp one offset (thread mode (32, n),
    stride 0 in its first mode). Its register side is only ever the thread's own fragment."""
    tv = tiled_copy.layout_src_tv_tiled if tmem_side == "src" else tiled_copy.layout_dst_tv_tiled
    thr_shape, thr_stride = tv.shape[0], tv.stride[0]
    if not (isinstance(thr_shape, tuple) and thr_shape[0] == 32 and thr_stride[0] == 0):
        raise ValueError(f"TMEM copy sliced by warp: its {tmem_side} TV layout {tv} gives a warp's threads "
                         "different TMEM offsets")
    return (cute.arch.make_warp_uniform(cute.arch.warp_idx()) % 4) * 32


def tmem_chunk_copy(tAcc, rows: int, cols: int, tidx):
    """A tcgen05.ld (32x32b, ``cols`` repetitions) of ``cols`` columns of the accumulator ``tAcc``
    (TMEM lane = row): thread ``tidx``'s slice, its source view at column 0 (offset the iterator for
    other columns) and the register fragment's shape."""
    acc_all = tAcc[(None, None), 0, 0]
    chunk0 = cute.make_tensor(acc_all.iterator, cute.composition(acc_all.layout, cute.make_layout((rows, cols))))
    atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(cols)), Float32)
    thr = tcgen05.make_tmem_copy(atom, chunk0).get_slice(tidx)
    return thr, thr.partition_S(chunk0), thr.partition_D(cute.make_identity_tensor((rows, cols))).shape


class FlashBwdSm100:
    """Blackwell backward main kernel for one ``BwdConfig``; see the module docstring."""

    def __init__(self, cfg: BwdConfig, spt: bool = False):
        reason = self.unsupported_reason(cfg)
        if reason is not None:
            raise ValueError(f"FlashBwdSm100: {reason}")
        self.cfg = cfg
        # Note [deterministic dQ, descending order] of bwd_sm90 (opt-in there too): deterministic
        # causal / window writers of a query tile go in descending key tile, highest key tile first.
        self.spt = bool(spt) and cfg.deterministic and (cfg.causal or cfg.has_window)
        self.head_dim = cfg.head_dim
        self.head_dim_v = cfg.head_dim_v
        self.group = cfg.qhead_per_kvhead
        # Note [FlashMask skipped steps, SM100]
        self.fm_skip_steps = bool(cfg.startend)
        sch = schedule(cfg)
        self.wide = is_wide(cfg)
        self.tile_m, self.n_split = sch["tile_m"], sch["n_split"]
        self.q_stage, self.do_stage, self.serial = sch["q_stage"], sch["do_stage"], sch["serial"]
        self.dq_chunks = sch["dq_chunks"]
        self.dk_cols, self.dv_cols = cfg.head_dim // self.n_split, cfg.head_dim_v // self.n_split
        self.tmem = tmem_plan(cfg)
        assert self.tmem["end"] <= TMEM_COLS, self.tmem
        assert self.wide or cfg.head_dim <= TILE_M, "dQ reuses the dP^T columns"
        assert self.serial or self.q_stage >= 2, "the pipelined order issues S^T(t+1) before Q(t) is released"
        assert self.smem_bytes(cfg) <= SMEM_BYTES_MAX_SM100
        assert sum((REGS[0], 2 * REGS[1], REGS[2])) <= 4 * 128

    # ------------------------------------------------------------------ host-side facts
    @staticmethod
    def unsupported_reason(cfg: BwdConfig) -> str | None:
        if _arch.family(cfg.arch) != 100:
            return f"arch {cfg.arch} is not SM100"
        if cfg.dtype not in ("bfloat16", "float16"):
            return f"dtype {cfg.dtype} (bfloat16/float16 only)"
        pairs = ((64, 64), (96, 96), (128, 128), (192, 192), (256, 256), (192, 128))
        if (cfg.head_dim, cfg.head_dim_v) not in pairs:
            return (f"head_dim {cfg.head_dim} / head_dim_v {cfg.head_dim_v} (SM100 backward supports "
                    f"{', '.join(f'({a}, {b})' for a, b in pairs)})")
        if cfg.qhead_per_kvhead < 1:
            return f"qhead_per_kvhead {cfg.qhead_per_kvhead}"
        if cfg.startend and cfg.varlen:
            return "FlashMask startend_row_indices with varlen"
        return None

    @staticmethod
    def smem_bytes(cfg: BwdConfig) -> int:
        sch = schedule(cfg)
        return _smem_bytes(cfg.head_dim, cfg.head_dim_v, sch["tile_m"], sch["q_stage"], sch["do_stage"],
                           is_wide(cfg))

    # ------------------------------------------------------------------ host (jit) side
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSElog2: cute.Tensor, mdPsum: cute.Tensor, mdQaccum: cute.Tensor,
                 mdK: cute.Tensor, mdV: cute.Tensor, mCuSeqlensQ, mCuSeqlensK, mdQsem, mdKaccum, mdVaccum,
                 mdKVsem, softmax_scale: Float32, softcap: Float32, window_left: Int32, window_right: Int32,
                 max_seqlen_q: Int32, max_seqlen_k: Int32, stream, trace_addr=None, mStartend=None, mFmMinMax=None):
        """``trace_addr``: the edge-trace array (common/trace.py) of a traced build, else None.
        ``mStartend`` / ``mFmMinMax``: a FlashMask build's column bounds and their per key tile (TILE_N)
        min / max (bwd_config.BwdKernelArgs), else None."""
        cfg = self.cfg
        self.dtype = mQ.element_type
        varlen = const_expr(mCuSeqlensQ is not None)
        if const_expr(cfg.varlen != varlen):
            raise ValueError("cfg.varlen does not match the cu_seqlens arguments")
        if const_expr(cfg.deterministic != (mdQsem is not None)):
            raise ValueError("cfg.deterministic does not match mdQsem")
        if const_expr(mdKaccum is not None or mdVaccum is not None or mdKVsem is not None):
            raise ValueError("the group-split workspace (dk_accum / dv_accum / dkv_sem) is SM90's")
        # (seq, dim, head[, batch]) views of every [.., seq, head, dim] tensor
        modes = [0, 2, 1] if const_expr(varlen) else [1, 3, 2, 0]
        mQ, mK, mV, mdO, mdK, mdV = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))
                                     for t in (mQ, mK, mV, mdO, mdK, mdV)]
        d, dv = self.head_dim, self.head_dim_v
        cta_group = tcgen05.CtaGroup.ONE
        K_, MN_ = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        tm = self.tile_m
        self.tiler_S = (TILE_N, tm, d)  # S^T = K Q^T
        self.tiler_dP = (TILE_N, tm, dv)  # dP^T = V dO^T
        self.tiler_dV = (TILE_N, self.dv_cols, tm)  # dV += P^T dO    (this CTA's head-dim slice)
        self.tiler_dK = (TILE_N, self.dk_cols, tm)  # dK += dS^T Q
        if const_expr(self.wide):
            self.tiler_dQ = (MMA_M, tm, TILE_N)  # dQ^T = K^T dS^T, one 128-head-dim chunk at a time
        else:
            self.tiler_dQ = (TILE_M, d, TILE_N)  # dQ = dS K
        dt = self.dtype
        mma_S = sm100_utils.make_trivial_tiled_mma(dt, dt, K_, K_, Float32, cta_group, self.tiler_S[:2])
        mma_dP = sm100_utils.make_trivial_tiled_mma(dt, dt, K_, K_, Float32, cta_group, self.tiler_dP[:2])
        mma_dV = sm100_utils.make_trivial_tiled_mma(dt, dt, K_, MN_, Float32, cta_group, self.tiler_dV[:2],
                                                    tcgen05.OperandSource.TMEM)
        mma_dK = sm100_utils.make_trivial_tiled_mma(dt, dt, K_, MN_, Float32, cta_group, self.tiler_dK[:2])
        mma_dQ = sm100_utils.make_trivial_tiled_mma(dt, dt, MN_, MN_, Float32, cta_group, self.tiler_dQ[:2])

        q_stage, do_stage = self.q_stage, self.do_stage
        sK_layout = sm100_utils.make_smem_layout_a(mma_S, self.tiler_S, dt, 1)
        sQ_layout = sm100_utils.make_smem_layout_b(mma_S, self.tiler_S, dt, q_stage)
        sV_layout = sm100_utils.make_smem_layout_a(mma_dP, self.tiler_dP, dt, 1)
        sdO_layout = sm100_utils.make_smem_layout_b(mma_dP, self.tiler_dP, dt, do_stage)
        tP_layout = sm100_utils.make_smem_layout_a(mma_dV, self.tiler_dV, dt, 1)
        sdOt_layout = sm100_utils.make_smem_layout_b(mma_dV, self.tiler_dV, dt, do_stage)
        sdSt_layout = sm100_utils.make_smem_layout_a(mma_dK, self.tiler_dK, dt, 1)
        sQt_layout = sm100_utils.make_smem_layout_b(mma_dK, self.tiler_dK, dt, q_stage)
        if const_expr(self.wide):
            sdS_layout = sm100_utils.make_smem_layout_b(mma_dQ, self.tiler_dQ, dt, 1)  # dS^T as B (N = query)
            sKt_layout = sm100_utils.make_smem_layout_a(mma_dQ, self.tiler_dQ, dt, 1)  # K^T as A (M = head dim)
        else:
            sdS_layout = sm100_utils.make_smem_layout_a(mma_dQ, self.tiler_dQ, dt, 1)
            sKt_layout = sm100_utils.make_smem_layout_b(mma_dQ, self.tiler_dQ, dt, 1)
        sdS_epi_layout = sm100_utils.make_smem_layout_epi(dt, LayoutEnum.ROW_MAJOR, (TILE_N, tm), 1)

        # The MN-major views alias the K-major buffers the TMA fills (stage 0 checked; stages are
        # whole-tile strides in both), and the dS^T epilogue view aliases the dK A operand. A view of a
        # head-dim slice (n_split, dQ^T chunks) starts at a static element offset of the K-major buffer.
        if const_expr(self.wide):
            self.k_offs = [check_operand_aliases([("K / K^T", sK_layout, sKt_layout, False)], TILE_N, MMA_M,
                                                 col_off=h * self.dk_cols + first)
                           for h in range(self.n_split) for first, _, _ in self.dq_chunks]
            # every slice's view (slice 0 at offset 0); q_off / do_off: the start of the last slice
            self.q_off = [check_operand_aliases([("Q / Q^T", sQ_layout, sQt_layout, False)], tm, self.dk_cols,
                                                col_off=h * self.dk_cols) for h in range(self.n_split)][-1]
            self.do_off = [check_operand_aliases([("dO / dO^T", sdO_layout, sdOt_layout, False)], tm,
                                                 self.dv_cols, col_off=h * self.dv_cols)
                           for h in range(self.n_split)][-1]
        else:
            check_operand_aliases([("K / K^T", sK_layout, sKt_layout, False),
                                   ("Q / Q^T", sQ_layout, sQt_layout, False),
                                   ("dO / dO^T", sdO_layout, sdOt_layout, False)], TILE_N, d)
        check_operand_aliases([("dS^T / dS", sdSt_layout, sdS_layout, False)], TILE_N, tm)
        check_operand_aliases([("dS^T / epilogue", sdSt_layout,
                                cute.make_composed_layout(sdS_epi_layout.inner, 0,
                                                          cute.slice_(sdS_epi_layout.outer, (None, None, 0))),
                                True)], TILE_N, tm)
        tma_op = cpasync.CopyBulkTensorTileG2SOp(cta_group)
        vmnk = (1, 1, 1, 1)
        sel = lambda l: cute.select(l, mode=[0, 1, 2])  # noqa: E731
        tma_atom_K, tma_K = cute.nvgpu.make_tiled_tma_atom_A(tma_op, mK, sel(sK_layout), self.tiler_S, mma_S, vmnk)
        tma_atom_Q, tma_Q = cute.nvgpu.make_tiled_tma_atom_B(tma_op, mQ, sel(sQ_layout), self.tiler_S, mma_S, vmnk)
        tma_atom_V, tma_V = cute.nvgpu.make_tiled_tma_atom_A(tma_op, mV, sel(sV_layout), self.tiler_dP, mma_dP, vmnk)
        tma_atom_dO, tma_dO = cute.nvgpu.make_tiled_tma_atom_B(tma_op, mdO, sel(sdO_layout), self.tiler_dP, mma_dP,
                                                               vmnk)
        # dQ: fp32 row-major staging -> TMA reduce-add into dq_accum, viewed as (accumulator rows, D,
        # head[, batch]); boxes of 128 rows x DQ_CHUNK (narrow) or DQT_ROWS x DQT_BOX (wide; two boxes,
        # lanes 0-63 and 64-127 of a dQ^T chunk, per stage)
        if const_expr(self.wide):
            # unswizzled: 32 consecutive lanes write 32 consecutive floats of one row (no bank conflict),
            # and every address is one base register plus an immediate (the 64-register reduce warps)
            box = (DQT_ROWS, DQT_BOX)
            sdQ_layout = cute.make_composed_layout(
                cute.make_swizzle(0, 4, 3), 0,
                cute.make_layout((DQT_ROWS, DQT_BOX, DQT_BOXES * DQ_STAGES), stride=(DQT_BOX, 1, DQT_ROWS * DQT_BOX)))
        else:
            box = (TILE_M, DQ_CHUNK)
            sdQ_layout = sm100_utils.make_smem_layout_epi(Float32, LayoutEnum.ROW_MAJOR, box, DQ_STAGES)
        acc_modes = [1, 2, 0] if const_expr(varlen) else [2, 3, 1, 0]
        mdQacc = cute.make_tensor(mdQaccum.iterator, cute.select(mdQaccum.layout, mode=acc_modes))
        tma_atom_dQ, tma_dQ = cpasync.make_tiled_tma_atom(
            cpasync.CopyReduceBulkTensorTileS2GOp(), mdQacc, cute.select(sdQ_layout, mode=[0, 1]), box)
        self.k_bytes = cute.size_in_bytes(dt, sel(sK_layout))
        self.v_bytes = cute.size_in_bytes(dt, sel(sV_layout))
        self.q_bytes = cute.size_in_bytes(dt, sel(sQ_layout))
        self.do_bytes = cute.size_in_bytes(dt, sel(sdO_layout))

        @cute.struct
        class SharedStorage:
            bar_kv: cute.struct.MemRange[Int64, 2]
            bar_q: cute.struct.MemRange[Int64, 2 * q_stage]
            bar_do: cute.struct.MemRange[Int64, 2 * do_stage]
            bar_S: cute.struct.MemRange[Int64, 2]
            bar_dP: cute.struct.MemRange[Int64, 2]
            bar_dS: cute.struct.MemRange[Int64, 2]
            bar_dQ: cute.struct.MemRange[Int64, 2]
            bar_dKV: cute.struct.MemRange[Int64, 2]
            bar_kvs: cute.struct.MemRange[Int64, 2]
            kv_flags: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, 2 * TILE_N], 16]
            fm_skips: cute.struct.Align[cute.struct.MemRange[Int32, 4 * self.group if self.fm_skip_steps else 4], 16]
            tmem_holding: Int32
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sV_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sdO_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sdSt_layout)], 1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sdQ_layout)], 1024]

        self.shared_storage = SharedStorage
        # the launch requests the allocator's usage: keep smem_bytes (the host-side plan) an upper bound
        check_smem_plan(SharedStorage.size_in_bytes(), self.smem_bytes(cfg))

        # Without softcap S stays raw q.k and the scale lives in the exp2 FMA; with softcap the
        # compute threads form the scaled logit first (as the forward), so the exp2 scale is log2(e).
        if const_expr(cfg.has_softcap):
            scale_log2 = Float32(LOG2_E)
            softcap_in = softmax_scale / softcap
        else:
            scale_log2 = softmax_scale * Float32(LOG2_E)
            softcap_in = Float32(0.0)

        if const_expr(varlen):
            num_batch = mCuSeqlensQ.shape[0] - 1
            num_heads_kv = mK.shape[2]
        else:
            num_batch = mQ.shape[3]
            num_heads_kv = mK.shape[2]
        num_n_tiles = (max_seqlen_k + TILE_N - 1) // TILE_N
        fm_head_div = Int32(1)
        if const_expr(cfg.startend != ""):
            fm_head_div = mQ.shape[2] // mStartend.shape[1]  # query heads per mask head

        self.kernel(
            mma_S, mma_dP, mma_dV, mma_dK, mma_dQ,
            tma_atom_K, tma_K, tma_atom_V, tma_V, tma_atom_Q, tma_Q, tma_atom_dO, tma_dO, tma_atom_dQ, tma_dQ,
            mLSElog2, mdPsum, mdQaccum, mdK, mdV, mCuSeqlensQ, mCuSeqlensK, mdQsem,
            sK_layout, sQ_layout, sV_layout, sdO_layout, tP_layout, sdOt_layout, sdSt_layout, sQt_layout,
            sdS_layout, sKt_layout, sdS_epi_layout, sdQ_layout,
            softmax_scale, scale_log2, softcap_in, softcap, window_left, window_right, trace_addr,
            mStartend, mFmMinMax, fm_head_div,
        ).launch(grid=[num_n_tiles * self.n_split, num_heads_kv, num_batch], block=[NUM_THREADS, 1, 1], stream=stream,
                 min_blocks_per_mp=1)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, mma_S: cute.TiledMma, mma_dP: cute.TiledMma, mma_dV: cute.TiledMma,
               mma_dK: cute.TiledMma, mma_dQ: cute.TiledMma,
               tma_atom_K: cute.CopyAtom, mK: cute.Tensor, tma_atom_V: cute.CopyAtom, mV: cute.Tensor,
               tma_atom_Q: cute.CopyAtom, mQ: cute.Tensor, tma_atom_dO: cute.CopyAtom, mdO: cute.Tensor,
               tma_atom_dQ: cute.CopyAtom, mdQacc: cute.Tensor,
               mLSElog2: cute.Tensor, mdPsum: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor,
               mdV: cute.Tensor, mCuSeqlensQ, mCuSeqlensK, mdQsem,
               sK_layout: cute.ComposedLayout, sQ_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
               sdO_layout: cute.ComposedLayout, tP_layout: cute.ComposedLayout,
               sdOt_layout: cute.ComposedLayout, sdSt_layout: cute.ComposedLayout,
               sQt_layout: cute.ComposedLayout, sdS_layout: cute.ComposedLayout,
               sKt_layout: cute.ComposedLayout, sdS_epi_layout: cute.ComposedLayout,
               sdQ_layout: cute.ComposedLayout,
               softmax_scale: Float32, scale_log2: Float32, softcap_in: Float32, softcap: Float32,
               window_left: Int32, window_right: Int32, trace_addr, mStartend, mFmMinMax, fm_head_div: Int32):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        trace = None
        if const_expr(trace_addr is not None):
            trace = EdgeTrace(trace_addr, TRACE_EDGES)
        if warp_idx == _WARP_LOAD:
            for atom in (tma_atom_K, tma_atom_V, tma_atom_Q, tma_atom_dO, tma_atom_dQ):
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        def group(n):
            return pipeline.CooperativeGroup(pipeline.Agent.Thread, n)

        rt = ROLE_THREADS

        def threads(roles):
            return sum(rt[r] for r in ((roles,) if isinstance(roles, str) else roles))

        counts = {name: (threads(p), threads(c)) for name, (p, c) in dict(PIPES, **SCRUB_PIPES).items()}
        g = {name: (group(p), group(c)) for name, (p, c) in counts.items()}

        pipe_kv = pipeline.PipelineTmaUmma.create(
            num_stages=1, producer_group=g["kv"][0], consumer_group=g["kv"][1],
            tx_count=self.k_bytes + self.v_bytes, barrier_storage=storage.bar_kv.data_ptr(), defer_sync=True)
        pipe_q = pipeline.PipelineTmaUmma.create(
            num_stages=self.q_stage, producer_group=g["q"][0], consumer_group=g["q"][1],
            tx_count=self.q_bytes, barrier_storage=storage.bar_q.data_ptr(), defer_sync=True)
        pipe_do = pipeline.PipelineTmaUmma.create(
            num_stages=self.do_stage, producer_group=g["do"][0], consumer_group=g["do"][1],
            tx_count=self.do_bytes, barrier_storage=storage.bar_do.data_ptr(), defer_sync=True)
        pipe_S = pipeline.PipelineUmmaAsync.create(
            num_stages=1, producer_group=g["S"][0], consumer_group=g["S"][1],
            barrier_storage=storage.bar_S.data_ptr(), defer_sync=True)
        pipe_dP = pipeline.PipelineUmmaAsync.create(
            num_stages=1, producer_group=g["dP"][0], consumer_group=g["dP"][1],
            barrier_storage=storage.bar_dP.data_ptr(), defer_sync=True)
        pipe_dS = pipeline.PipelineAsyncUmma.create(
            num_stages=1, producer_group=g["dS"][0], consumer_group=g["dS"][1],
            barrier_storage=storage.bar_dS.data_ptr(), defer_sync=True)
        pipe_dQ = pipeline.PipelineUmmaAsync.create(
            num_stages=1, producer_group=g["dQ"][0], consumer_group=g["dQ"][1],
            barrier_storage=storage.bar_dQ.data_ptr(), defer_sync=True)
        pipe_dKV = pipeline.PipelineUmmaAsync.create(
            num_stages=1, producer_group=g["dKV"][0], consumer_group=g["dKV"][1],
            barrier_storage=storage.bar_dKV.data_ptr(), defer_sync=True)
        pipe_kvs = pipeline.PipelineAsync.create(
            num_stages=1, producer_group=g["kvs"][0], consumer_group=g["kvs"][1],
            barrier_storage=storage.bar_kvs.data_ptr(), defer_sync=True)
        pipes = (pipe_kv, pipe_q, pipe_do, pipe_S, pipe_dP, pipe_dS, pipe_dQ, pipe_dKV)
        check_arrivals({name: pipeline_counts(name, p) for name, p in zip(list(PIPES) + ["kvs"], pipes + (pipe_kvs,))},
                       {b: sum(rt[r] for r in roles) for b, roles in BARRIERS.items()})

        if warp_idx == _WARPS_REDUCE[0]:
            cute.arch.alloc_tmem(TMEM_COLS, storage.tmem_holding.ptr)
            cute.arch.relinquish_tmem_alloc_permit()
        pipeline.pipeline_init_arrive(is_relaxed=True)
        pipeline.pipeline_init_wait()

        dt = self.dtype
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sdSt = storage.sdS.get_tensor(sdSt_layout.outer, swizzle=sdSt_layout.inner)
        # MN-major views of the same bytes
        sQt = cute.make_tensor(cute.recast_ptr(sQ.iterator, sQt_layout.inner, dtype=dt), sQt_layout.outer)
        sdOt = cute.make_tensor(cute.recast_ptr(sdO.iterator, sdOt_layout.inner, dtype=dt), sdOt_layout.outer)
        sKt = cute.make_tensor(cute.recast_ptr(sK.iterator, sKt_layout.inner, dtype=dt), sKt_layout.outer)
        sdS = cute.make_tensor(cute.recast_ptr(sdSt.iterator, sdS_layout.inner, dtype=dt), sdS_layout.outer)
        sdS_epi = cute.make_tensor(cute.recast_ptr(sdSt.iterator, sdS_epi_layout.inner, dtype=dt),
                                   cute.slice_(sdS_epi_layout.outer, (None, None, 0)))

        tmem_ptr = cute.arch.retrieve_tmem_ptr(Float32, 16, storage.tmem_holding.ptr)
        tm = self.tmem

        def acc(tiled_mma, mn, col):
            thr = tiled_mma.get_slice(0)
            layout = thr.make_fragment_C(thr.partition_shape_C(mn)).layout
            return cute.make_tensor(tmem_ptr + col, layout)

        tStS = acc(mma_S, self.tiler_S[:2], tm["S"])
        tdPtdP = acc(mma_dP, self.tiler_dP[:2], tm["dP"])
        tdVtdV = acc(mma_dV, self.tiler_dV[:2], tm["dV"])
        tdKtdK = acc(mma_dK, self.tiler_dK[:2], tm["dK"])
        if const_expr(self.wide):  # one dQ^T accumulator per chunk
            tdQtdQ = tuple(acc(mma_dQ, self.tiler_dQ[:2], col) for _, _, col in self.dq_chunks)
        else:
            tdQtdQ = (acc(mma_dQ, self.tiler_dQ[:2], tm["dQ"]),)

        tile_args = (mCuSeqlensQ, mCuSeqlensK, mQ, mK, window_left, window_right)
        # Each role's view of the pipelines (traced builds: every wait marks its edge; slots = TRACE_ROLES;
        # built outside the role branches, which may carry only runtime values).
        tp = [traced_pipes(dict(zip(list(PIPES) + ["kvs"], pipes + (pipe_kvs,))), trace, slot)
              for slot in range(len(TRACE_ROLES))]
        kv_flags = storage.kv_flags.get_tensor(cute.make_layout((TILE_N, 2)))
        # Note [FlashMask skipped steps, SM100]: the skipped ranges of each query head, written once, read by
        # every role (tile_info's live step count, the coordinate walks)
        fm_skips = None
        if const_expr(self.fm_skip_steps):
            fm_skips = storage.fm_skips.get_tensor(cute.make_layout((4, self.group)))
            if cute.arch.thread_idx()[0] == 0:
                self.write_skips(self.tile_info(*tile_args), fm_skips, mFmMinMax, fm_head_div)
            cute.arch.barrier()
        tile_args = tile_args + (fm_skips,)

        if warp_idx <= _WARPS_REDUCE[-1]:
            cute.arch.setmaxregister_decrease(REGS[0])
            tile = self.tile_info(*tile_args)
            sdQ = storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner)
            self.reduce(tdQtdQ, tma_atom_dQ, mdQacc, sdQ, mdQsem, tp[0]["dQ"], tile, trace, fm_skips)
            if const_expr(trace is not None):
                trace.mark(0, "tmem_free", 0)
            pipeline.NamedBarrier(barrier_id=int(BwdBarrier.TmemFree),
                                  num_threads=rt["compute"] + rt["reduce"]).arrive_and_wait()
            if const_expr(trace is not None):
                trace.done(0)
            if warp_idx == _WARPS_REDUCE[0]:
                cute.arch.dealloc_tmem(tmem_ptr, TMEM_COLS)
        elif warp_idx <= _WARPS_COMPUTE[-1]:
            cute.arch.setmaxregister_increase(REGS[1])
            tile = self.tile_info(*tile_args)
            fmask = None
            if const_expr(self.cfg.startend != ""):
                fmask = (mStartend, mFmMinMax, fm_head_div)
            self.compute(tStS, tdPtdP, tdVtdV, tdKtdK, sdS_epi, mLSElog2, mdPsum, mdK, mdV,
                         tp[1]["S"], tp[1]["dP"], tp[1]["dS"], tp[1]["dKV"], tile, mCuSeqlensQ,
                         softmax_scale, scale_log2, softcap_in, softcap, fmask, (tp[1]["kvs"], kv_flags), fm_skips)
            if const_expr(trace is not None):
                trace.done(1)
            pipeline.NamedBarrier(barrier_id=int(BwdBarrier.TmemFree),
                                  num_threads=rt["compute"] + rt["reduce"]).arrive()
        elif warp_idx == _WARP_MMA:
            cute.arch.setmaxregister_decrease(REGS[2])
            tile = self.tile_info(*tile_args)
            self.mma(mma_S, mma_dP, mma_dV, mma_dK, mma_dQ, sK, sV, sQ, sdO, sQt, sdOt, sKt, sdSt, sdS,
                     tP_layout, tmem_ptr, tStS, tdPtdP, tdVtdV, tdKtdK, tdQtdQ, tuple(tp[2][n] for n in PIPES), tile,
                     tp[2]["kvs"])
            if const_expr(trace is not None):
                trace.done(2)
        elif warp_idx == _WARP_LOAD:
            cute.arch.setmaxregister_decrease(REGS[2])
            tile = self.tile_info(*tile_args)
            self.load(mma_S, mma_dP, tma_atom_K, mK, tma_atom_V, mV, tma_atom_Q, mQ, tma_atom_dO, mdO,
                      sK, sV, sQ, sdO, tp[3]["kv"], tp[3]["q"], tp[3]["do"], tile, fm_skips)
            if const_expr(trace is not None):
                trace.done(3)
        else:
            # ------------------------------------------------------------ SCRUB warps 14-15
            cute.arch.setmaxregister_decrease(REGS[2])
            tile = self.tile_info(*tile_args)
            self.scrub_kv(sK, sV, sK_layout, sV_layout, kv_flags, tp[4]["kv"], tp[4]["kvs"], tile)
            if const_expr(trace is not None):
                trace.done(4)

    # ------------------------------------------------------------------ Note [scrubbed K / V, SM100]
    @staticmethod
    def key_major(layout):
        """(keys, head dims) view of a K-major A-operand buffer (((128 keys, 16 dims), 1, dim groups, 1) layout;
        the swizzle rides on the buffer's pointer)."""
        outer = layout.outer
        (keys, k16), one, kb = outer.shape[0], outer.shape[1], outer.shape[2]
        (key_stride, k16_stride), _zero, kb_stride = outer.stride[0], outer.stride[1], outer.stride[2]
        assert one == 1 and keys == TILE_N and k16 == 16, outer
        return cute.make_layout((keys, (k16, kb)), stride=(key_stride, (k16_stride, kb_stride)))

    @cute.jit
    def scrub_kv(self, sK, sV, sK_layout, sV_layout, kv_flags, pipe_kv, pipe_kvs, tile):
        """Warps 14-15 (otherwise idle): once K and V have landed, zero their non-finite elements in shared
        memory and flag their keys (``kv_flags[key, 0 / 1]``; common/nonfinite.scrub_rows), then hand both to
        the MMA warp and the compute warps (``kvs``). They only read the kv barrier (the CTA loads K / V once)."""
        n_iter = tile[9]
        if n_iter > 0:
            threads = 32 * len(_WARPS_SCRUB)
            tid = cute.arch.thread_idx()[0] - 32 * _WARPS_SCRUB[0]
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            kvs_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            pipe_kv.consumer_wait(kv_state)
            pipe_kvs.producer_acquire(kvs_state)
            for x, layout, j, d in ((sK, sK_layout, 0, self.head_dim), (sV, sV_layout, 1, self.head_dim_v)):
                nf.scrub_rows(cute.make_tensor(x[None, None, None, 0].iterator, self.key_major(layout)),
                              kv_flags[None, j], tid, threads, nf.threads_per_row(TILE_N, d, threads, self.dtype))
            cute.arch.fence_view_async_shared()
            pipe_kvs.producer_commit(kvs_state)

    @cute.jit
    def nan_where_seen(self, x, n: cutlass.Constexpr, bad: Int32, warp_bad: Int32, p=None):
        """NaN into ``x[k]`` where this thread's key is flagged (``bad``) and P (``p[k]``, else ``x[k]``) is not 0:
        what the unscrubbed K / V tile gives a pair the mask lets through (Note [scrubbed K / V, SM100]). One
        warp-uniform test when no key of the warp is flagged."""
        if warp_bad != 0:
            for k in cutlass.range_constexpr(n):
                pk = x[k] if const_expr(p is None) else p[k]
                x[k] = Float32.nan if (bad != 0) & (pk != Float32(0.0)) else x[k]

    # ------------------------------------------------------------------ work of this CTA
    @cute.jit
    def tile_info(self, mCuSeqlensQ, mCuSeqlensK, mQ, mK, window_left: Int32, window_right: Int32, skips=None):
        """(n_tile, head_kv, batch, offset_q, offset_k, seqlen_q, seqlen_k, m_min, num_m, n_iter,
        accum_row0, left, right, split, n_struct): the same values in every role (split: this CTA's slice of
        the head dims when n_split > 1, else 0). ``n_iter``: the steps that compute; ``n_struct``: the
        (query head, query tile) pairs of the range, which differ with ``skips`` (Note [FlashMask skipped
        steps, SM100]: the merged ranges the column bounds skip, per query head of the group)."""
        cfg = self.cfg
        n_tile, head_kv, batch = cute.arch.block_idx()
        split = Int32(0)
        if const_expr(self.n_split > 1):
            split = n_tile % self.n_split
            n_tile = n_tile // self.n_split
        seq = SeqlenInfo.create(batch, mQ.shape[0], mK.shape[0], mCuSeqlensQ, mCuSeqlensK)
        offset_q, offset_k, seqlen_q, seqlen_k = seq.offset_q, seq.offset_k, seq.seqlen_q, seq.seqlen_k
        accum_row0 = Int32(0)
        if const_expr(mCuSeqlensQ is not None):
            # bwd_config.accum_row_start: (cu_q[b] + R b) // R * R
            accum_row0 = (offset_q + ACCUM_ROW_PAD * batch) // ACCUM_ROW_PAD * ACCUM_ROW_PAD
        left, right = normalize_window(window_left, window_right, seqlen_q, seqlen_k, cfg.causal, cfg.has_window)
        if const_expr(self.spt):
            n_tile = (seqlen_k + TILE_N - 1) // TILE_N - 1 - n_tile  # < 0: past this sequence's key tiles
        n_start = n_tile * TILE_N
        if const_expr(self.spt):
            n_start = n_start if n_tile >= 0 else seqlen_k
        m_min = Int32(0)
        num_m = Int32(0)
        if n_start < seqlen_k:
            rng = QueryTileRange.create(n_start, seqlen_q, seqlen_k, left, right, self.tile_m, TILE_N,
                                        cfg.causal or cfg.has_window, cfg.has_window)
            m_min = rng.m_min
            num_m = cutlass.max(rng.m_max - rng.m_min, 0)
        n_struct = num_m * self.group
        n_iter = n_struct
        if const_expr(skips is not None):
            n_iter = Int32(0)
            for hi in cutlass.range_constexpr(self.group):
                n_iter = n_iter + fm.live_count(m_min, m_min + num_m, self.head_skips(skips, hi))
        return (n_tile, head_kv, batch, offset_q, offset_k, seqlen_q, seqlen_k, m_min, num_m, n_iter,
                accum_row0, left, right, split, n_struct)

    def head_skips(self, skips, hi):
        """Query head ``hi`` of the group's merged skipped ranges (common/flashmask.merged_skips)."""
        return tuple(skips[c, hi] for c in range(4))

    @cute.jit
    def write_skips(self, tile, skips, mFmMinMax, fm_head_div: Int32):
        """Note [FlashMask skipped steps, SM100]: one thread writes, per query head of the group, the query
        tiles of [m_min, m_min + num_m) the column bounds skip against this key tile (from the key tile's
        per-bound min / max, common/flashmask.skipped_query_tiles), merged and clipped to the range."""
        n_tile, head_kv, batch, seqlen_q, m_min, num_m = tile[0], tile[1], tile[2], tile[5], tile[7], tile[8]
        for hi in cutlass.range_constexpr(self.group):
            sk = (m_min, Int32(0), m_min, Int32(0))
            if num_m > 0:
                mh = (head_kv * self.group + hi) // fm_head_div
                lo, hi_ = fm.load_tile_minmax(mFmMinMax[batch, mh, None, None], n_tile, self.cfg.startend)
                sk = fm.merged_skips(m_min, m_min + num_m,
                                     fm.skipped_query_tiles(lo, hi_, self.cfg.startend, self.tile_m, seqlen_q))
            for c in cutlass.range_constexpr(4):
                skips[c, hi] = sk[c]

    @cute.jit
    def skip_to_live(self, head: Int32, m: Int32, tile, skips):
        """The first (query head, query tile) at or after (``head``, ``m``) in the walk order that the column
        bounds do not skip (the group's end when none is left)."""
        m_min, num_m = tile[7], tile[8]
        head0 = tile[1] * self.group
        h = head
        mm = m
        go = Int32(1)
        while go != 0:
            if h - head0 >= self.group:
                go = Int32(0)
            else:
                fa, fl, sa, sl = self.head_skips(skips, h - head0)
                mm = fa + fl if (mm >= fa) & (mm < fa + fl) else mm
                mm = sa + sl if (mm >= sa) & (mm < sa + sl) else mm
                if mm >= m_min + num_m:
                    h = h + 1
                    mm = m_min
                else:
                    go = Int32(0)
        return h, mm

    @cute.jit
    def step_skipped(self, head: Int32, m: Int32, tile, skips):
        """Whether the column bounds skip (``head``, query tile ``m``)."""
        fa, fl, sa, sl = self.head_skips(skips, head - tile[1] * self.group)
        return ((m >= fa) & (m < fa + fl)) | ((m >= sa) & (m < sa + sl))

    @cute.jit
    def first_coords(self, tile, skips=None):
        """(query head, query tile) of iteration 0; ``next_coords`` steps them (head-major order over
        the kv head's group, no division in the loops). ``skips``: past the steps the column bounds skip."""
        head, m = tile[1] * self.group, tile[7]
        if const_expr(skips is not None):
            head, m = self.skip_to_live(head, m, tile, skips)
        return head, m

    @cute.jit
    def next_coords(self, head: Int32, m_tile: Int32, tile, skips=None):
        m_min, num_m = tile[7], tile[8]
        m_next = m_tile + 1
        head_next = head
        if m_next == m_min + num_m:
            m_next = m_min
            head_next = head + 1
        if const_expr(skips is not None):
            head_next, m_next = self.skip_to_live(head_next, m_next, tile, skips)
        return head_next, m_next

    # ------------------------------------------------------------------ load warp
    @cute.jit
    def load(self, mma_S, mma_dP, tma_atom_K, mK, tma_atom_V, mV, tma_atom_Q, mQ, tma_atom_dO, mdO,
             sK, sV, sQ, sdO, pipe_kv, pipe_q, pipe_do, tile, skips=None):
        n_tile, head_kv, batch, offset_q, offset_k = tile[0], tile[1], tile[2], tile[3], tile[4]
        n_iter = tile[9]
        thr_S = mma_S.get_slice(0)
        thr_dP = mma_dP.get_slice(0)
        if n_iter > 0:
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            mK_cur = self.seq_view(mK, offset_k, head_kv, batch)
            mV_cur = self.seq_view(mV, offset_k, head_kv, batch)
            gK = cute.local_tile(mK_cur, (TILE_N, self.head_dim), (None, 0))
            gV = cute.local_tile(mV_cur, (TILE_N, self.head_dim_v), (None, 0))
            tKsK, tKgK = cpasync.tma_partition(tma_atom_K, 0, cute.make_layout(1), cute.group_modes(sK, 0, 3),
                                               cute.group_modes(thr_S.partition_A(gK), 0, 3))
            tVsV, tVgV = cpasync.tma_partition(tma_atom_V, 0, cute.make_layout(1), cute.group_modes(sV, 0, 3),
                                               cute.group_modes(thr_dP.partition_A(gV), 0, 3))
            pipe_kv.producer_acquire(kv_state)
            cute.copy(tma_atom_K, tKgK[None, n_tile], tKsK[None, 0], tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
            cute.copy(tma_atom_V, tVgV[None, n_tile], tVsV[None, 0], tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))

            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stage)
            do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.do_stage)
            head, m_tile = self.first_coords(tile, skips)
            for it in cutlass.range(n_iter, unroll=1):
                gQ = cute.local_tile(self.seq_view(mQ, offset_q, head, batch), (self.tile_m, self.head_dim),
                                     (None, 0))
                gdO = cute.local_tile(self.seq_view(mdO, offset_q, head, batch), (self.tile_m, self.head_dim_v),
                                      (None, 0))
                tQsQ, tQgQ = cpasync.tma_partition(tma_atom_Q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 3),
                                                   cute.group_modes(thr_S.partition_B(gQ), 0, 3))
                tdOsdO, tdOgdO = cpasync.tma_partition(tma_atom_dO, 0, cute.make_layout(1),
                                                       cute.group_modes(sdO, 0, 3),
                                                       cute.group_modes(thr_dP.partition_B(gdO), 0, 3))
                pipe_q.producer_acquire(q_state)
                cute.copy(tma_atom_Q, tQgQ[None, m_tile], tQsQ[None, q_state.index],
                          tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
                q_state.advance()
                pipe_do.producer_acquire(do_state)
                cute.copy(tma_atom_dO, tdOgdO[None, m_tile], tdOsdO[None, do_state.index],
                          tma_bar_ptr=pipe_do.producer_get_barrier(do_state))
                do_state.advance()
                head, m_tile = self.next_coords(head, m_tile, tile, skips)

    @cute.jit
    def seq_view(self, mX, offset: Int32, head: Int32, batch: Int32):
        """(seq, dim) view of one head of one sequence."""
        if const_expr(self.cfg.varlen):
            return cute.domain_offset((offset, 0), mX[None, None, head])
        return mX[None, None, head, batch]

    # ------------------------------------------------------------------ MMA warp
    @cute.jit
    def mma(self, mma_S, mma_dP, mma_dV, mma_dK, mma_dQ, sK, sV, sQ, sdO, sQt, sdOt, sKt, sdSt, sdS,
            tP_layout, tmem_ptr, tStS, tdPtdP, tdVtdV, tdKtdK, tdQtdQ, pipes, tile, pipe_kvs):
        pipe_kv, pipe_q, pipe_do, pipe_S, pipe_dP, pipe_dS, pipe_dQ, pipe_dKV = pipes
        n_iter, split = tile[9], tile[13]
        thr_S, thr_dP, thr_dV = mma_S.get_slice(0), mma_dP.get_slice(0), mma_dV.get_slice(0)
        thr_dK, thr_dQ = mma_dK.get_slice(0), mma_dQ.get_slice(0)
        tSrK = thr_S.make_fragment_A(sK)
        tSrQ = thr_S.make_fragment_B(sQ)
        tdPrV = thr_dP.make_fragment_A(sV)
        tdPrdO = thr_dP.make_fragment_B(sdO)
        # dV / dK take this CTA's head-dim slice of dO^T / Q^T (n_split > 1: split * the slice's offset)
        tdVrdO = thr_dV.make_fragment_B(self.slice_view(sdOt, split, 0, self.do_off if self.wide else 0))
        tdKrdS = thr_dK.make_fragment_A(sdSt)
        tdKrQ = thr_dK.make_fragment_B(self.slice_view(sQt, split, 0, self.q_off if self.wide else 0))
        if const_expr(self.wide):
            # dQ^T chunk c = K^T[dims of chunk c] dS^T: A = K^T from the chunk's first head dim, B = dS^T
            tdQrdS = thr_dQ.make_fragment_B(sdS)
            nc = len(self.dq_chunks)
            tdQrK = tuple(thr_dQ.make_fragment_A(self.slice_view(
                sKt, split, self.k_offs[c], self.k_offs[nc + c] - self.k_offs[c] if self.n_split > 1 else 0))
                for c in range(nc))
        else:
            tdQrdS = thr_dQ.make_fragment_A(sdS)
            tdQrK = (thr_dQ.make_fragment_B(sKt),)
        # P^T (16-bit, K-major A operand) in TMEM over the S^T columns
        tP = cute.make_tensor(tStS.iterator, tP_layout.outer)
        tdVrP_layout = thr_dV.make_fragment_A(tP)[None, None, None, 0].layout
        tdVrP = cute.make_tensor(cute.recast_ptr(tmem_ptr + self.tmem["P"], dtype=self.dtype), tdVrP_layout)

        if n_iter > 0:
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stage)
            do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.do_stage)
            s_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            dp_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            dq_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            ds_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            dkv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            pipe_kv.consumer_wait(kv_state)
            kvs_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            pipe_kvs.consumer_wait(kvs_state)  # K / V scrubbed (Note [scrubbed K / V, SM100])
            pipe_kvs.consumer_release(kvs_state)
            q_s = q_state.clone()  # Q of the next S^T to issue (one query tile ahead of q_state)
            ops = (mma_S, mma_dP, mma_dV, mma_dK, mma_dQ, tSrK, tSrQ, tdPrV, tdPrdO, tdVrP, tdVrdO, tdKrdS, tdKrQ,
                   tdQrdS, tdQrK, tStS, tdPtdP, tdVtdV, tdKtdK, tdQtdQ)
            states = (q_state, q_s, do_state, s_state, dp_state, dq_state, ds_state)
            # prologue: S^T(0), dP^T(0)
            pipe_S.producer_acquire(s_state)
            self.mma_s(mma_S, tStS, tSrK, tSrQ, pipe_q, pipe_S, q_s, s_state)
            self.mma_dp(mma_dP, tdPtdP, tdPrV, tdPrdO, pipe_do, pipe_dQ, pipe_dP, do_state, dq_state, dp_state)
            # the last iteration is peeled: no pipeline state changes inside a data-dependent branch
            # (states is reassigned from the call, so the staged loop carries the pipeline states)
            for it in cutlass.range(n_iter - 1, unroll=1):
                states = self.mma_iter(ops, pipes, states, it > 0, False)
            states = self.mma_iter(ops, pipes, states, n_iter > 1, True)
            # every tcgen05.commit is issued before the dKV one: the compute warps wait for dKV, so no
            # commit arrives on this CTA's barriers after they (and the CTA) are done
            pipe_kv.consumer_release(kv_state)
            pipe_dKV.producer_acquire(dkv_state)
            pipe_dKV.producer_commit(dkv_state)

    @cute.jit
    def mma_iter(self, ops, pipes, states, accumulate, last: cutlass.Constexpr):
        """One query tile (see Note [SM100 backward handshakes]): dV, S^T(next), dK, dQ, dP^T(next); the
        serial order (Note [SM100 wide schedule]) issues S^T(next) after dQ has drained instead."""
        (mma_S, mma_dP, mma_dV, mma_dK, mma_dQ, tSrK, tSrQ, tdPrV, tdPrdO, tdVrP, tdVrdO, tdKrdS, tdKrQ,
         tdQrdS, tdQrK, tStS, tdPtdP, tdVtdV, tdKtdK, tdQtdQ) = ops
        pipe_kv, pipe_q, pipe_do, pipe_S, pipe_dP, pipe_dS, pipe_dQ, pipe_dKV = pipes
        q_state, q_s, do_state, s_state, dp_state, dq_state, ds_state = states
        # dV += P^T dO once P^T is in TMEM (pipe_S empty: S^T read, P^T written)
        s_state.advance()
        pipe_S.producer_acquire(s_state)
        self.gemm(mma_dV, tdVtdV, tdVrP, tdVrdO[None, None, None, do_state.index], accumulate)
        pipe_do.consumer_release(do_state)
        do_state.advance()
        # S^T(next) over the S^T / P^T columns: issued after dV (tcgen05 issue order), so the tensor
        # core computes it while the compute warps form dS
        if const_expr(not last and not self.serial):
            q_s.advance()
            self.mma_s(mma_S, tStS, tSrK, tSrQ, pipe_q, pipe_S, q_s, s_state)
        # dK += dS^T Q and dQ = dS K (wide: dQ^T = K^T dS^T per chunk) once dS is in smem
        pipe_dS.consumer_wait(ds_state)
        self.gemm(mma_dK, tdKtdK, tdKrdS[None, None, None, 0], tdKrQ[None, None, None, q_state.index], accumulate)
        pipe_q.consumer_release(q_state)
        q_state.advance()
        for c in cutlass.range_constexpr(len(tdQtdQ)):
            if const_expr(self.wide):
                self.gemm(mma_dQ, tdQtdQ[c], tdQrK[c][None, None, None, 0], tdQrdS[None, None, None, 0], False)
            else:
                self.gemm(mma_dQ, tdQtdQ[c], tdQrdS[None, None, None, 0], tdQrK[c][None, None, None, 0], False)
        pipe_dQ.producer_commit(dq_state)
        pipe_dS.consumer_release(ds_state)
        ds_state.advance()
        # dP^T(next) over the dP^T / dQ columns once the reduce warps have loaded this dQ
        if const_expr(not last):
            dp_state.advance()
            dq_state.advance()
            if const_expr(self.serial):
                # S^T(next) also waits the drain (a dQ^T chunk over the S^T columns, or one Q stage:
                # Q(next) could only load after dK released Q(t) anyway)
                pipe_dQ.producer_acquire(dq_state)
                q_s.advance()
                self.mma_s(mma_S, tStS, tSrK, tSrQ, pipe_q, pipe_S, q_s, s_state)
            self.mma_dp(mma_dP, tdPtdP, tdPrV, tdPrdO, pipe_do, pipe_dQ, pipe_dP, do_state, dq_state, dp_state)
        return q_state, q_s, do_state, s_state, dp_state, dq_state, ds_state

    def slice_view(self, view, split, off0: int, step: int):
        """``view`` started ``off0 + split * step`` elements into its buffer (whole swizzle repeats,
        checked by check_operand_aliases); split is this CTA's runtime head-dim slice."""
        if off0 == 0 and step == 0:
            return view
        return cute.make_tensor(view.iterator + (off0 + split * step), view.layout)

    @cute.jit
    def mma_s(self, mma_S, tStS, tSrK, tSrQ, pipe_q, pipe_S, q_s, s_state):
        """S^T = K Q^T of the query tile in stage ``q_s`` (the caller acquired the S^T columns)."""
        pipe_q.consumer_wait(q_s)
        self.gemm(mma_S, tStS, tSrK[None, None, None, 0], tSrQ[None, None, None, q_s.index], False)
        pipe_S.producer_commit(s_state)

    @cute.jit
    def mma_dp(self, mma_dP, tdPtdP, tdPrV, tdPrdO, pipe_do, pipe_dQ, pipe_dP, do_state, dq_state, dp_state):
        """dP^T = V dO^T into the dP^T / dQ columns: waits dO, the columns' previous dQ drained
        (pipe_dQ) and read (pipe_dP)."""
        pipe_do.consumer_wait(do_state)
        pipe_dQ.producer_acquire(dq_state)
        pipe_dP.producer_acquire(dp_state)
        self.gemm(mma_dP, tdPtdP, tdPrV[None, None, None, 0], tdPrdO[None, None, None, do_state.index], False)
        pipe_dP.producer_commit(dp_state)

    @cute.jit
    def gemm(self, tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor,
             accumulate):
        """acc (+)= A B over the K blocks of one tile (issued by one elected thread inside cute.gemm)."""
        mma = cute.make_tiled_mma(tiled_mma.op)
        for k in cutlass.range(cute.size(tCrA.shape[2]), unroll=1):
            mma.set(tcgen05.Field.ACCUMULATE, accumulate | (k != 0))
            cute.gemm(mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)

    # ------------------------------------------------------------------ compute warpgroups
    @cute.jit
    def compute(self, tStS, tdPtdP, tdVtdV, tdKtdK, sdS_epi, mLSElog2, mdPsum, mdK, mdV,
                pipe_S, pipe_dP, pipe_dS, pipe_dKV, tile, mCuSeqlensQ,
                softmax_scale: Float32, scale_log2: Float32, softcap_in: Float32, softcap: Float32, fmask=None,
                scrub=None, skips=None):
        """``scrub``: (the kvs pipeline, the key flags) of Note [scrubbed K / V, SM100]; ``skips``: Note
        [FlashMask skipped steps, SM100]."""
        cfg = self.cfg
        n_tile, head_kv, batch, offset_q, offset_k, seqlen_q, seqlen_k = tile[:7]
        n_iter, accum_row0, left, right = tile[9], tile[10], tile[11], tile[12]
        tidx = cute.arch.thread_idx()[0] % 128  # TMEM lane = key row of the tile
        wg = (cute.arch.make_warp_uniform(cute.arch.warp_idx()) - _WARPS_COMPUTE[0]) // 4
        half = self.tile_m // 2  # query columns of this warpgroup
        # S^T / dP^T: (128 keys, 64 query columns) of this warpgroup, both read in DS_CHUNK-column chunks; the
        # TMEM copies are sliced by a warp-uniform index (Note [compute warps' registers])
        tS_all = tStS[(None, None), 0, 0]
        tdP_all = tdPtdP[(None, None), 0, 0]
        chunk_layout = cute.composition(tS_all.layout, cute.make_layout((TILE_N, DS_CHUNK)))
        t2r_atom_c = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(DS_CHUNK)), Float32)
        tiled_t2r_c = tcgen05.make_tmem_copy(t2r_atom_c, cute.make_tensor(tdP_all.iterator, chunk_layout))
        thr_t2r_c = tiled_t2r_c.get_slice(warp_lane0(tiled_t2r_c, "src"))
        tS_t2r0 = thr_t2r_c.partition_S(cute.make_tensor(tS_all.iterator, chunk_layout))
        tdP_t2r0 = thr_t2r_c.partition_S(cute.make_tensor(tdP_all.iterator, chunk_layout))
        rdP_shape = thr_t2r_c.partition_D(cute.make_identity_tensor((TILE_N, DS_CHUNK))).shape
        # P^T: this warpgroup's 64 query columns as 32 packed 16-bit pairs, at P + 32 wg
        p_cols = half * self.dtype.width // 32
        p_layout = cute.composition(tS_all.layout, cute.make_layout((TILE_N, p_cols)))
        r2t_atom = cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(p_cols)), Float32)
        tP0 = cute.make_tensor(tS_all.iterator + (self.tmem["P"] - self.tmem["S"]), p_layout)
        thr_r2t = tcgen05.make_tmem_copy(r2t_atom, tP0)
        thr_r2t = thr_r2t.get_slice(warp_lane0(thr_r2t, "dst"))
        tP_r2t0 = thr_r2t.partition_D(tP0)
        tP_r2t = cute.make_tensor(tP_r2t0.iterator + p_cols * wg, tP_r2t0.layout)
        rP_shape = thr_r2t.partition_S(cute.make_identity_tensor((TILE_N, p_cols))).shape
        # dS^T -> smem (row = key, columns = this warpgroup's query half)
        n_ds = half // DS_CHUNK
        r2s_atom = sm100_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.dtype, Float32, tiled_t2r_c)
        thr_r2s = cute.make_tiled_copy_D(r2s_atom, tiled_t2r_c).get_slice(tidx)

        key = n_tile * TILE_N + tidx  # key row within the sequence
        tanh_coef = Float32(0.0)
        if const_expr(cfg.has_softcap):
            tanh_coef = Float32(LN_2) / softcap
        shift = seqlen_k - seqlen_q
        cols = list(range(half))
        if n_iter > 0:
            # Note [scrubbed K / V, SM100]: this thread's key flags (K, V) and whether any key of the warp has one
            pipe_kvs, kv_flags = scrub
            kvs_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            pipe_kvs.consumer_wait(kvs_state)
            k_bad = Int32(kv_flags[tidx, 0])
            v_bad = Int32(kv_flags[tidx, 1])
            pipe_kvs.consumer_release(kvs_state)
            k_warp = Int32(cute.arch.vote_ballot_sync(k_bad != 0))
            v_warp = Int32(cute.arch.vote_ballot_sync(v_bad != 0))
            s_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            dp_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            ds_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            bar_compute = pipeline.NamedBarrier(barrier_id=int(BwdBarrier.Compute), num_threads=ROLE_THREADS["compute"])
            head, m_tile = self.first_coords(tile, skips)
            fm_head = Int32(0)
            fm_head_rem = Int32(0)
            if const_expr(fmask is not None):
                # the mask head of `head` (head // fm_head_div) and the remainder, stepped with the head below
                # (no division in the loop: ptxas kept the divisor's reciprocal in registers through it)
                fm_head = head // fmask[2]
                fm_head_rem = head - fm_head * fmask[2]
            for it in cutlass.range(n_iter, unroll=1):
                q0 = m_tile * self.tile_m + half * wg  # first query row (sequence-relative) of this WG's columns
                stats_off = self.stats_offset(mLSElog2, head, batch, accum_row0 + q0)
                # mask only where the tile crosses a limit (TileRange's rule; rows >= seqlen_q get P = 0
                # from their +inf lse fill, see load_row_stats)
                need_mask = n_tile * TILE_N + TILE_N > seqlen_k
                if const_expr(cfg.causal or cfg.has_window):
                    rng = TileRange.create(m_tile * self.tile_m, seqlen_q, seqlen_k, left, right, self.tile_m, TILE_N,
                                           True, cfg.has_window)
                    need_mask = need_mask | (n_tile >= rng.n_right_mask) | (n_tile < rng.n_left_mask)
                fm_bounds = None
                if const_expr(fmask is not None):
                    # FlashMask: the column bounds cut this step unless the key tile's min / max leave the
                    # query tile whole (steps they skip are masked entirely: P = dS = 0); a cut step takes the
                    # masked branch, which also masks with this key's bounds
                    mStartend, mFmMinMax, fm_head_div = fmask
                    mh = fm_head
                    m0 = m_tile * self.tile_m
                    lo, hi = fm.load_tile_minmax(mFmMinMax[batch, mh, None, None], n_tile, cfg.startend)
                    _skip, whole = fm.classify_tile(m0, cutlass.min(m0 + self.tile_m, seqlen_q), lo, hi, cfg.startend)
                    need_mask = need_mask | (not whole)
                    fm_bounds = (mStartend[batch, mh, None, None], cutlass.min(key, seqlen_k - 1))
                # 1.-2. per DS_CHUNK columns: S^T -> registers, softcap (keep tanh for the chain rule), mask,
                # P = exp2(s * scale_log2 - lse_log2) (Note [compute warps' registers])
                pipe_S.consumer_wait(s_state)
                rS = cute.make_rmem_tensor((half,), Float32)
                if need_mask:
                    self.s_to_p(rS, thr_t2r_c, tS_t2r0, rdP_shape, half * wg, True, cols, key, q0, seqlen_k, shift,
                                left, right, mLSElog2, stats_off, seqlen_q, scale_log2, softcap_in, softcap, fm_bounds)
                else:
                    self.s_to_p(rS, thr_t2r_c, tS_t2r0, rdP_shape, half * wg, False, cols, key, q0, seqlen_k, shift,
                                left, right, mLSElog2, stats_off, seqlen_q, scale_log2, softcap_in, softcap, None)
                self.nan_where_seen(rS, half, k_bad, k_warp)  # a flagged K row: P = NaN where the pair is seen
                # 3. P^T (16-bit) over S^T once every compute thread has read its S^T columns
                rP = cute.make_rmem_tensor(rP_shape, Float32)
                rP_h = cute.make_tensor(cute.recast_ptr(rP.iterator, dtype=self.dtype), cute.make_layout(half))
                rP_h.store(cute.make_tensor(rS.iterator, cute.make_layout(half)).load().to(self.dtype))
                bar_compute.arrive_and_wait()
                cute.copy(thr_r2t, rP, tP_r2t)
                cute.arch.fence_view_async_tmem_store()
                pipe_S.consumer_release(s_state)
                s_state.advance()
                # 4. dS^T = P^T (dP^T - D) [* (1 - tanh^2)]
                pipe_dP.consumer_wait(dp_state)
                pipe_dS.producer_acquire(ds_state)  # sdS free once the previous dK / dQ MMAs completed
                for j in cutlass.range_constexpr(n_ds):
                    rdP = cute.make_rmem_tensor(rdP_shape, Float32)
                    cute.copy(thr_t2r_c, cute.make_tensor(tdP_t2r0.iterator + half * wg + DS_CHUNK * j,
                                                          tdP_t2r0.layout), rdP)
                    cute.arch.fence_view_async_tmem_load()
                    if const_expr(j == n_ds - 1):
                        pipe_dP.consumer_release(dp_state)
                    for jj in cutlass.range_constexpr(DS_CHUNK // STAT_CHUNK):
                        rD = self.load_row_stats(mdPsum, stats_off, q0, j * DS_CHUNK // STAT_CHUNK + jj, seqlen_q,
                                                 0.0)
                        rL = None
                        if const_expr(cfg.has_softcap):
                            rL = self.load_row_stats(mLSElog2, stats_off, q0, j * DS_CHUNK // STAT_CHUNK + jj,
                                                     seqlen_q, 0.0)
                        for kk in cutlass.range_constexpr(0, STAT_CHUNK, 2):
                            c = jj * STAT_CHUNK + kk
                            k = j * DS_CHUNK + c
                            a0, a1 = cute.arch.sub_packed_f32x2((rdP[c], rdP[c + 1]), (rD[kk], rD[kk + 1]))
                            a0, a1 = cute.arch.mul_packed_f32x2((rS[k], rS[k + 1]), (a0, a1))
                            if const_expr(cfg.has_softcap):
                                a0 = self.softcap_grad(a0, rS[k], rL[kk], tanh_coef)
                                a1 = self.softcap_grad(a1, rS[k + 1], rL[kk + 1], tanh_coef)
                            rdP[c] = a0
                            rdP[c + 1] = a1
                        if const_expr(not cfg.has_softcap):
                            self.guard_masked_ds(rdP, rS, rD, jj * STAT_CHUNK, j * DS_CHUNK + jj * STAT_CHUNK)
                    # a flagged V row: dS^T = NaN where P^T != 0 (Note [scrubbed K / V, SM100])
                    self.nan_where_seen(cute.make_tensor(rdP.iterator, cute.make_layout(DS_CHUNK)), DS_CHUNK, v_bad,
                                        v_warp, cute.make_tensor(rS.iterator + j * DS_CHUNK, cute.make_layout(DS_CHUNK)))
                    rdS = cute.make_rmem_tensor(rdP_shape, self.dtype)
                    rdS.store(rdP.load().to(self.dtype))
                    # dS^T rows = keys, columns = query rows [q0 + DS_CHUNK j, ..) of the tile
                    sdS_c = cute.local_tile(sdS_epi, (TILE_N, DS_CHUNK), (0, wg * n_ds + j))
                    cute.autovec_copy(rdS, thr_r2s.partition_D(sdS_c))
                dp_state.advance()
                cute.arch.fence_view_async_shared()
                pipe_dS.producer_commit(ds_state)
                ds_state.advance()
                head_next, m_tile = self.next_coords(head, m_tile, tile, skips)
                if const_expr(fmask is not None):
                    # one mask-head step per query head passed (a head whose steps are all skipped is passed too)
                    for _h in cutlass.range(head_next - head, unroll=1):
                        fm_head_rem = fm_head_rem + 1
                        if fm_head_rem == fmask[2]:
                            fm_head_rem = Int32(0)
                            fm_head = fm_head + 1
                head = head_next
        # 6. epilogue: dK = softmax_scale * acc, dV = acc, this warpgroup's half of the head dims
        dkv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        if n_iter > 0:
            pipe_dKV.consumer_wait(dkv_state)
        row_ok = (key < seqlen_k) & (n_tile >= 0)  # n_tile < 0: spt CTA past this sequence's key tiles
        split = tile[13]
        self.store_rows(tdKtdK, mdK, self.dk_cols, split * self.dk_cols, n_iter > 0, row_ok, softmax_scale, key,
                        offset_k, head_kv, batch, wg, tidx)
        self.store_rows(tdVtdV, mdV, self.dv_cols, split * self.dv_cols, n_iter > 0, row_ok, Float32(1.0), key,
                        offset_k, head_kv, batch, wg, tidx)
        if n_iter > 0:
            cute.arch.fence_view_async_tmem_load()
            pipe_dKV.consumer_release(dkv_state)

    @cute.jit
    def s_to_p(self, rS, thr_t2r_c, tS_t2r0, rdP_shape, col0: Int32, masked: cutlass.Constexpr, cols, key: Int32,
               q0: Int32, seqlen_k: Int32, shift: Int32, left: Int32, right: Int32, mLSElog2, stats_off,
               seqlen_q: Int32, scale_log2: Float32, softcap_in: Float32, softcap: Float32, fm_bounds=None):
        """P = exp2(softcap(S^T) [masked] * scale_log2 - lse_log2) into ``rS`` (this warpgroup's columns from
        ``col0`` of the S^T view ``tS_t2r0``), DS_CHUNK columns at a time (Note [compute warps' registers]); the
        caller waits for S^T and writes P^T after every compute thread has run this. ``masked``: the causal /
        window / key-tail mask and, with ``fm_bounds`` (a FlashMask build: the mask head's ``(Sk, n)`` bounds
        and this key's clamped index), the key's column bounds."""
        cfg = self.cfg
        kb = None
        if const_expr(masked and fm_bounds is not None):
            # this key's FlashMask bounds, made relative to q0 once: each chunk compares compile-time columns
            mBounds, key_c = fm_bounds
            kb = [x - q0 for x in fm.load_bounds(mBounds, key_c, cfg.startend)]
        for j in cutlass.range_constexpr(len(cols) // DS_CHUNK):
            c0 = j * DS_CHUNK
            cute.copy(thr_t2r_c, cute.make_tensor(tS_t2r0.iterator + col0 + c0, tS_t2r0.layout),
                      cute.make_tensor(rS.iterator + c0, cute.make_layout(rdP_shape)))
            cute.arch.fence_view_async_tmem_load()
            if const_expr(cfg.has_softcap):
                for k in cutlass.range_constexpr(c0, c0 + DS_CHUNK):
                    rS[k] = softcap_logit(rS[k], softcap_in, softcap)
            for jj in cutlass.range_constexpr(DS_CHUNK // STAT_CHUNK):
                rLSE = self.load_row_stats(mLSElog2, stats_off, q0, j * DS_CHUNK // STAT_CHUNK + jj, seqlen_q,
                                           Float32.inf)
                for kk in cutlass.range_constexpr(0, STAT_CHUNK, 2):
                    k = c0 + jj * STAT_CHUNK + kk
                    x0, x1 = cute.arch.fma_packed_f32x2((rS[k], rS[k + 1]), (scale_log2, scale_log2),
                                                        (-rLSE[kk], -rLSE[kk + 1]))
                    rS[k] = cute.math.exp2(x0, fastmath=True)
                    rS[k + 1] = cute.math.exp2(x1, fastmath=True)
            # the mask on P (0), not as -inf on S: a masked pair stays 0 where the row's lse is NaN (a row that saw
            # a NaN / Inf key; Note [scrubbed K / V, SM100]). The same values otherwise.
            if const_expr(masked):
                apply_mask_kv_major(cute.make_tensor(rS.iterator + c0, cute.make_layout((1, DS_CHUNK), stride=(0, 1))),
                                    cols[c0:c0 + DS_CHUNK], [key], q0, seqlen_k, shift, left, right,
                                    cfg.causal or cfg.has_window, cfg.has_window, 0.0)
                if const_expr(kb is not None):
                    for k in cutlass.range_constexpr(c0, c0 + DS_CHUNK):
                        rS[k] = Float32(0.0) if fm.row_masked(cols[k], kb, cfg.startend) else rS[k]

    @cute.jit
    def guard_masked_ds(self, rdS, rP, rD, c0: cutlass.Constexpr, k0: cutlass.Constexpr):
        """dS^T = 0 where P^T = 0 in the STAT_CHUNK columns from ``c0`` of ``rdS`` (P from ``k0`` of ``rP``) when
        some of their D is not finite: a row that saw a NaN / Inf value has a NaN or +-Inf out, so D =
        rowsum(dO * O) is too and P (dP - D) = 0 * NaN or 0 * Inf would carry it to the dK of keys the row cannot
        see (the SM90 kernel's rule, bwd_sm90.guard_masked_ds, which tests each column). D is the same in every
        thread of the warp: one uniform test per chunk, on the sum of its values (x - x is 0 for every finite x,
        NaN for NaN and +-Inf; a sum that overflows only applies the exact guard needlessly)."""
        total = _sum_tree([rD[kk] for kk in range(STAT_CHUNK)])
        if total - total != Float32(0.0):
            for kk in cutlass.range_constexpr(STAT_CHUNK):
                rdS[c0 + kk] = Float32(0.0) if rP[k0 + kk] == Float32(0.0) else rdS[c0 + kk]

    @cute.jit
    def softcap_grad(self, ds: Float32, p: Float32, lse_log2: Float32, tanh_coef: Float32) -> Float32:
        """dS = dS' (1 - t^2), t = tanh(s / c) = s' / c, with the logit s' recovered from P itself:
        log2 P = s' log2(e) - lse_log2, so t = (log2 P + lse_log2) ln2 / c (one MUFU lg2 instead of
        keeping 64 registers of tanh per thread). P = 0 (masked, or no keys) gives dS = 0."""
        t = (cute.math.log2(p, fastmath=True) + lse_log2) * tanh_coef
        return Float32(cutlass.select_(p > Float32(0.0), ds * (Float32(1.0) - t * t), Float32(0.0)))

    @cute.jit
    def stats_offset(self, mStat, head: Int32, batch: Int32, row: Int32):
        """Element offset of (head, batch, accumulator row) in lse_log2 / dpsum (same layout)."""
        if const_expr(self.cfg.varlen):
            return cute.crd2idx((head, row), mStat.layout)
        return cute.crd2idx((batch, head, row), mStat.layout)

    @cute.jit
    def load_row_stats(self, mStat, offset, q0: Int32, j: cutlass.Constexpr, seqlen_q: Int32,
                       fill: cutlass.Constexpr):
        """Chunk j (STAT_CHUNK query rows from q0 + j * STAT_CHUNK) of this warpgroup's per-row values;
        rows >= seqlen_q read as ``fill`` (+inf lse: P = 0; 0 for D): padded rows are never trusted."""
        src = cute.make_tensor(
            cute.make_ptr(Float32, (mStat.iterator + offset + j * STAT_CHUNK).toint(), cute.AddressSpace.gmem,
                          assumed_align=16),
            cute.make_layout(STAT_CHUNK))
        r = cute.make_rmem_tensor((STAT_CHUNK,), Float32)
        cute.autovec_copy(src, r)
        for k in cutlass.range_constexpr(STAT_CHUNK):
            r[k] = Float32(cutlass.select_(q0 + j * STAT_CHUNK + k < seqlen_q, r[k], Float32(fill)))
        return r

    @cute.jit
    def store_rows(self, tAcc, mOut, dim: cutlass.Constexpr, col0: Int32, has_work, row_ok, scale: Float32,
                   key: Int32, offset_k: Int32, head_kv: Int32, batch: Int32, wg: Int32, tidx: Int32):
        """Row ``key`` of dK or dV: TMEM columns [dim/2 wg, dim/2 (wg + 1)) of this CTA's ``dim``-wide
        head-dim slice (x scale) -> q's dtype, at output columns col0 + those."""
        thr, src0, r_shape = tmem_chunk_copy(tAcc, TILE_N, EPI_CHUNK, tidx)
        cols_wg = dim // 2
        row_g = key
        if const_expr(self.cfg.varlen):
            row_g = offset_k + key
            out_row = mOut[row_g, None, head_kv]
        else:
            out_row = mOut[row_g, None, head_kv, batch]
        for c in cutlass.range_constexpr(cols_wg // EPI_CHUNK):
            col = wg * cols_wg + c * EPI_CHUNK
            r = cute.make_rmem_tensor(r_shape, Float32)
            if has_work:
                cute.copy(thr, cute.make_tensor(src0.iterator + col, src0.layout), r)
                for k in cutlass.range_constexpr(0, EPI_CHUNK, 2):
                    r[k], r[k + 1] = cute.arch.mul_packed_f32x2((r[k], r[k + 1]), (scale, scale))
            else:
                r.fill(0.0)
            if row_ok:
                r_h = cute.make_rmem_tensor((EPI_CHUNK,), self.dtype)
                r_h.store(cute.make_tensor(r.iterator, cute.make_layout(EPI_CHUNK)).load().to(self.dtype))
                dst = cute.make_tensor(
                    cute.make_ptr(self.dtype, (out_row.iterator + col0 + col).toint(), cute.AddressSpace.gmem,
                                  assumed_align=16),
                    cute.make_layout(EPI_CHUNK))
                cute.autovec_copy(r_h, dst)

    # ------------------------------------------------------------------ dQ reduce warps
    @cute.jit
    def reduce(self, tdQtdQ, tma_atom_dQ, mdQacc, sdQ, mdQsem, pipe_dQ, tile, trace=None, skips=None):
        """dQ(t) of each query tile: TMEM -> registers -> fp32 smem stage -> TMA reduce-add
        (``cp.reduce.async.bulk.tensor ... add.f32``) into dq_accum (``drain`` / ``drain_wide``). Warp 0
        of the role issues the TMA and owns its bulk groups; a stage is rewritten only after warp 0 saw
        its previous reduce finish reading (wait_group read, then the Reduce barrier).

        Every query tile reduces whole tile_m-row boxes: rows past seqlen_q add exact zeros (their dS is
        0) into accumulator rows the tile owns (Sq_pad rows, or the sequence's padded varlen rows).

        ``skips`` (Note [FlashMask skipped steps, SM100]): without deterministic dQ the role walks the steps that
        compute; with it, every (query head, query tile) of the range, so that a step the column bounds skip
        still takes its turn (waits for it and passes it on, reducing nothing)."""
        cfg = self.cfg
        n_tile, head_kv, batch, offset_q, offset_k, seqlen_q, seqlen_k = tile[:7]
        n_iter, accum_row0, left, right, split = tile[9], tile[10], tile[11], tile[12], tile[13]
        walk_skips = skips  # the coordinate walk: the live steps ...
        n_walk = n_iter
        if const_expr(cfg.deterministic and skips is not None):
            walk_skips = None  # ... or, taking turns, every step of the range
            n_walk = tile[14]
        tidx = cute.arch.thread_idx()[0] % 128  # TMEM lane: query row (narrow) or head dim (wide)
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx()) - _WARPS_REDUCE[0]
        tm = self.tile_m
        box = (DQT_ROWS, DQT_BOX) if self.wide else (TILE_M, DQ_CHUNK)
        if n_walk > 0:
            dq_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            it_live = Int32(0)  # steps drained so far (the staging buffers alternate over them)
            bar_reduce = pipeline.NamedBarrier(barrier_id=int(BwdBarrier.Reduce), num_threads=ROLE_THREADS["reduce"])
            head, m_tile = self.first_coords(tile, walk_skips)
            for it in cutlass.range(n_walk, unroll=1):
                if const_expr(cfg.varlen):
                    gdQ = cute.local_tile(cute.domain_offset((accum_row0, 0), mdQacc[None, None, head]),
                                          box, (None, None))
                else:
                    gdQ = cute.local_tile(mdQacc[None, None, head, batch], box, (None, None))
                tdQsdQ, tdQgdQ = cpasync.tma_partition(tma_atom_dQ, 0, cute.make_layout(1), cute.group_modes(sdQ, 0, 2),
                                                       cute.group_modes(gdQ, 0, 2))
                sem_ptr = Int64(0)
                if const_expr(cfg.deterministic):
                    if const_expr(self.spt):
                        turn = last_key_tile(m_tile * tm, seqlen_q, seqlen_k, right, tm, TILE_N, True) - n_tile
                    else:
                        # turn = rank of this key tile among the key tiles that see query tile m_tile
                        turn = n_tile - first_key_tile(m_tile * tm, seqlen_q, seqlen_k, left, TILE_N,
                                                       cfg.has_window)
                    if const_expr(self.n_split > 1):
                        turn = turn * self.n_split + split  # the slices of one key tile in slice order
                    blk = (accum_row0 + m_tile * tm) // DQ_SEM_ROWS  # bwd_config.dq_sem_index
                    if const_expr(cfg.varlen):
                        sem_off = cute.crd2idx((head, blk), mdQsem.layout)
                    else:
                        sem_off = cute.crd2idx((batch, head, blk), mdQsem.layout)
                    sem_ptr = (mdQsem.iterator + sem_off).toint()
                    if const_expr(trace is not None):
                        trace.mark(0, "dq_turn", m_tile)
                    if tidx == 0:
                        seen = ld_acquire_gpu(sem_ptr)
                        while seen != turn:
                            seen = ld_acquire_gpu(sem_ptr)
                live = True
                if const_expr(cfg.deterministic and skips is not None):
                    live = not self.step_skipped(head, m_tile, tile, skips)
                if live:
                    pipe_dQ.consumer_wait(dq_state)
                    if const_expr(self.wide):
                        self.drain_wide(tdQtdQ, tma_atom_dQ, tdQsdQ, tdQgdQ, sdQ, pipe_dQ, dq_state, bar_reduce,
                                        m_tile, split, tidx, warp)
                    else:
                        self.drain(tdQtdQ[0], tma_atom_dQ, tdQsdQ, tdQgdQ, sdQ, pipe_dQ, dq_state, bar_reduce,
                                   m_tile, it_live, tidx, warp)
                    dq_state.advance()
                    it_live = it_live + 1
                if const_expr(cfg.deterministic):
                    if warp == 0:
                        cute.arch.cp_async_bulk_wait_group(0, read=False)  # the adds are done
                        cute.arch.sync_warp()
                        if tidx == 0:
                            cute.arch.fence_acq_rel_gpu()
                            red_release_add_gpu(sem_ptr, 1)
                head, m_tile = self.next_coords(head, m_tile, tile, walk_skips)
            if warp == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=False)  # smem and the adds outlive no CTA

    @cute.jit
    def load_stage(self, thr, src, r_shape, last: cutlass.Constexpr, pipe_dQ, dq_state, warp: Int32, bar_reduce):
        """One dQ chunk from TMEM into registers (the last one frees the dQ columns), then wait until
        the staging buffer it goes to is free: its previous reduce has read it (warp 0 keeps at most
        DQ_STAGES - 1 bulk groups in flight) and every reduce thread knows (the Reduce barrier)."""
        r = cute.make_rmem_tensor(r_shape, Float32)
        cute.copy(thr, src, r)
        cute.arch.fence_view_async_tmem_load()
        if const_expr(last):
            pipe_dQ.consumer_release(dq_state)
        if warp == 0:
            cute.arch.cp_async_bulk_wait_group(DQ_STAGES - 1, read=True)
        bar_reduce.arrive_and_wait()
        return r

    @cute.jit
    def drain(self, tdQ, tma_atom_dQ, tdQsdQ, tdQgdQ, sdQ, pipe_dQ, dq_state, bar_reduce, m_tile: Int32,
              it: Int32, tidx: Int32, warp: Int32):
        """Narrow schedule: thread = query row of dQ (128 x d in TMEM); DQ_CHUNK columns per stage."""
        thr, src0, r_shape = tmem_chunk_copy(tdQ, TILE_M, DQ_CHUNK, tidx)
        nchunk = self.head_dim // DQ_CHUNK
        for c in cutlass.range_constexpr(nchunk):
            stage = (it * nchunk + c) % DQ_STAGES  # stages alternate across tiles too (d 96: 3 chunks)
            r = self.load_stage(thr, cute.make_tensor(src0.iterator + c * DQ_CHUNK, src0.layout), r_shape,
                                c == nchunk - 1, pipe_dQ, dq_state, warp, bar_reduce)
            cute.autovec_copy(cute.make_tensor(r.iterator, cute.make_layout(DQ_CHUNK)), sdQ[tidx, None, stage])
            cute.arch.fence_view_async_shared()
            bar_reduce.arrive_and_wait()
            if warp == 0:  # the whole warp issues (the TMA copy elects one lane)
                cute.copy(tma_atom_dQ, tdQsdQ[None, stage], tdQgdQ[None, m_tile, c])
                cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def drain_wide(self, tdQ_chunks, tma_atom_dQ, tdQsdQ, tdQgdQ, sdQ, pipe_dQ, dq_state, bar_reduce,
                   m_tile: Int32, split: Int32, tidx: Int32, warp: Int32):
        """Wide schedule (Note [SM100 wide schedule]): thread = head dim (TMEM lane) of a dQ^T chunk
        (128 head dims x tile_m queries); DQT_ROWS queries per stage, written as two DQT_ROWS x DQT_BOX
        boxes (lanes 0-63, 64-127); lanes below the chunk's lane_lo repeat the previous chunk's head
        dims and are skipped. A tile drains an even number of stages, so the stage is static."""
        groups = self.tile_m // DQT_ROWS
        n_stage = len(self.dq_chunks) * groups
        assert n_stage % DQ_STAGES == 0
        col = tidx % DQT_BOX
        box = tidx // DQT_BOX
        for c in cutlass.range_constexpr(len(self.dq_chunks)):
            first, lane_lo, _ = self.dq_chunks[c]
            thr, src0, r_shape = tmem_chunk_copy(tdQ_chunks[c], MMA_M, DQT_ROWS, tidx)
            col_blk0 = (split * self.dk_cols + first) // DQT_BOX
            for g in cutlass.range_constexpr(groups):
                k = c * groups + g
                stage = k % DQ_STAGES
                r = self.load_stage(thr, cute.make_tensor(src0.iterator + g * DQT_ROWS, src0.layout), r_shape,
                                    k == n_stage - 1, pipe_dQ, dq_state, warp, bar_reduce)
                if tidx >= lane_lo:
                    for q in cutlass.range_constexpr(DQT_ROWS):
                        sdQ[q, col, DQT_BOXES * stage + box] = r[q]
                cute.arch.fence_view_async_shared()
                bar_reduce.arrive_and_wait()
                if warp == 0:
                    for b in cutlass.range_constexpr(lane_lo // DQT_BOX, DQT_BOXES):
                        cute.copy(tma_atom_dQ, tdQsdQ[None, DQT_BOXES * stage + b],
                                  tdQgdQ[None, m_tile * groups + g, col_blk0 + b])
                    cute.arch.cp_async_bulk_commit_group()
