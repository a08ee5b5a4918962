"""Host launcher of the attention backward: config, compile cache, run with any DLPack tensors.

``bwd_config(...)`` builds the compile key, ``unsupported_reason(cfg)`` says why a config cannot run,
``workspace_shapes(cfg, ...)`` (from ``bwd_config``) lists the buffers the caller allocates with its
framework's ``empty``, and ``run_bwd(...)`` launches preprocess, main kernel and postprocess on the
caller's current stream (each compiled once per config against fake tensors, ``--enable-tvm-ffi``).
Arguments were validated one layer up; only internal invariants are asserted here.
"""

from __future__ import annotations

import dataclasses
import functools

from cute_kernels import arch as _arch
from cute_kernels.dtypes import cutlass_dtype, dtype_name
from cute_kernels.jit_cache import jit_cache

from .bwd_config import (ACCUM_ROW_PAD, DQ_SEM_ROWS, DTYPES, HEAD_DIMS, BwdConfig, BwdKernelArgs,
                         group_split, workspace_shapes)


@functools.lru_cache(maxsize=None)
def bwd_config(arch: int, dtype, head_dim: int, head_dim_v: int, qhead_per_kvhead: int, causal: bool,
               has_window: bool, has_softcap: bool, varlen: bool, deterministic: bool,
               has_dlse: bool = False, startend: str = "") -> BwdConfig:
    """The compile key for one backward call (``arch``: the exact compute capability, e.g. 103;
    ``startend``: the FlashMask layout, "" = none)."""
    return BwdConfig(arch=int(arch), dtype=dtype_name(dtype), head_dim=int(head_dim),
                     head_dim_v=int(head_dim_v), qhead_per_kvhead=int(qhead_per_kvhead), causal=bool(causal),
                     has_window=bool(has_window), has_softcap=bool(has_softcap), varlen=bool(varlen),
                     deterministic=bool(deterministic), has_dlse=bool(has_dlse), startend=str(startend))


def _kernel_class(arch: int):
    arch = _arch.family(arch)
    if arch == 90:
        from .bwd_sm90 import FlashBwdSm90

        return FlashBwdSm90
    if arch == 100:
        from .bwd_sm100 import FlashBwdSm100  # written by the SM100 issue; imported lazily

        return FlashBwdSm100
    return None


@functools.lru_cache(maxsize=None)
def unsupported_reason(cfg: BwdConfig) -> str | None:
    """None when ``cfg`` compiles and runs, else a reason naming the unsupported case."""
    arch_reason = _arch.arch_reason(cfg.arch)
    if arch_reason is not None:
        return arch_reason
    if cfg.startend and cfg.varlen:
        return "FlashMask startend_row_indices with varlen"
    try:
        cls = _kernel_class(cfg.arch)
    except ImportError as exc:
        return f"attention backward for {_arch.arch_name(cfg.arch)} is not available ({exc})"
    return cls.unsupported_reason(cfg)


def smem_bytes(cfg: BwdConfig) -> int | None:
    return _kernel_class(cfg.arch).smem_bytes(cfg)


