"""Block-sparse attention configs (compile-cache keys) and the row-tile geometry.

Shape letters: B batch, S tokens, Hq = Hkv * G query heads, Dk / Dv head dims, NS index sets (B for
shared ids, B * Hkv per kv head), NQT = ceil(S / WQ) query tiles, CAP = WQ * topk union slots.

Row tile (one CTA): the 64 MMA rows are ``WQ = tile_queries(G)`` consecutive queries x ``GC``
query heads of one kv head, ``GC = min(G, 64)`` (row ``r`` = query ``w * WQ + r // GC``, head
``h * G + c * GC + r % GC`` for head chunk ``c < G / GC``): GQA packs ``64 // G`` queries over the
union of their blocks (one bit per query and block), MQA with ``G >= 64`` takes one query's heads
(two CTAs for G = 128). Plan tensors: ``paddle_fa4/_plan/block_sparse.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

#: MMA rows per CTA (one consumer warpgroup, wgmma m64).
TILE_M = 64
#: The block size the kernels take (one block = one key tile = one TMA box).
BLOCK_SIZE = 64
HEAD_DIMS = (64, 128, 256)
#: (Dk, Dv) of the absorbed-MLA latent (v=None, V = the leading Dv columns of K) the forward takes:
#: kv_lora_rank 512 + rope 64, and 448 + 64 (PaddleFleet's two HySparse configs); forward and backward.
LATENT_DIMS = ((576, 512), (512, 448))
#: The backward kernels keep dK and dV (64 keys x D fp32) in one warpgroup's registers each: D <= 128.
BWD_HEAD_DIMS = (64, 128)
DTYPES = ("bfloat16", "float16")


# Note [key block segments] (bwd_dkdv_sm90.py): a key block's (query tile, slot) pairs are split over up to
# SEGMENTS CTAs of the dK/dV grid, CTA id x = r * SEGMENTS + k for segment k of key block r.
SEGMENTS = 8
#: Shortest segment (``min_seg``) of the key-block-major CTA order (launches without a key_order). H200, 2026-12-03
#: (docs/benchmarks.md, Run AC), the SM90 kernel alone in that order, 256 against 64 / 128 / unsplit: GQA 32/4 16K
#: local 1.10 ms (1.19 / 1.16 / 1.28), 16K random 4.28 (4.73 / 4.77 / 4.30), 64K local 5.19 (5.73 / 5.59 / 5.32),
#: MQA 64 16K 2.29 (2.35 / 2.33 / 3.49).
MIN_SEGMENT_PAIRS = 256
#: Shortest segment when the CTAs run in the plan's ``key_order`` (Note [tile-ordered segments]; the SM100
#: kernel takes the SM90 kernels' order and length, unmeasured there): H200, 2026-12-04 (Runs AO1, AO4, AO5),
#: against key-major at 256: 64 gave 1.02-1.10x, 256 0.99-1.10x; 32 and 16 less than 64 but for MQA 64.
ORDERED_MIN_SEGMENT_PAIRS = 64


def segment_split(n_pairs, min_seg, maximum=max):
    """Note [key block segments]: ``(L, nseg)`` for a key block of ``n_pairs`` pairs -- segment k takes pairs
    [k L, min(n, (k + 1) L)). One rule for the kernels (``maximum`` = ``cutlass.max`` on Int32), the planner
    (element-wise on tensors) and Python ints (``max``)."""
    min_seg = max(min_seg, 1) if isinstance(min_seg, int) else maximum(min_seg, 1)
    seg_len = maximum((n_pairs + SEGMENTS - 1) // SEGMENTS, min_seg)
    nseg = (n_pairs + seg_len - 1) // seg_len
    nseg1 = maximum(nseg, 1)
    seg_len = maximum((n_pairs + nseg1 - 1) // nseg1, 1)  # 0 pairs: no segment
    return seg_len, (n_pairs + seg_len - 1) // seg_len


#: SM100 (fwd_sm100.py): rows of one Q stage (one TMEM lane each).
SM100_STAGE_ROWS = 128


def stage_queries_sm100(group: int) -> int:
    """SM100: queries per Q stage, ``128 // GC`` (the stage's rows past ``QS * GC`` idle)."""
    return SM100_STAGE_ROWS // head_chunk(group)


