"""token_page_scores: per-page sums of the token state, the page scores select_pages ranks.

    out[b, g, j] = sum_{o < c_j} state[block_tables[b, j], g, o],   c_j = min(P, n - j * P)

for logical pages j < n_pages = ceil(seq_lens[b] / P); ``-inf`` for j >= n_pages and for table
entries outside [0, num_pages). With P = 1 this is the token state gathered into request order.

Tensors: state [num_pages, Hkv, P] float32/bfloat16; block_tables [B, max_pages] int32;
seq_lens [B] int32; out [B, Hkv, max_pages] float32. One thread per (request, kv head, page).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32

THREADS = 128


@dataclass(frozen=True)
class TokenPageScoresConfig:
    arch: int
    state_dtype: str = "float32"
    num_kv_heads: int = 8
    page_size: int = 16


class TokenPageScores:
    def __init__(self, cfg: TokenPageScoresConfig):
        if cfg.state_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"token_accumulate: unsupported state dtype {cfg.state_dtype}")
        self.cfg = cfg

    @cute.jit
    def __call__(self, mState: cute.Tensor, mTable: cute.Tensor, mSeqLen: cute.Tensor, mOut: cute.Tensor,
                 stream):
        rows = mOut.shape[0] * self.cfg.num_kv_heads
        self.kernel(mState, mTable, mSeqLen, mOut).launch(
            grid=[rows, cute.ceil_div(mOut.shape[2], THREADS), 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mState: cute.Tensor, mTable: cute.Tensor, mSeqLen: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        row, tile, _ = cute.arch.block_idx()
        P = self.cfg.page_size
        hkv = self.cfg.num_kv_heads
        b = row // hkv
        g = row - b * hkv
        j = tile * THREADS + tidx
        n = mSeqLen[b]
        n_pages = (n + P - 1) // P
        if j < mOut.shape[2]:
            score = Float32(float("-inf"))
            if j < n_pages:
                phys = mTable[b, j]
                if (phys >= 0) & (phys < mState.shape[0]):
                    c = cutlass.min(n - j * P, P)
                    acc = Float32(0.0)
                    for o in cutlass.range_constexpr(P):
                        if o < c:
                            acc = acc + mState[phys, g, o].to(Float32)
                    score = acc
            mOut[b, g, j] = score
