"""FlashBwdSm90: warp-specialised Hopper attention backward (main kernel: dK, dV and the dQ accumulator).

Math, tensors and workspace: ``bwd_config`` (module docstring); argument order ``BwdKernelArgs``. The
preprocess (``bwd_pre``) has written lse_log2, dpsum and zeroed dq_accum (and dq_sem); the
postprocess (``bwd_post``) turns dq_accum into dQ.

One CTA per (key tile of TILE_N = 128 keys, kv head, batch), 384 threads:

    warp 0        TMA producer: K and V of the tile once, then for every query head of the kv head's
                  group and every query tile m in ``QueryTileRange`` (ascending): Q[m] + lse_log2[m] on
                  pipeline_q, dO[m] + dpsum[m] on pipeline_do (2 stages each)
    warp 1        dQ writer: per step waits until the consumer warpgroups staged their dQ tile in
                  shared memory, then one TMA reduce-add (``cp.reduce.async.bulk.tensor ... add.f32``)
                  per staged region into dq_accum; deterministic: first waits for its turn on the
                  query tile's dq_sem counter (key tiles in ascending order), and bumps it after
                  the reduce has completed (Note [deterministic dQ])
    WG 1, WG 2    consumers; WG w owns keys [64 w, 64 w + 64) of the tile: per step
                      S^T = K_w Q^T, dP^T = V_w dO^T           (wgmma, both operands in smem)
                      mask, softcap, P^T = exp2(S^T scale log2e - lse_log2)
                      dS^T = P^T (dP^T - dpsum) (* (1 - tanh^2) with softcap)
                      dV_w += P^T dO, dK_w += dS^T Q           (wgmma, P^T / dS^T from registers)
                      dS^T -> smem (stmatrix), both WGs sync, dQ tile = dS K (smem x smem) -> fp32
                      staging -> warp 1
                  dK_w / dV_w stay in registers across all steps of all query heads of the group (GQA
                  sums its group without any fp32 expansion; bitwise deterministic by construction),
                  then dK * softmax_scale and dV go out with predicated stores (zeros for keys that no
                  query sees).

dQ tile split between the consumers (``dq_split``): "n" (d 128, tile_m 64): WG w computes columns
[w D/2, (w + 1) D/2); "m" (d 64, tile_m 128): WG w computes rows [64 w, 64 w + 64); "single" (d 96):
WG 1 computes the whole tile. Each WG stages its region (fp32, swizzled) and warp 1 reduces each
region with one TMA box.

Note [deterministic dQ]: query tile m of (batch, head) is reduced into by the key tiles
n in [first_key_tile(m), ...) that see it (``QueryTileRange`` and ``first_key_tile`` in
common/tile_range.py are exact inverses), in ascending n: the writer of key tile n waits until
dq_sem == n - first_key_tile(m), reduce-adds, waits for the writes to complete and adds 1 (release).
A key tile that does not see m never touches its counter, and no counter waits on one. CTAs are
launched in ascending n within a (head, batch), so the tile a writer waits on is already resident.

Note [deterministic dQ, descending order] (``FlashBwdSm90(cfg, spt=True)``, causal / window only;
opt-in, NOT yet run on a GPU). Measured on the H200 the ascending order costs causal rows half their
speed (det / FA4 det 0.49-0.67): key tile n's first query tile (its diagonal) waits for every lower
key tile to reach that tile, which they do last. With spt the writers of query tile m go in
descending n (lock = last_key_tile(m) - n) and blockIdx.x maps to the highest key tile first, so a
key tile is the first writer of its diagonal tiles and waits only on tiles launched before it (FA4's
"SPT" order). Every counter still sees each of its writers exactly once.

Not supported (``unsupported_reason``): head_dim > 128 (192, 256, (192, 128)) -- not implemented yet.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.tensor_utils import LayoutEnum

from cute_kernels.common.mask import apply_mask_kv_major
from cute_kernels.common.seqlen import SeqlenInfo
from cute_kernels.common.tile_range import QueryTileRange, first_key_tile, last_key_tile, normalize_window
from cute_kernels.common.utils import (LOG2_E, acc_as_operand_a, acc_mn_view, convert_to_16bit,
                                       select_modes, sm90_thread0_cols, transpose_view, wgmma_gemm,
                                       wgmma_smem_layout)
from cute_kernels.dtypes import cutlass_dtype

from .bwd_config import ACCUM_ROW_PAD, DQ_SEM_ROWS, BwdConfig

SMEM_BYTES_MAX = 232_448
TILE_N = 128
KEYS_PER_WG = 64
THREADS_PER_WG = 128
NUM_THREADS = 3 * THREADS_PER_WG
STAGES = 2
# setmaxnreg split within the launch allocation (168 registers x 384 threads = 64,512): 128 * 24 + 256 * 240,
# the forward's. (A split over it, e.g. 32 / 240 = 65,536, would leave setmaxnreg.inc waiting for registers
# that never free.) The first H200-verified build (fc3944e) had 40 / 232, which spilled 8-40 bytes in 32 of
# the 149 sm_90a full-matrix configs (windows, softcap d 64, d 64 GQA / varlen, d 128 varlen MHA).
PRODUCER_REGS, CONSUMER_REGS = 24, 240
# Named barriers (0 is __syncthreads). Each staging WG hands its dQ region to warp 1 on barriers of its
# own (128 + 32 threads), so one WG's staging never waits for the other's.
DS_FULL_BARRIER = 1  # both consumer WGs: dS^T of the step is in smem
DQ_FULL_BARRIER = 2  # + wg: WG wg staged its dQ region, warp 1 waits
DQ_EMPTY_BARRIER = 4  # + wg: warp 1 has read WG wg's region (staging free again), WG wg waits


def tile_config(cfg: BwdConfig) -> tuple[int, str]:
    """(tile_m, dq_split) for ``cfg`` (see the module docstring)."""
    if cfg.head_dim <= 64:
        return 128, "m"
    if cfg.head_dim <= 96:
        return 64, "single"
    return 64, "n"


@dsl_user_op
def _ld_acquire(addr: Int64, *, loc=None, ip=None) -> Int32:
    return Int32(llvm.inline_asm(
        T.i32(), [Int64(addr).ir_value(loc=loc, ip=ip)], "ld.acquire.gpu.global.b32 $0, [$1];",
        "=r,l", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def _red_release_add(addr: Int64, val: Int32, *, loc=None, ip=None) -> None:
    llvm.inline_asm(
        None, [Int64(addr).ir_value(loc=loc, ip=ip), Int32(val).ir_value(loc=loc, ip=ip)],
        "red.release.gpu.global.add.s32 [$0], $1;", "l,r", has_side_effects=True,
        is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


class FlashBwdSm90:
    def __init__(self, cfg: BwdConfig, spt: bool = False):
        reason = FlashBwdSm90.unsupported_reason(cfg)
        if reason is not None:
            raise ValueError(f"FlashBwdSm90: {reason}")
        self.cfg = cfg
        # Note [deterministic dQ, descending order]: opt-in, NOT yet run on a GPU.
        self.spt = bool(spt) and cfg.deterministic and (cfg.causal or cfg.has_window)
        self.dtype = cutlass_dtype(cfg.dtype)
        self.hdim = cfg.head_dim
        self.hdimv = cfg.head_dim_v
        self.tile_m, self.dq_split = tile_config(cfg)
        self.tile_n = TILE_N
        # dQ region of one staging WG: (rows, cols) and how many WGs stage one.
        if self.dq_split == "m":
            self.dq_rows, self.dq_cols, self.dq_wgs = self.tile_m // 2, self.hdim, 2
        elif self.dq_split == "n":
            self.dq_rows, self.dq_cols, self.dq_wgs = self.tile_m, self.hdim // 2, 2
        else:
            self.dq_rows, self.dq_cols, self.dq_wgs = self.tile_m, self.hdim, 1
        # Issue dQ = dS K before dK += dS^T Q and stage dQ while the dK GEMM runs (tile_m 64; at tile_m
        # 128 the live dQ accumulator spills). Not in deterministic mode, where it measured no faster.
        self.dq_before_dk = self.tile_m == 64 and not cfg.deterministic

    # ------------------------------------------------------------------ host-side facts
    @staticmethod
    def unsupported_reason(cfg: BwdConfig) -> str | None:
        if cfg.arch != 90:
            return f"FlashBwdSm90 is the SM90 kernel, got arch {cfg.arch}"
        if cfg.dtype not in ("bfloat16", "float16"):
            return f"dtype {cfg.dtype} (only bfloat16/float16)"
        if cfg.head_dim_v != cfg.head_dim:
            return (f"attention backward with head_dim {cfg.head_dim} != head_dim_v {cfg.head_dim_v} "
                    f"on SM90 is not implemented yet")
        if cfg.head_dim not in (64, 96, 128):
            return (f"attention backward with head_dim {cfg.head_dim} on SM90 is not implemented yet "
                    f"(implemented: 64, 96, 128)")
        if cfg.qhead_per_kvhead < 1:
            return f"qhead_per_kvhead {cfg.qhead_per_kvhead}"
        return None

    @staticmethod
    def smem_bytes(cfg: BwdConfig) -> int:
        tile_m, split = tile_config(cfg)
        d, dv = cfg.head_dim, cfg.head_dim_v
        q = STAGES * tile_m * d * 2
        do = STAGES * tile_m * dv * 2
        k = TILE_N * d * 2
        v = TILE_N * dv * 2
        ds = STAGES * TILE_N * tile_m * 2
        dq = tile_m * d * 4
        stats = 2 * STAGES * tile_m * 4
        barriers = 8 * (2 * 2 * STAGES + 2)
        return sum(-(-x // 1024) * 1024 for x in (q, do, k, v, ds, dq)) + stats + barriers + 1024

    # ------------------------------------------------------------------ host launch
    def _shared_storage(self, sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout, sdQ_layout):
        fields = {
            "mbar_q": cute.struct.MemRange[Int64, 2 * STAGES],
            "mbar_do": cute.struct.MemRange[Int64, 2 * STAGES],
            "mbar_kv": cute.struct.MemRange[Int64, 2],
            "sLSE": cute.struct.Align[cute.struct.MemRange[Float32, self.tile_m * STAGES], 128],
            "sdPsum": cute.struct.Align[cute.struct.MemRange[Float32, self.tile_m * STAGES], 128],
            "sQ": cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024],
            "sdO": cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdO_layout)], 1024],
            "sK": cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024],
            "sV": cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024],
            "sdS": cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdS_layout)], 1024],
            "sdQ": cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sdQ_layout)], 1024],
        }
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSElog2: cute.Tensor, mdPsum: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor,
                 mdV: cute.Tensor, mCuSeqlensQ, mCuSeqlensK, mdQsem, softmax_scale: Float32,
                 softcap: Float32, window_left: Int32, window_right: Int32, max_seqlen_q: Int32,
                 max_seqlen_k: Int32, stream):
        cfg = self.cfg
        varlen = const_expr(cfg.varlen)
        # (B, S, H, D) -> (S, D, H, B); varlen (T, H, D) -> (T, D, H)
        order = (0, 2, 1) if const_expr(varlen) else (1, 3, 2, 0)
        mQt, mKt, mVt, mdOt = [select_modes(t, order) for t in (mQ, mK, mV, mdO)]
        # workspace rows: (B, H, R) -> (R, H, B); varlen (H, R) -> (R, H)
        sorder = (1, 0) if const_expr(varlen) else (2, 1, 0)
        mLSEt, mdPsumt = [select_modes(t, sorder) for t in (mLSElog2, mdPsum)]
        # dq_accum (B, H, R, D) -> (R, D, H, B); varlen (H, R, D) -> (R, D, H)
        mdQacct = select_modes(mdQaccum, (1, 2, 0) if const_expr(varlen) else (2, 3, 1, 0))

        sQ_layout = wgmma_smem_layout(self.dtype, (self.tile_m, self.hdim, STAGES))
        sdO_layout = wgmma_smem_layout(self.dtype, (self.tile_m, self.hdimv, STAGES))
        sK_layout = wgmma_smem_layout(self.dtype, (self.tile_n, self.hdim))
        sV_layout = wgmma_smem_layout(self.dtype, (self.tile_n, self.hdimv))
        sdS_layout = wgmma_smem_layout(self.dtype, (self.tile_n, self.tile_m, STAGES))  # (keys, rows)
        sdQ_layout = sm90_utils.make_smem_layout_epi(Float32, LayoutEnum.ROW_MAJOR, (self.dq_rows, self.dq_cols),
                                                     self.dq_wgs)

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        sel = lambda l: cute.select(l, mode=[0, 1])
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(g2s, mQt, sel(sQ_layout), (self.tile_m, self.hdim))
        tma_atom_dO, tma_dO = cpasync.make_tiled_tma_atom(g2s, mdOt, sel(sdO_layout), (self.tile_m, self.hdimv))
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(g2s, mKt, sK_layout, (self.tile_n, self.hdim))
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(g2s, mVt, sV_layout, (self.tile_n, self.hdimv))
        stat_layout = cute.make_layout((self.tile_m,))
        tma_atom_LSE, tma_LSE = cpasync.make_tiled_tma_atom(g2s, mLSEt, stat_layout, (self.tile_m,))
        tma_atom_dPsum, tma_dPsum = cpasync.make_tiled_tma_atom(g2s, mdPsumt, stat_layout, (self.tile_m,))
        tma_atom_dQ, tma_dQ = cpasync.make_tiled_tma_atom(
            cpasync.CopyReduceBulkTensorTileS2GOp(), mdQacct, cute.select(sdQ_layout, mode=[0, 1]),
            (self.dq_rows, self.dq_cols))
        self.tx_q = cute.size_in_bytes(self.dtype, sel(sQ_layout)) + self.tile_m * 4
        self.tx_do = cute.size_in_bytes(self.dtype, sel(sdO_layout)) + self.tile_m * 4
        self.tx_kv = cute.size_in_bytes(self.dtype, sK_layout) + cute.size_in_bytes(self.dtype, sV_layout)
        self.shared_storage = self._shared_storage(sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout,
                                                   sdQ_layout)

        if const_expr(varlen):
            batch = mCuSeqlensK.shape[0] - 1
            num_kv_heads = mK.shape[1]
        else:
            batch = mK.shape[0]
            num_kv_heads = mK.shape[2]
        grid = (cute.ceil_div(max_seqlen_k, self.tile_n), num_kv_heads, batch)
        self.kernel(tma_Q, tma_K, tma_V, tma_dO, tma_LSE, tma_dPsum, tma_dQ, mdK, mdV, mCuSeqlensQ,
                    mCuSeqlensK, mdQsem, tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO, tma_atom_LSE,
                    tma_atom_dPsum, tma_atom_dQ, sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout,
                    sdQ_layout, softmax_scale, softcap, window_left, window_right,
                    mQt.shape[0], mKt.shape[0]).launch(
            grid=grid, block=[NUM_THREADS, 1, 1], smem=self.shared_storage.size_in_bytes(),
            stream=stream, min_blocks_per_mp=1)

    # ------------------------------------------------------------------ device
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
               mLSE: cute.Tensor, mdPsum: cute.Tensor, mdQacc: cute.Tensor, mdK: cute.Tensor,
               mdV: cute.Tensor, mCuSeqlensQ, mCuSeqlensK, mdQsem,
               tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom,
               tma_atom_dO: cute.CopyAtom, tma_atom_LSE: cute.CopyAtom, tma_atom_dPsum: cute.CopyAtom,
               tma_atom_dQ: cute.CopyAtom, sQ_layout: cute.ComposedLayout, sdO_layout: cute.ComposedLayout,
               sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
               sdS_layout: cute.ComposedLayout, sdQ_layout: cute.ComposedLayout,
               softmax_scale: Float32, softcap: Float32, window_left: Int32, window_right: Int32,
               seqlen_q_static: Int32, seqlen_k_static: Int32):
        cfg = self.cfg
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == 0:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO, tma_atom_LSE, tma_atom_dPsum,
                         tma_atom_dQ):
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, 2 * THREADS_PER_WG // 32)
        pipeline_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=STAGES, producer_group=producer,
            consumer_group=consumers, tx_count=self.tx_q, defer_sync=True)
        pipeline_do = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_do.data_ptr(), num_stages=STAGES, producer_group=producer,
            consumer_group=consumers, tx_count=self.tx_do, defer_sync=True)
        pipeline_kv = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_kv.data_ptr(), num_stages=1, producer_group=producer,
            consumer_group=consumers, tx_count=self.tx_kv, defer_sync=False)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        sdQ = storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner)
        sLSE = storage.sLSE.get_tensor(cute.make_layout((self.tile_m, STAGES)))
        sdPsum = storage.sdPsum.get_tensor(cute.make_layout((self.tile_m, STAGES)))

        n_tile, head_kv, batch_idx = cute.arch.block_idx()
        seqlen = SeqlenInfo.create(batch_idx, seqlen_q_static, seqlen_k_static, mCuSeqlensQ, mCuSeqlensK)
        if const_expr(self.spt):
            # Highest key tile first (it is the first writer of its query tiles in descending order).
            n_tile = (seqlen.seqlen_k + self.tile_n - 1) // self.tile_n - 1 - n_tile
        n_start = n_tile * self.tile_n
        if const_expr(self.spt):
            n_start = n_start if n_tile >= 0 else seqlen.seqlen_k  # past this sequence's key tiles: no work
        if n_start < seqlen.seqlen_k:
            left, right = normalize_window(window_left, window_right, seqlen.seqlen_q, seqlen.seqlen_k,
                                           cfg.causal, cfg.has_window)
            mask_right = const_expr(cfg.causal or cfg.has_window)
            qtiles = QueryTileRange.create(n_start, seqlen.seqlen_q, seqlen.seqlen_k, left, right,
                                           self.tile_m, self.tile_n, mask_right, cfg.has_window)
            num_m = qtiles.m_max - qtiles.m_min
            if num_m < 0:
                num_m = Int32(0)
            steps = num_m * cfg.qhead_per_kvhead
            # Workspace row of this sequence's row 0 (bwd_config.accum_row_start).
            row0 = Int32(0)
            if const_expr(cfg.varlen):
                row0 = (seqlen.offset_q + ACCUM_ROW_PAD * batch_idx) // ACCUM_ROW_PAD * ACCUM_ROW_PAD
            if warp_idx < 4:
                cute.arch.setmaxregister_decrease(PRODUCER_REGS)
                if warp_idx == 0:
                    self.load(mQ, mK, mV, mdO, mLSE, mdPsum, sQ, sK, sV, sdO, sLSE, sdPsum, tma_atom_Q,
                              tma_atom_K, tma_atom_V, tma_atom_dO, tma_atom_LSE, tma_atom_dPsum,
                              pipeline_q, pipeline_do, pipeline_kv, seqlen, qtiles, steps, row0, n_tile,
                              head_kv, batch_idx)
                if warp_idx == 1:
                    self.store_dq(mdQacc, mdQsem, sdQ, tma_atom_dQ, seqlen, qtiles, steps, row0, left,
                                  right, n_tile, head_kv, batch_idx)
            else:
                cute.arch.setmaxregister_increase(CONSUMER_REGS)
                self.consume(mdK, mdV, sQ, sK, sV, sdO, sdS, sdQ, sLSE, sdPsum, pipeline_q, pipeline_do,
                             pipeline_kv, seqlen, qtiles, steps, left, right, n_tile, head_kv, batch_idx,
                             tidx - THREADS_PER_WG, softmax_scale, softcap)

    # ------------------------------------------------------------------ producer
    def _seq_view(self, t: cute.Tensor, offset, batch_idx):
        """(S, D, H[, B]) -> (S, D, H) of this sequence (varlen: shifted to its first row)."""
        if const_expr(self.cfg.varlen):
            return cute.domain_offset((offset, 0, 0), t)
        return t[None, None, None, batch_idx]

    def _stat_view(self, t: cute.Tensor, row0, batch_idx):
        """(R, H[, B]) -> (R, H) of this sequence (varlen: shifted to its first accumulator row)."""
        if const_expr(self.cfg.varlen):
            return cute.domain_offset((row0, 0), t)
        return t[None, None, batch_idx]

    @cute.jit
    def load(self, mQ, mK, mV, mdO, mLSE, mdPsum, sQ, sK, sV, sdO, sLSE, sdPsum, tma_atom_Q, tma_atom_K,
             tma_atom_V, tma_atom_dO, tma_atom_LSE, tma_atom_dPsum, pipeline_q, pipeline_do, pipeline_kv,
             seqlen: SeqlenInfo, qtiles: QueryTileRange, steps: Int32, row0: Int32, n_tile: Int32,
             head_kv: Int32, batch_idx: Int32):
        cfg = self.cfg
        G = cfg.qhead_per_kvhead
        mK_cur = self._seq_view(mK, seqlen.offset_k, batch_idx)[None, None, head_kv]
        mV_cur = self._seq_view(mV, seqlen.offset_k, batch_idx)[None, None, head_kv]
        gK = cute.local_tile(mK_cur, (self.tile_n, self.hdim), (n_tile, 0))
        gV = cute.local_tile(mV_cur, (self.tile_n, self.hdimv), (n_tile, 0))
        one = cute.make_layout(1)
        tKsK, tKgK = cpasync.tma_partition(tma_atom_K, 0, one, cute.group_modes(sK, 0, 2),
                                           cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_atom_V, 0, one, cute.group_modes(sV, 0, 2),
                                           cute.group_modes(gV, 0, 2))
        mQ_seq = self._seq_view(mQ, seqlen.offset_q, batch_idx)
        mdO_seq = self._seq_view(mdO, seqlen.offset_q, batch_idx)
        mLSE_seq = self._stat_view(mLSE, row0, batch_idx)
        mdPsum_seq = self._stat_view(mdPsum, row0, batch_idx)
        if steps > 0:
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            pipeline_kv.producer_acquire(kv_state)
            cute.copy(tma_atom_K, tKgK, tKsK, tma_bar_ptr=pipeline_kv.producer_get_barrier(kv_state))
            cute.copy(tma_atom_V, tVgV, tVsV, tma_bar_ptr=pipeline_kv.producer_get_barrier(kv_state))
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES)
            for hi in cutlass.range(G, unroll=1):
                head = head_kv * G + hi
                gQ = cute.local_tile(mQ_seq[None, None, head], (self.tile_m, self.hdim), (None, 0))
                gdO = cute.local_tile(mdO_seq[None, None, head], (self.tile_m, self.hdimv), (None, 0))
                gLSE = cute.local_tile(mLSE_seq[None, head], (self.tile_m,), (None,))
                gdPsum = cute.local_tile(mdPsum_seq[None, head], (self.tile_m,), (None,))
                tQsQ, tQgQ = cpasync.tma_partition(tma_atom_Q, 0, one, cute.group_modes(sQ, 0, 2),
                                                   cute.group_modes(gQ, 0, 2))
                tdOsdO, tdOgdO = cpasync.tma_partition(tma_atom_dO, 0, one, cute.group_modes(sdO, 0, 2),
                                                       cute.group_modes(gdO, 0, 2))
                tLsL, tLgL = cpasync.tma_partition(tma_atom_LSE, 0, one, sLSE, gLSE)
                tPsP, tPgP = cpasync.tma_partition(tma_atom_dPsum, 0, one, sdPsum, gdPsum)
                for mi in cutlass.range(qtiles.m_max - qtiles.m_min, unroll=1):
                    m = qtiles.m_min + mi
                    pipeline_q.producer_acquire(state)
                    bar_q = pipeline_q.producer_get_barrier(state)
                    cute.copy(tma_atom_Q, tQgQ[None, m], tQsQ[None, state.index], tma_bar_ptr=bar_q)
                    cute.copy(tma_atom_LSE, tLgL[None, m], tLsL[None, state.index], tma_bar_ptr=bar_q)
                    pipeline_do.producer_acquire(state)
                    bar_do = pipeline_do.producer_get_barrier(state)
                    cute.copy(tma_atom_dO, tdOgdO[None, m], tdOsdO[None, state.index], tma_bar_ptr=bar_do)
                    cute.copy(tma_atom_dPsum, tPgP[None, m], tPsP[None, state.index], tma_bar_ptr=bar_do)
                    state.advance()

    # ------------------------------------------------------------------ dQ writer (warp 1)
    @cute.jit
    def store_dq(self, mdQacc, mdQsem, sdQ, tma_atom_dQ, seqlen: SeqlenInfo, qtiles: QueryTileRange,
                 steps: Int32, row0: Int32, left: Int32, right: Int32, n_tile: Int32, head_kv: Int32,
                 batch_idx: Int32):
        cfg = self.cfg
        G = cfg.qhead_per_kvhead
        lane = cute.arch.lane_idx()
        nbar = THREADS_PER_WG + 32
        one = cute.make_layout(1)
        if const_expr(cfg.varlen):
            mdQ_seq = cute.domain_offset((row0, 0, 0), mdQacc)
        else:
            mdQ_seq = mdQacc[None, None, None, batch_idx]
        if steps > 0:
            for r in cutlass.range_constexpr(self.dq_wgs):
                cute.arch.barrier_arrive(barrier_id=DQ_EMPTY_BARRIER + r, number_of_threads=nbar)
        step = Int32(0)
        for hi in cutlass.range(G, unroll=1):
            head = head_kv * G + hi
            gdQ = cute.local_tile(mdQ_seq[None, None, head], (self.dq_rows, self.dq_cols), (None, None))
            tdQsdQ, tdQgdQ = cpasync.tma_partition(tma_atom_dQ, 0, one, cute.group_modes(sdQ, 0, 2),
                                                   cute.group_modes(gdQ, 0, 2))
            for mi in cutlass.range(qtiles.m_max - qtiles.m_min, unroll=1):
                m = qtiles.m_min + mi
                sem_addr = Int64(0)
                if const_expr(cfg.deterministic):
                    sem_idx = (row0 + m * self.tile_m) // DQ_SEM_ROWS
                    if const_expr(cfg.varlen):
                        sem_ptr = mdQsem.iterator + cute.crd2idx((head, sem_idx), mdQsem.layout)
                    else:
                        sem_ptr = mdQsem.iterator + cute.crd2idx((batch_idx, head, sem_idx), mdQsem.layout)
                    sem_addr = sem_ptr.toint()
                    if const_expr(self.spt):
                        lock = last_key_tile(m * self.tile_m, seqlen.seqlen_q, seqlen.seqlen_k, right, self.tile_m,
                                             self.tile_n, cfg.causal or cfg.has_window) - n_tile
                    else:
                        lock = n_tile - first_key_tile(m * self.tile_m, seqlen.seqlen_q, seqlen.seqlen_k, left,
                                                       self.tile_n, cfg.has_window)
                    if lane == 0:
                        cur = _ld_acquire(sem_addr)
                        while cur != lock:
                            cur = _ld_acquire(sem_addr)
                    cute.arch.sync_warp()
                # The whole warp issues (the TMA copy elects one lane itself; one active lane hangs). Region
                # r goes out as soon as WG r staged it and is handed back once the TMA has read it.
                for r in cutlass.range_constexpr(self.dq_wgs):
                    cute.arch.barrier(barrier_id=DQ_FULL_BARRIER + r, number_of_threads=nbar)
                    if const_expr(self.dq_split == "m"):
                        cute.copy(tma_atom_dQ, tdQsdQ[None, r], tdQgdQ[None, m * 2 + r, 0])
                    elif const_expr(self.dq_split == "n"):
                        cute.copy(tma_atom_dQ, tdQsdQ[None, r], tdQgdQ[None, m, r])
                    else:
                        cute.copy(tma_atom_dQ, tdQsdQ[None, r], tdQgdQ[None, m, 0])
                    cute.arch.cp_async_bulk_commit_group()
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                    cute.arch.sync_warp()
                    if step + 1 < steps:
                        cute.arch.barrier_arrive(barrier_id=DQ_EMPTY_BARRIER + r, number_of_threads=nbar)
                if const_expr(cfg.deterministic):
                    cute.arch.cp_async_bulk_wait_group(0, read=False)
                    cute.arch.sync_warp()
                    if lane == 0:
                        cute.arch.fence_acq_rel_gpu()
                        _red_release_add(sem_addr, Int32(1))
                    cute.arch.sync_warp()
                step = step + 1
        cute.arch.cp_async_bulk_wait_group(0, read=False)

    # ------------------------------------------------------------------ consumers
    @cute.jit
    def consume(self, mdK, mdV, sQ, sK, sV, sdO, sdS, sdQ, sLSE, sdPsum, pipeline_q, pipeline_do, pipeline_kv,
                seqlen: SeqlenInfo, qtiles: QueryTileRange, steps: Int32, left: Int32, right: Int32,
                n_tile: Int32, head_kv: Int32, batch_idx: Int32, ctidx: Int32, softmax_scale: Float32,
                softcap: Float32):
        cfg = self.cfg
        dt = self.dtype
        wg = cute.arch.make_warp_uniform(ctidx // THREADS_PER_WG)
        tid = ctidx % THREADS_PER_WG
        K = warpgroup.OperandMajorMode.K
        MN = warpgroup.OperandMajorMode.MN
        mma_sdp = sm90_utils.make_trivial_tiled_mma(dt, dt, K, K, Float32, atom_layout_mnk=(1, 1, 1),
                                                    tiler_mn=(KEYS_PER_WG, self.tile_m))
        mma_dkv = sm90_utils.make_trivial_tiled_mma(dt, dt, K, MN, Float32, atom_layout_mnk=(1, 1, 1),
                                                    tiler_mn=(KEYS_PER_WG, self.hdim),
                                                    a_source=warpgroup.OperandSource.RMEM)
        mma_dq = sm90_utils.make_trivial_tiled_mma(dt, dt, MN, MN, Float32, atom_layout_mnk=(1, 1, 1),
                                                   tiler_mn=(64, self.dq_cols))
        thr_sdp = mma_sdp.get_slice(tid)
        thr_dkv = mma_dkv.get_slice(tid)
        thr_dq = mma_dq.get_slice(tid)

        sK_w = cute.local_tile(sK, (KEYS_PER_WG, self.hdim), (wg, 0))
        sV_w = cute.local_tile(sV, (KEYS_PER_WG, self.hdimv), (wg, 0))
        tSrK = thr_sdp.make_fragment_A(thr_sdp.partition_A(sK_w))
        tSrQ = thr_sdp.make_fragment_B(thr_sdp.partition_B(sQ))  # (.., .., k, stage)
        tPrV = thr_sdp.make_fragment_A(thr_sdp.partition_A(sV_w))
        tPrdO = thr_sdp.make_fragment_B(thr_sdp.partition_B(sdO))
        tVrdOt = thr_dkv.make_fragment_B(thr_dkv.partition_B(transpose_view(sdO)))  # (.., .., k, stage)
        tKrQt = thr_dkv.make_fragment_B(thr_dkv.partition_B(transpose_view(sQ)))
        tVrP = thr_dkv.make_fragment_A(thr_dkv.partition_shape_A((KEYS_PER_WG, self.tile_m)))
        tKrdS = thr_dkv.make_fragment_A(thr_dkv.partition_shape_A((KEYS_PER_WG, self.tile_m)))
        acc_S_shape = thr_sdp.partition_shape_C((KEYS_PER_WG, self.tile_m))
        acc_dV = cute.make_rmem_tensor(thr_dkv.partition_shape_C((KEYS_PER_WG, self.hdimv)), Float32)
        acc_dK = cute.make_rmem_tensor(thr_dkv.partition_shape_C((KEYS_PER_WG, self.hdim)), Float32)
        acc_dV.fill(0.0)
        acc_dK.fill(0.0)

        # dQ = dS K: A = dS (rows, keys) read MN-major from sdS (keys, rows); B = K^T (D, keys).
        sdSt = transpose_view(sdS)  # (rows, keys, stage)
        sKt = transpose_view(sK)  # (D, keys)
        does_dq = True
        if const_expr(self.dq_split == "m"):
            sdSt_w = cute.local_tile(sdSt, (64, self.tile_n, STAGES), (wg, 0, 0))
            sKt_w = sKt
        elif const_expr(self.dq_split == "n"):
            sdSt_w = sdSt
            sKt_w = cute.local_tile(sKt, (self.dq_cols, self.tile_n), (wg, 0))
        else:
            sdSt_w = sdSt
            sKt_w = sKt
            does_dq = wg == 0
        tdQrdS = thr_dq.make_fragment_A(thr_dq.partition_A(sdSt_w))  # (.., .., k, stage)
        tdQrK = thr_dq.make_fragment_B(thr_dq.partition_B(sKt_w))
        acc_dQ_shape = thr_dq.partition_shape_C((self.dq_rows, self.dq_cols))
        sdQ_w = sdQ[None, None, wg if const_expr(self.dq_wgs == 2) else 0]
        tdQsdQ = thr_dq.partition_C(sdQ_w)  # same shape (and element order) as the dQ accumulator

        # dS^T -> sdS with stmatrix (C layout of mma_sdp, rows = keys of this WG).
        st_atom = sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, dt, Float32)
        st_copy = cute.make_tiled_copy_C(st_atom, mma_sdp)
        thr_st = st_copy.get_slice(tid)
        sdS_w = cute.local_tile(sdS, (KEYS_PER_WG, self.tile_m, STAGES), (wg, 0, 0))
        tSsdS = thr_st.partition_D(sdS_w)  # (.., .., .., stage)

        # Coordinates of this thread's S^T elements: keys (rows) and query rows (columns).
        cS = cute.make_identity_tensor((KEYS_PER_WG, self.tile_m))
        tScS_mn = acc_mn_view(thr_sdp.partition_C(cS))
        key_base = n_tile * self.tile_n + wg * KEYS_PER_WG
        keys = [key_base + tScS_mn[r, 0][0] for r in range(cute.size(tScS_mn, mode=[0]))]
        thr_col = tScS_mn[0, 0][1]
        cols = sm90_thread0_cols(self.tile_m)
        ncols = cute.size(tScS_mn, mode=[1])
        shift = seqlen.seqlen_k - seqlen.seqlen_q
        mask_right = const_expr(cfg.causal or cfg.has_window)

        if const_expr(cfg.has_softcap):
            scale_log2 = Float32(LOG2_E)
            softcap_in = softmax_scale / softcap
            inv_cap_log2 = 1.0 / (softcap * LOG2_E)
        else:
            scale_log2 = softmax_scale * LOG2_E
            softcap_in = Float32(0.0)
            inv_cap_log2 = Float32(0.0)
        nbar_dq = THREADS_PER_WG + 32

        if steps > 0:
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            pipeline_kv.consumer_wait(kv_state)
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
            step = Int32(0)
            for hi in cutlass.range(cfg.qhead_per_kvhead, unroll=1):
                for mi in cutlass.range(qtiles.m_max - qtiles.m_min, unroll=1):
                    m = qtiles.m_min + mi
                    stage = state.index
                    ds_stage = step % STAGES
                    acc_S = cute.make_rmem_tensor(acc_S_shape, Float32)
                    acc_dP = cute.make_rmem_tensor(acc_S_shape, Float32)
                    pipeline_q.consumer_wait(state)
                    wgmma_gemm(mma_sdp, acc_S, tSrK, tSrQ[None, None, None, stage], True)
                    pipeline_do.consumer_wait(state)
                    wgmma_gemm(mma_sdp, acc_dP, tPrV, tPrdO[None, None, None, stage], True)
                    warpgroup.wait_group(1)
                    S = acc_mn_view(acc_S)
                    if const_expr(cfg.has_softcap):
                        for i in cutlass.range_constexpr(cute.size(acc_S)):
                            acc_S[i] = cute.math.tanh(acc_S[i] * softcap_in, fastmath=False) * softcap
                    apply_mask_kv_major(S, cols, keys, m * self.tile_m + thr_col, seqlen.seqlen_k, shift,
                                        left, right, mask_right, cfg.has_window)
                    dP = acc_mn_view(acc_dP)
                    if const_expr(self.tile_m == 128):
                        # Column (query row) outer: each lse / dpsum value is live for its column only
                        # (holding all 32 of each spilled at tile_m 128).
                        for c in cutlass.range_constexpr(ncols):
                            lse_c = sLSE[thr_col + cols[c], stage]
                            for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
                                S[r, c] = cute.math.exp2(S[r, c] * scale_log2 - lse_c, fastmath=True)
                        warpgroup.wait_group(0)
                        for c in cutlass.range_constexpr(ncols):
                            dps_c = sdPsum[thr_col + cols[c], stage]
                            lse_c = sLSE[thr_col + cols[c], stage] if const_expr(cfg.has_softcap) else None
                            for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
                                dP[r, c] = self.grad_score(S[r, c], dP[r, c], dps_c, lse_c, inv_cap_log2)
                    else:
                        lse = [sLSE[thr_col + cols[c], stage] for c in range(ncols)]
                        for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
                            for c in cutlass.range_constexpr(ncols):
                                S[r, c] = cute.math.exp2(S[r, c] * scale_log2 - lse[c], fastmath=True)
                        warpgroup.wait_group(0)
                        dps = [sdPsum[thr_col + cols[c], stage] for c in range(ncols)]
                        for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
                            for c in cutlass.range_constexpr(ncols):
                                dP[r, c] = self.grad_score(S[r, c], dP[r, c], dps[c], lse[c], inv_cap_log2)
                    convert_to_16bit(acc_as_operand_a(acc_S), tVrP)
                    if const_expr(self.dq_before_dk):
                        wgmma_gemm(mma_dkv, acc_dV, tVrP, tVrdOt[None, None, None, stage], False)
                        convert_to_16bit(acc_as_operand_a(acc_dP), tKrdS)
                    else:
                        convert_to_16bit(acc_as_operand_a(acc_dP), tKrdS)
                        wgmma_gemm(mma_dkv, acc_dV, tVrP, tVrdOt[None, None, None, stage], False)
                        wgmma_gemm(mma_dkv, acc_dK, tKrdS, tKrQt[None, None, None, stage], False)
                    # dS^T -> smem for dQ (both WGs' halves), then all consumers sync.
                    rdS = cute.make_rmem_tensor(acc_S_shape, dt)
                    convert_to_16bit(acc_dP, rdS)
                    cute.copy(st_copy, thr_st.retile(rdS), tSsdS[None, None, None, ds_stage])
                    cute.arch.fence_view_async_shared()
                    cute.arch.barrier(barrier_id=DS_FULL_BARRIER, number_of_threads=2 * THREADS_PER_WG)
                    if does_dq:
                        acc_dQ = cute.make_rmem_tensor(acc_dQ_shape, Float32)
                        wgmma_gemm(mma_dq, acc_dQ, tdQrdS[None, None, None, ds_stage], tdQrK, True)
                        if const_expr(self.dq_before_dk):
                            wgmma_gemm(mma_dkv, acc_dK, tKrdS, tKrQt[None, None, None, stage], False)
                            warpgroup.wait_group(1)  # dV and dQ done, dK may still run
                            pipeline_do.consumer_release(state)
                        else:
                            warpgroup.wait_group(0)
                            pipeline_q.consumer_release(state)
                            pipeline_do.consumer_release(state)
                        # Staging free (warp 1 has read the previous tile) -> write, hand to warp 1.
                        cute.arch.barrier(barrier_id=DQ_EMPTY_BARRIER + wg, number_of_threads=nbar_dq)
                        for i in cutlass.range_constexpr(cute.size(acc_dQ)):
                            tdQsdQ[i] = acc_dQ[i]
                        cute.arch.fence_view_async_shared()
                        cute.arch.barrier_arrive(barrier_id=DQ_FULL_BARRIER + wg, number_of_threads=nbar_dq)
                        if const_expr(self.dq_before_dk):
                            warpgroup.wait_group(0)
                            pipeline_q.consumer_release(state)
                    else:
                        if const_expr(self.dq_before_dk):
                            wgmma_gemm(mma_dkv, acc_dK, tKrdS, tKrQt[None, None, None, stage], False)
                        warpgroup.wait_group(0)
                        pipeline_q.consumer_release(state)
                        pipeline_do.consumer_release(state)
                    state.advance()
                    step = step + 1

        # Epilogue: dK * scale, dV; keys past seqlen_k are not written.
        self.store_kv(acc_dK, softmax_scale, mdK, thr_dkv, seqlen, key_base, head_kv, batch_idx, self.hdim)
        self.store_kv(acc_dV, None, mdV, thr_dkv, seqlen, key_base, head_kv, batch_idx, self.hdimv)

    @cute.jit
    def grad_score(self, p: Float32, dp: Float32, dpsum: Float32, lse2, inv_cap_log2: Float32) -> Float32:
        """dS = P (dP - D), times 1 - tanh^2 with softcap (tanh recovered from P: s' = c t =
        (log2 P + lse_log2) / log2e; P = 0 -> 0)."""
        ds = p * (dp - dpsum)
        if const_expr(self.cfg.has_softcap):
            t = (cute.math.log2(p, fastmath=True) + lse2) * inv_cap_log2
            ds = ds * (1.0 - t * t) if p > 0.0 else Float32(0.0)
        return ds

    @cute.jit
    def store_kv(self, acc, scale, mX, thr_dkv, seqlen: SeqlenInfo, key_base: Int32, head_kv: Int32,
                 batch_idx: Int32, dim: cutlass.Constexpr):
        if const_expr(self.cfg.varlen):
            mX_cur = cute.domain_offset((seqlen.offset_k, 0, 0), mX)[None, head_kv, None]
        else:
            mX_cur = mX[batch_idx, None, head_kv, None]
        gX = cute.local_tile(cute.domain_offset((key_base, 0), mX_cur), (KEYS_PER_WG, dim), (0, 0))
        tXgX = acc_mn_view(thr_dkv.partition_C(gX))
        tXcX = acc_mn_view(thr_dkv.partition_C(cute.make_identity_tensor((KEYS_PER_WG, dim))))
        if const_expr(scale is not None):
            for i in cutlass.range_constexpr(cute.size(acc)):
                acc[i] = acc[i] * scale
        r16 = cute.make_rmem_tensor_like(acc, self.dtype)
        convert_to_16bit(acc, r16)
        r_mn = acc_mn_view(r16)
        for r in cutlass.range_constexpr(cute.size(r_mn, mode=[0])):
            if key_base + tXcX[r, 0][0] < seqlen.seqlen_k:
                for c in cutlass.range_constexpr(cute.size(r_mn, mode=[1])):
                    tXgX[r, c] = r_mn[r, c]