# ---------------------------------------------------------------------------- fake arguments
def _fake_common(cfg: BwdConfig):
    """Fake q-side tensors and workspace: dict of name -> fake tensor (dense 4-D or varlen 3-D)."""
    import cutlass

    from cute_kernels.fake import fake_tensor, sym

    dt = cutlass_dtype(cfg.dtype)
    f32 = cutlass.Float32
    hq, hkv = sym(), sym()
    rows = sym(ACCUM_ROW_PAD)
    t = {}
    if cfg.varlen:
        tq, tk, bp1 = sym(), sym(), sym()
        t["q"] = fake_tensor(dt, (tq, hq, cfg.head_dim))
        t["k"] = fake_tensor(dt, (tk, hkv, cfg.head_dim))
        t["v"] = fake_tensor(dt, (tk, hkv, cfg.head_dim_v))
        t["o"] = fake_tensor(dt, (tq, hq, cfg.head_dim_v))
        t["lse"] = fake_tensor(f32, (hq, tq), align_bytes=4)
        lead = (hq, rows)
        t["cu_q"] = fake_tensor(cutlass.Int32, (bp1,), align_bytes=4)
        t["cu_k"] = fake_tensor(cutlass.Int32, (bp1,), align_bytes=4)
        sems = (hq, sym())
    else:
        b, sq, sk = sym(), sym(), sym()
        t["q"] = fake_tensor(dt, (b, sq, hq, cfg.head_dim))
        t["k"] = fake_tensor(dt, (b, sk, hkv, cfg.head_dim))
        t["v"] = fake_tensor(dt, (b, sk, hkv, cfg.head_dim_v))
        t["o"] = fake_tensor(dt, (b, sq, hq, cfg.head_dim_v))
        t["lse"] = fake_tensor(f32, (b, hq, sq), align_bytes=4)
        lead = (b, hq, rows)
        t["cu_q"] = t["cu_k"] = None
        sems = (b, hq, sym())
    for name, src in (("do", "o"), ("dq", "q"), ("dk", "k"), ("dv", "v")):
        t[name] = fake_tensor(dt, t[src].shape)
    t["lse_log2"] = fake_tensor(f32, lead)
    t["dpsum"] = fake_tensor(f32, lead)
    t["dq_accum"] = fake_tensor(f32, lead + (cfg.head_dim,))
    t["dq_sem"] = fake_tensor(cutlass.Int32, sems, align_bytes=4) if cfg.deterministic else None
    t["dlse"] = fake_tensor(f32, t["lse"].shape, align_bytes=4) if cfg.has_dlse else None
    t["dk_accum"] = t["dv_accum"] = t["dkv_sem"] = None
    if group_split(cfg):
        t["dk_accum"] = fake_tensor(f32, t["k"].shape)
        t["dv_accum"] = fake_tensor(f32, t["v"].shape)
        t["dkv_sem"] = fake_tensor(cutlass.Int32, (sym(), hkv, sym()), align_bytes=4)
    return t


def fake_bwd_args(cfg: BwdConfig) -> BwdKernelArgs:
    import cutlass

    t = _fake_common(cfg)
    f32 = cutlass.Float32
    return BwdKernelArgs(t["q"], t["k"], t["v"], t["do"], t["lse_log2"], t["dpsum"], t["dq_accum"], t["dk"],
                         t["dv"], t["cu_q"], t["cu_k"], t["dq_sem"], t["dk_accum"], t["dv_accum"], t["dkv_sem"],
                         f32(1.0), f32(0.0), cutlass.Int32(-1),
                         cutlass.Int32(-1), cutlass.Int32(1), cutlass.Int32(1))


def _prepost_key(cfg: BwdConfig) -> BwdConfig:
    """The fields the pre/post kernels depend on (others normalised, so configs share one compile;
    ``group_split`` kept: the preprocess then zeroes dkv_sem)."""
    split = group_split(cfg)
    return dataclasses.replace(cfg, qhead_per_kvhead=2 if split else 1, causal=split, has_window=False,
                               has_softcap=False, startend="")


def fm_meta_config(cfg: BwdConfig):
    """The ``fm_meta.FmMetaConfig`` whose per-key-tile bounds the main kernel of ``cfg`` reads (its
    key tile; the query tile is not read by the bounds kernel)."""
    from .fm_meta import FmMetaConfig

    if _arch.family(cfg.arch) == 100:
        from .bwd_sm100 import TILE_N

        return FmMetaConfig(arch=cfg.arch, layout=cfg.startend, tile_m=128, tile_n=TILE_N)
    from .bwd_sm90 import tile_config

    t = tile_config(cfg)
    return FmMetaConfig(arch=cfg.arch, layout=cfg.startend, tile_m=t.tile_m, tile_n=t.tile_n)


def fake_fm_args(cfg: BwdConfig) -> tuple:
    """Fake (mStartend, mFmMinMax) after the stream of a FlashMask config, else ()."""
    if not cfg.startend:
        return ()
    import cutlass

    from cute_kernels.common.flashmask import num_cols
    from cute_kernels.fake import fake_tensor, sym

    n = num_cols(cfg.startend)
    b, hm, sk, nt = sym(), sym(), sym(), sym()
    return (fake_tensor(cutlass.Int32, (b, hm, sk, n), align_bytes=4),
            fake_tensor(cutlass.Int32, (b, hm, nt, 2 * n), align_bytes=4))


