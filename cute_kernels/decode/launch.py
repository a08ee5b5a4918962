"""Host launchers of the decode kernels: compiled once per config, called with any DLPack tensor.

``run_decode`` takes caller-allocated outputs and (when it splits) caller-allocated fp32 partials of
``partial_shapes(...)``, launches on the caller's current stream, allocates nothing, reads no device
memory on the host and never synchronises, so a decode step can be captured in a CUDA graph. The
split count is the caller's (``choose_num_splits`` picks one from shapes only). Arguments were
validated by the Paddle layer (or the test); only internal invariants are asserted here.

The dense index form (``seqlens [B]``, ``table [B, n]``: FA's ``cache_seqlens`` / ``block_table``, one
length and page list per sequence, shared by its kv heads) is read in place by kernels compiled with
``DecodeConfig.dense_index`` (a kv-head stride of 0 at compile time), so a caller never expands it
over kv heads. Per call the launcher does one dict lookup on a key of the tensors' dtype, static
extents and the options that pick a config; everything else derived from them is built on the miss.

Tensors (int32 index tensors, every tensor compact row-major):
    q            [B, Sq, Hq, D]                bf16 / fp16
    k/v cache    "hnd" [pages, Hkv, P, D] | "nhd" [pages, P, Hkv, D] | "contiguous" [B, Sk, Hkv, D]
    seqlens      [B, Hkv] | [B]                keys of each (sequence, kv head) | of each sequence (dense)
    table        [B, Hkv, n] | [B, n]          page ids (None for "contiguous"); [B, n] iff seqlens is [B]
    out          [B, Sq, Hq, D]                q's dtype;   lse [B, Hq, Sq] fp32
    block_logit  [B, Hq, Sq, nb]               fp32 or None
    o_part       [S, B, Sq, Hq, D] fp32,  lse_part [S, B, Sq, Hq] fp32   (S = num_splits > 1 only)
"""

from __future__ import annotations

import cutlass.cute as cute

from cute_kernels import arch as _arch
from cute_kernels.dtypes import cutlass_dtype, dtype_name
from cute_kernels.jit_cache import direct_call as _direct
from cute_kernels.jit_cache import fast_lookup as _lookup
from cute_kernels.jit_cache import fast_memo as _fast
from cute_kernels.jit_cache import jit_cache

from .combine import smem_bytes as combine_smem_bytes
from .combine import CombineConfig, DecodeCombine
from .config import MAX_SPLITS, PAGE_SIZES, DecodeConfig, choose_splits, unsupported_reason
from .fwd import DecodeFwd


def _fakes(cfg: DecodeConfig):
    import cutlass

    from cute_kernels.fake import fake_tensor, sym

    dt = cutlass_dtype(cfg.dtype)
    f32, i32 = cutlass.Float32, cutlass.Int32
    d, sq = cfg.head_dim, cfg.seqlen_q
    q = fake_tensor(dt, (sym(), sq, sym(), d))
    if cfg.layout == "hnd":
        kv_shape = (sym(), sym(), cfg.page_size, d)
    elif cfg.layout == "nhd":
        kv_shape = (sym(), cfg.page_size, sym(), d)
    else:
        kv_shape = (sym(), sym(), sym(), d)
    k, v = fake_tensor(dt, kv_shape), fake_tensor(dt, kv_shape)
    idx = (sym(),) if cfg.dense_index else (sym(), sym())  # [B] | [B, Hkv]
    seq = fake_tensor(i32, idx, align_bytes=4)
    # the dense table's row offset b * n in 32 bits (it holds < 2^31 ids: the Paddle layer checks), which keeps
    # the kernel at the per-kv-head form's registers (64-bit strides there cost 18 more on sm_90a)
    table = None if cfg.layout == "contiguous" else fake_tensor(i32, idx + (sym(),), align_bytes=4,
                                                                 stride32=cfg.dense_index)
    if cfg.split:
        out = fake_tensor(f32, (sym(), sym(), sq, sym(), d))
        lse = fake_tensor(f32, (sym(), sym(), sq, sym()), align_bytes=4)
    else:
        out = fake_tensor(dt, (sym(), sq, sym(), d))
        lse = fake_tensor(f32, (sym(), sym(), sq), align_bytes=4)
    blk = fake_tensor(f32, (sym(), sym(), sq, sym()), align_bytes=4) if cfg.block_size else None
    return q, k, v, seq, table, out, lse, blk


