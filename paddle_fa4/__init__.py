"""paddle_fa4: FlashAttention-4-class CuTe-DSL attention kernels for PaddlePaddle.

Public API (see ``docs/api.md`` for exact semantics):

- :func:`flash_attn_func`, :func:`flash_attn_varlen_func` — FA4-compatible entry points (autograd)
- :func:`flash_attn_fwd` — attention forward with fused ``block_logit`` and natural-log LSE
  (differentiable w.r.t. q, k, v through autograd)
- :func:`flash_attn_bwd` — its backward as a low-level op, for callers managing their own autograd
- :func:`flashmask_attention` — Paddle's FlashMask op (``startend_row_indices`` column masks), with
  :func:`startend_row_indices_from_cu_seqlens` / :func:`cu_seqlens_from_startend_row_indices`
- :func:`block_log_weight`, :func:`select_topk_blocks`, :func:`blocks_to_indices` — block selection
- :func:`indexed_attention`, :func:`indexed_attention_plan` — sparse attention over token indices
- :func:`block_sparse_attention`, :func:`block_sparse_plan` — attention over per-query key blocks
- :func:`flash_attn_with_kvcache`, :func:`sparse_decode_attention`,
  :func:`block_selection_to_page_table` — paged / split-KV decode attention, sparse decode over
  compacted page tables and the HySparse selection -> page table helper
- :mod:`paddle_fa4.h2o` — heavy-hitter (H2O) decode ops on the paged KV layout

Every op takes ``backend="auto" | "cute" | "reference"``. Submodules load on first use so that
``import paddle_fa4`` is cheap and needs no GPU.
"""

import importlib as _importlib

__version__ = "0.1.0"

from ._static import install_sot_graph_break as _install_sot_graph_break

_install_sot_graph_break()  # to_static's SOT mode runs every op eagerly between graph breaks

_EXPORTS = {
    "flash_attn_func": "attention",
    "flash_attn_varlen_func": "attention",
    "flash_attn_fwd": "attention",
    "flash_attn_bwd": "attention",
    "flashmask_attention": "flashmask",
    "startend_row_indices_from_cu_seqlens": "flashmask",
    "cu_seqlens_from_startend_row_indices": "flashmask",
    "block_log_weight": "selection",
    "select_topk_blocks": "selection",
    "blocks_to_indices": "selection",
    "select_topk_blocks_chunked": "selection",
    "indexed_attention": "indexed",
    "indexed_attention_plan": "indexed",
    "IndexedAttentionPlan": "indexed",
    "block_sparse_attention": "block_sparse",
    "block_sparse_plan": "block_sparse",
    "BlockSparsePlan": "block_sparse",
    "flash_attn_with_kvcache": "decode",
    "sparse_decode_attention": "decode",
    "block_selection_to_page_table": "decode",
}
_SUBMODULES = ("h2o", "backend", "library")

__all__ = sorted(_EXPORTS) + list(_SUBMODULES)


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(_importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    elif name in _SUBMODULES:
        value = _importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module 'paddle_fa4' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    """The API and the dunders only: not the private helpers, nor the submodules that importing an op
    binds on the package (``attention``, ``_cute``, ...)."""
    return sorted(set(__all__) | {n for n in globals() if n.startswith("__")})
