"""Host launchers of the block-selection kernels: compiled once per config, any DLPack tensor.

Both launchers take out-parameters and run on the caller's current stream. Arguments were
validated one layer up (Paddle op or test): contiguous row-major tensors, fp32 logits, int32 ids.
"""

from __future__ import annotations

from cute_kernels import arch as _arch
from cute_kernels.jit_cache import jit_cache

from .blocks_to_indices import BlocksToIndices, BlocksToIndicesConfig
from .topk_blocks import HEAD_AGG, NB_MAX, TOPK_MAX, TopkBlocks, TopkBlocksConfig, nb_cap_for


def topk_unsupported_reason(nb: int, topk: int, head_agg: str = "max") -> str | None:
    """Why the selection kernel cannot take this problem, or None."""
    if head_agg not in HEAD_AGG:
        return f"head_agg = {head_agg!r} is not one of {HEAD_AGG}"
    if nb > NB_MAX:
        return f"nb = {nb} key blocks > {NB_MAX} (the per-row registers hold at most {NB_MAX})"
    if topk > TOPK_MAX:
        return f"topk = {topk} > {TOPK_MAX}"
    return None


@jit_cache
def compile_topk_blocks(cfg: TopkBlocksConfig):
    import cutlass
    import cutlass.cute as cute

    from cute_kernels.fake import arch_options, fake_stream, fake_tensor, sym

    block_logit = fake_tensor(cutlass.Float32, (sym(), sym(), sym(), sym(cfg.vec)), align_bytes=4 * cfg.vec)
    lse = fake_tensor(cutlass.Float32, (sym(), sym(), sym()), align_bytes=4)
    out = fake_tensor(cutlass.Int32, (sym(), sym(), sym(), cfg.topk), align_bytes=4)
    return cute.compile(TopkBlocks(cfg), block_logit, lse, out, cutlass.Int32(0), cutlass.Int32(0),
                        cutlass.Int32(0), cutlass.Int32(64), fake_stream(), options=arch_options(cfg.arch))


def topk_config(arch: int, num_heads: int, num_groups: int, nb: int, topk: int, ptr: int = 0,
                causal_rows: bool = False, head_agg: str = "max") -> TopkBlocksConfig:
    """The config a [B, Hq, Sq, nb] problem with Hs groups compiles to (one head per group: "sum"
    is "max", so it takes the max config)."""
    vec = 4 if nb % 4 == 0 and ptr % 16 == 0 else 1
    group_size = num_heads // num_groups
    return TopkBlocksConfig(arch=arch, group_size=group_size, nb_cap=nb_cap_for(nb, vec), topk=topk, vec=vec,
                            causal_rows=causal_rows, head_agg="max" if group_size == 1 else head_agg)


def run_select_topk_blocks(block_logit, lse, out, *, sink_blocks: int = 0, local_blocks: int = 0,
                           causal_limit: tuple[int, int] | None = None, head_agg: str = "max",
                           arch: int | None = None) -> None:
    """``out [B, Hs, Sq, topk]`` int32 <- top-k blocks of ``block_logit [B, Hq, Sq, nb]``, ``lse [B, Hq, Sq]``.

    ``causal_limit = (block_size, seqlen_k)``: row i reads only blocks <= (i + Sk - Sq) // block_size.
    ``head_agg``: ``"max"`` of the group's log-weights or log of the ``"sum"`` of its weights.
    """
    b, hq, sq, nb = (int(d) for d in block_logit.shape)
    hs, topk = int(out.shape[1]), int(out.shape[3])
    if b * sq * hs == 0:
        return
    assert nb > 0 and hq % hs == 0 and topk_unsupported_reason(nb, topk, head_agg) is None
    arch = _arch.kernel_arch(arch)
    cfg = topk_config(arch, hq, hs, nb, topk, block_logit.data_ptr(), causal_rows=causal_limit is not None,
                      head_agg=head_agg)
    block_size, seqlen_k = causal_limit if causal_limit is not None else (1, sq)
    compile_topk_blocks(cfg)(block_logit, lse, out, sink_blocks, local_blocks, seqlen_k - sq, block_size)


