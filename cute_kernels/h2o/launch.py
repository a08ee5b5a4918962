"""Host launchers of the H2O kernels: compiled once per config, called with any DLPack tensor.

Each ``run_*`` takes out-parameters (in-place state, caller-allocated outputs and workspaces) and
launches on the caller's current stream; nothing here allocates, reads device memory on the host
or synchronises, so a sequence of calls can be captured in a CUDA graph. Arguments were validated
by the Paddle layer (or the test); only internal invariants are asserted. Static in a config:
dtypes, Hkv, G, D, page size and the GQA reduction; batch, pages, lengths, scale, decay, bos,
eos and top-k are runtime values (one compile serves them all).
"""

from __future__ import annotations

from cute_kernels import arch as _arch
from cute_kernels.common.utils import LOG2_E
from cute_kernels.dtypes import cutlass_dtype, dtype_name
from cute_kernels.jit_cache import fast_memo as _fast
from cute_kernels.jit_cache import jit_cache

from .page_scores import GQA_MAX as _PAGE_GQA_MAX
from .page_scores import GQA_MEAN_Q as _PAGE_GQA_MEAN_Q
from .page_scores import PageScores, PageScoresConfig
from .page_summary import PageSummary, PageSummaryConfig
from .reset_scores import ResetScores, ResetScoresConfig
from .select_pages import SelectPages, SelectPagesConfig
from .token_accumulate import (GQA_MAX, GQA_MEAN_P, GQA_MEAN_Q, GQA_SUM, TokenConfig, TokenLogits,
                               TokenUpdate, workspace_shapes)
from .token_page_scores import TokenPageScores, TokenPageScoresConfig

#: GQA reduction names of the Paddle API -> kernel enums.
PAGE_GQA = {"mean_q": _PAGE_GQA_MEAN_Q, "max": _PAGE_GQA_MAX}
TOKEN_GQA = {"mean_q": GQA_MEAN_Q, "max": GQA_MAX, "sum": GQA_SUM, "mean_p": GQA_MEAN_P}


def _opts(arch: int) -> str:
    from cute_kernels.fake import arch_options

    return arch_options(arch)


def _i32(shape, align=4):
    import cutlass

    from cute_kernels.fake import fake_tensor

    return fake_tensor(cutlass.Int32, shape, align_bytes=align)


def _f32(shape, align=4):
    import cutlass

    from cute_kernels.fake import fake_tensor

    return fake_tensor(cutlass.Float32, shape, align_bytes=align)


# --------------------------------------------------------------------------- reset_scores
@jit_cache
def compile_reset_scores(cfg: ResetScoresConfig):
    import cutlass
    import cutlass.cute as cute

    from cute_kernels.fake import fake_stream, fake_tensor, sym

    state = fake_tensor(cutlass_dtype(cfg.state_dtype), (sym(), cfg.num_kv_heads, sym()), align_bytes=4)
    slots = fake_tensor(cutlass.Int32, (sym(),), align_bytes=4)
    return cute.compile(ResetScores(cfg), state, slots, fake_stream(),
                        options=_opts(cfg.arch))


def run_reset_scores(state, slot_mapping, *, arch: int | None = None) -> None:
    """Zero ``state[page, :, off]`` for every valid flat slot in ``slot_mapping`` (in place)."""
    if slot_mapping.shape[0] == 0 or state.shape[0] == 0:
        return
    fn = _fast(("reset", state.dtype, state.shape[1], arch), lambda: compile_reset_scores(ResetScoresConfig(
        arch=_arch.kernel_arch(arch), state_dtype=dtype_name(state.dtype), num_kv_heads=int(state.shape[1]))))
    fn(state, slot_mapping)


# --------------------------------------------------------------------------- update_page_summary
@jit_cache
def compile_page_summary(cfg: PageSummaryConfig):
    import cutlass.cute as cute

    from cute_kernels.fake import fake_stream, fake_tensor, sym

    key = fake_tensor(cutlass_dtype(cfg.key_dtype), (sym(), cfg.num_kv_heads, cfg.page_size, cfg.head_dim))
    summary = fake_tensor(cutlass_dtype(cfg.summary_dtype), (sym(), cfg.num_kv_heads, 3, cfg.head_dim))
    return cute.compile(PageSummary(cfg), key, _i32((sym(),)), summary, fake_stream(), options=_opts(cfg.arch))