@jit_cache
def compile_decode(cfg: DecodeConfig):
    import cutlass
    import cutlass.cute as cute

    from cute_kernels.fake import arch_options, fake_stream

    reason = unsupported_reason(cfg)
    if reason is not None:
        raise NotImplementedError(f"decode attention: {reason}")
    f32, i32 = cutlass.Float32, cutlass.Int32
    return cute.compile(DecodeFwd(cfg), *_fakes(cfg), f32(1.0), f32(0.0), i32(-1), i32(-1), fake_stream(),
                        options=arch_options(cfg.arch))


class DecodeSplitStep:
    """The split kernel and the combine behind one host entry: one TVM-FFI call (each tensor converted once) launches
    both, the combine as the programmatic dependent of the split kernel, as two separate calls would."""

    def __init__(self, cfg: DecodeConfig):
        self.fwd = DecodeFwd(cfg)
        self.comb = DecodeCombine(CombineConfig(arch=cfg.arch, dtype=cfg.dtype, head_dim=cfg.head_dim))

    @cute.jit
    def __call__(self, mQ, mK, mV, mSeq, mTable, mOp, mLp, mBL, mO, mLse, softmax_scale, softcap, window_left,
              window_right, stream):
        self.fwd(mQ, mK, mV, mSeq, mTable, mOp, mLp, mBL, softmax_scale, softcap, window_left, window_right, stream)
        self.comb(mOp, mLp, mO, mLse, stream)


@jit_cache
def compile_decode_step(cfg: DecodeConfig):
    """The split config's kernel and the combine as one compiled function (``DecodeSplitStep``): ``step(q, k, v,
    seqlens, table, o_part, lse_part, block_logit, out, lse, scale, softcap, window_left, window_right)``."""
    import cutlass

    from cute_kernels.fake import arch_options, fake_stream, fake_tensor, sym

    reason = unsupported_reason(cfg)
    if reason is not None:
        raise NotImplementedError(f"decode attention: {reason}")
    assert cfg.split, "a split step needs a split config"
    f32, i32 = cutlass.Float32, cutlass.Int32
    q, k, v, seq, table, o_part, lse_part, blk = _fakes(cfg)
    out = fake_tensor(cutlass_dtype(cfg.dtype), (sym(), cfg.seqlen_q, sym(), cfg.head_dim))
    lse = fake_tensor(f32, (sym(), sym(), cfg.seqlen_q), align_bytes=4)
    return cute.compile(DecodeSplitStep(cfg), q, k, v, seq, table, o_part, lse_part, blk, out, lse, f32(1.0),
                        f32(0.0), i32(-1), i32(-1), fake_stream(), options=arch_options(cfg.arch))


@jit_cache
def compile_combine(cfg: CombineConfig):
    import cutlass
    import cutlass.cute as cute

    from cute_kernels.fake import arch_options, fake_stream, fake_tensor, sym

    f32, d = cutlass.Float32, cfg.head_dim
    o_part = fake_tensor(f32, (sym(), sym(), sym(), sym(), d))
    lse_part = fake_tensor(f32, (sym(), sym(), sym(), sym()), align_bytes=4)
    out = fake_tensor(cutlass_dtype(cfg.dtype), (sym(), sym(), sym(), d))
    lse = fake_tensor(f32, (sym(), sym(), sym()), align_bytes=4)
    return cute.compile(DecodeCombine(cfg), o_part, lse_part, out, lse, fake_stream(), options=arch_options(cfg.arch))