@jit_cache
def compile_blocks_to_indices(cfg: BlocksToIndicesConfig):
    import cutlass
    import cutlass.cute as cute

    from cute_kernels.fake import arch_options, fake_stream, fake_tensor, sym

    block_idx = fake_tensor(cutlass.Int32, (sym(), sym(), sym(), cfg.topk), align_bytes=4)
    out = fake_tensor(cutlass.Int32, (sym(), sym(), sym(), cfg.width), align_bytes=16)
    return cute.compile(BlocksToIndices(cfg), block_idx, out, cutlass.Int32(1), cutlass.Int32(1),
                        fake_stream(), options=arch_options(cfg.arch))


def run_blocks_to_indices(block_idx, out, *, block_size: int, seqlen_k: int, causal: bool = True,
                          arch: int | None = None) -> None:
    """``out [B, Hs, Sq, topk * block_size]`` int32 token ids <- ``block_idx [B, Hs, Sq, topk]``."""
    b, hs, sq, topk = (int(d) for d in block_idx.shape)
    rows = b * hs * sq
    if rows == 0:
        return
    arch = _arch.kernel_arch(arch)
    cfg = BlocksToIndicesConfig(arch=arch, block_size=block_size, topk=topk, causal=causal)
    compile_blocks_to_indices(cfg)(block_idx, out, sq, seqlen_k)


# Configs compiled by ``python -m cute_kernels.check`` (and in CI for both archs).
def topk_config_matrix(arch: int, full: bool = False):
    if full:
        return [TopkBlocksConfig(arch=arch, group_size=g, nb_cap=cap, topk=k, vec=vec, causal_rows=c, head_agg=a)
                for g in (1, 4, 32) for cap in (128, 512, 2048) for k in (1, 16, 64) for vec in (1, 4)
                for c in (False, True) for a in (("max",) if g == 1 else HEAD_AGG)]
    return [
        TopkBlocksConfig(arch=arch, group_size=32, nb_cap=512, topk=16, vec=4),  # HySparse, 32K, Hs=1
        TopkBlocksConfig(arch=arch, group_size=32, nb_cap=2048, topk=16, vec=4, causal_rows=True),  # 128K
        TopkBlocksConfig(arch=arch, group_size=4, nb_cap=2048, topk=64, vec=4),  # the largest row
        TopkBlocksConfig(arch=arch, group_size=1, nb_cap=32, topk=3, vec=1),  # unaligned nb
        TopkBlocksConfig(arch=arch, group_size=32, nb_cap=512, topk=16, vec=4, head_agg="sum"),  # PaddleFleet
        TopkBlocksConfig(arch=arch, group_size=4, nb_cap=2048, topk=64, vec=4, causal_rows=True,
                         head_agg="sum"),  # the largest row, summed
    ]


def indices_config_matrix(arch: int, full: bool = False):
    if full:
        return [BlocksToIndicesConfig(arch=arch, block_size=bs, topk=k, causal=c)
                for bs in (16, 32, 64, 128, 256) for k in (1, 16, 64) for c in (True, False)]
    return [
        BlocksToIndicesConfig(arch=arch, block_size=64, topk=16, causal=True),  # HySparse
        BlocksToIndicesConfig(arch=arch, block_size=16, topk=3, causal=False),  # partial CTA
        BlocksToIndicesConfig(arch=arch, block_size=256, topk=64, causal=True),  # two tiles per row
    ]


CHECKS = {
    "select_topk_blocks": (topk_config_matrix, compile_topk_blocks, lambda cfg: 0),
    "blocks_to_indices": (indices_config_matrix, compile_blocks_to_indices, lambda cfg: 0),
}