def page_summary_config(key_cache, summary, arch: int) -> PageSummaryConfig:
    _, hkv, page_size, d = (int(x) for x in key_cache.shape)
    return PageSummaryConfig(arch=arch, key_dtype=dtype_name(key_cache.dtype),
                             summary_dtype=dtype_name(summary.dtype), num_kv_heads=hkv,
                             page_size=page_size, head_dim=d)


def run_update_page_summary(key_cache, slot_mapping, summary, *, arch: int | None = None) -> None:
    """Refresh ``summary [num_pages, Hkv, 3, D]`` (mean, max, min) of the pages ``slot_mapping`` wrote."""
    if slot_mapping.shape[0] == 0 or key_cache.shape[0] == 0:
        return
    fn = _fast(("summary", key_cache.dtype, summary.dtype, tuple(key_cache.shape[1:]), arch),
               lambda: compile_page_summary(page_summary_config(key_cache, summary, _arch.kernel_arch(arch))))
    fn(key_cache, slot_mapping, summary)


# --------------------------------------------------------------------------- page_scores
@jit_cache
def compile_page_scores(cfg: PageScoresConfig):
    import cutlass
    import cutlass.cute as cute

    from cute_kernels.fake import fake_stream, fake_tensor, sym

    hq = cfg.num_kv_heads * cfg.group
    q = fake_tensor(cutlass_dtype(cfg.q_dtype), (sym(), hq, cfg.head_dim))
    summary = fake_tensor(cutlass_dtype(cfg.summary_dtype), (sym(), cfg.num_kv_heads, 3, cfg.head_dim))
    out = _f32((sym(), cfg.num_kv_heads, sym()))
    return cute.compile(PageScores(cfg), q, summary, _i32((sym(), sym())), _i32((sym(),)), out,
                        cutlass.Float32(1.0), cutlass.Float32(1.0), fake_stream(), options=_opts(cfg.arch))


def run_page_scores(q, summary, block_tables, seq_lens, out, *, page_size: int, w_avg: float = 1.0,
                    w_peak: float = 1.0, gqa_reduce: str = "mean_q", arch: int | None = None) -> None:
    """``out [B, Hkv, max_pages]`` = w_avg * avg + w_peak * peak per page (-inf where invalid)."""
    if out.shape[0] == 0 or out.shape[2] == 0:
        return

    def build():
        _, hkv, _, d = (int(x) for x in summary.shape)
        return compile_page_scores(PageScoresConfig(
            arch=_arch.kernel_arch(arch), q_dtype=dtype_name(q.dtype), summary_dtype=dtype_name(summary.dtype),
            num_kv_heads=hkv, group=int(q.shape[1]) // hkv, head_dim=d, page_size=int(page_size),
            gqa=PAGE_GQA[gqa_reduce]))

    fn = _fast(("page_scores", q.dtype, summary.dtype, q.shape[1], tuple(summary.shape[1:]), page_size, gqa_reduce,
                arch), build)
    fn(q, summary, block_tables, seq_lens, out, float(w_avg), float(w_peak))


# --------------------------------------------------------------------------- token_accumulate
def _token_fakes(cfg: TokenConfig):
    from cute_kernels.fake import fake_tensor, sym

    hq = cfg.num_kv_heads * cfg.group
    r = cfg.rows_per_head
    return dict(
        q=fake_tensor(cutlass_dtype(cfg.q_dtype), (sym(), hq, cfg.head_dim)),
        key=fake_tensor(cutlass_dtype(cfg.key_dtype), (sym(), cfg.num_kv_heads, cfg.page_size, cfg.head_dim)),
        state=fake_tensor(cutlass_dtype(cfg.state_dtype), (sym(), cfg.num_kv_heads, cfg.page_size), align_bytes=4),
        table=_i32((sym(), sym())), seq=_i32((sym(),)),
        logits=_f32((sym(), cfg.num_kv_heads, r, sym())),
        stats=_f32((sym(), cfg.num_kv_heads, r, sym(), 2)),
    )


@jit_cache
def compile_token_logits(cfg: TokenConfig):
    import cutlass
    import cutlass.cute as cute

    from cute_kernels.fake import fake_stream

    f = _token_fakes(cfg)
    return cute.compile(TokenLogits(cfg), f["q"], f["key"], f["table"], f["seq"], f["logits"], f["stats"],
                        cutlass.Float32(1.0), cutlass.Int32(0), cutlass.Int32(0), fake_stream(),
                        options=_opts(cfg.arch))


