"""Host launchers of the attention forward: config, compile cache, run with any DLPack tensors.

``fwd_config(...)`` builds the compile key, ``unsupported_reason(cfg)`` says why a config cannot run
(the Paddle layer turns it into NotImplementedError), ``compile_fwd(cfg)`` compiles once per config
against fake tensors (``--enable-tvm-ffi``: the compiled function takes Paddle or torch tensors and
runs on the caller's current stream), ``run_fwd(...)`` launches with out-parameters.
Arguments were validated one layer up; only internal invariants are asserted here.
"""

from __future__ import annotations

import functools

from cute_kernels import arch as _arch
from cute_kernels.dtypes import cutlass_dtype, dtype_name
from cute_kernels.jit_cache import jit_cache

from .config import BLOCK_SIZES, DTYPES, FwdArgs, FwdConfig


# fwd_config and unsupported_reason are pure and run on every call of the Paddle op (backend
# resolution, then the launch): memoised so a call costs a dict lookup, not a dataclass build.
@functools.lru_cache(maxsize=None)
def fwd_config(arch: int, dtype, head_dim: int, head_dim_v: int, qhead_per_kvhead: int, causal: bool,
               has_window: bool, has_softcap: bool, block_size: int, varlen: bool, startend: str = "",
               block_bos: bool = False) -> FwdConfig:
    """The compile key for one forward call (``arch``: the exact compute capability, e.g. 103;
    ``block_size`` 0 = no block_logit; ``startend``: the FlashMask layout, "" = none; ``block_bos``:
    block_logit blocks relative to each row's origin)."""
    return FwdConfig(arch=int(arch), dtype=dtype_name(dtype), head_dim=int(head_dim),
                     head_dim_v=int(head_dim_v), qhead_per_kvhead=int(qhead_per_kvhead), causal=bool(causal),
                     has_window=bool(has_window), has_softcap=bool(has_softcap), block_size=int(block_size),
                     varlen=bool(varlen), startend=str(startend), block_bos=bool(block_bos))


def _kernel_class(arch: int):
    """The kernel class of compute capability ``arch``'s family (None where there is none)."""
    arch = _arch.family(arch)
    if arch == 90:
        from .fwd_sm90 import FlashFwdSm90

        return FlashFwdSm90
    if arch == 100:
        from .fwd_sm100 import FlashFwdSm100  # written by the SM100 issue; imported lazily

        return FlashFwdSm100
    return None


@functools.lru_cache(maxsize=None)
def unsupported_reason(cfg: FwdConfig) -> str | None:
    """None when ``cfg`` compiles and runs, else a reason naming the unsupported case."""
    arch_reason = _arch.arch_reason(cfg.arch)
    if arch_reason is not None:
        return arch_reason
    if cfg.has_block_logit and cfg.block_size not in BLOCK_SIZES:
        return f"block_size {cfg.block_size} (supported: {', '.join(map(str, BLOCK_SIZES))})"
    if cfg.has_startend and cfg.varlen:
        return "FlashMask startend_row_indices with varlen"
    if cfg.block_bos and (cfg.varlen or not cfg.has_block_logit):
        return "block_bos needs block_logit on a dense (not varlen) call"
    try:
        cls = _kernel_class(cfg.arch)
    except ImportError as exc:
        return f"attention forward for {_arch.arch_name(cfg.arch)} is not available ({exc})"
    return cls.unsupported_reason(cfg)


def smem_bytes(cfg: FwdConfig) -> int | None:
    return _kernel_class(cfg.arch).smem_bytes(cfg)


def fm_tiles(cfg: FwdConfig) -> tuple[int, int]:
    """(tile_m, tile_n) of the forward kernel of ``cfg``: the tiles its FlashMask metadata is built for
    (SM100: a work tile of q_stage x 128 rows, 128-key tiles)."""
    if _arch.family(cfg.arch) == 100:
        from .fwd_sm100 import TILE_M, TILE_N, _q_stage

        return _q_stage(cfg) * TILE_M, TILE_N
    from .fwd_sm90 import tile_shape

    tile_m, tile_n, _ = tile_shape(cfg)
    return tile_m, tile_n


