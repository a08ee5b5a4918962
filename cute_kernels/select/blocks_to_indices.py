"""blocks_to_indices: selected key blocks -> the token index rows indexed_attention takes.

    out[r, s * block_size + t] = blk * block_size + t   if 0 <= blk < ceil(Sk / block_size) and
                                                         key <= last(r)
                               = -1                     otherwise (padding)
    blk = block_idx[r, s];  last(r) = Sk - 1, or min(Sk - 1, i + Sk - Sq) when causal, i = r % Sq

Tensors (row-major; viewed as 2-D [R, ...] rows, R = B * Hs * Sq, inside ``__call__``):
    mBlockIdx  [B, Hs, Sq, topk] int32
    mOut       [B, Hs, Sq, topk * block_size] int32

Grid (R, ceil(width / 4 / threads)): CTA x owns row r, each thread four consecutive outputs of one
block (block_size >= 16 keeps them inside one block), written with one 16-byte store. One gmem
read (the block id) per 4 outputs; the kernel is a pure write stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32

#: Outputs per thread (one 16-byte store).
VEC = 4
BLOCK_SIZES = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class BlocksToIndicesConfig:
    arch: int
    block_size: int
    topk: int
    causal: bool = True

    @property
    def width(self) -> int:
        return self.topk * self.block_size

    @property
    def threads(self) -> int:
        """Threads per CTA: one warp multiple covering a row's quads, at most 256."""
        quads = self.width // VEC
        return min(256, -(-quads // 32) * 32)


class BlocksToIndices:
    def __init__(self, cfg: BlocksToIndicesConfig):
        if cfg.block_size not in BLOCK_SIZES:
            raise ValueError(f"blocks_to_indices: block_size must be one of {BLOCK_SIZES}, got {cfg.block_size}")
        if cfg.topk < 1:
            raise ValueError(f"blocks_to_indices: topk must be >= 1, got {cfg.topk}")
        self.cfg = cfg

    @cute.jit
    def __call__(self, mBlockIdx: cute.Tensor, mOut: cute.Tensor, seqlen_q: Int32, seqlen_k: Int32,
                 stream):
        # mBlockIdx: (B, Hs, Sq, topk); mOut: (B, Hs, Sq, topk * block_size), both compact
        cfg = self.cfg
        rows = mOut.shape[0] * mOut.shape[1] * mOut.shape[2]
        mIdx2 = cute.make_tensor(mBlockIdx.iterator, cute.make_layout((rows, cfg.topk), stride=(cfg.topk, 1)))
        mOut2 = cute.make_tensor(mOut.iterator, cute.make_layout((rows, cfg.width), stride=(cfg.width, 1)))
        tiles = -(-(cfg.width // VEC) // cfg.threads)
        self.kernel(mIdx2, mOut2, seqlen_q, seqlen_k).launch(
            grid=[rows, tiles, 1], block=[cfg.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mBlockIdx: cute.Tensor, mOut: cute.Tensor, seqlen_q: Int32, seqlen_k: Int32):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        row, tile, _ = cute.arch.block_idx()
        quad = tile * cfg.threads + tidx
        if quad < cfg.width // VEC:
            slot = quad // (cfg.block_size // VEC)
            first = (quad % (cfg.block_size // VEC)) * VEC  # key offset inside the block
            blk = mBlockIdx[row, slot]
            last = seqlen_k - 1
            if cutlass.const_expr(cfg.causal):
                i = row % seqlen_q
                last = Int32(cutlass.select_(i + seqlen_k - seqlen_q < last, i + seqlen_k - seqlen_q, last))
            nb_k = (seqlen_k + cfg.block_size - 1) // cfg.block_size
            blk_ok = (blk >= 0) & (blk < nb_k)
            # (VEC,) int32: this thread's four token ids
            tOrIdx = cute.make_rmem_tensor((VEC,), Int32)
            for v in cutlass.range_constexpr(VEC):
                key = blk * cfg.block_size + first + v
                tOrIdx[v] = Int32(cutlass.select_(blk_ok & (key <= last), key, -1))
            cute.autovec_copy(tOrIdx, cute.local_tile(mOut[row, None], (VEC,), (quad,)))