@jit_cache
def compile_token_update(cfg: TokenConfig):
    import cutlass
    import cutlass.cute as cute

    from cute_kernels.fake import fake_stream

    f = _token_fakes(cfg)
    return cute.compile(TokenUpdate(cfg), f["state"], f["table"], f["seq"], f["logits"], f["stats"],
                        cutlass.Float32(1.0), cutlass.Int32(0), cutlass.Int32(0), fake_stream(),
                        options=_opts(cfg.arch))


def compile_token_accumulate(cfg: TokenConfig):
    """Both kernels of one config (what ``check.py`` compiles as ``h2o_token_accumulate``)."""
    return compile_token_logits(cfg), compile_token_update(cfg)


def token_config(q, key_cache, state, gqa_reduce: str, arch: int) -> TokenConfig:
    _, hkv, page_size, d = (int(x) for x in key_cache.shape)
    return TokenConfig(arch=arch, q_dtype=dtype_name(q.dtype), key_dtype=dtype_name(key_cache.dtype),
                       state_dtype=dtype_name(state.dtype), num_kv_heads=hkv, group=int(q.shape[1]) // hkv,
                       head_dim=d, page_size=page_size, gqa=TOKEN_GQA[gqa_reduce])


def token_workspace_shapes(q, key_cache, block_tables, gqa_reduce: str) -> tuple[tuple, tuple]:
    """Shapes of the fp32 (logits, stats) workspaces ``run_token_accumulate`` needs."""
    def build():
        cfg = token_config(q, key_cache, key_cache, gqa_reduce, 90)
        return workspace_shapes(int(q.shape[0]), cfg, int(block_tables.shape[1]))

    return _fast(("ws", q.shape[0], q.shape[1], tuple(key_cache.shape[1:]), block_tables.shape[1], gqa_reduce), build)


def run_token_accumulate(q, key_cache, state, block_tables, seq_lens, logits_ws, stats_ws, *, scale: float,
                         decay: float, bos: int, eos: int, gqa_reduce: str = "mean_q",
                         arch: int | None = None) -> None:
    """One step of ``state <- softmax-window probabilities + decay * state`` (in place).

    ``logits_ws``/``stats_ws`` are fp32 workspaces of ``token_workspace_shapes(...)`` (contents
    irrelevant; overwritten). ``bos``/``eos`` are in tokens.
    """
    if q.shape[0] == 0 or block_tables.shape[1] == 0:
        return
    def build():
        cfg = token_config(q, key_cache, state, gqa_reduce, _arch.kernel_arch(arch))
        return compile_token_logits(cfg), compile_token_update(cfg)

    logits_fn, update_fn = _fast(("token", q.dtype, key_cache.dtype, state.dtype, q.shape[1],
                                  tuple(key_cache.shape[1:]), gqa_reduce, arch), build)
    logits_fn(q, key_cache, block_tables, seq_lens, logits_ws, stats_ws, float(scale) * LOG2_E, int(bos), int(eos))
    update_fn(state, block_tables, seq_lens, logits_ws, stats_ws, float(decay), int(bos), int(eos))


# --------------------------------------------------------------------------- token_page_scores
@jit_cache
def compile_token_page_scores(cfg: TokenPageScoresConfig):
    import cutlass.cute as cute

    from cute_kernels.fake import fake_stream, fake_tensor, sym

    state = fake_tensor(cutlass_dtype(cfg.state_dtype), (sym(), cfg.num_kv_heads, cfg.page_size), align_bytes=4)
    return cute.compile(TokenPageScores(cfg), state, _i32((sym(), sym())), _i32((sym(),)),
                        _f32((sym(), cfg.num_kv_heads, sym())), fake_stream(), options=_opts(cfg.arch))


def run_token_page_scores(state, block_tables, seq_lens, out, *, arch: int | None = None) -> None:
    """``out [B, Hkv, max_pages]``: per-page sums of the token state (-inf where invalid)."""
    if out.shape[0] == 0 or out.shape[2] == 0:
        return
    def build():
        _, hkv, page_size = (int(x) for x in state.shape)
        return compile_token_page_scores(TokenPageScoresConfig(
            arch=_arch.kernel_arch(arch), state_dtype=dtype_name(state.dtype), num_kv_heads=hkv, page_size=page_size))

    _fast(("token_pages", state.dtype, tuple(state.shape[1:]), arch), build)(state, block_tables, seq_lens, out)


# --------------------------------------------------------------------------- select_pages
@jit_cache
def compile_select_pages(cfg: SelectPagesConfig):
    import cutlass
    import cutlass.cute as cute

    from cute_kernels.fake import fake_stream, sym

    h = cfg.num_kv_heads
    zero = cutlass.Int32(0)
    return cute.compile(SelectPages(cfg), _f32((sym(), h, sym())), _i32((sym(), sym())), _i32((sym(),)),
                        _i32((sym(), h, sym())), _i32((sym(), h)), zero, zero, zero, zero, fake_stream(),
                        options=_opts(cfg.arch))