def q_stages_sm100(group: int, head_dim_v: int) -> int:
    """SM100: Q stages per row tile: 2 (ping-pong through the tensor core, as the dense forward) when
    both fit TMEM (Dv <= 128) and a second stage gets queries of its own (the 32-query cap of the
    mask word leaves it idle for G <= 4), else 1."""
    return 2 if head_dim_v <= 128 and stage_queries_sm100(group) < 32 else 1


def tile_queries(group: int, arch: int = 90, head_dim_v: int = 128) -> int:
    """Queries per row tile (the plan's window). SM90: ``min(64 // G, 32)``, 1 for ``G >= 64``. SM100:
    ``min(stages * QS, 32)`` (``q_stages_sm100``, ``stage_queries_sm100``)."""
    if arch // 10 == 10:
        return min(q_stages_sm100(group, head_dim_v) * stage_queries_sm100(group), 32)
    return min(TILE_M // min(group, TILE_M), 32)


def head_chunk(group: int) -> int:
    """Query heads of one kv head in a row tile (``GC``)."""
    return min(group, TILE_M)


@dataclass(frozen=True)
class FwdConfig:
    """Everything that changes the forward's generated code (all extents are dynamic)."""

    arch: int  # exact compute capability
    dtype: str
    head_dim: int  # Dk
    head_dim_v: int  # Dv
    group: int  # G = Hq // Hkv
    per_kv_head: bool  # ids [B, Hkv, S, topk] (set b * Hkv + h) vs [B, S, topk] (set b)
    has_sink: bool
    latent: bool = False  # V = the leading head_dim_v columns of K (absorbed MLA); no v tensor

    @property
    def window_queries(self) -> int:
        return tile_queries(self.group, self.arch, self.head_dim_v)


def unsupported_reason(*, head_dim: int, head_dim_v: int, group: int, dtype: str, block_size: int,
                       latent: bool = False, backward: bool = False) -> str | None:
    """Why the CuTe kernels (the forward, and with ``backward`` also the dQ and dK/dV kernels; for the latent
    the latent dQ and combined dK kernels) cannot run this case, or None."""
    if block_size != BLOCK_SIZE:
        return f"block_size {block_size} (the CuTe kernels take {BLOCK_SIZE})"
    if dtype not in DTYPES:
        return f"dtype {dtype} (supported: {DTYPES})"
    if group > TILE_M and group % TILE_M:
        return f"{group} query heads per kv head (above 64 it must be a multiple of 64)"
    if latent:
        if (head_dim, head_dim_v) not in LATENT_DIMS:
            return (f"the absorbed-MLA latent with Dk {head_dim} / Dv {head_dim_v} (the CuTe kernels take "
                    f"(Dk, Dv) in {LATENT_DIMS})")
        return None
    if head_dim not in HEAD_DIMS or head_dim_v != head_dim:
        return f"head dims Dk {head_dim} / Dv {head_dim_v} (supported: Dk == Dv in {HEAD_DIMS})"
    if backward and head_dim not in BWD_HEAD_DIMS:
        return f"the backward at head dim {head_dim} (the CuTe backward takes {BWD_HEAD_DIMS})"
    return None


@dataclass(frozen=True)
class BwdConfig:
    """Everything that changes the backward kernels' generated code (the sink needs nothing there:
    lse includes it, and its gradient is a reduction the caller does)."""

    arch: int
    dtype: str
    head_dim: int
    head_dim_v: int
    group: int
    per_kv_head: bool
    latent: bool = False  # V = the leading head_dim_v columns of K; one combined dK gradient (no v / dv)
    #: delta = rowsum(P dP) from the dQ kernel's own P and dP (a first sweep over the blocks) instead of
    #: rowsum(dO * O): Note [exact delta] in bwd_dq_sm90.py. Only the dQ kernels' code changes.
    exact_delta: bool = False

    @property
    def window_queries(self) -> int:
        return tile_queries(self.group, self.arch, self.head_dim_v)
