"""Tiny CuTe kernels that run the device helpers of ``common/`` one value (or one case) per thread.

They let the plain-PTX / integer helpers the SM100 kernels use be checked on any GPU we build for:
``tests/gpu/test_sm100_helpers.py`` compiles them for sm_90a on the H200 and compares with numpy;
``python -m cute_kernels.selftest`` runs the same checks on the Blackwell part itself (where
``math_sm100.fmax3`` is the three-input ``max.f32``). Each ``compile_*`` returns a TVM-FFI callable
taking DLPack tensors (torch or Paddle), launched on the caller's current stream:

    exp2    x f32 [N]                   -> poly f32 [N] (math_sm100.exp2_poly), mufu f32 [N] (ex2.approx)
    max     x f32 [N, k]                -> y f32 [N]    (math_sm100.max_tree over the k values of a row)
    tiles   case i32 [N, 6]             -> out i32 [N, 12]   (common/tile_range, see TILE_FIELDS)
    mask    case i32 [N, 6]             -> q-major f32 [N, tile_n], kv-major f32 [N, tile_m]
                                           (common/mask: 0 kept, -inf masked)

A tiles / mask case row is (m_start, n_start, seqlen_q, seqlen_k, window_left, window_right), window
sizes -1 = unbounded, as the kernels receive them. Mask case: the query-major probe masks row
``m_start`` of key tile ``n_start // tile_n`` (keys n_tile * tile_n + c); the key-major probe masks
key ``n_start`` against query rows (m_start // tile_m) * tile_m + c.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from cute_kernels.common.mask import apply_mask, apply_mask_kv_major
from cute_kernels.common.math_sm100 import exp2_poly, max_tree
from cute_kernels.common.tile_range import (QueryTileRange, TileRange, first_key_tile, last_key_tile,
                                             normalize_window)
from cute_kernels.fake import arch_options, fake_stream, fake_tensor, sym
from cute_kernels.jit_cache import jit_cache

THREADS = 128
#: Columns of the tiles probe's output row.
TILE_FIELDS = ("left", "right", "n_min", "n_max", "n_right_mask", "n_left_mask", "first_key_tile",
               "last_key_tile", "m_min", "m_max", "m_right_mask", "m_left_mask")


def _grid(n):
    return [(n + THREADS - 1) // THREADS, 1, 1]


def _index():
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    return bidx * THREADS + tidx


class _Exp2:
    @cute.jit
    def __call__(self, mX: cute.Tensor, mPoly: cute.Tensor, mMufu: cute.Tensor, stream):
        self.kernel(mX, mPoly, mMufu).launch(grid=_grid(mX.shape[0]), block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mPoly: cute.Tensor, mMufu: cute.Tensor):
        i = _index()
        if i < mX.shape[0]:
            x = mX[i]
            mPoly[i] = exp2_poly(x)
            mMufu[i] = cute.math.exp2(x, fastmath=True)


class _MaxTree:
    def __init__(self, k: int):
        self.k = k

    @cute.jit
    def __call__(self, mX: cute.Tensor, mY: cute.Tensor, stream):
        self.kernel(mX, mY).launch(grid=_grid(mX.shape[0]), block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mY: cute.Tensor):
        i = _index()
        if i < mX.shape[0]:
            mY[i] = max_tree([mX[i, j] for j in range(self.k)])


class _Tiles:
    def __init__(self, tile_m: int, tile_n: int, causal: bool, has_window: bool):
        self.tile_m, self.tile_n, self.causal, self.has_window = tile_m, tile_n, causal, has_window

    @cute.jit
    def __call__(self, mCase: cute.Tensor, mOut: cute.Tensor, stream):
        self.kernel(mCase, mOut).launch(grid=_grid(mCase.shape[0]), block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mCase: cute.Tensor, mOut: cute.Tensor):
        i = _index()
        if i < mCase.shape[0]:
            m_start, n_start, sq, sk = mCase[i, 0], mCase[i, 1], mCase[i, 2], mCase[i, 3]
            left, right = normalize_window(mCase[i, 4], mCase[i, 5], sq, sk, self.causal, self.has_window)
            mask_right = const_expr(self.causal or self.has_window)
            rng = TileRange.create(m_start, sq, sk, left, right, self.tile_m, self.tile_n, mask_right,
                                   self.has_window)
            qrng = QueryTileRange.create(n_start, sq, sk, left, right, self.tile_m, self.tile_n, mask_right,
                                         self.has_window)
            vals = (left, right, rng.n_min, rng.n_max, rng.n_right_mask, rng.n_left_mask,
                    first_key_tile(m_start, sq, sk, left, self.tile_n, self.has_window),
                    last_key_tile(m_start, sq, sk, right, self.tile_m, self.tile_n, mask_right),
                    qrng.m_min, qrng.m_max, qrng.m_right_mask, qrng.m_left_mask)
            for j in cutlass.range_constexpr(len(vals)):
                mOut[i, j] = Int32(vals[j])


class _Mask:
    def __init__(self, tile_m: int, tile_n: int, causal: bool, has_window: bool):
        self.tile_m, self.tile_n, self.causal, self.has_window = tile_m, tile_n, causal, has_window

    @cute.jit
    def __call__(self, mCase: cute.Tensor, mQ: cute.Tensor, mKV: cute.Tensor, stream):
        self.kernel(mCase, mQ, mKV).launch(grid=_grid(mCase.shape[0]), block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mCase: cute.Tensor, mQ: cute.Tensor, mKV: cute.Tensor):
        i = _index()
        if i < mCase.shape[0]:
            row, key, sq, sk = mCase[i, 0], mCase[i, 1], mCase[i, 2], mCase[i, 3]
            left, right = normalize_window(mCase[i, 4], mCase[i, 5], sq, sk, self.causal, self.has_window)
            mask_right = const_expr(self.causal or self.has_window)
            shift = sk - sq
            acc = cute.make_rmem_tensor((1, self.tile_n), Float32)
            acc.fill(0.0)
            apply_mask(acc, tuple(range(self.tile_n)), [row], (key // self.tile_n) * self.tile_n, sk, shift,
                       left, right, True, mask_right, self.has_window)
            for c in cutlass.range_constexpr(self.tile_n):
                mQ[i, c] = acc[0, c]
            acc_t = cute.make_rmem_tensor((1, self.tile_m), Float32)
            acc_t.fill(0.0)
            apply_mask_kv_major(acc_t, tuple(range(self.tile_m)), [key], (row // self.tile_m) * self.tile_m, sk,
                                shift, left, right, mask_right, self.has_window)
            for c in cutlass.range_constexpr(self.tile_m):
                mKV[i, c] = acc_t[0, c]


def _f32(*shape):
    return fake_tensor(Float32, shape, align_bytes=4)


def _i32(*shape):
    return fake_tensor(Int32, shape, align_bytes=4)


@jit_cache
def compile_exp2(arch: int):
    n = sym()
    return cute.compile(_Exp2(), _f32(n), _f32(n), _f32(n), fake_stream(), options=arch_options(arch))


@jit_cache
def compile_max_tree(arch: int, k: int):
    n = sym()
    return cute.compile(_MaxTree(k), _f32(n, k), _f32(n), fake_stream(), options=arch_options(arch))


@jit_cache
def compile_tiles(arch: int, tile_m: int, tile_n: int, causal: bool, has_window: bool):
    n = sym()
    return cute.compile(_Tiles(tile_m, tile_n, causal, has_window), _i32(n, 6), _i32(n, len(TILE_FIELDS)),
                        fake_stream(), options=arch_options(arch))


@jit_cache
def compile_mask(arch: int, tile_m: int, tile_n: int, causal: bool, has_window: bool):
    n = sym()
    return cute.compile(_Mask(tile_m, tile_n, causal, has_window), _i32(n, 6), _f32(n, tile_n), _f32(n, tile_m),
                        fake_stream(), options=arch_options(arch))


__all__ = ["TILE_FIELDS", "compile_exp2", "compile_max_tree", "compile_tiles", "compile_mask"]