# ---------------------------------------------------------------------------- compile
@jit_cache
def compile_bwd_main(cfg: BwdConfig, trace: bool = False):
    """The main kernel of ``cfg``; ``trace``: the SM100 kernel's edge-trace build (common/trace.py; the
    selftest's), which takes the trace array's address as a last argument."""
    import cutlass
    import cutlass.cute as cute

    from cute_kernels.fake import arch_options, fake_stream

    if trace and _arch.family(cfg.arch) != 100:
        raise NotImplementedError("flash_attn_bwd: the edge trace is built for the SM100 kernel only")
    reason = unsupported_reason(cfg)
    if reason is not None:
        raise NotImplementedError(f"flash_attn_bwd: {reason}")
    kernel = _kernel_class(cfg.arch)(cfg)
    extra = (cutlass.Int64(0),) if trace else fake_fm_args(cfg)
    if cfg.startend and _arch.family(cfg.arch) == 100:
        extra = (None,) + extra  # SM100: trace_addr comes first after the stream
    return cute.compile(kernel, *fake_bwd_args(cfg), fake_stream(), *extra, options=arch_options(cfg.arch))


def compile_bwd_main_traced(cfg: BwdConfig):
    """``compile_bwd_main(cfg, trace=True)`` (the ``compile_main`` of ``run_bwd_with``)."""
    return compile_bwd_main(cfg, trace=True)


@jit_cache
def _compile_pre(key: BwdConfig):
    import cutlass
    import cutlass.cute as cute

    from cute_kernels.fake import arch_options, fake_stream

    from .bwd_pre import FlashBwdPre

    t = _fake_common(key)
    return cute.compile(FlashBwdPre(key), t["o"], t["do"], t["lse"], t["dlse"], t["lse_log2"], t["dpsum"],
                        t["dq_accum"], t["dq_sem"], t["dkv_sem"], t["cu_q"], cutlass.Int32(1), fake_stream(),
                        options=arch_options(key.arch))


@jit_cache
def _compile_post(key: BwdConfig):
    import cutlass
    import cutlass.cute as cute

    from cute_kernels.fake import arch_options, fake_stream

    from .bwd_post import FlashBwdPost

    t = _fake_common(key)
    return cute.compile(FlashBwdPost(key), t["dq_accum"], t["dq"], t["cu_q"], cutlass.Float32(1.0),
                        cutlass.Int32(1), fake_stream(), options=arch_options(key.arch))


@jit_cache
def _compile_zero(key: BwdConfig):
    import cutlass
    import cutlass.cute as cute

    from cute_kernels.fake import arch_options, fake_stream

    from .bwd_post import FlashBwdZeroKV

    t = _fake_common(key)
    return cute.compile(FlashBwdZeroKV(key), t["dk"], t["dv"], t["cu_k"], cutlass.Int32(1), fake_stream(),
                        options=arch_options(key.arch))


def compile_bwd_pre(cfg: BwdConfig):
    return _compile_pre(_prepost_key(cfg))


def compile_bwd_post(cfg: BwdConfig):
    return _compile_post(_prepost_key(cfg))


def compile_bwd(cfg: BwdConfig):
    """All kernels of one backward config: (pre, main, post)."""
    return compile_bwd_pre(cfg), compile_bwd_main(cfg), compile_bwd_post(cfg)


# ---------------------------------------------------------------------------- run
def run_bwd(cfg: BwdConfig, dout, q, k, v, out, lse, dlse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
            workspace: dict, *, softmax_scale: float, softcap: float, window_left: int, window_right: int,
            max_seqlen_q: int, max_seqlen_k: int, trace_addr: int | None = None, startend=None,
            fm_minmax=None) -> None:
    """Launch preprocess, main kernel and postprocess on the caller's current stream.
    ``trace_addr``: device-visible address of an edge-trace array: the traced SM100 main kernel.
    ``startend``, ``fm_minmax``: a FlashMask call's bounds and the int32 workspace
    ``fm_meta.workspace_shapes(fm_meta_config(cfg), ...)["fm_minmax"]``, filled here first.

    Shapes as in ``bwd_config``; ``workspace`` holds the buffers of ``workspace_shapes(cfg, ...)``
    (uninitialised; the preprocess writes them). Writes every element of ``dq``, ``dk``, ``dv``
    (zeros where no visible (query, key) pair contributes). Window sizes -1 = unbounded.
    """
    run_bwd_with(compile_bwd_main if trace_addr is None else compile_bwd_main_traced, cfg, dout, q, k, v, out,
                 lse, dlse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, workspace, softmax_scale=softmax_scale,
                 softcap=softcap, window_left=window_left, window_right=window_right,
                 max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                 extra=() if trace_addr is None else (int(trace_addr),), startend=startend, fm_minmax=fm_minmax)


