"""Host launchers of the block-sparse attention kernels: compiled once per config, called with any
DLPack tensors (Paddle in production, torch on the H200 in tests), out-parameters only, on the
caller's current stream. Arguments were validated one layer up (``paddle_fa4/block_sparse.py``).

Tensors: q [B, S, Hq, Dk], k [B, S, Hkv, Dk], v [B, S, Hkv, Dv] (bf16 / fp16, contiguous); the plan's
tile_start / tile_mask [NS, NQT, CAP], tile_count [NS, NQT], q_limit [B, S] (int32); sink [Hq]
fp32 or None; out [B, S, Hq, Dv], lse [B, Hq, S] fp32 (every element written). The absorbed-MLA
latent (``FwdConfig.latent`` / ``BwdConfig.latent``): V is the leading Dv columns of k, v is None, and the
backward writes one combined key gradient dkv [B, S, Hkv, Dk] (dk's place; no dv).
"""

from __future__ import annotations

import dataclasses

from cute_kernels import arch as _arch
from cute_kernels.jit_cache import jit_cache

from .config import (BWD_HEAD_DIMS, DTYPES, HEAD_DIMS, LATENT_DIMS, MIN_SEGMENT_PAIRS, ORDERED_MIN_SEGMENT_PAIRS,
                     SEGMENTS, BwdConfig, FwdConfig)


def fwd_config(q, k, v, *, per_kv_head: bool, has_sink: bool, arch: int | None = None,
               latent_dv: int | None = None) -> FwdConfig:
    """The config of a call; ``latent_dv``: the absorbed-MLA latent with V = k[..., :latent_dv] (v None)."""
    from cute_kernels.dtypes import dtype_name

    hq, hkv = int(q.shape[2]), int(k.shape[2])
    latent = latent_dv is not None
    return FwdConfig(arch=_arch.kernel_arch(arch), dtype=dtype_name(q.dtype), head_dim=int(q.shape[3]),
                     head_dim_v=int(latent_dv) if latent else int(v.shape[3]), group=hq // hkv,
                     per_kv_head=per_kv_head, has_sink=has_sink, latent=latent)


def _fwd_fakes(cfg: FwdConfig):
    import cutlass

    from cute_kernels.dtypes import cutlass_dtype
    from cute_kernels.fake import fake_tensor, sym

    dt, i32, f32 = cutlass_dtype(cfg.dtype), cutlass.Int32, cutlass.Float32
    b, s, hkv, ns, nqt, cap = (sym() for _ in range(6))
    hq = sym()
    return (fake_tensor(dt, (b, s, hq, cfg.head_dim)), fake_tensor(dt, (b, s, hkv, cfg.head_dim)),
            fake_tensor(dt, (b, s, hkv, cfg.head_dim if cfg.latent else cfg.head_dim_v)),
            fake_tensor(i32, (ns, nqt, cap), align_bytes=4), fake_tensor(i32, (ns, nqt, cap), align_bytes=4),
            fake_tensor(i32, (ns, nqt), align_bytes=4), fake_tensor(i32, (b, s), align_bytes=4),
            fake_tensor(f32, (hq,), align_bytes=4) if cfg.has_sink else None,
            fake_tensor(dt, (b, s, hq, cfg.head_dim_v)), fake_tensor(f32, (b, hq, s), align_bytes=4),
            f32(1.0))


def compile_fwd(cfg: FwdConfig, sm_count: int | None = None):
    """The forward of ``cfg``, compiled once. ``sm_count``: SMs of the device the persistent kernels (SM100, and
    the SM90 latent) launch on (their grid; None = the target's default, compile-only builds); the other SM90
    kernels ignore it."""
    if not _persistent_fwd(cfg):
        sm_count = None
    elif sm_count is None:
        sm_count = _arch.SM_COUNT_DEFAULT[cfg.arch]
    return _compile_fwd(cfg, sm_count)


