"""Reference (pure Paddle) H2O ops."""

from __future__ import annotations

import paddle


def reset_scores(state, slot_mapping) -> None:
    num_pages, hkv, page_size = state.shape
    slots = slot_mapping.astype("int64")
    valid = (slots >= 0) & (slots < num_pages * page_size)
    slots = paddle.masked_select(slots, valid)
    if slots.shape[0] == 0:
        return
    flat = state.reshape([num_pages, hkv, page_size]).transpose([0, 2, 1]).reshape([num_pages * page_size, hkv])
    zeros = paddle.zeros([slots.shape[0], hkv], dtype=state.dtype)
    flat = paddle.scatter(flat, slots, zeros, overwrite=True)
    paddle.assign(flat.reshape([num_pages, page_size, hkv]).transpose([0, 2, 1]), state)
