"""Register the ops' names with ``paddle.library`` (``paddle.ops.paddle_fa4.<name>``).

In Paddle 3.3 ``paddle.library.custom_op`` is a name registry only (see
``/work/shared/notes/paddle.md`` 1.2): it stores a Python callable under ``"namespace::name"`` so
``paddle.ops.paddle_fa4.flash_attn_fwd(...)`` (or ``.default(...)``) calls it. It adds no autograd,
no fake/meta function and no static graph; ``mutates_args`` is accepted and ignored. The
registered callables are thin wrappers that look up the public op in :mod:`paddle_fa4` at call time,
so registering imports nothing heavy. Importing this module registers once; :func:`register_ops`
is idempotent.

Registered names: ``flash_attn_func``, ``flash_attn_varlen_func``, ``flash_attn_fwd``, ``flash_attn_bwd``, ``indexed_attention``, ``block_log_weight``,
``select_topk_blocks``, ``blocks_to_indices`` and the H2O ops as ``h2o_<op>``
(``h2o_update_page_summary``, ``h2o_page_scores``, ``h2o_reset_scores``, ``h2o_token_accumulate``,
``h2o_token_page_scores``, ``h2o_select_pages``), and the decode ops ``flash_attn_with_kvcache``,
``sparse_decode_attention``, ``block_selection_to_page_table``.
"""

from __future__ import annotations

import importlib
from typing import Callable, Dict, Tuple

NAMESPACE = "paddle_fa4"

#: registered name -> (module under paddle_fa4 holding the op, the op's name there)
OPS: Dict[str, Tuple[str, str]] = {
    "flash_attn_func": ("", "flash_attn_func"),
    "flash_attn_varlen_func": ("", "flash_attn_varlen_func"),
    "flash_attn_fwd": ("", "flash_attn_fwd"),
    "flash_attn_bwd": ("", "flash_attn_bwd"),
    "indexed_attention": ("", "indexed_attention"),
    "block_log_weight": ("", "block_log_weight"),
    "select_topk_blocks": ("", "select_topk_blocks"),
    "blocks_to_indices": ("", "blocks_to_indices"),
    "h2o_update_page_summary": ("h2o", "update_page_summary"),
    "h2o_page_scores": ("h2o", "page_scores"),
    "h2o_reset_scores": ("h2o", "reset_scores"),
    "h2o_token_accumulate": ("h2o", "token_accumulate"),
    "h2o_select_pages": ("h2o", "select_pages"),
    "h2o_token_page_scores": ("h2o", "token_page_scores"),
    "flash_attn_with_kvcache": ("", "flash_attn_with_kvcache"),
    "sparse_decode_attention": ("", "sparse_decode_attention"),
    "block_selection_to_page_table": ("", "block_selection_to_page_table"),
}

#: Ops that write into one of their arguments (informational: Paddle 3.3 ignores mutates_args).
_MUTATES = {"h2o_reset_scores": ("state",), "h2o_update_page_summary": ("summary",),
            "h2o_token_accumulate": ("state",)}


def resolve(name: str) -> Callable:
    """The public op registered as ``name`` (e.g. ``"h2o_reset_scores"`` -> ``paddle_fa4.h2o.reset_scores``).

    Raises:
        KeyError: ``name`` is not one of :data:`OPS`.
        AttributeError: the op is not part of this install.
    """
    module, attr = OPS[name]
    target = importlib.import_module("paddle_fa4" + (f".{module}" if module else ""))
    return getattr(target, attr)


def _wrapper(name: str) -> Callable:
    def op(*args, **kwargs):
        return resolve(name)(*args, **kwargs)

    op.__name__ = op.__qualname__ = name
    module, attr = OPS[name]
    op.__doc__ = f"Calls ``paddle_fa4.{module + '.' if module else ''}{attr}`` (see its docstring)."
    op._paddle_fa4_op = name
    return op


def qualified_name(name: str) -> str:
    return f"{NAMESPACE}::{name}"


def register_ops() -> Tuple[str, ...]:
    """Register every op of :data:`OPS` once; returns the qualified names.

    Raises:
        RuntimeError: one of the names is already registered by someone else.
    """
    import paddle.library
    from paddle._ops import PYTHON_OP_REGISTRY

    names = []
    for name in OPS:
        qualname = qualified_name(name)
        if PYTHON_OP_REGISTRY.has_operator(qualname):
            existing = PYTHON_OP_REGISTRY.get_operator(qualname)
            if getattr(existing, "_paddle_fa4_op", None) != name:
                raise RuntimeError(f"paddle_fa4.library: {qualname} is already registered by {existing!r}")
        else:
            paddle.library.custom_op(qualname, _wrapper(name), mutates_args=_MUTATES.get(name, ()))
        names.append(qualname)
    return tuple(names)


register_ops()