def run_select_pages(scores, block_tables, seq_lens, out, out_lens, *, page_size: int, topk: int, bos: int,
                     eos: int, arch: int | None = None) -> None:
    """Sparse block table ``out [B, Hkv, bos + topk + eos]`` and its token lengths ``out_lens [B, Hkv]``."""
    if out.shape[0] == 0:
        return
    assert int(out.shape[2]) == bos + topk + eos, "out width must be bos + topk + eos"
    fn = _fast(("select", scores.shape[1], arch), lambda: compile_select_pages(
        SelectPagesConfig(arch=_arch.kernel_arch(arch), num_kv_heads=int(scores.shape[1]))))
    fn(scores, block_tables, seq_lens, out, out_lens, int(page_size), int(topk), int(bos), int(eos))


# --------------------------------------------------------------------------- check.py matrix
def _reset_matrix(arch: int, full: bool = False):
    heads = (1, 2, 8) if full else (8,)
    return [ResetScoresConfig(arch=arch, state_dtype=dt, num_kv_heads=h)
            for dt in ("float32", "bfloat16") for h in heads]


def _summary_matrix(arch: int, full: bool = False):
    pages = (1, 16, 64) if full else (16,)
    return [PageSummaryConfig(arch=arch, key_dtype=kd, summary_dtype=sd, page_size=p)
            for kd in ("bfloat16", "float16") for sd in ("float32", "bfloat16") for p in pages
            if full or kd == "bfloat16"]


def _page_scores_matrix(arch: int, full: bool = False):
    if not full:  # the two reductions, the two summary dtypes
        return [PageScoresConfig(arch=arch, summary_dtype="float32", gqa=_PAGE_GQA_MEAN_Q),
                PageScoresConfig(arch=arch, summary_dtype="bfloat16", gqa=_PAGE_GQA_MAX)]
    return [PageScoresConfig(arch=arch, q_dtype=qd, summary_dtype=sd, group=g, gqa=gqa)
            for qd in ("bfloat16", "float32") for sd in ("float32", "bfloat16") for g in (1, 3, 4, 5, 7, 8)
            for gqa in (_PAGE_GQA_MEAN_Q, _PAGE_GQA_MAX)]


def _token_matrix(arch: int, full: bool = False):
    if not full:  # every reduction, page sizes 1 and 16, both state dtypes
        return [TokenConfig(arch=arch, page_size=1, gqa=GQA_MEAN_Q),
                TokenConfig(arch=arch, page_size=16, gqa=GQA_MAX),
                TokenConfig(arch=arch, page_size=16, gqa=GQA_SUM, state_dtype="bfloat16"),
                TokenConfig(arch=arch, page_size=1, gqa=GQA_MEAN_P, group=5)]
    return [TokenConfig(arch=arch, state_dtype=sd, group=g, page_size=p, gqa=gqa)
            for sd in ("float32", "bfloat16") for g in (1, 3, 4, 5, 7, 8) for p in (1, 16, 64)
            for gqa in TOKEN_GQA.values()]


def _token_page_matrix(arch: int, full: bool = False):
    return [TokenPageScoresConfig(arch=arch, state_dtype=sd, page_size=p)
            for sd in ("float32", "bfloat16") for p in (1, 16, 64) if full or sd == "float32"]


def _select_matrix(arch: int, full: bool = False):
    return [SelectPagesConfig(arch=arch, num_kv_heads=h) for h in ((1, 8) if full else (8,))]


def _smem_token(cfg: TokenConfig) -> int:
    return 4 * 2 * cfg.rows_per_head * 4  # (WARPS, R, 2) fp32


CHECKS = {
    "h2o_reset_scores": (_reset_matrix, compile_reset_scores, lambda cfg: 0),
    "h2o_update_page_summary": (_summary_matrix, compile_page_summary, lambda cfg: 0),
    "h2o_page_scores": (_page_scores_matrix, compile_page_scores, lambda cfg: 0),
    "h2o_token_accumulate": (_token_matrix, compile_token_accumulate, _smem_token),
    "h2o_token_page_scores": (_token_page_matrix, compile_token_page_scores, lambda cfg: 0),
    "h2o_select_pages": (_select_matrix, compile_select_pages, lambda cfg: 4 * (256 + 16 + 4)),
}