def run_bwd_with(compile_main, cfg: BwdConfig, dout, q, k, v, out, lse, dlse, dq, dk, dv, cu_seqlens_q,
                 cu_seqlens_k, workspace: dict, *, softmax_scale: float, softcap: float, window_left: int,
                 window_right: int, max_seqlen_q: int, max_seqlen_k: int, extra: tuple = (), startend=None,
                 fm_minmax=None) -> None:
    """``run_bwd`` with the main kernel from ``compile_main(cfg)`` (a seam for experiments with another build;
    ``extra``: trailing arguments of that build)."""
    assert (cu_seqlens_q is None) == (not cfg.varlen), "cu_seqlens must match cfg.varlen"
    assert (dlse is None) == (not cfg.has_dlse), "dlse must match cfg.has_dlse"
    assert (startend is None) == (not cfg.startend), "startend_row_indices must match cfg.startend"
    if cfg.varlen:
        batch = int(cu_seqlens_q.shape[0]) - 1
        total_q, total_k = int(q.shape[0]), int(k.shape[0])
        if batch <= 0:
            return
        q_empty = total_q == 0 or max_seqlen_q <= 0
        k_empty = total_k == 0 or max_seqlen_k <= 0
    else:
        batch = int(q.shape[0])
        if batch == 0:
            return
        q_empty = int(q.shape[1]) == 0
        k_empty = int(k.shape[1]) == 0
        max_seqlen_q, max_seqlen_k = int(q.shape[1]), int(k.shape[1])
    if q_empty:
        # No query: dQ is empty (or has no rows of any sequence) and dK = dV = 0.
        if not k_empty:
            _compile_zero(_prepost_key(cfg))(dk, dv, cu_seqlens_k, int(max_seqlen_k))
        return
    ws = workspace
    sem = ws.get("dq_sem") if cfg.deterministic else None
    split = group_split(cfg)
    dk_acc, dv_acc, kv_sem = (ws["dk_accum"], ws["dv_accum"], ws["dkv_sem"]) if split else (None, None, None)
    pre, main, post = compile_bwd_pre(cfg), compile_main(cfg), compile_bwd_post(cfg)
    pre(out, dout, lse, dlse, ws["lse_log2"], ws["dpsum"], ws["dq_accum"], sem, kv_sem, cu_seqlens_q,
        int(max_seqlen_q))
    if cfg.startend and not k_empty:
        from .fm_meta import run_bounds

        run_bounds(fm_meta_config(cfg), startend, fm_minmax)
        if _arch.family(cfg.arch) == 100 and not extra:
            extra = (None,)  # SM100: trace_addr comes first after the stream
        extra = tuple(extra) + (startend, fm_minmax)
    if not k_empty:
        main(q, k, v, dout, ws["lse_log2"], ws["dpsum"], ws["dq_accum"], dk, dv, cu_seqlens_q, cu_seqlens_k,
             sem, dk_acc, dv_acc, kv_sem, float(softmax_scale), float(softcap) if cfg.has_softcap else 0.0,
             int(window_left), int(window_right), int(max_seqlen_q), int(max_seqlen_k), *extra)
    post(ws["dq_accum"], dq, cu_seqlens_q, float(softmax_scale), int(max_seqlen_q))


# ---------------------------------------------------------------------------- config matrix
_MASKS = ("none", "causal", "window")


def _supported(cfgs):
    return [c for c in cfgs if unsupported_reason(c) is None]