def fm_meta_config(cfg: FwdConfig):
    """The ``fm_meta.FmMetaConfig`` whose metadata the forward of ``cfg`` reads."""
    from .fm_meta import FmMetaConfig

    tile_m, tile_n = fm_tiles(cfg)
    return FmMetaConfig(arch=cfg.arch, layout=cfg.startend, tile_m=tile_m, tile_n=tile_n)


def fake_fm_args(cfg: FwdConfig) -> tuple:
    """Fake (mStartend, mFmMinMax, mFmRanges) of a FlashMask config (after the stream), else ()."""
    if not cfg.has_startend:
        return ()
    import cutlass

    from cute_kernels.common.flashmask import num_cols
    from cute_kernels.fake import fake_tensor, sym

    n = num_cols(cfg.startend)
    b, hm, sk, nt, mt = sym(), sym(), sym(), sym(), sym()
    i32 = cutlass.Int32
    return (fake_tensor(i32, (b, hm, sk, n), align_bytes=4), fake_tensor(i32, (b, hm, nt, 2 * n), align_bytes=4),
            fake_tensor(i32, (b, hm, mt, sym()), align_bytes=4))


def fake_bos_args(cfg: FwdConfig) -> tuple:
    """``block_bos`` build: (None x 3 without startend, then a fake mBlockBos [B, Sq]), else ()."""
    if not cfg.block_bos:
        return ()
    import cutlass

    from cute_kernels.fake import fake_tensor, sym

    pad = () if cfg.has_startend else (None, None, None)
    return pad + (fake_tensor(cutlass.Int32, (sym(), sym()), align_bytes=4),)


def fake_fwd_args(cfg: FwdConfig) -> FwdArgs:
    """Fake tensors/scalars in FwdArgs order: every extent but head dims and nb's alignment is dynamic."""
    import cutlass

    from cute_kernels.fake import fake_tensor, sym

    dt = cutlass_dtype(cfg.dtype)
    f32 = cutlass.Float32
    hq = sym()
    hkv = sym()
    if cfg.varlen:
        tq, tk, bp1 = sym(), sym(), sym()
        q = fake_tensor(dt, (tq, hq, cfg.head_dim))
        k = fake_tensor(dt, (tk, hkv, cfg.head_dim))
        v = fake_tensor(dt, (tk, hkv, cfg.head_dim_v))
        o = fake_tensor(dt, (tq, hq, cfg.head_dim_v))
        lse = fake_tensor(f32, (hq, tq), align_bytes=4)
        blk = fake_tensor(f32, (hq, tq, sym()), align_bytes=4) if cfg.has_block_logit else None
        cu_q = fake_tensor(cutlass.Int32, (bp1,), align_bytes=4)
        cu_k = fake_tensor(cutlass.Int32, (bp1,), align_bytes=4)
    else:
        b, sq, sk = sym(), sym(), sym()
        q = fake_tensor(dt, (b, sq, hq, cfg.head_dim))
        k = fake_tensor(dt, (b, sk, hkv, cfg.head_dim))
        v = fake_tensor(dt, (b, sk, hkv, cfg.head_dim_v))
        o = fake_tensor(dt, (b, sq, hq, cfg.head_dim_v))
        lse = fake_tensor(f32, (b, hq, sq), align_bytes=4)
        blk = fake_tensor(f32, (b, hq, sq, sym()), align_bytes=4) if cfg.has_block_logit else None
        cu_q = cu_k = None
    return FwdArgs(q, k, v, o, lse, blk, cu_q, cu_k, f32(1.0), f32(0.0), cutlass.Int32(-1),
                   cutlass.Int32(-1), cutlass.Int32(1))