def decode_config(q, k_cache, *, layout: str, causal_or_right: bool, has_left: bool, softcap: bool,
                  block_size: int, split: bool, arch: int, ring_kb: int | None = None,
                  dense_index: bool = False) -> DecodeConfig:
    b, sq, hq, d = (int(x) for x in q.shape)
    if layout == "hnd":
        hkv, page = int(k_cache.shape[1]), int(k_cache.shape[2])
    elif layout == "nhd":
        hkv, page = int(k_cache.shape[2]), int(k_cache.shape[1])
    else:
        hkv, page = int(k_cache.shape[2]), 0
    return DecodeConfig(arch=arch, dtype=dtype_name(q.dtype), head_dim=d, group=hq // hkv, seqlen_q=sq, layout=layout,
                        page_size=page, mask_right=bool(causal_or_right), mask_left=bool(has_left),
                        softcap=bool(softcap), block_size=int(block_size or 0), split=bool(split),
                        dense_index=bool(dense_index), **({} if ring_kb is None else {"ring_kb": int(ring_kb)}))


def sk_max(k_cache, table, layout: str) -> int:
    """Keys a sequence can reach: the table's pages times P, or the contiguous cache's length."""
    if layout == "contiguous":
        return int(k_cache.shape[1])
    page = int(k_cache.shape[2] if layout == "hnd" else k_cache.shape[1])
    return int(table.shape[-1]) * page  # [B, Hkv, n] or dense [B, n]


def choose_num_splits(q, k_cache, table, *, layout: str, sm_count: int, block_size: int = 0) -> int:
    """The split count ``num_splits=None`` means: from shapes only (CUDA-graph safe)."""
    def build():
        cfg = decode_config(q, k_cache, layout=layout, causal_or_right=False, has_left=False, softcap=False,
                            block_size=block_size, split=True, arch=90)
        hkv = int(q.shape[2]) // cfg.group
        return choose_splits(cfg, int(q.shape[0]), hkv, sk_max(k_cache, table, layout), int(sm_count))

    key = ("splits", tuple(q.shape), tuple(k_cache.shape), None if table is None else int(table.shape[-1]), layout,
           sm_count, block_size)
    hit = _lookup(key)
    return hit if hit is not None else _fast(key, build)


def partial_shapes(q, num_splits: int) -> tuple[tuple, tuple]:
    """Shapes of the fp32 ``(o_part, lse_part)`` workspaces for ``num_splits`` > 1."""
    b, sq, hq, d = (int(x) for x in q.shape)
    return (num_splits, b, sq, hq, d), (num_splits, b, sq, hq)


def run_decode(q, k_cache, v_cache, seqlens, table, out, lse, block_logit=None, o_part=None, lse_part=None, *,
               layout: str, softmax_scale: float, window_left: int = -1, window_right: int = -1,
               softcap: float = 0.0, block_size: int = 0, arch: int | None = None, ring_kb: int | None = None) -> None:
    """Decode attention into ``out``/``lse`` (and ``block_logit``). Splits when ``o_part`` is given
    (its first extent is the split count, >= 2), then combines into ``out``/``lse`` in split order.

    ``seqlens`` / ``table``: per (sequence, kv head) ``[B, Hkv]`` / ``[B, Hkv, n]``, or dense ``[B]`` /
    ``[B, n]`` read by every kv head (no expanded copy needed). ``window_left``/``window_right``: -1 =
    unbounded (causal is right = 0). ``ring_kb``: override of the per-warp load ring (bench A/B only).
    """
    split = o_part is not None
    if split:
        assert 2 <= o_part.shape[0] <= MAX_SPLITS, f"split count must be in [2, {MAX_SPLITS}]"
    if q.shape[0] == 0:
        return
    capped = softcap > 0.0
    has_bl = block_logit is not None
    launch = _lookup(_launch_key(q, k_cache, seqlens, table, has_bl, split, layout, window_left, window_right, capped,
                                 block_size, arch, ring_kb))
    if launch is None:
        launch = decode_launcher(q, k_cache, seqlens, table, layout=layout, split=split, has_block_logit=has_bl,
                                 window_left=window_left, window_right=window_right, softcap=softcap,
                                 block_size=block_size, arch=arch, ring_kb=ring_kb)
    launch(q, k_cache, v_cache, seqlens, table, out, lse, block_logit, o_part, lse_part, float(softmax_scale),
           float(softcap) if capped else 0.0, int(window_left), int(window_right))


