"""Heavy-hitter (H2O) decode ops on Paddle's paged KV layout. See ``docs/api.md`` (H2O).

Layout: ``key_cache [num_pages, Hkv, page_size, D]``, ``block_tables [B, max_pages]`` int32,
``seq_lens [B]`` int32, decode ``q [B, Hq, D]``; token score state ``[num_pages, Hkv, page_size]``
(float32 by default, bfloat16 allowed), parallel to the KV cache.
"""

from __future__ import annotations

from .backend import resolve_backend

_STATE_DTYPES = ("float32", "bfloat16")


def _dtype_name(t) -> str:
    from cute_kernels.dtypes import dtype_name

    return dtype_name(t.dtype)


def reset_scores(state, slot_mapping, backend: str = "auto"):
    """Zero the accumulated score of the token slots written this step (in place).

    Args:
        state (Tensor): ``[num_pages, Hkv, page_size]`` float32 or bfloat16 score state.
        slot_mapping (Tensor): int32 ``[N]`` flat slots ``page * page_size + offset`` written this
            step (Paddle's block-attention ``slot_mapping``). Slots ``< 0`` or
            ``>= num_pages * page_size`` are padding and touch nothing.
        backend (str): ``"auto"``, ``"cute"`` or ``"reference"``.

    Returns:
        Tensor: ``state`` (updated in place).
    """
    op = "h2o.reset_scores"
    if state.ndim != 3:
        raise ValueError(f"{op}: state must be [num_pages, Hkv, page_size], got shape {list(state.shape)}")
    if _dtype_name(state) not in _STATE_DTYPES:
        raise TypeError(f"{op}: state must be float32 or bfloat16, got {_dtype_name(state)}")
    if slot_mapping.ndim != 1:
        raise ValueError(f"{op}: slot_mapping must be 1-D [N], got shape {list(slot_mapping.shape)}")
    if _dtype_name(slot_mapping) != "int32":
        raise TypeError(f"{op}: slot_mapping must be int32, got {_dtype_name(slot_mapping)}")
    if state.place != slot_mapping.place:
        raise ValueError(f"{op}: state and slot_mapping must be on the same place "
                         f"({state.place} vs {slot_mapping.place})")
    if state.numel() == 0 or slot_mapping.numel() == 0:
        return state

    def reason(arch):
        from ._cute import h2o as glue

        if not state.is_contiguous() or not slot_mapping.is_contiguous():
            return "state and slot_mapping must be contiguous"
        return glue.unsupported_reason(arch, "reset_scores")

    if resolve_backend(op, backend, state, reason) == "cute":
        from ._cute import h2o as glue

        glue.reset_scores(state, slot_mapping)
    else:
        from .reference import h2o as ref

        ref.reset_scores(state, slot_mapping)
    return state