def _fm_matrix(arch: int) -> list[BwdConfig]:
    """FlashMask (startend_row_indices) lines of the compile matrix, default and full alike."""
    out = []
    if _arch.family(arch) == 100:  # FlashMask on SM100: every layout, deterministic, GQA, both head-dim splits
        out += [bwd_config(arch, dt, d, d, r, c, w, False, False, det, startend=se) for dt, d, r, c, w, det, se in (
            ("bfloat16", 128, 1, True, False, False, "lts"),
            ("bfloat16", 128, 4, True, False, True, "lts_lte"),
            ("bfloat16", 128, 1, False, False, True, "lts_ute"),
            ("float16", 64, 2, False, True, False, "lts_lte_uts_ute"),
            ("bfloat16", 256, 1, False, False, True, "lts_lte_uts_ute"))]
    if _arch.family(arch) == 90:  # FlashMask: every layout, the three schedules, deterministic and group split
        out += [bwd_config(arch, dt, d, d, r, c, w, False, False, det, startend=se) for dt, d, r, c, w, det, se in (
            ("bfloat16", 128, 1, True, False, False, "lts"),
            ("bfloat16", 128, 4, True, False, True, "lts_lte"),
            ("bfloat16", 128, 1, False, False, True, "lts_ute"),
            ("float16", 64, 2, False, True, False, "lts_lte_uts_ute"),
            ("bfloat16", 96, 1, True, False, False, "lts"),
            ("bfloat16", 256, 1, False, False, True, "lts_lte_uts_ute"),
            ("bfloat16", 192, 4, True, False, False, "lts_lte"))]
    # (192, 128) on both archs: a 4-column mask with GQA, deterministic
    out.append(bwd_config(arch, "bfloat16", 192, 128, 2, False, False, False, False, True, startend="lts_lte_uts_ute"))
    return out


def config_matrix(arch: int, full: bool = False) -> list[BwdConfig]:
    """Backward configs compiled by ``python -m cute_kernels.check`` (those the arch's kernel supports);
    each FlashMask line names its column layout (``startend=...``)."""
    arch = int(arch)
    if full:
        out = [bwd_config(arch, dt, d, dv, r, m == "causal", m == "window", False, vl, det)
               for dt in DTYPES for d, dv in HEAD_DIMS for m in _MASKS for r in (1, 4)
               for vl in (False, True) for det in (False, True)]
        out += [bwd_config(arch, "bfloat16", d, d, 1, c, False, True, False, False)
                for d in (64, 128, 256) for c in (False, True)]
        out += [bwd_config(arch, "bfloat16", 128, 128, 1, True, False, False, False, False, True)]
        return _supported(out + _fm_matrix(arch))
    rep = [
        ("bfloat16", 128, 1, True, False, False, False, False),
        ("bfloat16", 128, 4, False, False, False, True, True),
        ("float16", 64, 1, False, True, False, False, False),
        ("bfloat16", 96, 2, True, False, True, False, False),
        ("bfloat16", 256, 1, True, False, False, False, True),
        ("bfloat16", 192, 1, False, False, False, True, False),
        ("float16", 256, 4, False, True, True, True, False),
    ]
    out = [bwd_config(arch, dt, d, d, r, c, w, sc, vl, det) for dt, d, r, c, w, sc, vl, det in rep]
    out.append(bwd_config(arch, "bfloat16", 192, 128, 2, True, False, False, False, False))
    return _supported(out + _fm_matrix(arch))


def prepost_matrix(arch: int, full: bool = False) -> list[BwdConfig]:
    """One config per distinct pre/post compile key (dtype x head dims x varlen x deterministic x dlse, and
    on SM90 the group-split keys, whose preprocess also zeroes dkv_sem)."""
    arch = int(arch)
    dims = HEAD_DIMS if full else ((128, 128), (64, 64), (192, 128))
    dts = DTYPES if full else ("bfloat16",)
    out = [bwd_config(arch, dt, d, dv, 1, False, False, False, vl, det, dl)
           for dt in dts for d, dv in dims for vl in (False, True) for det in (False, True)
           for dl in (False, True)]
    split = [_prepost_key(bwd_config(arch, dt, d, dv, 4, True, False, False, vl, True, dl))
             for dt in dts for d, dv in dims for vl in (False, True) for dl in (False, True)]
    split = [c for c in split if group_split(c)]
    if full:
        return out + split
    return out[:6] + [bwd_config(arch, "float16", 96, 96, 1, False, False, False, True, True)] + split[:2]


def _no_smem(cfg) -> None:
    return None


CHECKS = {"attention_bwd": (config_matrix, compile_bwd_main, smem_bytes),
          "attention_bwd_pre": (prepost_matrix, compile_bwd_pre, _no_smem),
          "attention_bwd_post": (prepost_matrix, compile_bwd_post, _no_smem)}

__all__ = ["bwd_config", "unsupported_reason", "workspace_shapes", "run_bwd", "run_bwd_with", "compile_bwd",
           "compile_bwd_main", "compile_bwd_pre", "compile_bwd_post", "config_matrix", "prepost_matrix",
           "fake_bwd_args", "smem_bytes", "CHECKS", "DQ_SEM_ROWS"]