def _launch_key(q, k_cache, seqlens, table, has_bl, split, layout, window_left, window_right, capped, block_size,
                arch, ring_kb):
    # Everything that picks the compiled pair. The dtype by identity (framework dtypes are long-lived singletons,
    # and hashing Paddle's costs ~0.5 us); the launch function keeps a reference to it, so the id stays its own.
    # The table's presence, block_logit's and the index ranks are checked against the config where it is built.
    return ("decode", id(q.dtype), tuple(q.shape[1:]),
            tuple(k_cache.shape[2:] if layout == "contiguous" else k_cache.shape[1:]), seqlens.ndim, layout,
            window_left >= 0, window_right >= 0, capped, block_size, has_bl, split, table is None, arch, ring_kb)


def decode_launcher(q, k_cache, seqlens, table, *, layout: str, split: bool = False, has_block_logit=None,
                    window_left: int = -1, window_right: int = -1, softcap: float = 0.0, block_size: int = 0,
                    arch: int | None = None, ring_kb: int | None = None):
    """The launch function ``run_decode`` uses for these tensors and options (memoised per launch key):
    ``launch(q, k_cache, v_cache, seqlens, table, out, lse, block_logit, o_part, lse_part, softmax_scale,
    softcap, window_left, window_right)`` (``softcap`` 0.0 unless capped; the scalars as Python float / int;
    ``o_part`` / ``lse_part`` given iff ``split``). A caller that memoises it under a key of its own covering
    everything ``run_decode``'s key holds (the Paddle glue) calls it directly and skips building that key on
    every call. ``has_block_logit`` defaults to ``block_size > 0``."""
    has_bl = bool(block_size) if has_block_logit is None else bool(has_block_logit)
    capped = softcap > 0.0
    key = _launch_key(q, k_cache, seqlens, table, has_bl, bool(split), layout, window_left, window_right, capped,
                      block_size, arch, ring_kb)
    hit = _lookup(key)
    if hit is not None:
        return hit
    return _fast(key, lambda: _build_launch(q, k_cache, seqlens, table, has_bl, bool(split), layout=layout,
                                            has_left=window_left >= 0, has_right=window_right >= 0, capped=capped,
                                            block_size=block_size, arch=arch, ring_kb=ring_kb))


def _build_launch(q, k_cache, seqlens, table, has_bl, split, *, layout, has_left, has_right, capped, block_size, arch,
                  ring_kb):
    """The launch function of a key: the config from shapes, both kernels compiled (or cached)."""
    assert has_bl == bool(block_size), "block_logit must match block_size"
    assert (table is None) == (layout == "contiguous"), "a page table iff the cache is paged"
    assert seqlens.ndim in (1, 2) and (table is None or table.ndim == seqlens.ndim + 1), \
        "seqlens [B] with table [B, n], or seqlens [B, Hkv] with table [B, Hkv, n]"
    a = _arch.kernel_arch(arch)
    cfg = decode_config(q, k_cache, layout=layout, causal_or_right=has_right, has_left=has_left, softcap=capped,
                        block_size=block_size, split=split, arch=a, ring_kb=ring_kb, dense_index=seqlens.ndim == 1)
    if not split:
        fwd = _direct(compile_decode(cfg))

        def launch(q, k, v, seqlens, table, out, lse, block_logit, o_part, lse_part, scale, cap, left, right):
            fwd(q, k, v, seqlens, table, out, lse, block_logit, scale, cap, left, right)
    else:
        step = _direct(compile_decode_step(cfg))  # the split kernel + the combine, one host call

        def launch(q, k, v, seqlens, table, out, lse, block_logit, o_part, lse_part, scale, cap, left, right):
            step(q, k, v, seqlens, table, o_part, lse_part, block_logit, out, lse, scale, cap, left, right)
    launch.dtype = q.dtype  # the key holds its id: this reference keeps the id this dtype's
    launch.config = cfg
    return launch