def compile_fwd(cfg: FwdConfig, sm_count: int | None = None, trace: bool = False):
    """Compile the arch kernel for ``cfg`` once (fake tensors; TVM-FFI env stream).

    ``sm_count``: SMs of the device the SM100 persistent kernel will launch on (its grid); None = the
    target's ``SM_COUNT_DEFAULT`` (compile-only builds). The SM90 kernel is not persistent, so for it
    the count is ignored and no part of the compile key. ``trace``: the SM100 kernel's edge-trace
    build (common/trace.py; the selftest's), which takes the trace array's address as a last argument.
    """
    if _arch.family(cfg.arch) != 100:
        sm_count = None
        if trace:
            raise NotImplementedError("flash_attn_fwd: the edge trace is built for the SM100 kernel only")
    elif sm_count is None:
        sm_count = _arch.SM_COUNT_DEFAULT[cfg.arch]
    return _compile_fwd(cfg, sm_count, bool(trace))


@jit_cache
def _compile_fwd(cfg: FwdConfig, sm_count: int | None, trace: bool = False):
    import cutlass
    import cutlass.cute as cute

    from cute_kernels.fake import arch_options, fake_stream

    reason = unsupported_reason(cfg)
    if reason is not None:
        raise NotImplementedError(f"flash_attn_fwd: {reason}")
    cls = _kernel_class(cfg.arch)
    kernel = cls(cfg) if sm_count is None else cls(cfg, sm_count=int(sm_count))
    extra = (cutlass.Int64(0),) if trace else fake_fm_args(cfg) + fake_bos_args(cfg)
    if (cfg.has_startend or cfg.block_bos) and _arch.family(cfg.arch) == 100:
        extra = (None,) + extra  # SM100: trace_addr comes first after the stream
    return cute.compile(kernel, *fake_fwd_args(cfg), fake_stream(), *extra,
                        options=arch_options(cfg.arch))


def run_fwd(cfg: FwdConfig, q, k, v, out, lse, block_logit, cu_seqlens_q, cu_seqlens_k, *,
            softmax_scale: float, softcap: float, window_left: int, window_right: int,
            max_seqlen_q: int, trace_addr: int | None = None, startend=None, fm_minmax=None,
            fm_ranges=None, block_bos=None) -> None:
    """Launch the forward on the caller's current stream; writes ``out``, ``lse``, ``block_logit``.
    ``trace_addr``: device-visible address of an edge-trace array (common/trace.py): the traced SM100 build.
    ``startend``, ``fm_minmax``, ``fm_ranges``: a FlashMask call's bounds and the workspace
    ``fm_meta.workspace_shapes(fm_meta_config(cfg), ...)``; this launch fills the workspace first.
    ``block_bos``: int32 [B, Sq] row origins of document-relative block_logit (``cfg.block_bos``).

    Shapes as in ``config.FwdArgs``; ``block_logit`` is None iff ``cfg.block_size == 0``;
    ``cu_seqlens_*`` are None iff not ``cfg.varlen``; window sizes -1 = unbounded.
    """
    assert (block_logit is None) == (not cfg.has_block_logit), "block_logit must match cfg.block_size"
    assert (cu_seqlens_q is None) == (not cfg.varlen), "cu_seqlens must match cfg.varlen"
    if cfg.varlen:
        if int(q.shape[0]) == 0 or int(cu_seqlens_q.shape[0]) <= 1:
            return
    elif int(q.shape[0]) == 0 or int(q.shape[1]) == 0:
        return
    if max_seqlen_q <= 0:
        return
    assert (startend is None) == (not cfg.has_startend), "startend_row_indices must match cfg.startend"
    fn = compile_fwd(cfg, _arch.tensor_sm_count(q) if _arch.family(cfg.arch) == 100 else None,
                     trace=trace_addr is not None)
    extra = () if trace_addr is None else (int(trace_addr),)
    if cfg.has_startend:
        from .fm_meta import run_meta

        run_meta(fm_meta_config(cfg), startend, fm_minmax, fm_ranges, seqlen_q=int(q.shape[1]))
        extra = (startend, fm_minmax, fm_ranges)
        if _arch.family(cfg.arch) == 100:
            extra = (None,) + extra  # SM100: trace_addr comes first after the stream
    assert (block_bos is None) == (not cfg.block_bos), "block_bos must match cfg.block_bos"
    if cfg.block_bos:
        if not cfg.has_startend:  # SM100: trace_addr (or None) first after the stream
            extra = (extra or (None,) if _arch.family(cfg.arch) == 100 else ()) + (None, None, None)
        extra = extra + (block_bos,)
    fn(q, k, v, out, lse, block_logit, cu_seqlens_q, cu_seqlens_k, float(softmax_scale),
       float(softcap) if cfg.has_softcap else 0.0, int(window_left), int(window_right), int(max_seqlen_q),
       *extra)