@jit_cache
def _compile_fwd(cfg: FwdConfig, sm_count: int | None):
    import cutlass.cute as cute

    from cute_kernels.fake import arch_options, fake_stream

    if _arch.family(cfg.arch) not in (90, 100):
        raise NotImplementedError(f"block_sparse_attention: no CuTe forward for arch {cfg.arch}")
    if _arch.family(cfg.arch) == 100:
        if cfg.latent:
            raise NotImplementedError("block_sparse_attention: no SM100 forward for the absorbed-MLA latent")
        from .fwd_sm100 import BlockSparseFwdSm100
        kernel = BlockSparseFwdSm100(cfg, sm_count=int(sm_count))
    elif cfg.latent:  # persistent: its grid is the SM count
        kernel = _fwd_kernel(cfg)(cfg, sm_count=int(sm_count))
    else:
        kernel = _fwd_kernel(cfg)(cfg)
    return cute.compile(kernel, *_fwd_fakes(cfg), fake_stream(), options=arch_options(cfg.arch))


def _persistent_fwd(cfg: FwdConfig) -> bool:
    """Whether the forward of ``cfg`` has a persistent grid (sized by the device's SM count)."""
    return _arch.family(cfg.arch) == 100 or cfg.latent


def _fwd_kernel(cfg: FwdConfig):
    if cfg.latent:
        from .fwd_latent_sm90 import BlockSparseLatentFwdSm90
        return BlockSparseLatentFwdSm90
    from .fwd_sm90 import BlockSparseFwdSm90
    return BlockSparseFwdSm90


