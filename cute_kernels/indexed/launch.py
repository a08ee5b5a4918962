"""Host launchers of the windowed indexed-attention kernels: compiled once per config, called with
any DLPack tensors (Paddle in production, torch on the H200 in tests), out-parameters only, on the
caller's current stream. Arguments were validated one layer up; only internal invariants are
asserted here.

Plan tensors (see ``plan.py`` for their meaning) are allocated by the caller from
``plan_shapes(...)``; ``tile_bits`` must be zero-filled. Index tensors are passed as
``[S, Lq, Wsel]`` (shared layout: S = B; per-kv-head layout ``[B, Hkv, Lq, Wsel]`` viewed as
S = B * Hkv).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from cute_kernels import arch as _arch
from cute_kernels.jit_cache import jit_cache

from .config import GROUP_SIZES, HEAD_DIMS, KEY_TILE, AttnConfig, PlanConfig, window_queries


class PlanShapes(NamedTuple):
    win_key: tuple
    win_mask: tuple
    win_count: tuple
    tile_bits: tuple
    tile_ptr: tuple
    tile_win: tuple
    tile_start: tuple


def plan_shapes(num_sets: int, num_queries: int, width: int, kv_len: int, wq: int) -> PlanShapes:
    """int32 shapes of the plan tensors (the pair capacity bounds the transpose, no host sync)."""
    nw = -(-num_queries // wq)
    cap = max(wq * width, 1)
    nt = -(-kv_len // KEY_TILE)
    pairs = max(num_sets * nw * min(cap, nt), 1)
    return PlanShapes((num_sets, nw, cap), (num_sets, nw, cap), (num_sets, nw),
                      (num_sets, nt, max(-(-nw // 32), 1)), (num_sets * nt + 1,), (pairs,), (pairs,))


def _i32(*shape):
    import cutlass

    from cute_kernels.fake import fake_tensor

    return fake_tensor(cutlass.Int32, shape, align_bytes=4)


class CompiledPlan(NamedTuple):
    windows: object
    tile_count: object
    scan: object
    tile_fill: object


@jit_cache
def compile_plan(cfg: PlanConfig) -> CompiledPlan:
    import cutlass
    import cutlass.cute as cute

    from cute_kernels.fake import arch_options, fake_stream, sym

    from .plan import PlanScan, PlanTileCount, PlanTileFill, PlanWindows

    S, L, W, NW, CAP, NT, NWW, NP, P = (sym() for _ in range(9))
    opts = arch_options(cfg.arch)
    windows = cute.compile(PlanWindows(cfg.window_queries), _i32(S, L, W), _i32(S, NW, CAP), _i32(S, NW, CAP),
                           _i32(S, NW), _i32(S, NT, NWW), cutlass.Int32(0), fake_stream(), options=opts)
    count = cute.compile(PlanTileCount(), _i32(S, NT, NWW), _i32(NP), fake_stream(), options=opts)
    scan = cute.compile(PlanScan(), _i32(NP), fake_stream(), options=opts)
    fill = cute.compile(PlanTileFill(), _i32(S, NT, NWW), _i32(NP), _i32(S, NW, CAP), _i32(S, NW), _i32(P),
                        _i32(P), fake_stream(), options=opts)
    return CompiledPlan(windows, count, scan, fill)


def _attn_fakes(cfg: AttnConfig):
    import cutlass

    from cute_kernels.fake import fake_tensor, sym

    B, Lq, Lk = sym(), sym(), sym()
    hq = cfg.group * cfg.num_kv_heads
    bf16, f32 = cutlass.BFloat16, cutlass.Float32
    q = lambda: fake_tensor(bf16, (B, Lq, hq, cfg.head_dim))  # noqa: E731
    kv = lambda: fake_tensor(bf16, (B, Lk, cfg.num_kv_heads, cfg.head_dim))  # noqa: E731
    rows = lambda: fake_tensor(f32, (B, hq, Lq), align_bytes=4)  # noqa: E731
    return q, kv, rows


@jit_cache
def compile_fwd(cfg: AttnConfig):
    import cutlass
    import cutlass.cute as cute

    from cute_kernels.fake import arch_options, fake_stream, sym

    from .fwd import IndexedFwd

    q, kv, rows = _attn_fakes(cfg)
    S, NW, CAP = sym(), sym(), sym()
    return cute.compile(IndexedFwd(cfg), q(), kv(), kv(), _i32(S, NW, CAP), _i32(S, NW, CAP), _i32(S, NW),
                        q(), rows(), cutlass.Float32(1.0), fake_stream(), options=arch_options(cfg.arch))


@jit_cache
def compile_bwd_dq(cfg: AttnConfig):
    import cutlass
    import cutlass.cute as cute

    from cute_kernels.fake import arch_options, fake_stream, sym

    from .bwd_dq import IndexedBwdDQ

    q, kv, rows = _attn_fakes(cfg)
    S, NW, CAP = sym(), sym(), sym()
    return cute.compile(IndexedBwdDQ(cfg), q(), kv(), kv(), q(), q(), rows(), _i32(S, NW, CAP),
                        _i32(S, NW, CAP), _i32(S, NW), q(), rows(), cutlass.Float32(1.0), fake_stream(),
                        options=arch_options(cfg.arch))


@jit_cache
def compile_bwd_dkdv(cfg: AttnConfig):
    import cutlass
    import cutlass.cute as cute

    from cute_kernels.fake import arch_options, fake_stream, sym

    q, kv, rows = _attn_fakes(cfg)
    S, NW, CAP, NP, P = sym(), sym(), sym(), sym(), sym()
    return cute.compile(_dkdv_class(cfg)(cfg), q(), kv(), kv(), q(), rows(), rows(), _i32(S, NW, CAP),
                        _i32(S, NW, CAP), _i32(S, NW), _i32(NP), _i32(P), _i32(P), kv(), kv(),
                        cutlass.Float32(1.0), fake_stream(), options=arch_options(cfg.arch))



def run_plan(indices, kv_len: int, win_key, win_mask, win_count, tile_bits, tile_ptr, tile_win, tile_start,
             *, window_queries: int, arch: int | None = None) -> None:
    """Build the windowed plan of ``indices [S, Lq, Wsel]`` into the (preallocated) plan tensors."""
    import cutlass

    num_sets, num_q = int(indices.shape[0]), int(indices.shape[1])
    if num_sets == 0 or num_q == 0:
        return
    fns = compile_plan(PlanConfig(arch=_arch.kernel_arch(arch), window_queries=window_queries))
    fns.windows(indices, win_key, win_mask, win_count, tile_bits, cutlass.Int32(kv_len))
    if int(tile_bits.shape[1]) == 0:
        return
    fns.tile_count(tile_bits, tile_ptr)
    fns.scan(tile_ptr)
    fns.tile_fill(tile_bits, tile_ptr, win_key, win_count, tile_win, tile_start)


def attn_config(q, k, per_kv_head: bool, arch: int | None = None, stages: int | None = None,
                meta_ahead: bool | None = None, skip_empty: bool | None = None,
                dkdv_impl: str = "auto") -> AttnConfig:
    """Config for these tensors. None = the measured-best defaults of ``AttnConfig`` (meta_ahead and
    skip_empty on, the wgmma dK/dV kernel on SM90); ``stages`` 1 or 2 forces that many stages in
    both the dQ and the dK/dV pass (meta_ahead then applies where its pass allows it: dK/dV with 2
    stages, dQ with 1); ``meta_ahead`` / ``skip_empty`` False turn the one-ahead plan reads / the
    dK/dV skipping off (the dK/dV knobs belong to ``dkdv_impl="mma"``)."""
    hq, hkv, d = int(q.shape[2]), int(k.shape[2]), int(q.shape[3])
    cfg = AttnConfig(arch=_arch.kernel_arch(arch), head_dim=d, group=hq // hkv, num_kv_heads=hkv,
                     per_kv_head=per_kv_head, dkdv_impl=dkdv_impl)
    if stages is not None:
        cfg = dataclasses.replace(cfg, dkdv_stages=stages, dq_stages=stages)
    if meta_ahead is not None:
        cfg = dataclasses.replace(cfg, meta_ahead=bool(meta_ahead))
    if skip_empty is not None:
        cfg = dataclasses.replace(cfg, skip_empty=bool(skip_empty))
    return cfg


def run_fwd(cfg: AttnConfig, q, k, v, win_key, win_mask, win_count, out, lse, softmax_scale: float) -> None:
    """out [B, Lq, Hq, D] bf16 and lse [B, Hq, Lq] fp32 (natural log) from a built plan."""
    import cutlass

    if q.shape[0] == 0 or q.shape[1] == 0:
        return
    compile_fwd(cfg)(q, k, v, win_key, win_mask, win_count, out, lse, cutlass.Float32(softmax_scale))


def run_bwd(cfg: AttnConfig, q, k, v, out, dout, lse, win_key, win_mask, win_count, tile_ptr, tile_win,
            tile_start, dq, dk, dv, delta, softmax_scale: float) -> None:
    """dq, dk, dv (bf16, every element written) and the scratch ``delta [B, Hq, Lq]`` fp32."""
    run_bwd_dq(cfg, q, k, v, out, dout, lse, win_key, win_mask, win_count, dq, delta, softmax_scale)
    run_bwd_dkdv(cfg, q, k, v, dout, lse, delta, win_key, win_mask, win_count, tile_ptr, tile_win, tile_start,
                 dk, dv, softmax_scale)


def run_bwd_dq(cfg: AttnConfig, q, k, v, out, dout, lse, win_key, win_mask, win_count, dq, delta,
               softmax_scale: float) -> None:
    """dq and delta = rowsum(out * dout) (needed by ``run_bwd_dkdv``)."""
    import cutlass

    if q.shape[0] > 0 and q.shape[1] > 0:
        compile_bwd_dq(cfg)(q, k, v, out, dout, lse, win_key, win_mask, win_count, dq, delta,
                            cutlass.Float32(softmax_scale))


def run_bwd_dkdv(cfg: AttnConfig, q, k, v, dout, lse, delta, win_key, win_mask, win_count, tile_ptr, tile_win,
                 tile_start, dk, dv, softmax_scale: float) -> None:
    """dk, dv (every row written; exact zeros for keys no query selects)."""
    import cutlass

    if k.shape[0] > 0 and k.shape[1] > 0:
        compile_bwd_dkdv(cfg)(q, k, v, dout, lse, delta, win_key, win_mask, win_count, tile_ptr, tile_win,
                              tile_start, dk, dv, cutlass.Float32(softmax_scale))


# ---- configs compiled by ``python -m cute_kernels.check`` (and in CI for both archs) ----
def plan_matrix(arch: int, full: bool = False):
    groups = GROUP_SIZES if full else (12, 1)
    return sorted({PlanConfig(arch=arch, window_queries=window_queries(g)) for g in groups},
                  key=lambda c: c.window_queries)


def attn_matrix(arch: int, full: bool = False):
    if full:
        return [AttnConfig(arch=arch, head_dim=d, group=g, num_kv_heads=hkv, per_kv_head=pk)
                for d in HEAD_DIMS for g in GROUP_SIZES for hkv in (2,) for pk in (False, True)]
    # The stage / meta / skip variants are knobs of the portable dK/dV kernel ("mma"; on SM90 the
    # defaults build the wgmma one, which has none), so they name it explicitly.
    return [AttnConfig(arch=arch, head_dim=256, group=12, num_kv_heads=2, per_kv_head=False),
            AttnConfig(arch=arch, head_dim=256, group=12, num_kv_heads=2, per_kv_head=False, dkdv_stages=1,
                       dq_stages=2, dkdv_impl="mma"),
            AttnConfig(arch=arch, head_dim=256, group=12, num_kv_heads=2, per_kv_head=False, meta_ahead=False,
                       skip_empty=False, dkdv_impl="mma"),
            AttnConfig(arch=arch, head_dim=128, group=8, num_kv_heads=1, per_kv_head=True),
            AttnConfig(arch=arch, head_dim=64, group=1, num_kv_heads=4, per_kv_head=False)] + (
        [AttnConfig(arch=arch, head_dim=256, group=12, num_kv_heads=2, per_kv_head=False, dkdv_impl="mma")]
        if arch == 90 else [])




def _fwd_smem(cfg):
    from .fwd import IndexedFwd
    return IndexedFwd.smem_bytes(cfg)


def _dq_smem(cfg):
    from .bwd_dq import IndexedBwdDQ
    return IndexedBwdDQ.smem_bytes(cfg)


def _dkdv_class(cfg: AttnConfig):
    if cfg.dkdv_impl == "wgmma":
        from .bwd_dkdv_sm90 import IndexedBwdDKDVSm90
        return IndexedBwdDKDVSm90
    from .bwd_dkdv import IndexedBwdDKDV
    return IndexedBwdDKDV


def _dkdv_smem(cfg):
    return _dkdv_class(cfg).smem_bytes(cfg)


def _plan_smem(cfg):
    from .plan import CHUNK, WARPS
    return CHUNK * 4 + 2 * WARPS * 4


CHECKS = {
    "indexed_plan": (plan_matrix, compile_plan, _plan_smem),
    "indexed_fwd": (attn_matrix, compile_fwd, _fwd_smem),
    "indexed_bwd_dq": (attn_matrix, compile_bwd_dq, _dq_smem),
    "indexed_bwd_dkdv": (attn_matrix, compile_bwd_dkdv, _dkdv_smem),
}