# ---------------------------------------------------------------------------- config matrix
_SM90_HEAD_DIMS = (64, 96, 128, 192, 256)
_SM100_HEAD_DIMS = (64, 128, 192, 256)


def _dense_matrix(arch: int, full: bool) -> list[FwdConfig]:
    """The configs without a FlashMask mask (``config_matrix``)."""
    arch = int(arch)
    sm90 = _arch.family(arch) == 90
    if full:
        hdims = _SM90_HEAD_DIMS if sm90 else _SM100_HEAD_DIMS
        out = []
        for dt in DTYPES:
            for d in hdims:
                for mask in ("none", "causal", "window"):
                    for ratio in (1, 4):
                        for varlen in (False, True):
                            for bsz in (0,) + BLOCK_SIZES:
                                out.append(fwd_config(arch, dt, d, d, ratio, mask == "causal", mask == "window",
                                                      False, bsz, varlen))
        out += [fwd_config(arch, "bfloat16", d, d, 1, c, False, True, 64, False)
                for d in (128, 256) for c in (False, True)]
        if sm90:  # softcap with every mask at d 64 (the SM90 tile choice depends on window + softcap)
            out += [fwd_config(arch, "bfloat16", 64, 64, 4, mask == "causal", mask == "window", True, bsz, True)
                    for mask in ("none", "causal", "window") for bsz in (0, 32)]
        out += [fwd_config(arch, dt, 192, 128, ratio, mask == "causal", mask == "window", False, bsz, varlen)
                for dt in DTYPES for mask in ("none", "causal", "window") for ratio in (1, 4)
                for varlen in (False, True) for bsz in (0,) + BLOCK_SIZES]
        return out
    rep = [
        ("bfloat16", 128, 1, True, False, False, 0, False),
        ("bfloat16", 128, 1, True, False, False, 64, False),
        ("bfloat16", 128, 4, False, False, False, 16, True),
        ("float16", 64, 1, False, True, False, 128, False),
        ("bfloat16", 256, 2, True, False, False, 256, False),
        ("bfloat16", 192, 1, False, False, False, 32, True),
    ]
    if sm90:
        rep += [("bfloat16", 96, 1, True, False, True, 64, False)]
    out = [fwd_config(arch, dt, d, d, r, c, w, sc, b, vl) for dt, d, r, c, w, sc, b, vl in rep]
    # (192, 128): Q/K 192 wide, V/O 128 wide
    out += [fwd_config(arch, "bfloat16", 192, 128, 2, True, False, False, 64, False),
            fwd_config(arch, "float16", 192, 128, 1, False, False, False, 0, True)]
    return out


def _fm_matrix(arch: int) -> list[FwdConfig]:
    """FlashMask (startend_row_indices) lines of the compile matrix, default and full alike."""
    # every layout (4 columns included), block_logit, window, GQA and (192, 128) on both archs; SM90 also both
    # consumer-WG counts (d 64: 3) and d 192
    lines = [("bfloat16", 128, 1, True, False, 0, "lts"),
             ("bfloat16", 128, 4, True, False, 64, "lts_lte"),
             ("bfloat16", 128, 1, False, False, 0, "lts_ute"),
             ("bfloat16", 128, 4, False, False, 0, "lts_lte_uts_ute"),
             ("float16", 64, 1, False, True, 16, "lts_lte_uts_ute")]
    if _arch.family(arch) == 90:
        lines.append(("bfloat16", 64, 2, True, False, 0, "lts"))
    lines.append(("bfloat16", 256, 1, True, True, 0, "lts_lte"))
    if _arch.family(arch) == 90:
        lines.append(("bfloat16", 192, 1, False, False, 32, "lts_ute"))
    out = [fwd_config(arch, dt, d, d, r, c, w, False, b, False, startend=se) for dt, d, r, c, w, b, se in lines]
    # (192, 128), its own build on both archs: a 4-column mask with GQA
    return out + [fwd_config(arch, "bfloat16", 192, 128, 2, False, False, False, 0, False, startend="lts_lte_uts_ute")]


