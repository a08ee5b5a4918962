"""What the three SM90 block-sparse kernels (``fwd_sm90.py``, ``bwd_dq_sm90.py``, ``bwd_dkdv_sm90.py``)
share: the config fields, the shared-storage struct and the TMA atoms of the row boxes and key blocks."""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import Int64
from cutlass.cute.nvgpu import cpasync

from cute_kernels.common.utils import select_modes, wgmma_smem_layout
from cute_kernels.dtypes import cutlass_dtype
from cute_kernels.indexed.bwd_dkdv_sm90 import IndexedBwdDKDVSm90

from .config import BLOCK_SIZE, TILE_M, head_chunk

THREADS_PER_WG = 128


def shared_storage(dtype, mbars: dict, words: dict | None = None, **layouts):
    """The struct of ``mbars`` (name: count of Int64 barriers), then ``words`` (name: (Float32 / Int32,
    count), 16-aligned), then one 1024-aligned buffer per layout."""
    fields = {name: cute.struct.MemRange[Int64, n] for name, n in mbars.items()}
    fields.update({name: cute.struct.Align[cute.struct.MemRange[t, n], 16] for name, (t, n) in (words or {}).items()})
    fields.update({name: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(layout)], 1024]
                   for name, layout in layouts.items()})
    return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))


def smem_tensors(storage, **layouts):
    """The storage buffers named by ``layouts`` as tensors of those (swizzled) layouts, in order."""
    return [getattr(storage, name).get_tensor(layout.outer, swizzle=layout.inner) for name, layout in layouts.items()]


class BlockSparseSm90:
    def __init__(self, cfg):
        if cfg.arch // 10 != 9:
            raise ValueError(f"{type(self).__name__} is the SM90 kernel, got arch {cfg.arch}")
        self.cfg = cfg
        self.dtype = cutlass_dtype(cfg.dtype)
        self.dk, self.dv = cfg.head_dim, cfg.head_dim_v
        self.gc = head_chunk(cfg.group)
        self.chunks = cfg.group // self.gc
        self.wq = cfg.window_queries
        self.tile_n = BLOCK_SIZE

    def rows_tma(self, mX: cute.Tensor, d: int, stages=None):
        """(atom, TMA tensor, row box) loading one (GC, d) box per tile query from the [B, S, H, d] tensor;
        the box of the indexed dK/dV kernel, laid out as stage 0 of ``stages`` (default: 2 stages of
        the (TILE_M, d) wgmma layout, as that kernel checks its stage layout)."""
        if stages is None:
            stages = wgmma_smem_layout(self.dtype, (TILE_M, d, 2))
        box = IndexedBwdDKDVSm90.row_box(SimpleNamespace(g=self.gc, d=d), stages)
        atom, tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), select_modes(mX, (2, 3, 1, 0)),
                                                box, (self.gc, d))
        return atom, tma, box

    def kv_tma(self, mX: cute.Tensor, layout, d: int):
        """(atom, TMA tensor) loading one (64, d) key block of the [B, S, H, d] tensor into ``layout``."""
        return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), select_modes(mX, (1, 3, 2, 0)),
                                           layout, (self.tile_n, d), 1)

    @cute.jit
    def allocate(self, atoms: tuple):
        """(warp index, thread index, shared storage); warp 0 prefetches the TMA descriptors first."""
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == 0:
            for atom in atoms:
                cpasync.prefetch_descriptor(atom)
        return warp_idx, tidx, cutlass.utils.SmemAllocator().allocate(self.shared_storage)
