"""FlashFwdSm90: warp-specialised Hopper attention forward with fused block_logit.

    O[i]   = sum_t softmax_t(s_it) V[t],   s_it = softmax_scale * q_i . k_t   (or softcap * tanh(. / softcap))
    lse[i] = log sum_t exp(s_it)                                             (natural log, -inf: no key)
    block_logit[i, j] = max_{t in key block j, visible} s_it                 (-inf: no visible key)

over the keys t visible to row i (bottom-right causal / sliding window / seqlen; see
``common/tile_range.py``). Tensors and argument order: ``attention/config.py`` (``FwdArgs``).

Warp roles (128 * (num_wg + 1) threads, one CTA per (query tile of tile_m = 64 * num_wg rows, head, batch);
num_wg = 3 consumer warpgroups at head_dim <= 64 (tile 192 x 128, as FA4 b36 does there), else 2):

    warp 0        TMA producer: Q once, then K[n], V[n+1] per key tile (descending n), 2 stages
    warps 1-3     block_logit: -inf into the blocks of key tiles this query tile never visits
    WG 1..num_wg  consumers, 64 query rows each: S = Q K^T (wgmma, smem x smem), mask, softcap,
                  block_logit (its quad exchange and stores one key tile late, Note [deferred
                  block_logit stores]), online softmax, O += P V (P from registers); the QK^T of tile n is in
                  flight while the PV of tile n+1 runs and softmax of tile n follows
                  (intra-warpgroup overlap); the WGs take turns issuing wgmma (named barriers, round
                  robin: WG w waits on its barrier, issues, arrives on WG (w + 1) % num_wg's)

    load ──K,V (mbarrier pipelines)──▶ WG1/WG2 ──▶ O (staged in Q's buffer, one TMA store; Note [staged O
                                                     epilogue]), lse, block_logit (plain stores)

FlashMask (``cfg.startend``): the query tile's key-tile range is narrowed to the tiles its column
bounds do not skip (``fm_meta``; the producer and the consumers read the same range, so they walk the
same tiles) and each visited tile applies the column bounds per element unless its per-tile minima /
maxima leave it whole (``common/flashmask.py``); tiles skipped inside the range are masked entirely.

Not supported (``unsupported_reason``): other head dims, head_dim != head_dim_v except (192, 128),
pack_gqa, FlashMask with varlen.

Note [block_logit and bit-identity]: block maxima are taken from the masked (and softcapped) S
registers before exponentiation. The row max fed to the softmax is then the max of the block maxima,
which equals the direct row max exactly (fmax is exact), and the tiles do not depend on block_size, so
``out`` and ``lse`` are bitwise the same with and without block_logit. With one block per tile
(block_size >= tile_n) the block max is all-reduced across the row's lanes first and then combined with
the running max (``_RowReducedSoftmax``): the same set of values, so again the same max.

Note [block_logit in the key-tile loop]: the lane's row address, first owned block and validity are
resolved once per work tile (``bl.owner_position`` / ``bl.pin_row``); a key tile then costs the
quad reduce-scatter of its block maxima plus one compare, scale and predicated store per owned value
(with several blocks per tile done one key tile later, see the next Note).

Note [deferred block_logit stores] (several blocks per key tile, i.e. block_size < tile_n). Each lane
first reduces its own columns of every (row, block) in registers (``bl.partial_block_max``), and the
softmax takes the row max from those partial maxima. The quad exchange (reduce-scatter,
``bl.reduce_row_threads``) and the stores of a tile's block maxima do not run in its softmax step:
the partial maxima stay in registers (``bl_pending``) and ``block_logit_flush`` reduces and stores them
in the NEXT key-tile step, after that step has issued its QK^T and PV (the last tile's: after the final
PV is issued), so the shuffles and stores overlap the tensor cores instead of lengthening the softmax.
With one block per tile (block_size >= tile_n) the block max is the row's tile max and one all-reduce
serves both (``block_logit_step``). Doing the exchange inside the softmax step ("split") or sharing its
shuffles with the row-max all-reduce ("fused"), and storing from the producer warps via shared memory,
were measured slower on the H200 and removed (docs/benchmarks.md, SM90 forward history).

Note [document-relative block_logit] (``block_bos`` builds). Each row's block grid starts at its own
origin bos_r, so blocks do not follow the key tiles and no lane owns fixed blocks: per key tile every
thread splits its S entries of each row among the row's candidate blocks (blocks_per_tile + 1),
all-reduces them across the quad, and the quad's lane r stores row r's finished blocks at runtime block
ids; the block cut by the tile's lower edge is carried to the next tile (common/block_logit.py, the
document-relative section). The softmax reduces its own row maxima (no sharing with block_logit), the
deferred/early-reduce machinery above is off. Built and compile-checked only (no GPU run yet).

Note [scrubbed value tiles] (NaN / Inf in values a row cannot see; common/nonfinite.py). On a partially
masked key tile the PV MMA multiplies P = 0 by every value row, so a non-finite value a row cannot see would
reach it. Before the PV of a masked tile (``v_tile_masked``: the tiles of the consumers' masked runs, and
FlashMask tiles its bounds do not leave whole), outside any WG's wgmma turn, the consumers wait for the V
tile, the first SCRUB_THREADS of them zero its non-finite elements in shared memory and flag their keys
(one byte per key, one byte per scanning warp), fence the async proxy, and all consumer WGs meet on
SCRUB_BARRIER; the PV then reads the scrubbed tile. Where a warp found one (rare; the OR of the bytes is
CTA-uniform) ``poison_bits`` marks, from the tile's P still in tOrP, the output rows whose P is non-zero on a
flagged key, which the unscrubbed tile would have made non-finite, and they get NaN in acc_O before the PV.
Every piece of this rare path sits at the step top, where the fewest registers are live: after the PV or
kept across the step it spilled (16-88 B at 160 / 240 registers). Unmasked tiles are untouched (every row
sees every key there).
A first version scrubbed in one producer warp and cost 8-30 % (one warp's serial scan on the consumers'
critical path; H100, `bench/ab_trees.py`).
"""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, Uint32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from cute_kernels.common import block_logit as bl
from cute_kernels.common import flashmask as fm
from cute_kernels.common import nonfinite as nf
from cute_kernels.common.mask import apply_mask
from cute_kernels.common.seqlen import SeqlenInfo
from cute_kernels.common.softmax import OnlineSoftmax, softcap_logit
from cute_kernels.common.tile_range import TileRange, normalize_window
from cute_kernels.common.utils import (LOG2_E, acc_as_operand_a, acc_mn_view, convert_to_16bit,
                                       reread_tid_x, select_modes, sm90_thread0_cols, stage_acc_16bit,
                                       transpose_view, wgmma_gemm, wgmma_smem_layout)
from cute_kernels.dtypes import cutlass_dtype

from .config import FwdConfig

SMEM_BYTES_MAX = 232_448
THREADS_PER_WG = 128
# setmaxnreg split (producer WG, each consumer WG) by consumer-WG count: 128 * (p + num_wg * c) stays within
# the 65,536 registers of the SM (one CTA per SM).
REGS = {2: (24, 240), 3: (32, 160)}
# Named barrier ids (0 is __syncthreads): consumer WG w waits on WG_SCHEDULER_BARRIER + w; the consumers
# meet on O_STAGED_BARRIER before one thread TMA-stores the staged O tile (Note [staged O epilogue]).
WG_SCHEDULER_BARRIER = 1
# Note [scrubbed value tiles]: the consumers meet on SCRUB_BARRIER once a masked V tile is scrubbed; the first
# SCRUB_THREADS consumer threads (two WGs) scan it.
SCRUB_BARRIER = 5
SCRUB_THREADS = 256
O_STAGED_BARRIER = 4


def tile_shape(cfg: FwdConfig) -> tuple[int, int, int]:
    """(tile_m, tile_n, kv_stages). Independent of block_size so out/lse do not depend on it. tile_m 192
    (3 consumer WGs) at head_dim <= 64: measured 1.08-1.10x the 128-row tile on the H200
    (docs/benchmarks.md); the 160-register budget of 3 WGs holds a 64 x 128 tile's acc_O / acc_S / P at d 64
    only. Not with block_bos (Note [document-relative block_logit]): its per-row block grid spilled at 160
    registers (block_size 16, or a window), so d 64 takes the 128-row tile (240 registers) there."""
    if cfg.head_dim <= 64 and not cfg.block_bos:
        return 192, 128, 2
    if cfg.head_dim <= 128:
        return 128, 128, 2
    return 128, 64, 2