def _bos_matrix(arch: int, full: bool) -> list[FwdConfig]:
    """Document-relative block_logit (``block_bos=True``) lines: block sizes below, equal to and above the key
    tile, with and without a FlashMask mask, causal, window, softcap, GQA (both archs); SM100 adds d 192 and
    (192, 128), and its full matrix every head dim x block size x mask (none, causal, window), softcap and
    each FlashMask layout."""
    lines = [("bfloat16", 128, 1, True, False, False, 64, "lts"),
             ("bfloat16", 128, 4, False, False, False, 16, ""),
             ("float16", 64, 2, True, True, False, 128, ""),
             ("bfloat16", 128, 1, False, False, True, 32, "lts_lte_uts_ute"),
             ("bfloat16", 256, 1, True, False, False, 256, "lts_lte"),
             ("bfloat16", 64, 1, False, False, False, 16, "lts_ute")]
    out = [fwd_config(arch, dt, d, d, r, c, w, sc, b, False, startend=se, block_bos=True)
           for dt, d, r, c, w, sc, b, se in lines]
    if _arch.family(arch) != 100:
        return out
    out += [fwd_config(arch, "bfloat16", 192, 192, 2, True, False, False, 16, False, block_bos=True),
            fwd_config(arch, "float16", 192, 128, 1, False, True, False, 256, False, startend="lts_ute",
                       block_bos=True)]
    if full:
        seen = set(out)
        more = [fwd_config(arch, dt, d, dv, r, mask == "causal", mask == "window", False, bs, False, block_bos=True)
                for (d, dv), dt, r in (((64, 64), "float16", 1), ((128, 128), "bfloat16", 4),
                                       ((192, 192), "bfloat16", 1), ((256, 256), "float16", 2),
                                       ((192, 128), "bfloat16", 1))
                for mask in ("none", "causal", "window") for bs in BLOCK_SIZES]
        more += [fwd_config(arch, "bfloat16", d, d, 1, c, False, True, bs, False, startend=se, block_bos=True)
                 for d in (64, 256) for c, se in ((True, ""), (False, "lts_lte_uts_ute")) for bs in (16, 256)]
        more += [fwd_config(arch, "bfloat16", d, d, 1, c, False, False, bs, False, startend=se, block_bos=True)
                 for d in (128, 256) for c, se in ((True, "lts"), (True, "lts_lte"), (False, "lts_ute"),
                                                   (False, "lts_lte_uts_ute"))
                 for bs in (16, 256)]
        out += [c for c in more if c not in seen and not seen.add(c)]
    return out


def config_matrix(arch: int, full: bool = False) -> list[FwdConfig]:
    """Configs compiled by ``python -m cute_kernels.check`` (and the CPU compile tests) for compute
    capability ``arch``; the configs of 10.0 and 10.3 differ only in ``arch``. Each FlashMask line names
    its column layout (``startend=...``); document-relative block_logit lines say ``block_bos=True``."""
    arch = int(arch)
    return _dense_matrix(arch, full) + _fm_matrix(arch) + _bos_matrix(arch, full)


CHECKS = {"attention_fwd": (config_matrix, compile_fwd, smem_bytes)}

__all__ = ["fwd_config", "unsupported_reason", "compile_fwd", "run_fwd", "config_matrix", "CHECKS",
           "fake_fwd_args", "smem_bytes"]
