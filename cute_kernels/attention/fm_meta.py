"""FlashMask tile metadata: two small arch-neutral kernels run once per call before the attention.

``FmTileBounds`` (one warp per (key tile, mask head, batch)): the minimum and maximum of every bound
column of ``startend_row_indices`` over the key tile's columns (those below Sk)::

    mStartend [B, Hm, Sk, n] int32  ->  mMinMax [B, Hm, NT, 2n] int32 = [min_0, max_0, min_1, max_1, ...]

``FmQueryRanges`` (one warp per (query tile, mask head, batch)): from those, the key tiles that
``common/flashmask.classify_tile`` does not skip for the query tile's rows ("live" tiles)::

    mMinMax  ->  mRanges [B, Hm, MT, 2 NT + 3] int32 = [n_first, n_last + 1,      ([0, 0]: no key tile)
                                                       prefix[0 .. NT],         live tiles below n
                                                       live[0 .. count)]        the live tiles, ascending

NT = ceil(Sk / tile_n), MT = ceil(Sq / tile_m) with the tiles of the attention kernel that reads them
(the forward narrows its key-tile range to ``mRanges`` and classifies each visited tile from
``mMinMax``: no element mask on tiles the bounds leave whole). ``FmMetaConfig`` is the compile key.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from cute_kernels.common import flashmask as fm
from cute_kernels.jit_cache import jit_cache

WARP = 32


@dataclass(frozen=True)
class FmMetaConfig:
    arch: int
    layout: str  # common/flashmask.COLS
    tile_m: int
    tile_n: int

    @property
    def cols(self) -> int:
        return fm.num_cols(self.layout)


def _warp_min(v):
    for off in (16, 8, 4, 2, 1):
        v = cutlass.min(v, cute.arch.shuffle_sync_bfly(v, offset=off))
    return v


def _warp_max(v):
    for off in (16, 8, 4, 2, 1):
        v = cutlass.max(v, cute.arch.shuffle_sync_bfly(v, offset=off))
    return v


class FmTileBounds:
    def __init__(self, cfg: FmMetaConfig):
        assert cfg.tile_n % WARP == 0
        self.cfg = cfg

    @cute.jit
    def __call__(self, mStartend: cute.Tensor, mMinMax: cute.Tensor, stream):
        grid = (mMinMax.shape[2], mMinMax.shape[1], mMinMax.shape[0])
        self.kernel(mStartend, mMinMax).launch(grid=grid, block=[WARP, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mStartend: cute.Tensor, mMinMax: cute.Tensor):
        cfg = self.cfg
        n = cfg.cols
        lane, _, _ = cute.arch.thread_idx()
        n_tile, head, batch = cute.arch.block_idx()
        seqlen_k = mStartend.shape[2]
        bounds = mStartend[batch, head, None, None]
        lo = [Int32(fm.INT32_MAX) for _ in range(n)]
        hi = [Int32(fm.INT32_MIN) for _ in range(n)]
        for i in cutlass.range_constexpr(cfg.tile_n // WARP):
            j = n_tile * cfg.tile_n + i * WARP + lane
            valid = j < seqlen_k
            b = fm.load_bounds(bounds, cutlass.min(j, seqlen_k - 1), cfg.layout)
            for c in cutlass.range_constexpr(n):
                lo[c] = cutlass.min(lo[c], b[c]) if valid else lo[c]
                hi[c] = cutlass.max(hi[c], b[c]) if valid else hi[c]
        for c in cutlass.range_constexpr(n):
            lo[c] = _warp_min(lo[c])
            hi[c] = _warp_max(hi[c])
        if lane == 0:
            for c in cutlass.range_constexpr(n):
                mMinMax[batch, head, n_tile, 2 * c] = lo[c]
                mMinMax[batch, head, n_tile, 2 * c + 1] = hi[c]


class FmQueryRanges:
    def __init__(self, cfg: FmMetaConfig):
        self.cfg = cfg

    @cute.jit
    def __call__(self, mMinMax: cute.Tensor, mRanges: cute.Tensor, seqlen_q: Int32, stream):
        grid = (mRanges.shape[2], mRanges.shape[1], mRanges.shape[0])
        self.kernel(mMinMax, mRanges, seqlen_q).launch(grid=grid, block=[WARP, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mMinMax: cute.Tensor, mRanges: cute.Tensor, seqlen_q: Int32):
        cfg = self.cfg
        lane, _, _ = cute.arch.thread_idx()
        m_tile, head, batch = cute.arch.block_idx()
        tiles = mMinMax[batch, head, None, None]
        n_tiles = mMinMax.shape[2]
        row = mRanges[batch, head, m_tile, None]
        m_start = m_tile * cfg.tile_m
        m_end = cutlass.min(m_start + cfg.tile_m, seqlen_q)
        first = Int32(fm.INT32_MAX)
        last = Int32(-1)
        running = Int32(0)  # live tiles below this chunk
        below = (Int32(1) << lane) - Int32(1)  # the lanes before this one
        for it in cutlass.range((n_tiles + WARP - 1) // WARP, unroll=1):
            n_tile = it * WARP + lane
            lo, hi = fm.load_tile_minmax(tiles, cutlass.min(n_tile, n_tiles - 1), cfg.layout)
            skip, _full = fm.classify_tile(m_start, m_end, lo, hi, cfg.layout)
            live = n_tile < n_tiles and not skip
            first = cutlass.min(first, n_tile) if live else first
            last = cutlass.max(last, n_tile) if live else last
            ballot = cute.arch.vote_ballot_sync(live)
            pos = running + cute.arch.popc(ballot & below)
            if n_tile < n_tiles:
                row[2 + n_tile] = pos  # prefix[n]: live tiles below n
            if live:
                row[3 + n_tiles + pos] = n_tile
            running = running + cute.arch.popc(ballot)
        if lane == 0:
            row[2 + n_tiles] = running  # prefix[NT] = count
        first = _warp_min(first)
        last = _warp_max(last)
        if lane == 0:
            if last < 0:
                mRanges[batch, head, m_tile, 0] = Int32(0)
                mRanges[batch, head, m_tile, 1] = Int32(0)
            else:
                mRanges[batch, head, m_tile, 0] = first
                mRanges[batch, head, m_tile, 1] = last + 1


# ---------------------------------------------------------------------------- host
def workspace_shapes(cfg: FmMetaConfig, batch: int, mask_heads: int, seqlen_q: int, seqlen_k: int) -> dict:
    """``{name: (shape, dtype)}`` of the two int32 outputs the caller allocates."""
    nt = -(-seqlen_k // cfg.tile_n)
    mt = -(-seqlen_q // cfg.tile_m)
    return {"fm_minmax": ([batch, mask_heads, nt, 2 * cfg.cols], "int32"),
            "fm_ranges": ([batch, mask_heads, mt, 2 * nt + 3], "int32")}


@jit_cache
def _compile(cfg: FmMetaConfig, which: str):
    from cute_kernels.fake import arch_options, fake_stream, fake_tensor, sym

    b, h, sk, nt, mt = sym(), sym(), sym(), sym(), sym()
    minmax = fake_tensor(cutlass.Int32, (b, h, nt, 2 * cfg.cols), align_bytes=4)
    if which == "bounds":
        se = fake_tensor(cutlass.Int32, (b, h, sk, cfg.cols), align_bytes=4)
        return cute.compile(FmTileBounds(cfg), se, minmax, fake_stream(), options=arch_options(cfg.arch))
    ranges = fake_tensor(cutlass.Int32, (b, h, mt, sym()), align_bytes=4)
    return cute.compile(FmQueryRanges(cfg), minmax, ranges, Int32(1), fake_stream(),
                        options=arch_options(cfg.arch))


def compile_meta(cfg: FmMetaConfig):
    """Both kernels of ``cfg`` (cached); returns ``(bounds_fn, ranges_fn)``."""
    return _compile(cfg, "bounds"), _compile(cfg, "ranges")


def run_bounds(cfg: FmMetaConfig, startend, minmax) -> None:
    """Fill ``minmax`` only (the backward reads no query-tile ranges)."""
    if int(minmax.shape[2]) == 0 or int(minmax.shape[0]) == 0:
        return
    _compile(cfg, "bounds")(startend, minmax)


def run_meta(cfg: FmMetaConfig, startend, minmax, ranges, *, seqlen_q: int) -> None:
    """Fill ``minmax`` and ``ranges`` (shapes: ``workspace_shapes``) on the caller's current stream."""
    if int(minmax.shape[2]) == 0 or int(ranges.shape[2]) == 0 or int(minmax.shape[0]) == 0:
        return
    bounds_fn, ranges_fn = compile_meta(cfg)
    bounds_fn(startend, minmax)
    ranges_fn(minmax, ranges, int(seqlen_q))


# ---------------------------------------------------------------------------- config matrix
def config_matrix(arch: int, full: bool = False) -> list[FmMetaConfig]:
    tiles = ((128, 128), (192, 128), (128, 64))
    if not full:
        tiles = tiles[:1]
    return [FmMetaConfig(int(arch), layout, tm, tn) for layout in fm.COLS for tm, tn in tiles]


def _no_smem(cfg: FmMetaConfig) -> int:
    return 0


CHECKS = {"flashmask_meta": (config_matrix, compile_meta, _no_smem)}
