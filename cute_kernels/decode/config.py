"""Decode attention configs: what changes generated code, and the host rules derived from it.

One kernel serves SM90 and SM100 (warp-level ``mma.sync`` and ``cp.async``; see ``fwd.py``), so a
config's ``arch`` only picks the compile target. Static in a config: dtype, head dim, G (query heads
per kv head), Sq, the cache layout and page size, which masks are live, softcap, block_logit's block
size, whether the result goes to split partials and whether the lengths / page table are per
sequence (dense) or per (sequence, kv head). Batch, kv heads, pages, lengths, the window sizes, the
scale and the split count are runtime values.
"""

from __future__ import annotations

from dataclasses import dataclass

from cute_kernels import arch as _arch

LAYOUTS = ("hnd", "nhd", "contiguous")
PAGE_SIZES = (1, 8, 16, 32, 64, 128, 256)
HEAD_DIMS = (64, 128, 256)
DTYPES = ("bfloat16", "float16")

WARPS = 4  # warps per CTA; each key group of them (config.key_groups) takes its own contiguous part of the CTA's keys
KEYS_PER_STEP = 16  # keys one warp consumes per pipeline step (one k16 of P @ V)
RING_BYTES_PER_WARP = 24 * 1024  # target bytes of K + V in each warp's cp.async ring
MAX_GROUP_ROWS = 256  # G * Sq
MAX_SPLITS = 128
MIN_KEYS_PER_SPLIT = 256
# Where the split would be 2 (an unsplit grid of about half the SMs), no split on a contiguous cache, nor on a paged
# one shorter than this:
# H100, one process (bench/decode_probe.py, 2026-12-07): at 64 CTAs on 132 SMs, 2 splits against none took 54.0 /
# 52.9 us (8/1 contiguous B 64 Sk 4K), 95.7 / 92.9 (32/8 contiguous B 8 Sk 8K), 23.3 / 20.4 (sparse decode, 32/8
# P 64 B 8, 1152 keys a kv head), but 97.6 / 106.5 (32/8 P 64 B 8 Sk 8K): a paged cache needs the second wave of
# CTAs to reach the read rate at long Sk, the others lose the combine (~3 us). 4096 lies between the paged points.
PAGED_SPLIT_MIN_KEYS = 4096