def check_plan_tiles(cfg, seqlen: int, tile_start) -> None:
    """ValueError unless ``tile_start`` ([NS, NQT, CAP]) has the row tiles of ``cfg``'s kernels: NQT = ceil(S / WQ)
    windows of WQ = ``cfg.window_queries`` queries (SM90 and SM100 tile differently, ``config.tile_queries``) and
    CAP a multiple of WQ (WQ x topk; 0 or 1 without ids). A plan built for another query tile would be read with
    the wrong rows and bits: refused before any launch."""
    wq = cfg.window_queries
    nqt, cap = int(tile_start.shape[1]), int(tile_start.shape[2])
    if nqt != -(-int(seqlen) // wq) or (cap > 1 and cap % wq):
        raise ValueError(f"block_sparse_attention: the plan has {nqt} row tiles of {cap} slots for {seqlen} queries; "
                         f"the kernels for compute capability {cfg.arch} (G {cfg.group}, Dv {cfg.head_dim_v}) tile "
                         f"{wq} queries: build the plan for them (block_sparse_plan on that GPU, with head_dim_v)")


def run_fwd(cfg: FwdConfig, q, k, v, tile_start, tile_mask, tile_count, q_limit, sink, out, lse,
            softmax_scale: float) -> None:
    """out and lse from a built plan (``paddle_fa4.block_sparse_plan`` or ``tests/oracles/block_sparse``);
    with ``cfg.latent`` v is None (V = k's leading ``head_dim_v`` columns)."""
    assert (sink is None) == (not cfg.has_sink), "sink must match cfg.has_sink"
    assert (v is None) == cfg.latent, "v is None exactly for the latent"
    if int(q.shape[0]) == 0 or int(q.shape[1]) == 0:
        return
    check_plan_tiles(cfg, int(q.shape[1]), tile_start)
    if cfg.latent:
        v = k  # the kernel reads V from K's shared memory; its v argument is k
    sm_count = _arch.tensor_sm_count(q) if _persistent_fwd(cfg) else None
    compile_fwd(cfg, sm_count)(q, k, v, tile_start, tile_mask, tile_count, q_limit, sink, out, lse, float(softmax_scale))


def bwd_config(q, k, v, *, per_kv_head: bool, arch: int | None = None, latent_dv: int | None = None,
               exact_delta: bool = False) -> BwdConfig:
    f = fwd_config(q, k, v, per_kv_head=per_kv_head, has_sink=False, arch=arch, latent_dv=latent_dv)
    return BwdConfig(arch=f.arch, dtype=f.dtype, head_dim=f.head_dim, head_dim_v=f.head_dim_v, group=f.group,
                     per_kv_head=per_kv_head, latent=f.latent, exact_delta=bool(exact_delta))


def compile_bwd_dq(cfg: BwdConfig, sm_count: int | None = None):
    """The dQ kernel of ``cfg``, compiled once; ``sm_count`` as ``compile_fwd`` (the SM100 kernel is persistent)."""
    if _arch.family(cfg.arch) != 100:
        sm_count = None
    elif sm_count is None:
        sm_count = _arch.SM_COUNT_DEFAULT[cfg.arch]
    return _compile_bwd_dq(cfg, sm_count)


@jit_cache
def _compile_bwd_dq(cfg: BwdConfig, sm_count: int | None):
    import cutlass
    import cutlass.cute as cute

    from cute_kernels.dtypes import cutlass_dtype
    from cute_kernels.fake import arch_options, fake_stream, fake_tensor, sym

    if _arch.family(cfg.arch) not in (90, 100):
        raise NotImplementedError(f"block_sparse_attention: no CuTe backward for arch {cfg.arch}")
    if _arch.family(cfg.arch) == 100 and cfg.latent:
        raise NotImplementedError("block_sparse_attention: no SM100 dQ kernel for the absorbed-MLA latent")
    dt, i32, f32 = cutlass_dtype(cfg.dtype), cutlass.Int32, cutlass.Float32
    b, s, hq, hkv, ns, nqt, cap = (sym() for _ in range(7))
    q = fake_tensor(dt, (b, s, hq, cfg.head_dim))
    kv = lambda d: fake_tensor(dt, (b, s, hkv, d))  # noqa: E731
    rows = lambda: fake_tensor(f32, (b, hq, s), align_bytes=4)  # noqa: E731
    ints = lambda *shape: fake_tensor(i32, shape, align_bytes=4)  # noqa: E731
    o = lambda: fake_tensor(dt, (b, s, hq, cfg.head_dim_v))  # noqa: E731
    plan = (ints(ns, nqt, cap), ints(ns, nqt, cap), ints(ns, nqt), ints(b, s))
    if cfg.latent:
        from .bwd_dq_latent_sm90 import BlockSparseLatentBwdDQSm90
        return cute.compile(BlockSparseLatentBwdDQSm90(cfg), q, kv(cfg.head_dim), o(), o(), rows(), rows(), *plan,
                            fake_tensor(dt, (b, s, hq, cfg.head_dim)), f32(1.0), fake_stream(),
                            options=arch_options(cfg.arch))
    if _arch.family(cfg.arch) == 100:
        from .bwd_dq_sm100 import BlockSparseBwdDQSm100
        kernel = BlockSparseBwdDQSm100(cfg, sm_count=int(sm_count))
    else:
        from .bwd_dq_sm90 import BlockSparseBwdDQSm90
        kernel = BlockSparseBwdDQSm90(cfg)
    return cute.compile(kernel, q, kv(cfg.head_dim), kv(cfg.head_dim_v), o(), o(), rows(), rows(),
                        *plan, fake_tensor(dt, (b, s, hq, cfg.head_dim)), f32(1.0), fake_stream(),
                        options=arch_options(cfg.arch))


def compile_bwd_dkdv(cfg: BwdConfig, ordered: bool | None = None):
    """The dK/dV kernel of ``cfg``; ``ordered`` (the default) takes the plan's ``key_order`` (Note [tile-ordered
    segments] in bwd_dkdv_sm90.py), else the CTAs run key-block-major."""
    return _compile_bwd_dkdv(cfg, True if ordered is None else bool(ordered))


@jit_cache
def _compile_bwd_dkdv(cfg: BwdConfig, ordered: bool):
    import cutlass
    import cutlass.cute as cute

    from cute_kernels.dtypes import cutlass_dtype
    from cute_kernels.fake import arch_options, fake_stream, fake_tensor, sym

    if _arch.family(cfg.arch) not in (90, 100):
        raise NotImplementedError(f"block_sparse_attention: no CuTe backward for arch {cfg.arch}")
    if _arch.family(cfg.arch) == 100:
        from .bwd_dkdv_sm100 import BlockSparseBwdDKDVSm100
        reason = BlockSparseBwdDKDVSm100.unsupported_reason(cfg)
        if reason is not None:
            raise NotImplementedError(f"block_sparse_attention: no SM100 dK/dV kernel for {reason}")
    dt, i32, f32 = cutlass_dtype(cfg.dtype), cutlass.Int32, cutlass.Float32
    b, s, hq, hkv, ns, nqt, cap, kcap, kp, np_, nx = (sym() for _ in range(11))
    kv = lambda d: fake_tensor(dt, (b, s, hkv, d))  # noqa: E731
    rows = lambda: fake_tensor(f32, (b, hq, s), align_bytes=4)  # noqa: E731
    ints = lambda *shape: fake_tensor(i32, shape, align_bytes=4)  # noqa: E731
    part = lambda d: fake_tensor(f32, (b, s, hkv, d))  # noqa: E731
    q, do = fake_tensor(dt, (b, s, hq, cfg.head_dim)), fake_tensor(dt, (b, s, hq, cfg.head_dim_v))
    plan = (ints(ns, nqt, cap), ints(b, s), ints(ns, kcap), ints(ns, kcap), ints(ns), ints(kp), ints(np_), ints(np_))
    order = (ints(ns, nx),) if ordered else ()
    if cfg.latent:
        from .bwd_dkv_latent_sm90 import BlockSparseLatentBwdDKVSm90
        return cute.compile(BlockSparseLatentBwdDKVSm90(cfg), q, kv(cfg.head_dim), do, rows(), rows(), *plan,
                            kv(cfg.head_dim), part(cfg.head_dim), ints(ns, kcap, hkv), f32(1.0), i32(1),
                            fake_stream(), *order, options=arch_options(cfg.arch))
    if _arch.family(cfg.arch) == 100:
        kernel = BlockSparseBwdDKDVSm100(cfg)
    else:
        from .bwd_dkdv_sm90 import BlockSparseBwdDKDVSm90
        kernel = BlockSparseBwdDKDVSm90(cfg)
    return cute.compile(kernel, q, kv(cfg.head_dim), kv(cfg.head_dim_v), do, rows(), rows(),
                        *plan, kv(cfg.head_dim), kv(cfg.head_dim_v), part(cfg.head_dim), part(cfg.head_dim_v),
                        ints(ns, kcap, hkv), f32(1.0), i32(1), fake_stream(), *order, options=arch_options(cfg.arch))


def dkdv_workspace_shapes(k, v, key_start) -> dict:
    """``{name: (shape, dtype, zero)}`` of the dK/dV kernel's workspace (Note [key block segments] in
    bwd_dkdv_sm90.py): fp32 partials shaped like k / v (no init; the latent, v None: k's only) and the turn
    counters, zero-filled."""
    b, s, hkv = (int(x) for x in k.shape[:3])
    shapes = {"dk_part": ([b, s, hkv, int(k.shape[3])], "float32", False)}
    if v is not None:
        shapes["dv_part"] = ([b, s, hkv, int(v.shape[3])], "float32", False)
    shapes["seg_sem"] = ([int(key_start.shape[0]), int(key_start.shape[1]), hkv], "int32", True)
    return shapes


def default_min_segment_pairs(batch: int, num_kv_heads: int, key_blocks: int, ordered: bool = False) -> int:
    """The dK/dV kernel's shortest segment for a launch of ``batch x num_kv_heads x key_blocks`` key blocks:
    ``config.ORDERED_MIN_SEGMENT_PAIRS`` in the plan's ``key_order``, else ``config.MIN_SEGMENT_PAIRS`` (the
    other arguments are what a shape-dependent rule would use; today one value was best at every shape)."""
    return ORDERED_MIN_SEGMENT_PAIRS if ordered else MIN_SEGMENT_PAIRS


def run_bwd_dkdv(cfg: BwdConfig, q, k, v, dout, lse, delta, tile_mask, q_limit, key_start, key_end, key_count,
                 key_ptr, key_tile, key_slot, dk, dv, dk_part, dv_part, seg_sem, softmax_scale: float,
                 min_segment_pairs: int | None = None, key_order=None) -> None:
    """dk, dv of the selected key blocks' rows; the caller passes them zero-filled (keys no query
    selects are not written) and the workspace of ``dkdv_workspace_shapes``. ``min_segment_pairs``: the
    shortest segment a heavily listed key block is split into (default ``default_min_segment_pairs``);
    it changes the summation order of dK / dV (each value is bitwise reproducible), not their meaning.
    ``key_order``: the plan's int32 [NS, KCAP * SEGMENTS] CTA order (Note [tile-ordered segments] in
    bwd_dkdv_sm90.py; it changes the schedule only, not a bit of the result); None: key-block-major.
    With ``cfg.latent`` v, dv and dv_part are None and dk is the combined latent gradient [B, S, Hkv, Dk]."""
    if min_segment_pairs is not None and int(min_segment_pairs) < 1:
        raise ValueError(f"min_segment_pairs must be >= 1, got {min_segment_pairs}")
    assert (v is None) == cfg.latent and (dv is None) == cfg.latent and (dv_part is None) == cfg.latent, \
        "v, dv and dv_part are None exactly for the latent"
    ordered = key_order is not None
    if ordered:
        want = [int(key_start.shape[0]), int(key_start.shape[1]) * SEGMENTS]
        if [int(x) for x in key_order.shape] != want or "int32" not in str(key_order.dtype):
            raise ValueError(f"key_order must be int32 {want} (the plan's), got {str(key_order.dtype)} "
                             f"{[int(x) for x in key_order.shape]}")
    if int(q.shape[0]) == 0 or int(q.shape[1]) == 0 or int(key_start.shape[1]) == 0:
        return
    check_plan_tiles(cfg, int(q.shape[1]), tile_mask)
    if min_segment_pairs is None:
        min_segment_pairs = default_min_segment_pairs(int(q.shape[0]), int(k.shape[2]), int(key_start.shape[1]),
                                                      ordered)
    if cfg.exact_delta:  # it changes the dQ kernel only: one dK / dV build (and no copy on the plain path)
        cfg = dataclasses.replace(cfg, exact_delta=False)
    plan = (tile_mask, q_limit, key_start, key_end, key_count, key_ptr, key_tile, key_slot)
    order = (key_order,) if ordered else ()
    if cfg.latent:
        compile_bwd_dkdv(cfg, ordered)(q, k, dout, lse, delta, *plan, dk, dk_part, seg_sem, float(softmax_scale),
                                       int(min_segment_pairs), *order)
        return
    compile_bwd_dkdv(cfg, ordered)(q, k, v, dout, lse, delta, *plan, dk, dv, dk_part, dv_part, seg_sem,
                                   float(softmax_scale), int(min_segment_pairs), *order)


def run_bwd_dq(cfg: BwdConfig, q, k, v, out, dout, lse, delta, tile_start, tile_mask, tile_count, q_limit, dq,
               softmax_scale: float) -> None:
    """dq (every element written) from the forward's out and lse; also writes ``delta = rowsum(dout * out)``
    [B, Hq, S] fp32 (every element), which ``run_bwd_dkdv`` and the sink gradient read; with
    ``cfg.exact_delta`` delta = rowsum(P dP) instead (Note [exact delta] in bwd_dq_sm90.py; out is not read).
    With ``cfg.latent`` v is None (V = k's leading ``head_dim_v`` columns)."""
    assert (v is None) == cfg.latent, "v is None exactly for the latent"
    if int(q.shape[0]) == 0 or int(q.shape[1]) == 0:
        return
    check_plan_tiles(cfg, int(q.shape[1]), tile_start)
    kv = (k,) if cfg.latent else (k, v)
    sm_count = _arch.tensor_sm_count(q) if _arch.family(cfg.arch) == 100 else None
    compile_bwd_dq(cfg, sm_count)(q, *kv, out, dout, lse, delta, tile_start, tile_mask, tile_count, q_limit, dq,
                        float(softmax_scale))


# ---- configs compiled by ``python -m cute_kernels.check`` ----
def fwd_matrix(arch: int, full: bool = False):
    if _arch.family(arch) == 100:  # no latent there
        return [FwdConfig(arch=arch, dtype=dt, head_dim=d, head_dim_v=d, group=g, per_kv_head=pk, has_sink=sk)
                for dt in (DTYPES if full else ("bfloat16",)) for d in HEAD_DIMS
                for g in ((1, 2, 4, 8, 12, 16, 64, 128) if full else (1, 8, 12, 128))
                for pk in ((False, True) if full else (False,)) for sk in ((False, True) if full else (True,))]
    if _arch.family(arch) != 90:
        return []
    latent = [FwdConfig(arch=arch, dtype=dt, head_dim=dk, head_dim_v=dv, group=g, per_kv_head=False, has_sink=sk,
                        latent=True)
              for dt in (DTYPES if full else ("bfloat16",)) for dk, dv in LATENT_DIMS
              for g in ((16, 64, 128) if full else (64,)) for sk in ((False, True) if full else (True,))]
    if full:
        return [FwdConfig(arch=arch, dtype=dt, head_dim=d, head_dim_v=d, group=g, per_kv_head=pk, has_sink=sk)
                for dt in DTYPES for d in HEAD_DIMS for g in (1, 2, 8, 12, 64, 128) for pk in (False, True)
                for sk in (False, True)] + latent
    return [FwdConfig(arch=arch, dtype="bfloat16", head_dim=128, head_dim_v=128, group=8, per_kv_head=False,
                      has_sink=False),
            FwdConfig(arch=arch, dtype="bfloat16", head_dim=128, head_dim_v=128, group=8, per_kv_head=True,
                      has_sink=True),
            FwdConfig(arch=arch, dtype="bfloat16", head_dim=64, head_dim_v=64, group=1, per_kv_head=False,
                      has_sink=False),
            FwdConfig(arch=arch, dtype="float16", head_dim=256, head_dim_v=256, group=12, per_kv_head=False,
                      has_sink=True),
            FwdConfig(arch=arch, dtype="bfloat16", head_dim=128, head_dim_v=128, group=128, per_kv_head=False,
                      has_sink=True)] + latent


def bwd_matrix(arch: int, full: bool = False):
    if _arch.family(arch) == 100:  # the dK/dV kernel (bwd_dkdv_sm100.py): head dim 128, no latent
        if full:
            return [BwdConfig(arch=arch, dtype=dt, head_dim=128, head_dim_v=128, group=g, per_kv_head=pk)
                    for dt in DTYPES for g in (1, 2, 5, 8, 12, 64, 128) for pk in (False, True)]
        return [BwdConfig(arch=arch, dtype="bfloat16", head_dim=128, head_dim_v=128, group=8, per_kv_head=True),
                BwdConfig(arch=arch, dtype="bfloat16", head_dim=128, head_dim_v=128, group=128, per_kv_head=False),
                BwdConfig(arch=arch, dtype="float16", head_dim=128, head_dim_v=128, group=12, per_kv_head=False),
                BwdConfig(arch=arch, dtype="bfloat16", head_dim=128, head_dim_v=128, group=1, per_kv_head=False)]
    if _arch.family(arch) != 90:
        return []
    latent = [BwdConfig(arch=arch, dtype=dt, head_dim=dk, head_dim_v=dv, group=g, per_kv_head=pk, latent=True)
              for dt in (DTYPES if full else ("bfloat16",)) for dk, dv in LATENT_DIMS
              for g in ((16, 64, 128) if full else (64,)) for pk in ((False, True) if full else (False,))]
    if full:
        return [BwdConfig(arch=arch, dtype=dt, head_dim=d, head_dim_v=d, group=g, per_kv_head=pk)
                for dt in DTYPES for d in BWD_HEAD_DIMS for g in (1, 2, 8, 12, 64, 128) for pk in (False, True)] + latent
    return [BwdConfig(arch=arch, dtype="bfloat16", head_dim=128, head_dim_v=128, group=8, per_kv_head=True),
            BwdConfig(arch=arch, dtype="bfloat16", head_dim=128, head_dim_v=128, group=128, per_kv_head=False),
            BwdConfig(arch=arch, dtype="float16", head_dim=128, head_dim_v=128, group=12, per_kv_head=False),
            BwdConfig(arch=arch, dtype="bfloat16", head_dim=64, head_dim_v=64, group=1, per_kv_head=False)] + latent


def dq_matrix(arch: int, full: bool = False):
    """``bwd_matrix`` and the exact-delta variant of each of its dQ kernels (``--full``; by default those of
    the GQA d 128 and the latent configs)."""
    if _arch.family(arch) == 100:  # bwd_dq_sm100.py: no latent
        if full:
            base = [BwdConfig(arch=arch, dtype=dt, head_dim=d, head_dim_v=d, group=g, per_kv_head=pk)
                    for dt in DTYPES for d in BWD_HEAD_DIMS for g in (1, 2, 8, 12, 64, 128) for pk in (False, True)]
        else:
            base = [BwdConfig(arch=arch, dtype="bfloat16", head_dim=128, head_dim_v=128, group=8, per_kv_head=True),
                    BwdConfig(arch=arch, dtype="bfloat16", head_dim=128, head_dim_v=128, group=128, per_kv_head=False),
                    BwdConfig(arch=arch, dtype="float16", head_dim=128, head_dim_v=128, group=12, per_kv_head=False),
                    BwdConfig(arch=arch, dtype="bfloat16", head_dim=64, head_dim_v=64, group=1, per_kv_head=False)]
    else:
        base = bwd_matrix(arch, full)
    exact = [c for c in base if full or (c.head_dim == 128 and c.group == 8) or c.latent]
    return base + [dataclasses.replace(c, exact_delta=True) for c in exact]


def _dq_smem(cfg):
    if _arch.family(cfg.arch) == 100:
        from .bwd_dq_sm100 import BlockSparseBwdDQSm100
        return BlockSparseBwdDQSm100.smem_bytes(cfg)
    if cfg.latent:
        from .bwd_dq_latent_sm90 import BlockSparseLatentBwdDQSm90
        return BlockSparseLatentBwdDQSm90.smem_bytes(cfg)
    from .bwd_dq_sm90 import BlockSparseBwdDQSm90
    return BlockSparseBwdDQSm90.smem_bytes(cfg)


def _dkdv_smem(cfg):
    if _arch.family(cfg.arch) == 100:
        from .bwd_dkdv_sm100 import BlockSparseBwdDKDVSm100
        return BlockSparseBwdDKDVSm100.smem_bytes(cfg)
    if cfg.latent:
        from .bwd_dkv_latent_sm90 import BlockSparseLatentBwdDKVSm90
        return BlockSparseLatentBwdDKVSm90.smem_bytes(cfg)
    from .bwd_dkdv_sm90 import BlockSparseBwdDKDVSm90
    return BlockSparseBwdDKDVSm90.smem_bytes(cfg)


def _fwd_smem(cfg):
    if _arch.family(cfg.arch) == 100:
        from .fwd_sm100 import BlockSparseFwdSm100
        return BlockSparseFwdSm100.smem_bytes(cfg)
    return _fwd_kernel(cfg).smem_bytes(cfg)


CHECKS = {
    "block_sparse_fwd": (fwd_matrix, compile_fwd, _fwd_smem),
    "block_sparse_bwd_dq": (dq_matrix, compile_bwd_dq, _dq_smem),
    "block_sparse_bwd_dkdv": (bwd_matrix, compile_bwd_dkdv, _dkdv_smem),
}
