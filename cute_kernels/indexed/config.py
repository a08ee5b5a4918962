"""Indexed-attention configs (compile-cache keys) and the windowed-plan geometry.

Shape letters: B batch, Lq queries, Lkv keys, Hq = Hkv * G query heads, D head dim, Wsel index
row width, S index sets (B for shared indices ``[B, Lq, Wsel]``, B * Hkv for per-kv-head indices
``[B, Hkv, Lq, Wsel]``), NW = ceil(Lq / WQ) windows, NT = ceil(Lkv / KEY_TILE) key tiles.

Window geometry: a window holds ``WQ = window_queries(G)`` consecutive queries so that WQ * G query
heads fill the 64 MMA rows of one program (5 x 12 for the production 24/2 layout, 4 rows idle).
Row ``r`` of a window tile is query ``w * WQ + r // G``, query head ``h * G + r % G``. The plan's
per-key bitmask has one bit per window query, so WQ <= 32 (G = 1 uses 32 queries, half the rows).
"""

from __future__ import annotations

from dataclasses import dataclass

#: MMA rows per program (4 warps x m16).
TILE_M = 64
#: Keys per key tile of the key-major dK/dV pass and of the plan's tile transpose.
KEY_TILE = 32
#: Query-head group sizes and head dims we compile.
GROUP_SIZES = (1, 2, 4, 8, 12, 16)
HEAD_DIMS = (64, 128, 256)
DTYPES = ("bfloat16",)


def window_queries(group: int) -> int:
    """Queries per window for ``group`` query heads per kv head (64 // G, at most 32)."""
    if group < 1 or group > TILE_M:
        raise ValueError(f"indexed_attention: heads per kv head must be in [1, {TILE_M}], got {group}")
    return min(TILE_M // group, 32)


@dataclass(frozen=True)
class PlanConfig:
    """Plan kernels depend only on the window size (all extents are dynamic)."""

    arch: int
    window_queries: int


@dataclass(frozen=True)
class AttnConfig:
    """Forward / dQ / dK-dV kernels: everything that changes generated code."""

    arch: int
    head_dim: int
    group: int  # G = Hq // Hkv
    num_kv_heads: int  # Hkv (static: head strides are compile-time)
    per_kv_head: bool  # indices [B, Hkv, Lq, Wsel] (plan set = b * Hkv + h) vs [B, Lq, Wsel]
    dtype: str = "bfloat16"
    #: dK/dV pass: 2 = prefetch the next window's Q/dO while computing (double buffer), 1 = not.
    #: H200, 2026-11-29, bench/bench_indexed.py: 2 stages 32.5 vs 35.6 ms (16K), 296 vs 332 ms (64K)
    dkdv_stages: int = 2
    #: dQ pass: 2 = prefetch the next chunk's K/V rows (double buffer, 1 CTA/SM at D = 256), 1 = not
    #: (2 CTAs/SM). H200, same run, D = 256: 1 stage 9.0 vs 14.2 ms (16K), 46.6 vs 73.6 ms (64K).
    #: 0 = auto: 1, except 2 at D = 128 (the build run on the H200; 1 stage spills on sm_100a at G 16)
    dq_stages: int = 0
    #: All three passes: read the plan (key indices, query masks; for dK/dV also the pair list, LSE
    #: and delta) one chunk / pair ahead into registers so the loads' latency hides behind the MMAs
    #: (Note [metadata ahead]); used by dK/dV with dkdv_stages == 2 and by dQ in its 1-stage walk.
    #: H200, 2026-11-29 (bench/bench_indexed.py, D 256, rho 0.9): fwd 8.1 -> 5.2 ms, dQ 9.0 -> 7.6,
    #: dK/dV 32.5 -> 30.3 (16K); fwd 41.2 -> 26.7, dQ 46.2 -> 39.3, dK/dV 297 -> 257 (64K).
    meta_ahead: bool = True
    #: dK/dV pass: a warp skips a pair when none of its 16 keys is selected by the window
    #: (Note [skip unselected halves] in bwd_dkdv.py). Same run: dK/dV 32.5 -> 28.9 ms (16K),
    #: 297 -> 238 (64K); with meta_ahead 28.2 / 220. Bitwise equal to the plain kernels either way.
    skip_empty: bool = True
    #: dK/dV kernel: "wgmma" = ``bwd_dkdv_sm90.py`` (SM90 only: warp-specialised, 64 keys per CTA,
    #: wgmma), "mma" = the portable ``bwd_dkdv.py`` (mma.sync; SM100, and SM90 on request; the
    #: dkdv_stages / meta_ahead / skip_empty knobs apply to it). "auto": wgmma on SM90, else mma.
    dkdv_impl: str = "auto"

    def __post_init__(self):
        if self.dkdv_impl == "auto":
            object.__setattr__(self, "dkdv_impl", "wgmma" if self.arch == 90 else "mma")
        if self.dkdv_impl not in ("wgmma", "mma"):
            raise ValueError(f"indexed: dkdv_impl must be 'auto', 'wgmma' or 'mma', got {self.dkdv_impl!r}")
        if self.dkdv_impl == "wgmma" and self.arch != 90:
            raise ValueError(f"indexed: the wgmma dK/dV kernel is SM90 only, got arch {self.arch}")
        if self.dq_stages == 0:
            object.__setattr__(self, "dq_stages", 2 if self.head_dim == 128 else 1)
        if self.dq_stages not in (1, 2) or self.dkdv_stages not in (1, 2):
            raise ValueError(f"indexed: stages must be 1 or 2, got dq {self.dq_stages} dkdv {self.dkdv_stages}")

    @property
    def window_queries(self) -> int:
        return window_queries(self.group)

    @property
    def rows(self) -> int:
        """Used MMA rows of a window (the rest of the 64 are masked)."""
        return self.window_queries * self.group


def unsupported_reason(head_dim: int, group: int, dtype: str) -> str | None:
    """Why the CuTe kernels cannot run this case, or None."""
    if dtype not in DTYPES:
        return f"dtype {dtype} (CuTe indexed kernels are bf16 only)"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (supported: {HEAD_DIMS})"
    if group not in GROUP_SIZES:
        return f"{group} query heads per kv head (supported: {GROUP_SIZES})"
    return None