@dataclass(frozen=True)
class DecodeConfig:
    arch: int
    dtype: str = "bfloat16"
    head_dim: int = 128
    group: int = 4  # G = Hq / Hkv
    seqlen_q: int = 1  # Sq
    layout: str = "hnd"
    page_size: int = 16  # P; ignored (0) for the contiguous layout
    mask_right: bool = False  # causal or a finite right window
    mask_left: bool = False  # a finite left window
    softcap: bool = False
    block_size: int = 0  # block_logit's key block (0: no block_logit)
    split: bool = False  # write fp32 split partials for the combine kernel
    ring_kb: int = RING_BYTES_PER_WARP // 1024  # K + V bytes of each warp's cp.async ring (a tuning knob)
    # seqlens [B] and table [B, n], shared by every kv head (FA's dense cache_seqlens / block_table, passed as the
    # caller's tensors) instead of seqlens [B, Hkv] and table [B, Hkv, n] (sparse decode's per-kv-head tables)
    dense_index: bool = False

    # ---------------------------------------------------------------- derived (compile-time) sizes
    @property
    def rows(self) -> int:
        """Packed query rows of one kv head: G * Sq (row m = s * G + g)."""
        return self.group * self.seqlen_q

    @property
    def m_tiles(self) -> int:
        """m16 tiles each warp holds (its O accumulator is m_tiles x head_dim fp32)."""
        return 1 if self.rows <= 16 or self.head_dim > 128 else 2

    @property
    def d_split(self) -> int:
        """Warps that share one key range, each holding D / d_split columns of O (1, or 2 at d 256).

        A warp's O is m_tiles x 16 x (head_dim / d_split) fp32: 128 registers a lane at d 256 unsplit, which left
        no room under the 255-register limit (ptxas spilled). At d 256 a pair of warps reads the same keys, both
        compute S = Q K^T over the whole head dim (identical instructions on identical data, so identical P) and
        each accumulates its own half of O's columns from its own half of V."""
        return 2 if self.head_dim > 128 else 1

    @property
    def key_groups(self) -> int:
        """Groups of ``d_split`` warps; each takes a contiguous part of the CTA's keys and has its own load ring."""
        return WARPS // self.d_split

    @property
    def rows_per_cta(self) -> int:
        return 16 * self.m_tiles

    @property
    def row_blocks(self) -> int:
        """CTAs along the packed rows of one (sequence, kv head, split): each reads the keys again."""
        return -(-self.rows // self.rows_per_cta)

    @property
    def q_in_regs(self) -> bool:
        """Q's A fragments live in registers (else ldmatrix from shared memory at every step)."""
        return self.m_tiles * self.head_dim <= 128

    @property
    def stage_bytes(self) -> int:
        """One warp's K + V tile of one pipeline step."""
        return 2 * KEYS_PER_STEP * self.head_dim * 2

    @property
    def stages(self) -> int:
        """Steps in each key group's ring (its ``d_split`` warps' ``ring_kb`` budgets together)."""
        return max(2, min(8, self.d_split * self.ring_kb * 1024 // self.stage_bytes))

    @property
    def ring_bytes(self) -> int:
        return self.key_groups * self.stages * self.stage_bytes

    @property
    def merge_bytes(self) -> int:
        """The key groups' (O, max, sum) exchanged through shared memory after the key loop (reuses the ring)."""
        return self.key_groups * self.rows_per_cta * (self.head_dim + 2) * 4

    @property
    def q_bytes(self) -> int:
        return self.rows_per_cta * self.head_dim * 2

    @property
    def smem_bytes(self) -> int:
        return max(self.ring_bytes, self.merge_bytes) + self.q_bytes

    @property
    def key_align(self) -> int:
        """Granule of the key ranges handed to key groups: whole block_logit blocks (or whole steps)."""
        return self.block_size if self.block_size else KEYS_PER_STEP


def unsupported_reason(cfg: DecodeConfig) -> str | None:
    """None when ``cfg`` compiles and runs, else the unsupported case, named."""
    why = _arch.arch_reason(cfg.arch)
    if why is not None:
        return why
    if cfg.dtype not in DTYPES:
        return f"dtype {cfg.dtype} (decode takes bfloat16 / float16)"
    if cfg.head_dim not in HEAD_DIMS:
        return f"head_dim {cfg.head_dim} (decode takes {HEAD_DIMS})"
    if cfg.layout not in LAYOUTS:
        return f"layout {cfg.layout!r} (one of {LAYOUTS})"
    if cfg.layout != "contiguous" and cfg.page_size not in PAGE_SIZES:
        return f"page size {cfg.page_size} (decode takes {PAGE_SIZES})"
    if not 1 <= cfg.seqlen_q <= 16:
        return f"seqlen_q {cfg.seqlen_q} (decode takes 1..16 query tokens)"
    if cfg.group < 1 or cfg.rows > MAX_GROUP_ROWS:
        return f"G * Sq = {cfg.rows} (decode packs at most {MAX_GROUP_ROWS} rows per kv head)"
    if cfg.block_size and (cfg.block_size % KEYS_PER_STEP or cfg.block_size < KEYS_PER_STEP):
        return f"block_logit block_size {cfg.block_size} (decode needs a multiple of {KEYS_PER_STEP})"
    if cfg.smem_bytes > _arch.SMEM_BYTES_MAX[_arch.family(cfg.arch)]:
        return f"shared memory {cfg.smem_bytes} B"
    return None


def ctas_per_sm(cfg: DecodeConfig) -> int:
    """Resident CTAs per SM the shared memory allows (228 KB per SM on SM90 / SM100, 1 KB reserved each)."""
    return max(1, min(4, (228 * 1024) // (cfg.smem_bytes + 1024)))


def choose_splits(cfg: DecodeConfig, batch: int, num_kv_heads: int, sk_max: int, sm_count: int) -> int:
    """Split count from shapes only (never a device read, so a CUDA graph can capture it).

    Enough CTAs to give every SM one (``sm_count``), at least ``MIN_KEYS_PER_SPLIT`` keys a split,
    and among the counts that qualify the smallest whose waves are within 5 % of the fullest; where that is 2,
    none, unless the cache is paged and at least ``PAGED_SPLIT_MIN_KEYS`` long.
    """
    base = max(1, batch * num_kv_heads * cfg.row_blocks)
    # one CTA per SM, not every resident slot: on an H100 at B 1, Sk 32K, Hkv 8, 16 splits (128 CTAs) took
    # 54.2 us against 57.1 us for 33 (264 CTAs, two per SM), fewer partials for the combine too
    # (bench/decode_probe.py, docs/decode.md)
    slots = sm_count
    cap = max(1, min(MAX_SPLITS, sk_max // MIN_KEYS_PER_SPLIT))
    if base >= slots or cap == 1:
        return 1
    scores = {}
    for s in range(1, cap + 1):
        ctas = base * s
        scores[s] = ctas / (-(-ctas // slots) * slots)
    top = max(scores.values())
    best = min(s for s, v in scores.items() if v >= 0.95 * top)
    if best == 2 and (cfg.layout == "contiguous" or sk_max < PAGED_SPLIT_MIN_KEYS):
        return 1  # the second wave of CTAs is not worth the combine here (PAGED_SPLIT_MIN_KEYS)
    return best
