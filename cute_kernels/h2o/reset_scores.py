"""reset_scores: zero the heavy-hitter state of the token slots written this step.

    state[page, h, off] = 0   for every slot s = page * page_size + off in slot_mapping, every h

Tensors:
    state         [num_pages, Hkv, page_size]  float32 (default) or bfloat16, updated in place
    slot_mapping  [N] int32, flat token slots; any slot < 0 or >= num_pages * page_size is padding
                  and touches nothing (so no out-of-bounds write is possible)

One thread per (slot, kv head); the kernel reads nothing but the slot ids, so it is a handful of
scattered stores and is capturable in a CUDA graph (no host sync, static arguments).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute

THREADS = 128


@dataclass(frozen=True)
class ResetScoresConfig:
    arch: int
    state_dtype: str = "float32"  # "float32" | "bfloat16"
    num_kv_heads: int = 8  # static: heads are unrolled per thread-group


class ResetScores:
    def __init__(self, cfg: ResetScoresConfig):
        if cfg.state_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"reset_scores: unsupported state dtype {cfg.state_dtype}")
        self.cfg = cfg

    @cute.jit
    def __call__(self, mState: cute.Tensor, mSlot: cute.Tensor, stream):
        # mState: (num_pages, Hkv, page_size); mSlot: (N,)
        n_work = mSlot.shape[0] * self.cfg.num_kv_heads
        grid = cute.ceil_div(n_work, THREADS)
        self.kernel(mState, mSlot).launch(grid=[grid, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mState: cute.Tensor, mSlot: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        work = bidx * THREADS + tidx
        hkv = self.cfg.num_kv_heads
        slot_idx = work // hkv
        head = work - slot_idx * hkv
        num_pages = mState.shape[0]
        page_size = mState.shape[2]
        if slot_idx < mSlot.shape[0]:
            slot = mSlot[slot_idx]
            page = slot // page_size
            off = slot - page * page_size
            # slot < 0 gives page < 0 (or off < 0): padding, as is page >= num_pages.
            if slot >= 0 and page < num_pages:
                mState[page, head, off] = mState.element_type(0.0)