class _RowReducedSoftmax(OnlineSoftmax):
    """OnlineSoftmax fed row maxima already reduced across a row's lanes (block_logit with one block per
    tile): the max of {tile max, running max} is the same value whichever is reduced first."""

    def _row_reduce_max(self, v: Float32) -> Float32:
        return v


class FlashFwdSm90:
    def __init__(self, cfg: FwdConfig):
        reason = FlashFwdSm90.unsupported_reason(cfg)
        if reason is not None:
            raise ValueError(f"FlashFwdSm90: {reason}")
        self.cfg = cfg
        self.dtype = cutlass_dtype(cfg.dtype)
        self.tile_m, self.tile_n, self.kv_stages = tile_shape(cfg)
        # Note [deferred block_logit stores]: with several blocks per key tile.
        # (Not with block_bos: the document-relative path, Note [document-relative block_logit].)
        self.bl_deferred = (cfg.has_block_logit and not cfg.block_bos
                            and max(1, self.tile_n // cfg.block_size) > 1)
        self.hdim = cfg.head_dim
        self.hdimv = cfg.head_dim_v
        self.num_wg = self.tile_m // 64  # consumer warpgroups, 64 query rows each
        self.num_threads = THREADS_PER_WG * (self.num_wg + 1)
        self.producer_regs, self.consumer_regs = REGS[self.num_wg]
        assert self.producer_regs + self.num_wg * self.consumer_regs <= 512, "setmaxnreg over the register file"
        self.use_scheduler_barrier = cfg.head_dim <= 128
        self.bl_shape = (bl.BlockLogitShape(self.tile_n, cfg.block_size, rows_per_thread=2, threads_per_row=4)
                         if cfg.has_block_logit else None)
        self.bos_shape = (bl.RelativeBlockShape(self.tile_n, cfg.block_size, threads_per_row=4)
                          if cfg.block_bos else None)
        # 3 WGs (160 registers) with 8 blocks per key tile (block_size 16), or 4 (block_size 32) with a window:
        # keeping the partial maxima live across the next QK^T issue spills (16-20 B; 32 B, 8 B with softcap);
        # reduce-scatter them in the softmax step instead (only the stores stay deferred) and finish the PV
        # before it. Same values either way.
        self.bl_early_reduce = self.bl_deferred and self.num_wg == 3 and (
            self.bl_shape.blocks_per_tile >= 8 or (cfg.has_window and self.bl_shape.blocks_per_tile >= 4))
        # Note [thread coordinates at use]: at 160 registers (3 consumer WGs) the CUDA 13 ptxas spilled 12-24 B
        # in 13 d 64 configs (block_logit blocks of 16 with causal or a window; one causal softcap): values
        # derived from the thread index once (the lane's column in S, the lane bits of the block maxima's
        # reduce-scatter, the epilogue's rows and columns) stayed live through the key-tile loops or were
        # spilled there. They are computed again from a volatile %tid.x read (not merged with the first) where
        # they are used: the epilogue's and the masked tiles' always (no cost measured), the reduce-scatter's
        # lane bits (every key tile) only with a window or varlen, which spill without them (causal bl 16 runs
        # 0.95x with them and compiles clean without). 2 WGs (240 registers) keep the values computed once.
        self.reread_coords = self.num_wg == 3
        self.reread_lane = self.reread_coords and (cfg.varlen or cfg.has_window)
        # FlashMask: walk only the key tiles the column bounds do not skip (fm_meta's list), gaps inside the
        # range included. Not with block_logit, whose deferred / carried block maxima assume consecutive
        # tiles: there a skipped tile inside the range is computed fully masked.
        self.fm_gap_skip = cfg.has_startend and not cfg.has_block_logit
        # Note [scrubbed value tiles]: adjacent scan threads per V row.
        self.v_per_row = nf.threads_per_row(self.tile_n, self.hdimv, SCRUB_THREADS, self.dtype)

    # ------------------------------------------------------------------ host-side facts
    @staticmethod
    def unsupported_reason(cfg: FwdConfig) -> str | None:
        if cfg.arch != 90:
            return f"FlashFwdSm90 is the SM90 kernel, got arch {cfg.arch}"
        if cfg.dtype not in ("bfloat16", "float16"):
            return f"dtype {cfg.dtype} (only bfloat16/float16)"
        if cfg.head_dim not in (64, 96, 128, 192, 256):
            return f"head_dim {cfg.head_dim} (supported: 64, 96, 128, 192, 256)"
        if cfg.head_dim_v != cfg.head_dim and (cfg.head_dim, cfg.head_dim_v) != (192, 128):
            return (f"head_dim_v {cfg.head_dim_v} != head_dim {cfg.head_dim} on SM90 "
                    f"(only 192/128 has its own build)")
        if cfg.qhead_per_kvhead < 1:
            return f"qhead_per_kvhead {cfg.qhead_per_kvhead}"
        if cfg.has_block_logit:
            if cfg.block_size not in (16, 32, 64, 128, 256):
                return f"block_size {cfg.block_size} (supported: 16, 32, 64, 128, 256)"
        if cfg.has_startend and cfg.varlen:
            return "FlashMask startend_row_indices with varlen"
        if cfg.block_bos and (cfg.varlen or not cfg.has_block_logit):
            return "block_bos needs block_logit on a dense (not varlen) call"
        return None

    @staticmethod
    def smem_bytes(cfg: FwdConfig) -> int:
        tile_m, tile_n, stages = tile_shape(cfg)
        elem = 2
        q = tile_m * cfg.head_dim * elem
        k = tile_n * cfg.head_dim * elem * stages
        v = tile_n * cfg.head_dim_v * elem * stages
        barriers = 8 * (2 + 4 * stages)
        flags = 8 + (SCRUB_THREADS // 32) * stages + tile_n * stages  # Note [scrubbed value tiles]
        # Each buffer is 1024-byte aligned.
        return sum(-(-x // 1024) * 1024 for x in (q, k, v)) + 1024 + barriers + flags

    # ------------------------------------------------------------------ host launch
    def _smem_layout(self, rows: int, cols: int, stages: int | None):
        return wgmma_smem_layout(self.dtype, (rows, cols) if stages is None else (rows, cols, stages))

    def _shared_storage(self, sQ_layout, sK_layout, sV_layout):
        """The CTA's shared memory.

        Fields are given as a dict (this module uses postponed annotations, which cute.struct does
        not evaluate outside a @cute.jit body).
        """
        fields = {
            "mbar_q": cute.struct.MemRange[Int64, 2],
            "mbar_k": cute.struct.MemRange[Int64, 2 * self.kv_stages],
            "mbar_v": cute.struct.MemRange[Int64, 2 * self.kv_stages],
            "v_any": cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, SCRUB_THREADS // 32 * self.kv_stages], 8],
            "v_flags": cute.struct.MemRange[cutlass.Uint8, self.tile_n * self.kv_stages],
            "sQ": cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024],
            "sK": cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024],
            "sV": cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024],
        }
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, mBlockLogit, mCuSeqlensQ, mCuSeqlensK,
                 softmax_scale: Float32, softcap: Float32, window_left: Int32, window_right: Int32,
                 max_seqlen_q: Int32, stream, mStartend=None, mFmMinMax=None, mFmRanges=None, mBlockBos=None):
        """``mStartend``/``mFmMinMax``/``mFmRanges``: the FlashMask tensors (config.py) of a ``startend``
        build, else None; ``mBlockBos``: the row origins of a ``block_bos`` build, else None."""
        varlen = const_expr(mCuSeqlensQ is not None)
        # (B, S, H, D) -> (S, D, H, B); varlen (T, H, D) -> (T, D, H)
        order = (0, 2, 1) if const_expr(varlen) else (1, 3, 2, 0)
        mQt, mKt, mVt = [select_modes(t, order) for t in (mQ, mK, mV)]

        sQ_layout = self._smem_layout(self.tile_m, self.hdim, None)
        sK_layout = self._smem_layout(self.tile_n, self.hdim, self.kv_stages)
        sV_layout = self._smem_layout(self.tile_n, self.hdimv, self.kv_stages)

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(g2s, mQt, sQ_layout, (self.tile_m, self.hdim))
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(
            g2s, mKt, cute.select(sK_layout, mode=[0, 1]), (self.tile_n, self.hdim), 1)
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(
            g2s, mVt, cute.select(sV_layout, mode=[0, 1]), (self.tile_n, self.hdimv), 1)
        # Note [staged O epilogue]: O goes through Q's buffer and one TMA store (not with varlen: a box
        # would run into the next sequence's rows).
        tma_atom_O = None
        if const_expr(not varlen):
            sO_layout = self._smem_layout(self.tile_m, self.hdimv, None)
            tma_atom_O, mO = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(),
                                                         select_modes(mO, order), sO_layout,
                                                         (self.tile_m, self.hdimv))
        self.tx_bytes_q = cute.size_in_bytes(self.dtype, sQ_layout)
        self.tx_bytes_k = cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1]))
        self.tx_bytes_v = cute.size_in_bytes(self.dtype, cute.select(sV_layout, mode=[0, 1]))

        self.shared_storage = self._shared_storage(sQ_layout, sK_layout, sV_layout)

        if const_expr(varlen):
            batch = mCuSeqlensQ.shape[0] - 1
            num_heads = mQ.shape[1]
        else:
            batch = mQ.shape[0]
            num_heads = mQ.shape[2]
        grid = (cute.ceil_div(max_seqlen_q, self.tile_m), num_heads, batch)
        fm_head_div = Int32(1)
        if const_expr(self.cfg.has_startend):
            fm_head_div = num_heads // mStartend.shape[1]  # query heads per mask head
        self.kernel(tma_Q, tma_K, tma_V, mO, mLSE, mBlockLogit, mCuSeqlensQ, mCuSeqlensK,
                    tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O, sQ_layout, sK_layout, sV_layout,
                    softmax_scale, softcap, window_left, window_right,
                    mQt.shape[0], mKt.shape[0], mStartend, mFmMinMax, mFmRanges, fm_head_div, mBlockBos).launch(
            grid=grid, block=[self.num_threads, 1, 1], smem=self.shared_storage.size_in_bytes(),
            stream=stream, min_blocks_per_mp=1)

    # ------------------------------------------------------------------ device
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
               mLSE: cute.Tensor, mBlockLogit, mCuSeqlensQ, mCuSeqlensK,
               tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom,
               tma_atom_O, sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, softmax_scale: Float32, softcap: Float32,
               window_left: Int32, window_right: Int32, seqlen_q_static: Int32, seqlen_k_static: Int32,
               mStartend, mFmMinMax, mFmRanges, fm_head_div: Int32, mBlockBos):
        cfg = self.cfg
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == 0:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V):
                cpasync.prefetch_descriptor(atom)
            if const_expr(tma_atom_O is not None):
                cpasync.prefetch_descriptor(tma_atom_O)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_wg * THREADS_PER_WG // 32)
        pipeline_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=1, producer_group=producer,
            consumer_group=consumers, tx_count=self.tx_bytes_q, defer_sync=True)
        pipeline_k = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_k.data_ptr(), num_stages=self.kv_stages, producer_group=producer,
            consumer_group=consumers, tx_count=self.tx_bytes_k, defer_sync=True)
        pipeline_v = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_v.data_ptr(), num_stages=self.kv_stages, producer_group=producer,
            consumer_group=consumers, tx_count=self.tx_bytes_v, defer_sync=False)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        # (the flag tensors are made where they are used: made here they failed the IR's dominance check)
        scrub = SimpleNamespace(storage=storage)
        sO = None
        if const_expr(tma_atom_O is not None):
            sO_layout = self._smem_layout(self.tile_m, self.hdimv, None)
            sO = storage.sQ.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)

        # Work tile: causal/window tiles are launched heaviest (last query tile) first.
        bidx, head_idx, batch_idx = cute.arch.block_idx()
        m_tile = bidx
        if const_expr(cfg.causal):
            m_tile = cute.arch.grid_dim()[0] - 1 - bidx
        seqlen = SeqlenInfo.create(batch_idx, seqlen_q_static, seqlen_k_static, mCuSeqlensQ, mCuSeqlensK)
        m_start = m_tile * self.tile_m
        if m_start < seqlen.seqlen_q:
            left, right = normalize_window(window_left, window_right, seqlen.seqlen_q, seqlen.seqlen_k,
                                           cfg.causal, cfg.has_window)
            mask_right = const_expr(cfg.causal or cfg.has_window)
            tiles = TileRange.create(m_start, seqlen.seqlen_q, seqlen.seqlen_k, left, right,
                                     self.tile_m, self.tile_n, mask_right, cfg.has_window)
            fmask = None
            if const_expr(cfg.has_startend):
                # FlashMask: key tiles the column bounds skip for every row of this tile lie outside
                # [first, last + 1) (fm_meta.FmQueryRanges); tiles inside are classified one by one.
                fm_head = head_idx // fm_head_div
                rng = mFmRanges[batch_idx, fm_head, m_tile, None]
                tiles = fm.narrow_tile_range(tiles, rng[0], rng[1])
                fmask = SimpleNamespace(bounds=mStartend[batch_idx, fm_head, None, None],
                                        minmax=mFmMinMax[batch_idx, fm_head, None, None], m_start=m_start,
                                        m_end=cutlass.min(m_start + self.tile_m, seqlen.seqlen_q),
                                        row=rng, nt=mFmMinMax.shape[2])
            if warp_idx < 4:
                cute.arch.setmaxregister_decrease(self.producer_regs)
                if warp_idx == 0:
                    self.load(mQ, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V,
                              pipeline_q, pipeline_k, pipeline_v, seqlen, tiles, m_tile, head_idx, batch_idx, fmask)
                else:
                    if const_expr(cfg.has_block_logit):
                        self.fill_block_logit(mBlockLogit, seqlen, tiles, m_start, head_idx, batch_idx,
                                              tidx - 32, mBlockBos)
            else:
                cute.arch.setmaxregister_increase(self.consumer_regs)
                self.consume(mO, mLSE, mBlockLogit, sQ, sK, sV, pipeline_q, pipeline_k, pipeline_v,
                             seqlen, tiles, left, right, m_tile, head_idx, batch_idx, tidx - THREADS_PER_WG,
                             softmax_scale, softcap, tma_atom_O, sO, fmask, mBlockBos, scrub)

    # ------------------------------------------------------------------ producer
    def _batch_view(self, t: cute.Tensor, offset, batch_idx, varlen: bool):
        """(S, D, H[, B]) -> (S, D, H) of this sequence (varlen: shifted to its first row)."""
        if const_expr(varlen):
            return cute.domain_offset((offset, 0, 0), t)
        return t[None, None, None, batch_idx]

    @cute.jit
    def load(self, mQ, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V,
             pipeline_q, pipeline_k, pipeline_v, seqlen: SeqlenInfo, tiles: TileRange,
             m_tile: Int32, head_idx: Int32, batch_idx: Int32, fmask=None):
        cfg = self.cfg
        head_kv = head_idx // cfg.qhead_per_kvhead
        mQ_cur = self._batch_view(mQ, seqlen.offset_q, batch_idx, cfg.varlen)[None, None, head_idx]
        mK_cur = self._batch_view(mK, seqlen.offset_k, batch_idx, cfg.varlen)[None, None, head_kv]
        mV_cur = self._batch_view(mV, seqlen.offset_k, batch_idx, cfg.varlen)[None, None, head_kv]
        gQ = cute.local_tile(mQ_cur, (self.tile_m, self.hdim), (m_tile, 0))  # (tile_m, D)
        gK = cute.local_tile(mK_cur, (self.tile_n, self.hdim), (None, 0))  # (tile_n, D, n_tiles)
        gV = cute.local_tile(mV_cur, (self.tile_n, self.hdimv), (None, 0))  # (tile_n, Dv, n_tiles)
        tQsQ, tQgQ = cpasync.tma_partition(tma_atom_Q, 0, cute.make_layout(1),
                                           cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
        tKsK, tKgK = cpasync.tma_partition(tma_atom_K, 0, cute.make_layout(1),
                                           cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_atom_V, 0, cute.make_layout(1),
                                           cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))

        if const_expr(self.fm_gap_skip):
            self.load_fm(tKgK, tKsK, tVgV, tVsV, tQgQ, tQsQ, tma_atom_Q, tma_atom_K, tma_atom_V, pipeline_q,
                         pipeline_k, pipeline_v, tiles, fmask)
        elif tiles.n_min < tiles.n_max:
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.kv_stages)
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            # 1. K of the first (highest) tile, then Q.
            n_tile = tiles.n_max - 1
            pipeline_k.producer_acquire(kv_state)
            cute.copy(tma_atom_K, tKgK[None, n_tile], tKsK[None, kv_state.index],
                      tma_bar_ptr=pipeline_k.producer_get_barrier(kv_state))
            pipeline_q.producer_acquire(q_state)
            cute.copy(tma_atom_Q, tQgQ, tQsQ, tma_bar_ptr=pipeline_q.producer_get_barrier(q_state))
            # 2. K[n - 1] with V[n]: the consumers run QK^T of tile n-1 next to PV of tile n.
            for i in cutlass.range(tiles.n_max - 1 - tiles.n_min, unroll=1):
                n_prev = tiles.n_max - 1 - i
                prev_state = kv_state.clone()
                kv_state.advance()
                pipeline_k.producer_acquire(kv_state)
                cute.copy(tma_atom_K, tKgK[None, n_prev - 1], tKsK[None, kv_state.index],
                          tma_bar_ptr=pipeline_k.producer_get_barrier(kv_state))
                pipeline_v.producer_acquire(prev_state)
                cute.copy(tma_atom_V, tVgV[None, n_prev], tVsV[None, prev_state.index],
                          tma_bar_ptr=pipeline_v.producer_get_barrier(prev_state))
            # 3. V of the last (lowest) tile.
            pipeline_v.producer_acquire(kv_state)
            cute.copy(tma_atom_V, tVgV[None, tiles.n_min], tVsV[None, kv_state.index],
                      tma_bar_ptr=pipeline_v.producer_get_barrier(kv_state))

    def fm_prefix(self, fmask, n: Int32) -> Int32:
        """FlashMask: how many of the query tile's live key tiles lie below tile ``n`` (fm_meta)."""
        return fmask.row[2 + n]

    def fm_live(self, fmask, p: Int32) -> Int32:
        """FlashMask: the query tile's ``p``-th live key tile, ascending (fm_meta)."""
        return fmask.row[3 + fmask.nt + p]

    @cute.jit
    def load_fm(self, tKgK, tKsK, tVgV, tVsV, tQgQ, tQsQ, tma_atom_Q, tma_atom_K, tma_atom_V, pipeline_q,
                pipeline_k, pipeline_v, tiles: TileRange, fmask):
        """``load`` over the live key tiles of [n_min, n_max) only (``fm_gap_skip``), in the consumers' order."""
        p_lo = self.fm_prefix(fmask, tiles.n_min)
        p_hi = self.fm_prefix(fmask, tiles.n_max)
        if p_lo < p_hi:
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.kv_stages)
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            pipeline_k.producer_acquire(kv_state)
            cute.copy(tma_atom_K, tKgK[None, self.fm_live(fmask, p_hi - 1)], tKsK[None, kv_state.index],
                      tma_bar_ptr=pipeline_k.producer_get_barrier(kv_state))
            pipeline_q.producer_acquire(q_state)
            cute.copy(tma_atom_Q, tQgQ, tQsQ, tma_bar_ptr=pipeline_q.producer_get_barrier(q_state))
            for i in cutlass.range(p_hi - 1 - p_lo, unroll=1):
                p = p_hi - 1 - i
                prev_state = kv_state.clone()
                kv_state.advance()
                pipeline_k.producer_acquire(kv_state)
                cute.copy(tma_atom_K, tKgK[None, self.fm_live(fmask, p - 1)], tKsK[None, kv_state.index],
                          tma_bar_ptr=pipeline_k.producer_get_barrier(kv_state))
                pipeline_v.producer_acquire(prev_state)
                cute.copy(tma_atom_V, tVgV[None, self.fm_live(fmask, p)], tVsV[None, prev_state.index],
                          tma_bar_ptr=pipeline_v.producer_get_barrier(prev_state))
            pipeline_v.producer_acquire(kv_state)
            cute.copy(tma_atom_V, tVgV[None, self.fm_live(fmask, p_lo)], tVsV[None, kv_state.index],
                      tma_bar_ptr=pipeline_v.producer_get_barrier(kv_state))

    @cute.jit
    def v_tile_masked(self, n_tile: Int32, seqlen: SeqlenInfo, tiles: TileRange, fmask):
        """Whether some row of this query tile cannot see some key of tile ``n_tile``: the consumers' masked
        runs (cut by the right bound, by the window's left bound, the seqlen tail) or a FlashMask tile its
        bounds do not leave whole. Exactly the tiles where a P = 0 meets the tile's values."""
        masked = n_tile >= tiles.n_right_mask or (n_tile + 1) * self.tile_n > seqlen.seqlen_k
        if const_expr(self.cfg.has_window):
            masked = masked or n_tile < tiles.n_left_mask
        if const_expr(self.cfg.has_startend):
            lo, hi = fm.load_tile_minmax(fmask.minmax, n_tile, self.cfg.startend)
            _skip, whole = fm.classify_tile(fmask.m_start, fmask.m_end, lo, hi, self.cfg.startend)
            masked = masked or not whole
        return masked

    def _block_logit_rows(self, mBlockLogit, seqlen: SeqlenInfo, head_idx, batch_idx):
        """(Sq, nb) view of this (batch, head)'s block_logit rows (varlen: shifted to the sequence)."""
        if const_expr(self.cfg.varlen):
            return cute.domain_offset((0, seqlen.offset_q, 0), mBlockLogit)[head_idx, None, None]
        return mBlockLogit[batch_idx, head_idx, None, None]

    @cute.jit
    def fill_block_logit(self, mBlockLogit, seqlen: SeqlenInfo, tiles: TileRange, m_start: Int32,
                         head_idx: Int32, batch_idx: Int32, thread: Int32, mBlockBos=None):
        """Warps 1-3: -inf into the blocks of key tiles this query tile never visits (block_bos: the
        relative blocks that meet no visited key, a per-row range)."""
        mRows = self._block_logit_rows(mBlockLogit, seqlen, head_idx, batch_idx)
        gRows = cute.domain_offset((m_start, 0), mRows)
        nb = mRows.shape[1]
        num_rows = cutlass.min(seqlen.seqlen_q - m_start, self.tile_m)
        if const_expr(self.cfg.block_bos):
            gBos = cute.domain_offset((m_start,), mBlockBos[batch_idx, None])
            bl.fill_unvisited_relative(gRows, gBos, num_rows, nb, tiles.n_min * self.tile_n,
                                       tiles.n_max * self.tile_n, self.cfg.block_size, thread, 3 * 32)
        else:
            lo, hi = bl.visited_block_range(self.bl_shape, tiles.n_min, tiles.n_max)
            bl.fill_unvisited(gRows, num_rows, nb, lo, hi, thread, 3 * 32)

    # ------------------------------------------------------------------ consumers
    @cute.jit
    def gemm(self, tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor,
             zero_init: cutlass.Constexpr, wait: cutlass.Constexpr):
        wgmma_gemm(tiled_mma, acc, tCrA, tCrB, zero_init)
        if const_expr(wait >= 0):
            warpgroup.wait_group(wait)

    def scheduler_sync(self, wg: Int32):
        if const_expr(self.use_scheduler_barrier):
            cute.arch.barrier(barrier_id=WG_SCHEDULER_BARRIER + wg, number_of_threads=2 * THREADS_PER_WG)

    def scheduler_arrive(self, wg: Int32):
        """Hand the wgmma turn to the next WG (round robin over num_wg)."""
        if const_expr(self.use_scheduler_barrier):
            next_wg = 1 - wg if const_expr(self.num_wg == 2) else (wg + 1) % self.num_wg
            cute.arch.barrier_arrive(barrier_id=WG_SCHEDULER_BARRIER + next_wg,
                                     number_of_threads=2 * THREADS_PER_WG)

    @cute.jit
    def consume(self, mO, mLSE, mBlockLogit, sQ, sK, sV, pipeline_q, pipeline_k, pipeline_v,
                seqlen: SeqlenInfo, tiles: TileRange, left: Int32, right: Int32, m_tile: Int32,
                head_idx: Int32, batch_idx: Int32, ctidx: Int32, softmax_scale: Float32, softcap: Float32,
                tma_atom_O, sO, fmask=None, mBlockBos=None, scrub=None):
        cfg = self.cfg
        wg = cute.arch.make_warp_uniform(ctidx // THREADS_PER_WG)
        lane = ctidx % 32
        if const_expr(self.use_scheduler_barrier):
            # WG 1 issues first: pre-arrive on its own scheduler barrier (the other half comes from the last WG).
            if wg == 0:
                cute.arch.barrier_arrive(barrier_id=WG_SCHEDULER_BARRIER, number_of_threads=2 * THREADS_PER_WG)
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, Float32,
            atom_layout_mnk=(self.tile_m // 64, 1, 1), tiler_mn=(64, self.tile_n))
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN, Float32,
            atom_layout_mnk=(self.tile_m // 64, 1, 1), tiler_mn=(64, self.hdimv),
            a_source=warpgroup.OperandSource.RMEM)
        thr_mma_qk = tiled_mma_qk.get_slice(ctidx)
        thr_mma_pv = tiled_mma_pv.get_slice(ctidx)
        wg_mma_qk = tiled_mma_qk.get_slice(wg * THREADS_PER_WG)
        wg_mma_pv = tiled_mma_pv.get_slice(wg * THREADS_PER_WG)
        sVt = transpose_view(sV)
        tSrQ = wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ))
        tSrK = wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK))  # (.., .., k, stage)
        tOrVt = wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(sVt))  # (.., .., k, stage)
        tOrP = wg_mma_pv.make_fragment_A(wg_mma_pv.partition_shape_A((self.tile_m, self.tile_n)))
        acc_S_shape = wg_mma_qk.partition_shape_C((self.tile_m, self.tile_n))
        acc_O = cute.make_rmem_tensor(wg_mma_pv.partition_shape_C((self.tile_m, self.hdimv)), Float32)
        acc_O_mn = acc_mn_view(acc_O)

        # Rows (sequence-relative) and column offset of this thread's S fragment.
        cS = cute.make_identity_tensor((self.tile_m, self.tile_n))
        tScS_mn = acc_mn_view(thr_mma_qk.partition_C(cS))
        m_start = m_tile * self.tile_m
        rows = [m_start + tScS_mn[r, 0][0] for r in range(2)]
        thr_col = self._thr_col(tiled_mma_qk, ctidx)
        cols = sm90_thread0_cols(self.tile_n)
        shift = seqlen.seqlen_k - seqlen.seqlen_q

        if const_expr(cfg.has_softcap):
            scale_log2 = Float32(LOG2_E)
            softcap_in = softmax_scale / softcap
            bl_scale = None
        else:
            scale_log2 = softmax_scale * LOG2_E
            softcap_in = Float32(0.0)
            bl_scale = softmax_scale
        # block_size >= tile_n: block_logit's all-reduced block max is the row max (see block_logit_step).
        softmax_cls = (_RowReducedSoftmax if cfg.has_block_logit and not cfg.block_bos
                       and self.bl_shape.blocks_per_tile == 1 else OnlineSoftmax)
        softmax = softmax_cls(scale_log2, 2, 4)
        softmax.reset()
        acc_O.fill(0.0)

        # block_logit: where this lane's finished block maxima go, resolved once for all key tiles
        # (row view shifted to the lane's first owned block, and how many entries it may write).
        bl_addr = Int64(0)
        bl_layout = None
        bl_limit = Int32(0)
        bl_row_sel = Int32(0)
        carry = None
        bos_ctx = None
        if const_expr(cfg.block_bos):
            # Note [document-relative block_logit]: the thread keeps both rows' origins; lanes 0 and 1 of
            # a quad store rows 0 and 1 (lanes 2 and 3 nothing: store limit 0) through a row address
            # pinned here, with that row's carried unfinished block (common/block_logit.py).
            bl_rows = self._block_logit_rows(mBlockLogit, seqlen, head_idx, batch_idx)
            bos_ctx = SimpleNamespace(bos=[])
            for r in cutlass.range_constexpr(2):
                bos_r = Int32(0)
                if rows[r] < seqlen.seqlen_q:
                    bos_r = mBlockBos[batch_idx, rows[r]]
                bos_ctx.bos.append(bos_r)
            st_row = rows[0] if lane % 2 == 0 else rows[1]
            bos_ctx.limit = Int32(0)
            if lane % 4 < 2 and st_row < seqlen.seqlen_q:
                bos_ctx.limit = bl_rows.shape[1]
            st_view = bl_rows[cutlass.min(st_row, seqlen.seqlen_q - 1), None]
            bos_ctx.addr = bl.pin_row(st_view)
            bos_ctx.layout = st_view.layout
            bos_ctx.carry_val = cute.make_rmem_tensor((1,), Float32)
            bos_ctx.carry_val.fill(-Float32.inf)
            bos_ctx.carry_id = cute.make_rmem_tensor((1,), Int32)
            bos_ctx.carry_id.fill(-1)
        elif const_expr(cfg.has_block_logit):
            bl_rows = self._block_logit_rows(mBlockLogit, seqlen, head_idx, batch_idx)
            row_sel, first_block, is_owner = bl.owner_position(self.bl_shape, lane)
            bl_row_sel = row_sel
            bl_row = rows[0] if row_sel == 0 else rows[1]
            bl_own = cute.domain_offset((first_block,), bl_rows[bl_row, None])
            bl_addr = bl.pin_row(bl_own)
            bl_layout = bl_own.layout
            if is_owner and bl_row < seqlen.seqlen_q:
                bl_limit = bl_rows.shape[1] - first_block
            carry = cute.make_rmem_tensor((self.bl_shape.owned,), Float32)
            carry.fill(-Float32.inf)

        ctx = SimpleNamespace(rows=rows, thr_col=thr_col, tiled_mma_qk=tiled_mma_qk, cols=cols, shift=shift,
                              left=left, right=right, seqlen=seqlen, tiles=tiles, lane=lane, bl_addr=bl_addr,
                              bl_layout=bl_layout, bl_limit=bl_limit, bl_row_sel=bl_row_sel, carry=carry,
                              bl_scale=bl_scale, softcap=softcap, softcap_in=softcap_in, softmax=softmax,
                              fmask=fmask, bos=bos_ctx, scrub=scrub, sV=sV, ctidx=ctidx)
        if const_expr(self.bl_early_reduce):
            ctx.bl_pending = cute.make_rmem_tensor((self.bl_shape.owned,), Float32)
        elif const_expr(self.bl_deferred):
            ctx.bl_pending = cute.make_rmem_tensor((2, self.bl_shape.blocks_per_tile), Float32)

        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stages)
        if const_expr(self.fm_gap_skip):
            self.consume_fm(ctx, tiles, kv_state, tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt, tOrP, acc_O_mn,
                            acc_O, acc_S_shape, pipeline_q, pipeline_k, pipeline_v, wg)
        else:
            if tiles.n_min < tiles.n_max:
                q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
                pipeline_q.consumer_wait(q_state)
                # 1. First tile (highest n): QK^T alone, full mask (seqlen tail + causal/window).
                n_tile = tiles.n_max - 1
                fm_whole = self.fm_tile_whole(ctx, n_tile)
                acc_S = cute.make_rmem_tensor(acc_S_shape, Float32)
                pipeline_k.consumer_wait(kv_state)
                self.gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv_state.index], True, 0)
                pipeline_k.consumer_release(kv_state)
                self.process_scores(ctx, acc_S, n_tile, True, True, True, fm_whole)
                vm = self.v_tile_masked(n_tile, seqlen, tiles, fmask)
                convert_to_16bit(acc_as_operand_a(acc_S), tOrP)
                # 2. Remaining tiles, descending; masked where causal/window cut through them.
                n_hi = n_tile
                n_lo_a = cutlass.max(tiles.n_right_mask, tiles.n_min)
                for i in cutlass.range(n_hi - n_lo_a, unroll=1):
                    kv_state, vm = self.overlap_step(n_hi - 1 - i, True, kv_state, tiled_mma_qk, tiled_mma_pv,
                                                 tSrQ, tSrK, tOrVt, tOrP, acc_O_mn, acc_O, acc_S_shape,
                                                 pipeline_k, pipeline_v, wg, ctx,
                                                 vm)
                n_hi = cutlass.min(n_hi, n_lo_a)
                n_lo_b = cutlass.min(cutlass.max(tiles.n_left_mask, tiles.n_min), n_hi)
                for i in cutlass.range(n_hi - n_lo_b, unroll=1):
                    kv_state, vm = self.overlap_step(n_hi - 1 - i, False, kv_state, tiled_mma_qk, tiled_mma_pv,
                                                 tSrQ, tSrK, tOrVt, tOrP, acc_O_mn, acc_O, acc_S_shape,
                                                 pipeline_k, pipeline_v, wg, ctx,
                                                 vm)
                n_hi = n_lo_b
                if const_expr(cfg.has_window):
                    for i in cutlass.range(n_hi - tiles.n_min, unroll=1):
                        kv_state, vm = self.overlap_step(n_hi - 1 - i, True, kv_state, tiled_mma_qk, tiled_mma_pv,
                                                     tSrQ, tSrK, tOrVt, tOrP, acc_O_mn, acc_O, acc_S_shape,
                                                     pipeline_k, pipeline_v, wg, ctx,
                                                     vm)
                pipeline_q.consumer_release(q_state)
                # 3. PV of the last tile (deferred block_logit: the last tile's block maxima meanwhile).
                self.scrub_v_tile(ctx, pipeline_v, kv_state, vm, tOrP, acc_O_mn)
                pipeline_v.consumer_wait(kv_state)
                self.gemm(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, kv_state.index], False, -1)
                if const_expr(self.bl_deferred):
                    self.block_logit_flush(ctx, tiles.n_min)
                warpgroup.wait_group(0)
                pipeline_v.consumer_release(kv_state)

        # 4. Epilogue: O /= l, lse; rows past seqlen_q are not written.
        row_scale, lse = softmax.finalize()
        softmax.rescale(acc_O_mn, row_scale)
        self.epilogue(acc_O, lse, mO, mLSE, seqlen, tiled_mma_pv, thr_mma_pv, m_tile, head_idx, batch_idx,
                      ctidx, tma_atom_O, sO)

    @cute.jit
    def consume_fm(self, ctx, tiles: TileRange, kv_state, tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt, tOrP,
                   acc_O_mn, acc_O, acc_S_shape, pipeline_q, pipeline_k, pipeline_v, wg: Int32):
        """The key-tile loop of ``consume`` over the live tiles only (``fm_gap_skip``; no block_logit): the
        same three masked / unmasked / masked runs of tiles, each walked through fm_meta's list."""
        cfg = self.cfg
        fmask = ctx.fmask
        p_lo = self.fm_prefix(fmask, tiles.n_min)
        p_hi = self.fm_prefix(fmask, tiles.n_max)
        if p_lo < p_hi:
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            pipeline_q.consumer_wait(q_state)
            # 1. First (highest live) tile: QK^T alone, full mask.
            n_first = self.fm_live(fmask, p_hi - 1)
            fm_whole = self.fm_tile_whole(ctx, n_first)
            acc_S = cute.make_rmem_tensor(acc_S_shape, Float32)
            pipeline_k.consumer_wait(kv_state)
            self.gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv_state.index], True, 0)
            pipeline_k.consumer_release(kv_state)
            self.process_scores(ctx, acc_S, n_first, True, True, True, fm_whole)
            vm = self.v_tile_masked(n_first, ctx.seqlen, tiles, fmask)
            convert_to_16bit(acc_as_operand_a(acc_S), tOrP)
            # 2. The live tiles below it, descending: [n_right_mask, n_first) masked, then unmasked, then the
            #    window's left run masked (positions in the list: prefix counts).
            n_hi = n_first
            n_lo_a = cutlass.max(tiles.n_right_mask, tiles.n_min)
            p_top = p_hi - 1
            p_a = cutlass.min(self.fm_prefix(fmask, cutlass.min(n_lo_a, n_hi)), p_top)
            for i in cutlass.range(p_top - p_a, unroll=1):
                kv_state, vm = self.overlap_step(self.fm_live(fmask, p_top - 1 - i), True, kv_state, tiled_mma_qk,
                                             tiled_mma_pv, tSrQ, tSrK, tOrVt, tOrP, acc_O_mn, acc_O, acc_S_shape,
                                             pipeline_k, pipeline_v, wg, ctx,
                                             vm)
            n_hi = cutlass.min(n_hi, n_lo_a)
            n_lo_b = cutlass.min(cutlass.max(tiles.n_left_mask, tiles.n_min), n_hi)
            p_b = self.fm_prefix(fmask, n_lo_b)
            for i in cutlass.range(p_a - p_b, unroll=1):
                kv_state, vm = self.overlap_step(self.fm_live(fmask, p_a - 1 - i), False, kv_state, tiled_mma_qk,
                                             tiled_mma_pv, tSrQ, tSrK, tOrVt, tOrP, acc_O_mn, acc_O, acc_S_shape,
                                             pipeline_k, pipeline_v, wg, ctx,
                                             vm)
            if const_expr(cfg.has_window):
                for i in cutlass.range(p_b - p_lo, unroll=1):
                    kv_state, vm = self.overlap_step(self.fm_live(fmask, p_b - 1 - i), True, kv_state, tiled_mma_qk,
                                                 tiled_mma_pv, tSrQ, tSrK, tOrVt, tOrP, acc_O_mn, acc_O,
                                                 acc_S_shape, pipeline_k, pipeline_v, wg, ctx,
                                                 vm)
            pipeline_q.consumer_release(q_state)
            # 3. PV of the last tile.
            self.scrub_v_tile(ctx, pipeline_v, kv_state, vm, tOrP, acc_O_mn)
            pipeline_v.consumer_wait(kv_state)
            self.gemm(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, kv_state.index], False, -1)
            warpgroup.wait_group(0)
            pipeline_v.consumer_release(kv_state)

    def scrub_flags(self, scrub):
        """Note [scrubbed value tiles]: (per-warp "found" bytes [warp, stage], per-key flags [key, stage]) in
        shared memory, made where used (made once in ``kernel`` they failed the IR's dominance check)."""
        return (scrub.storage.v_any.get_tensor(cute.make_layout((SCRUB_THREADS // 32, self.kv_stages))),
                scrub.storage.v_flags.get_tensor(cute.make_layout((self.tile_n, self.kv_stages))))

    @cute.jit
    def scrub_v_tile(self, ctx, pipeline_v, v_state, v_masked, tOrP, acc_O_mn):
        """Note [scrubbed value tiles]: if the V tile of stage ``v_state`` is masked for some row (``v_masked``),
        wait for it, zero its non-finite values and flag their keys (the first SCRUB_THREADS consumer threads),
        and meet the other consumers on SCRUB_BARRIER. Then the rows ``poison_bits`` names get NaN in acc_O now,
        before the PV adds the tile (no wgmma is in flight here): kept in a register until the step's O rescale
        they spilled at 240 registers (d 192)."""
        if v_masked:
            pipeline_v.consumer_wait(v_state)
            words, flags = self.scrub_flags(ctx.scrub)
            ctidx = ctx.ctidx
            if const_expr(self.reread_coords):
                ctidx = reread_tid_x() - THREADS_PER_WG
            if ctidx < SCRUB_THREADS:  # whole warps
                found = nf.scrub_rows(ctx.sV[None, None, v_state.index], flags[None, v_state.index], ctidx,
                                      SCRUB_THREADS, self.v_per_row)
                cute.arch.fence_view_async_shared()
                ballot = cute.arch.vote_ballot_sync(found != 0)
                if ctidx % 32 == 0:
                    words[ctidx // 32, v_state.index] = cutlass.Uint8(1) if ballot != 0 else cutlass.Uint8(0)
            cute.arch.barrier(barrier_id=SCRUB_BARRIER, number_of_threads=self.num_wg * THREADS_PER_WG)
            bits = self.poison_bits(ctx, v_state, tOrP)
            if bits != 0:
                nf.poison_acc(acc_O_mn, bits)

    @cute.jit
    def poison_bits(self, ctx, v_state, tOrP) -> Int32:
        """The rows (bit r) whose P was non-zero on a key the scrub of stage ``v_state`` flagged
        (from its 16-bit P, still in tOrP), which the unscrubbed tile would make non-finite in the PV; 0 when no warp
        found one (the common case: one test of the scanning warps' bytes)."""
        words, flags = self.scrub_flags(ctx.scrub)
        # one byte per scanning warp, read as words
        w32 = cute.recast_tensor(words, Uint32)
        per = SCRUB_THREADS // 32 // 4
        found = Uint32(0)
        for w in cutlass.range_constexpr(per):
            found = found | w32[per * v_state.index + w]
        bits = Int32(0)
        if found != 0:
            # tOrP still holds this tile's P: the PV that reads it comes next in the step
            vis = nf.visible_bits_sm90(tOrP)
            flagged = nf.flag_bits_sm90(flags[None, v_state.index], (reread_tid_x() - THREADS_PER_WG) % 32,
                                        self.tile_n)
            bits = nf.row_poison_bits(vis, flagged, 4)
        return bits

    def _thr_col(self, tiled_mma_qk, ctidx: Int32) -> Int32:
        """Column (within a key tile) of consumer thread ``ctidx``'s first S fragment entry."""
        cS = cute.make_identity_tensor((self.tile_m, self.tile_n))
        return acc_mn_view(tiled_mma_qk.get_slice(ctidx).partition_C(cS))[0, 0][1]

    def _lane(self, ctx) -> Int32:
        """This thread's lane, read again at the use with ``reread_lane`` (Note [thread coordinates at use])."""
        return reread_tid_x() % 32 if const_expr(self.reread_lane) else ctx.lane

    @cute.jit
    def overlap_step(self, n_tile: Int32, masked: cutlass.Constexpr, kv_state, tiled_mma_qk, tiled_mma_pv,
                     tSrQ, tSrK, tOrVt, tOrP, acc_O_mn, acc_O, acc_S_shape, pipeline_k, pipeline_v,
                     wg: Int32, ctx, v_masked):
        """QK^T of tile n in flight with PV of the previous tile (n + 1, or the previous live tile of FlashMask's
        list; ``v_masked``: whether some row cannot see some of its keys, as its step returned); then softmax of
        tile n and O rescale. Returns the pipeline state and whether tile n is masked for some row."""
        v_state = kv_state.clone()
        kv_state.advance()
        # Note [scrubbed value tiles]: before this WG takes its wgmma turn (the consumers meet on a barrier).
        self.scrub_v_tile(ctx, pipeline_v, v_state, v_masked, tOrP, acc_O_mn)
        fm_whole = self.fm_tile_whole(ctx, n_tile)
        acc_S = cute.make_rmem_tensor(acc_S_shape, Float32)
        pipeline_k.consumer_wait(kv_state)
        self.scheduler_sync(wg)
        self.gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv_state.index], True, -1)
        pipeline_v.consumer_wait(v_state)
        self.gemm(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, v_state.index], False, -1)
        self.scheduler_arrive(wg)
        if const_expr(self.bl_deferred):
            self.block_logit_flush(ctx, n_tile + 1)
        warpgroup.wait_group(0 if const_expr(self.bl_early_reduce) else 1)
        pipeline_k.consumer_release(kv_state)
        row_scale = self.process_scores(ctx, acc_S, n_tile, False, False, masked, fm_whole)
        s_masked = cutlass.Boolean(masked)
        if const_expr(self.cfg.has_startend and not masked):
            s_masked = cutlass.Boolean(True) if fm_whole == False else cutlass.Boolean(False)  # noqa: E712
        warpgroup.wait_group(0)
        # P to 16 bits first: acc_S is dead before the O rescale
        convert_to_16bit(acc_as_operand_a(acc_S), tOrP)
        pipeline_v.consumer_release(v_state)
        ctx.softmax.rescale(acc_O_mn, row_scale)
        return kv_state, s_masked

    @cute.jit
    def process_scores(self, ctx, acc_S: cute.Tensor, n_tile: Int32, is_first: cutlass.Constexpr,
                       mask_seqlen: cutlass.Constexpr, masked: cutlass.Constexpr, fm_whole=True) -> cute.Tensor:
        """softcap, mask, block_logit, online softmax of one S tile -> P in acc_S; returns the O rescale."""
        cfg = self.cfg
        acc_S_mn = acc_mn_view(acc_S)
        if const_expr(cfg.has_softcap):
            for i in cutlass.range_constexpr(cute.size(acc_S)):
                acc_S[i] = softcap_logit(acc_S[i], ctx.softcap_in, ctx.softcap)
        if const_expr(masked):
            thr_col = ctx.thr_col
            if const_expr(self.reread_coords):
                thr_col = self._thr_col(ctx.tiled_mma_qk, reread_tid_x() - THREADS_PER_WG)
            apply_mask(acc_S_mn, ctx.cols, ctx.rows, thr_col + n_tile * self.tile_n, ctx.seqlen.seqlen_k,
                       ctx.shift, ctx.left, ctx.right, mask_seqlen, cfg.causal or cfg.has_window,
                       cfg.has_window)
        if const_expr(cfg.has_startend):
            # FlashMask: the element mask only on tiles the per-tile bounds do not leave whole (a tile
            # the bounds skip inside the visited range, with block_logit, is masked entirely here).
            # ``fm_whole`` was classified before the tile's GEMMs were waited for (fm_tile_whole).
            if not fm_whole:
                self.startend_mask(ctx, acc_S_mn, n_tile)
        local_max = None
        if const_expr(cfg.block_bos):
            self.block_logit_relative_step(ctx, acc_S_mn, n_tile)
        elif const_expr(cfg.has_block_logit):
            if const_expr(self.bl_deferred):
                # Keep this tile's partial block maxima; block_logit_flush finishes them while the
                # next tile's QK^T runs (or after the loop for the last tile).
                blk = bl.partial_block_max(self.bl_shape, acc_S_mn, ctx.cols)
                local_max = [bl.row_max_from_blocks(self.bl_shape, blk, r) for r in range(2)]
                if const_expr(self.bl_early_reduce):
                    ctx.bl_pending.store(bl.reduce_row_threads(self.bl_shape, blk, self._lane(ctx)).load())
                else:
                    ctx.bl_pending.store(blk.load())
            else:
                local_max = self.block_logit_step(acc_S_mn, ctx.cols, n_tile, ctx.tiles.n_min,
                                                  bl.row_at(ctx.bl_addr, ctx.bl_layout), ctx.bl_limit,
                                                  ctx.bl_row_sel, ctx.carry, ctx.bl_scale)
        return ctx.softmax.update(acc_S_mn, is_first, local_max)

    @cute.jit
    def fm_tile_whole(self, ctx, n_tile: Int32):
        """FlashMask: whether key tile ``n_tile``'s bound min / max leave this query tile whole (no element
        mask). Called before the tile's scores are waited for, so the loads overlap the GEMMs instead of
        lengthening the softmax. True without a mask."""
        whole = True
        if const_expr(self.cfg.has_startend):
            fmask = ctx.fmask
            lo, hi = fm.load_tile_minmax(fmask.minmax, n_tile, self.cfg.startend)
            _skip, whole = fm.classify_tile(fmask.m_start, fmask.m_end, lo, hi, self.cfg.startend)
        return whole

    @cute.jit
    def startend_mask(self, ctx, acc_S_mn: cute.Tensor, n_tile: Int32):
        """The FlashMask element mask of key tile ``n_tile`` (common/flashmask.apply_startend_mask)."""
        fm_col = ctx.thr_col
        if const_expr(self.reread_coords):
            fm_col = self._thr_col(ctx.tiled_mma_qk, reread_tid_x() - THREADS_PER_WG)
        fm.apply_startend_mask(acc_S_mn, ctx.cols, ctx.rows, fm_col + n_tile * self.tile_n, ctx.fmask.bounds,
                               ctx.seqlen.seqlen_k, self.cfg.startend)

    @cute.jit
    def block_logit_step(self, acc_S_mn, cols: cutlass.Constexpr, n_tile: Int32, n_tile_min: Int32,
                         bl_own: cute.Tensor, bl_limit: Int32, row_sel: Int32, carry, scale):
        """One block per key tile (block_size >= tile_n): block maxima of this S tile -> plain stores;
        returns this thread's row maxima for the softmax.

        The block max is the row's tile max, so one all-reduce serves both (the softmax is a
        ``_RowReducedSoftmax`` here and does not reduce again). ``bl_own``/``bl_limit`` (from
        ``consume``) already hold the lane's row, first owned block and validity, so a tile costs the
        all-reduce, one compare, scale and predicated store: no row address arithmetic and no branch
        in the key-tile loop.
        """
        shape = self.bl_shape  # blocks_per_tile == 1 (several: Note [deferred block_logit stores])
        blk = bl.partial_block_max(shape, acc_S_mn, cols)
        local_max, owned = bl.reduce_single_block(shape, blk, row_sel)
        if const_expr(shape.tiles_per_block > 1):
            # block_size spans tiles: one owned value (first_block 0); store when the block is finished.
            if bl.carry_across_tiles(owned, carry, n_tile, n_tile_min, shape.tiles_per_block):
                bl.store_owned(bl_own, owned, n_tile // shape.tiles_per_block, bl_limit, scale)
        else:
            bl.store_owned(bl_own, owned, n_tile * shape.blocks_per_tile, bl_limit, scale)
        return local_max

    @cute.jit
    def block_logit_relative_step(self, ctx, acc_S_mn, n_tile: Int32):
        """Note [document-relative block_logit]: block maxima of this S tile on each row's own block grid
        (origin bos_r) -> plain stores of the finished blocks, the unfinished one carried to the next
        (lower) tile. Independent of the softmax (which reduces its row maxima itself here)."""
        shape = self.bos_shape
        b = ctx.bos
        n0 = n_tile * self.tile_n
        origins = [bl.relative_origin(self.cfg.block_size, n0, b.bos[r]) for r in range(2)]
        # The thread's column offset and lane from a fresh %tid.x read (Note [thread coordinates at use]):
        # kept live through the loop they spilled here.
        ctid = reread_tid_x() - THREADS_PER_WG
        thr_col = self._thr_col(ctx.tiled_mma_qk, ctid)
        sel = ctid % 2  # the row this lane stores (limit 0 on lanes 2 and 3)
        for r in cutlass.range_constexpr(2):
            # one row at a time: its candidates' maxima are the only extra live values
            blk = bl.partial_relative_block_max(shape, acc_S_mn, ctx.cols, thr_col, r, origins[r][1])
            bl.allreduce_relative_blocks(shape, blk)
            if sel == r:
                bl.store_relative_blocks(shape, blk, bl.row_at(b.addr, b.layout), origins[r][0], origins[r][1],
                                         b.limit, n_tile == ctx.tiles.n_min, b.carry_val, b.carry_id, 0,
                                         ctx.bl_scale)

    @cute.jit
    def block_logit_flush(self, ctx, n_tile: Int32):
        """Note [deferred block_logit stores]: reduce-scatter and store the block maxima kept from key
        tile ``n_tile`` (the tile processed last); called while the next QK^T (or the last PV) runs."""
        shape = self.bl_shape  # blocks_per_tile >= 2: no block spans tiles
        if const_expr(self.bl_early_reduce):
            owned = ctx.bl_pending
        else:
            owned = bl.reduce_row_threads(shape, ctx.bl_pending, ctx.lane)
        bl.store_owned(bl.row_at(ctx.bl_addr, ctx.bl_layout), owned, n_tile * shape.blocks_per_tile,
                       ctx.bl_limit, ctx.bl_scale)

    @cute.jit
    def epilogue(self, acc_O, lse, mO, mLSE, seqlen: SeqlenInfo, tiled_mma_pv, thr_mma_pv, m_tile: Int32,
                 head_idx: Int32, batch_idx: Int32, ctidx: Int32, tma_atom_O, sO):
        """O (already divided by the row sums) in q's dtype and lse to global memory; rows past
        seqlen_q are not written.

        Note [staged O epilogue]: without varlen the consumers write O into Q's shared-memory buffer
        (stmatrix, the buffer's swizzled layout for (tile_m, head_dim_v)) and one thread stores the tile
        with one TMA box, which clips the rows past the sequence; storing the wgmma fragments straight
        to global memory takes 4-byte pieces spread over 8 rows per warp instruction. Q's buffer is
        free: every consumer's last QK^T has completed (wait_group(0) in the key-tile loop). With
        head_dim == head_dim_v each WG writes exactly the entries of its own 64 Q rows (same layout), so
        the WGs need to meet only before the store; with (192, 128) the layouts differ and they also
        meet before writing. Varlen keeps the direct stores (a box would cross into the next sequence).
        """
        cfg = self.cfg
        # The thread's coordinates again (Note [thread coordinates at use]).
        if const_expr(self.reread_coords):
            ctidx = reread_tid_x() - THREADS_PER_WG
            thr_mma_pv = tiled_mma_pv.get_slice(ctidx)
        if const_expr(cfg.varlen):
            mO_cur = cute.domain_offset((seqlen.offset_q, 0, 0), mO)[None, head_idx, None]
            mLSE_cur = cute.domain_offset((0, seqlen.offset_q), mLSE)[head_idx, None]
        else:
            mLSE_cur = mLSE[batch_idx, head_idx, None]
        cO = cute.make_identity_tensor((self.tile_m, self.hdimv))
        tOcO_mn = acc_mn_view(thr_mma_pv.partition_C(cO))
        rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
        convert_to_16bit(acc_O, rO)
        rO_mn = acc_mn_view(rO)
        m_start = m_tile * self.tile_m
        n_consumers = self.num_wg * THREADS_PER_WG
        if const_expr(tma_atom_O is not None):
            if const_expr(self.hdim != self.hdimv):
                cute.arch.barrier(barrier_id=O_STAGED_BARRIER, number_of_threads=n_consumers)
            stage_acc_16bit(rO, tiled_mma_pv, ctidx, sO)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=O_STAGED_BARRIER, number_of_threads=n_consumers)
            if ctidx == 0:
                gO = cute.local_tile(mO[None, None, head_idx, batch_idx], (self.tile_m, self.hdimv), (m_tile, 0))
                tOsO, tOgO = cpasync.tma_partition(tma_atom_O, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2),
                                                   cute.group_modes(gO, 0, 2))
                cute.copy(tma_atom_O, tOsO, tOgO)
                cute.arch.cp_async_bulk_commit_group()
            if tOcO_mn[0, 0][1] == 0:
                for r in cutlass.range_constexpr(cute.size(rO_mn, mode=[0])):
                    row = m_start + tOcO_mn[r, 0][0]
                    if row < seqlen.seqlen_q:
                        mLSE_cur[row] = lse[r]
            if ctidx == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)  # smem is read before the CTA exits
        else:
            gO = cute.local_tile(mO_cur, (self.tile_m, self.hdimv), (m_tile, 0))
            tOgO_mn = acc_mn_view(thr_mma_pv.partition_C(gO))
            for r in cutlass.range_constexpr(cute.size(rO_mn, mode=[0])):
                row = m_start + tOcO_mn[r, 0][0]
                if row < seqlen.seqlen_q:
                    for c in cutlass.range_constexpr(cute.size(rO_mn, mode=[1])):
                        tOgO_mn[r, c] = rO_mn[r, c]
                    if tOcO_mn[0, 0][1] == 0:
                        mLSE_cur[row] = lse[r]
