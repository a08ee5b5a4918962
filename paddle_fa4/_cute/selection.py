"""CuTe backend of ``paddle_fa4.selection``: out-parameter calls into ``cute_kernels.select``."""

from __future__ import annotations

from .._bridge import arch_of, as_contiguous, kernel_arg


def topk_unsupported_reason(arch: int, *, nb: int, topk: int, head_agg: str = "max") -> str | None:
    from cute_kernels.select.launch import topk_unsupported_reason

    return topk_unsupported_reason(nb, topk, head_agg)


def indices_unsupported_reason(arch: int, *, topk: int, block_size: int) -> str | None:
    return None


def select_topk_blocks(block_logit, lse, out, topk, num_groups, sink_blocks, local_blocks,
                       causal_limit=None, head_agg="max") -> None:
    """Dense 4-D ``block_logit``/``lse`` (varlen callers add a batch axis of 1), ``out [B, Hs, Sq, topk]``.

    Strided ``block_logit``/``lse`` are read through contiguous copies (the caller's tensors are
    never touched); the kernel is compiled for row-major rows."""
    from cute_kernels.select.launch import run_select_topk_blocks

    block_logit, lse = as_contiguous(block_logit), as_contiguous(lse)
    assert out.shape[1] == num_groups and out.shape[3] == topk
    run_select_topk_blocks(kernel_arg(block_logit), kernel_arg(lse), kernel_arg(out),
                           sink_blocks=sink_blocks, local_blocks=local_blocks, causal_limit=causal_limit,
                           head_agg=head_agg, arch=arch_of(block_logit))


def blocks_to_indices(block_idx, out, block_size, seqlen_k, causal) -> None:
    """A strided ``block_idx`` is read through a contiguous copy."""
    from cute_kernels.select.launch import run_blocks_to_indices

    block_idx = as_contiguous(block_idx)
    run_blocks_to_indices(kernel_arg(block_idx), kernel_arg(out), block_size=block_size,
                          seqlen_k=seqlen_k, causal=causal, arch=arch_of(block_idx))
