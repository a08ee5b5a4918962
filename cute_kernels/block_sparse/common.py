"""What the three SM90 block-sparse kernels (``fwd_sm90.py``, ``bwd_dq_sm90.py``, ``bwd_dkdv_sm90.py``)
share: the config fields, the shared-storage struct and the TMA atoms of the row boxes and key blocks."""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync

from cute_kernels.common import nonfinite as nf
from cute_kernels.common.utils import (LOG2_E, convert_to_16bit, select_modes, stage_acc_16bit, transpose_view,
                                       wgmma_smem_layout)
from cute_kernels.dtypes import cutlass_dtype
from cute_kernels.indexed.bwd_dkdv_sm90 import IndexedBwdDKDVSm90

from .config import BLOCK_SIZE, TILE_M, head_chunk

THREADS_PER_WG = 128


def check_setmaxnreg(producer: int, consumer: int, consumer_wgs: int) -> None:
    """A setmaxnreg split for one producer and ``consumer_wgs`` consumer warpgroups at one CTA per SM: the
    launch gives each thread floor(65,536 / threads) registers rounded down to 8 (168 at 384 threads), and an
    increase past what the CTA holds waits forever, so producer + n * consumer <= (1 + n) * that."""
    per_thread = min(255, 65536 // (THREADS_PER_WG * (1 + consumer_wgs))) // 8 * 8
    assert producer % 8 == 0 and consumer % 8 == 0 and 24 <= producer <= consumer <= 256, (producer, consumer)
    assert producer + consumer_wgs * consumer <= (1 + consumer_wgs) * per_thread, \
        f"setmaxnreg {producer} / {consumer} x {consumer_wgs} exceeds the {per_thread} registers per thread launched"


def two_wg_pipeline(barrier_storage, num_stages: int, producers: int, tx_count: int):
    """A TMA pipeline whose stages ``producers`` arrivals fill (the TMA thread's, plus a row warp's) and both
    consumer warpgroups release (8 warps' arrivals): the latent kernels, whose two consumer warpgroups read
    every stage."""
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=barrier_storage, num_stages=num_stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, producers),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 2 * THREADS_PER_WG // 32),
        tx_count=tx_count, defer_sync=False)


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
        # scrub_rows' adjacent threads per key row of a value block (one consumer warpgroup scans it)
        self.v_per_row = nf.threads_per_row(BLOCK_SIZE, self.dv, THREADS_PER_WG, self.dtype)
        self.k_per_row = nf.threads_per_row(BLOCK_SIZE, self.dk, THREADS_PER_WG, self.dtype)
        # and the chunks each scrub thread loads together (one shared-memory round trip per batch)
        # (fewer where more spilled at sm_90a: the forward's d 256 consumer, the dQ consumer)
        self.v_batch = nf.batch_for(self.dv, self.v_per_row, self.dtype, most=4 if self.dv <= 128 else 2)
        self.k_batch = nf.batch_for(self.dk, self.k_per_row, self.dtype, most=2)

    def rows_tma(self, mX: cute.Tensor, d: int, stages=None, store: bool = False):
        """(atom, TMA tensor, row box) loading (``store``: storing) one (GC, d) box per tile query from (to) the
        [B, S, H, d] tensor; the box of the indexed dK/dV kernel, laid out as stage 0 of ``stages`` (default: 2
        stages of the (TILE_M, d) wgmma layout, as that kernel checks its stage layout)."""
        if stages is None:
            stages = wgmma_smem_layout(self.dtype, (TILE_M, d, 2))
        box = IndexedBwdDKDVSm90.row_box(SimpleNamespace(g=self.gc, d=d), stages)
        op = cpasync.CopyBulkTensorTileS2GOp() if store else cpasync.CopyBulkTensorTileG2SOp()
        atom, tma = cpasync.make_tiled_tma_atom(op, select_modes(mX, (2, 3, 1, 0)), box, (self.gc, d))
        return atom, tma, box

    def kv_tma(self, mX: cute.Tensor, layout, d: int):
        """(atom, TMA tensor) loading one (64, d) key block of the [B, S, H, d] tensor into ``layout``."""
        return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), select_modes(mX, (1, 3, 2, 0)),
                                           layout, (self.tile_n, d), 1)

    def key_columns(self, sK_layout: cute.ComposedLayout, c0: int, cols: int, stages: int, d: int | None = None):
        """Composed layout of columns [c0, c0 + cols) of every stage of a (64, d) key buffer of ``sK_layout``
        (``stages`` stages, d default Dk); the view starts ``64 * c0`` elements into the buffer. c0 and cols
        are multiples of 64: whole 64-column chunks of the wgmma layout (64 x 64 elements, one after the
        other, each its own swizzle atom), so the view is the (64, cols) wgmma layout with the buffer's stage
        stride. Checked against ``sK_layout`` at trace time (the latent kernels read V, and the dQ / dK
        column splits, this way)."""
        d = self.dk if d is None else d
        assert c0 % 64 == 0 and cols % 64 == 0 and c0 + cols <= d, (c0, cols, d)
        base = wgmma_smem_layout(self.dtype, (self.tile_n, cols))
        stride = self.tile_n * d
        outer = cute.append(base.outer, cute.make_layout(stages, stride=stride))
        full = sK_layout.outer
        if stages > 1:
            assert cute.crd2idx((0, 0, 1), full) == stride, "key stage stride"
        for r in (0, 1, 7, 8, 63):
            for c in sorted({0, 1, 63, 64, cols - 1} & set(range(cols))):
                for st in range(stages):
                    want = cute.crd2idx((r, c0 + c, st), full)
                    assert want == c0 * self.tile_n + cute.crd2idx((r, c, st), outer), \
                        f"columns [{c0}, {c0 + cols}) are not a sub-block of the key buffer at ({r}, {c}, {st})"
        return cute.make_composed_layout(base.inner, 0, outer)

    def key_columns_operand(self, mma_slice, sK_base, sK_layout, c0: int, cols: int, stages: int, d: int | None = None):
        """The B fragment (.., .., k, stage) of columns [c0, c0 + cols) (``key_columns``) of a (64, d) buffer for
        a GEMM whose K dimension runs over the buffer's 64 rows (P V and dS K over keys; P^T dO and dS^T Q over
        tile rows), read MN-major."""
        layout = self.key_columns(sK_layout, c0, cols, stages, d)
        sX = cute.make_tensor(cute.recast_ptr(sK_base + c0 * self.tile_n, layout.inner), layout.outer)
        return mma_slice.make_fragment_B(mma_slice.partition_B(transpose_view(sX)))

    @cute.jit
    def stage_columns(self, acc, sX_base, sX_layout, tiled_mma, ctidx: Int32, c0: cutlass.Constexpr,
                      cols: cutlass.Constexpr):
        """The fp32 accumulator (64 rows x ``cols``) in q's dtype into columns [c0, c0 + cols) of a (64, d)
        buffer of ``sX_layout`` (``key_columns``' view; stmatrix from the accumulator's layout), fenced for
        a TMA store (Note [staged latent O] in fwd_latent_sm90.py)."""
        r16 = cute.make_rmem_tensor_like(acc, self.dtype)
        convert_to_16bit(acc, r16)
        d = cute.size(sX_layout.outer, mode=[1])
        layout = self.key_columns(sX_layout, c0, cols, 1, d)
        sX = cute.make_tensor(cute.recast_ptr(sX_base + c0 * TILE_M, layout.inner), layout.outer)[None, None, 0]
        stage_acc_16bit(r16, tiled_mma, ctidx, sX)
        cute.arch.fence_view_async_shared()

    @cute.jit
    def store_row_boxes(self, atom, rows, mX, sX_base, tile, d: cutlass.Constexpr):
        """The staged tile to ``mX`` (``rows_tma(.., store=True)``'s TMA tensor): one (GC, d) box per real
        query of the tile, from its row slots (so padding rows are never written); waits until the
        boxes have been read, so the CTA may exit. One thread."""
        for j in cutlass.range(tile.nq, unroll=1):
            src = cute.make_tensor(cute.recast_ptr(sX_base + j * self.gc * 64, rows.inner), rows.outer)
            dst = cute.local_tile(mX[None, None, tile.q0 + j, tile.b], (self.gc, d), (tile.head0 // self.gc, 0))
            tS, tG = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(src, 0, 2),
                                           cute.group_modes(dst, 0, 2))
            cute.copy(atom, tS, tG)
        cute.arch.cp_async_bulk_commit_group()
        cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def allocate(self, atoms: tuple):
        """(warp index, thread index, shared storage); warp 0 prefetches the TMA descriptors first."""
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == 0:
            for atom in atoms:
                cpasync.prefetch_descriptor(atom)
        return warp_idx, tidx, cutlass.utils.SmemAllocator().allocate(self.shared_storage)


@cute.jit
def fold_sink_row(row_max: Float32, row_sum: Float32, sink: Float32, scale_log2: Float32, lead):
    """The sink column (logit ``sink``, natural log, not scaled) joins one row's online-softmax statistics
    (``row_max`` in units of ``scale_log2``, ``row_sum`` relative to it); ``lead`` adds it (1) or not (0: a
    row's other lanes, which hold partial sums). A row without keys gets max = sink and sum = lead (out 0).
    Returns (max, sum, 1 if the row had no key else 0): the caller then sets lse = sink exactly, as
    finalize's (m * scale_log2 + log2 1) * ln 2 with m = sink * log2(e) / scale_log2 rounds three times."""
    sink_log2 = sink * LOG2_E
    empty = row_max == -Float32.inf
    extra = lead * cute.math.exp2(sink_log2 - (Float32(0.0) if empty else row_max) * scale_log2, fastmath=True)
    new_sum = lead if empty else row_sum + extra
    new_max = sink_log2 / scale_log2 if empty else row_max
    return new_max, new_sum, Int32(1) if empty else Int32(0)