# --------------------------------------------------------------------------- check.py matrix
def _decode_matrix(arch: int, full: bool = False):
    C = DecodeConfig
    base = [
        C(arch=arch, mask_right=True),
        C(arch=arch, mask_right=True, split=True),
        C(arch=arch, group=8, seqlen_q=4, page_size=64, mask_right=True, block_size=64, split=True),
        C(arch=arch, dtype="float16", head_dim=64, group=1, layout="nhd", page_size=1, mask_right=True,
          mask_left=True, softcap=True),
        # d 256 (warp pairs, config.d_split): contiguous + block_logit unsplit, and paged P 8 (page groups) split
        C(arch=arch, head_dim=256, group=16, layout="contiguous", page_size=0, block_size=64),
        C(arch=arch, head_dim=256, page_size=8, mask_right=True, split=True),
        C(arch=arch, group=8, seqlen_q=16, page_size=128, mask_right=True, block_size=16, split=True),
        # the dense index form (seqlens [B], table [B, n] read by every kv head): FA's call, the serving default
        C(arch=arch, mask_right=True, dense_index=True),
        C(arch=arch, mask_right=True, split=True, dense_index=True),
        C(arch=arch, dtype="float16", head_dim=64, group=1, layout="nhd", page_size=1, mask_right=True,
          mask_left=True, softcap=True, dense_index=True),
        C(arch=arch, layout="contiguous", page_size=0, mask_right=True, split=True, dense_index=True),
    ]
    if not full:
        return base
    out = list(base)
    for dt in ("bfloat16", "float16"):
        for d in (64, 128, 256):
            for p in (1, 8, 16, 32, 64, 128, 256):
                out.append(C(arch=arch, dtype=dt, head_dim=d, page_size=p, mask_right=True, split=p % 2 == 0))
            for g, sq in ((1, 1), (4, 2), (8, 1), (16, 1), (16, 16), (64, 1), (128, 1)):
                out.append(C(arch=arch, dtype=dt, head_dim=d, group=g, seqlen_q=sq, mask_right=True,
                             block_size=64, split=True))
            for layout in ("hnd", "nhd", "contiguous"):
                for dense in (False, True):
                    out.append(C(arch=arch, dtype=dt, head_dim=d, layout=layout, page_size=0 if layout == "contiguous"
                                 else 64, mask_right=True, mask_left=True, softcap=True, block_size=128,
                                 dense_index=dense))
            for p in PAGE_SIZES if dt == "bfloat16" else ():
                out.append(C(arch=arch, dtype=dt, head_dim=d, page_size=p, mask_right=True, split=p % 2 == 0,
                             dense_index=True))
    return list(dict.fromkeys(c for c in out if unsupported_reason(c) is None))


def _combine_matrix(arch: int, full: bool = False):
    dts = ("bfloat16", "float16") if full else ("bfloat16",)
    dims = (64, 128, 256) if full else (128,)
    return [CombineConfig(arch=arch, dtype=dt, head_dim=d) for dt in dts for d in dims]


def _step_matrix(arch: int, full: bool = False):
    """The split configs of the decode matrix, compiled as the split step (split kernel + combine, one entry)."""
    return [c for c in _decode_matrix(arch, full) if c.split]


CHECKS = {
    "decode_attention": (_decode_matrix, compile_decode, lambda cfg: cfg.smem_bytes),
    "decode_split_step": (_step_matrix, compile_decode_step,
                          lambda cfg: max(cfg.smem_bytes, combine_smem_bytes(cfg.head_dim))),
    "decode_combine": (_combine_matrix, compile_combine, lambda cfg: combine_smem_bytes(cfg.head_dim)),
}
