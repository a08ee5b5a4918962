"""FlashBwdSm90: warp-specialised Hopper attention backward (main kernel: dK, dV and the dQ accumulator).

Math, tensors and workspace: ``bwd_config`` (module docstring); argument order ``BwdKernelArgs``. The
preprocess (``bwd_pre``) has written lse_log2, dpsum and zeroed dq_accum (and dq_sem); the
postprocess (``bwd_post``) turns dq_accum into dQ.

One CTA per (key tile, kv head, batch), 384 threads; two consumer schedules (``tile_config``):
head_dim <= 128 the 128-key schedule (TILE_N = 128), head_dim 192 / 256 / (192, 128) the wide one
(WIDE_TILE_N = 64, Note [wide schedule]). The 128-key schedule:

    warp 0        TMA producer: K and V of the tile once, then for every query head of the kv head's
                  group and every query tile m in ``QueryTileRange`` (ascending): Q[m] + lse_log2[m] on
                  pipeline_q, dO[m] + dpsum[m] on pipeline_do (``Tiles.q_stages`` / ``do_stages``)
    warp 1        dQ writer: per step waits until a consumer warpgroup staged its dQ region in shared
                  memory, then one TMA reduce-add (``cp.reduce.async.bulk.tensor ... add.f32``) per
                  staged region into dq_accum; deterministic: first waits for its turn on the query
                  tile's dq_sem counter, and bumps it after the reduces have completed (Notes
                  [deterministic dQ], [deterministic dQ, descending order])
    WG 1, WG 2    consumers; WG w owns keys [64 w, 64 w + 64) of the tile: per step
                      S^T = K_w Q^T, dP^T = V_w dO^T           (wgmma, both operands in smem)
                      mask, softcap, P^T = exp2(S^T scale log2e - lse_log2)
                      dS^T = P^T (dP^T - dpsum) (* (1 - tanh^2) with softcap)
                      dV_w += P^T dO, dK_w += dS^T Q           (wgmma, P^T / dS^T from registers)
                      dS^T -> smem (stmatrix), both WGs sync, dQ tile = dS K (smem x smem) -> fp32
                      staging -> warp 1
                  dK_w / dV_w stay in registers across all steps of all query heads of the group (GQA
                  sums its group without any fp32 expansion; bitwise deterministic by construction;
                  deterministic causal / window GQA instead takes one head per CTA, Note [group split]),
                  then dK * softmax_scale and dV go out with predicated stores (zeros for keys that no
                  query sees).

dQ tile split between the consumers (``dq_split``): "n" (d 128, tile_m 64): WG w computes columns
[w D/2, (w + 1) D/2); "m" (d 64, tile_m 128): WG w computes rows [64 w, 64 w + 64); "single" (d 96):
WG 1 computes the whole tile; "wide": Note [wide schedule]. Each WG stages its region (fp32,
swizzled) and warp 1 reduces each region with one TMA box.

Note [wide schedule] (d 192, 256, (192, 128)): 64 keys x d of dK plus dV per WG would need d
registers per thread for the accumulators alone, so the CTA takes 64 keys (tile_m 64) and splits
the other way: WG w computes S^T / dP^T (64 keys x 32 query rows, SS wgmma) for rows [32 w, 32 w + 32)
of the step and writes P^T and dS^T to shared memory (stmatrix); after a barrier it owns columns
[w d/2, (w + 1) d/2) of dK and dV (SS wgmma over the whole 64 x 64 P^T / dS^T: 64 x d/2 fp32 each,
d/2 registers per thread for both at d 256) and of the dQ tile. Q, K and dO use swizzle atoms no
wider than d/2 columns so each column half is a wgmma operand of its own (d 192: SW64). Shared
memory (``smem_bytes``; limit 232,448): d 256 keeps one dO stage and one P^T / dS^T stage and stages
dQ in two rounds of 64 columns per WG (``dq_rounds``; 32 KB instead of 64 KB), d 192 one P^T / dS^T
stage, (192, 128) two. With one P^T / dS^T stage both WGs meet on PDS_EMPTY_BARRIER before
overwriting it (each has waited for its GEMMs of the previous step).

Note [deterministic dQ]: query tile m of (batch, head) is reduced into by the key tiles
n in [first_key_tile(m), last_key_tile(m)] that see it (``QueryTileRange``, ``first_key_tile`` and
``last_key_tile`` in common/tile_range.py are exact inverses), one at a time in a fixed order: the
writer of key tile n waits until dq_sem == its turn, reduce-adds, waits for the writes to complete
and adds 1 (release). A key tile that does not see m never touches its counter, and no counter waits
on one. Without causal / window the turn is n - first_key_tile(m) (ascending n; CTAs are launched in
ascending n within a (head, batch), so the tile a writer waits on is already resident).

Note [deterministic dQ, descending order] (causal / window, the default there): in ascending order
key tile n's first query tile (its diagonal) would wait for every lower key tile to reach that tile,
which they do last (H200: det / FA4 det 0.49-0.67 for causal rows; 0.74-0.88 in this order). So the
writers of query tile m go in descending n (turn = last_key_tile(m) - n) and blockIdx.x maps to the
highest key tile first: a key tile is the first writer of its diagonal tiles and waits only on tiles
launched before it (FA4's "SPT" order). Every counter still sees each of its writers exactly once.

Note [head swizzle] (deterministic without causal / window, not varlen): a writer waits for the key
tile before it in the order, so a (head, batch)'s key tiles form a chain, and with blockIdx.x the key
tile, consecutive blocks are consecutive links: when an MHA CTA is short next to the hand-off latency
(8K rows: 128 steps), each link waits on the one launched just before it and the lag adds up along
the chain. So deterministic grids interleave ``swizzle_heads`` (batch, head) pairs
(``common/tile_range.head_swizzled_tile``: key tile n of those heads, then n + 1; as many as keep
their Q, dO and dQ accumulator in L2): a link is launched that many blocks after the one it waits on.
Waits still go only to earlier blocks. H200, 8K MHA non-causal: det / FA4 det 0.82 -> 0.89. Not
taken: the descending order (causal / window; 0.93-0.96 of FA4's deterministic backward without it)
and varlen, where the remapped batch index kept a cu_seqlens pointer live across the main loop (an
8-byte spill in the sm_90a matrix).

Note [group split] (``bwd_config.group_split``: deterministic GQA with causal / window): in the
descending order a kv head's longest key tiles (the low ones, which see every query) are launched
last, and with the group's G heads in one CTA each of them runs G times as long as an MHA CTA, so
the grid ends on a tail of them (H200, GQA 32 / 8 causal: det / FA4 det 0.74-0.79 against 0.92 for
MHA). So these configs take one CTA per (key tile, query head) -- blockIdx.y is the query head, the
CTA walks that head only -- and sum dK / dV over the group in head order: the CTA of group rank r
waits until the key tile's dkv_sem counter equals r, adds the fp32 partial the ranks before it left
in dk_accum / dv_accum (rank 0 reads nothing), and either stores the sum back and bumps the counter
(r < G - 1) or writes dK * scale and dV in the output dtype (r = G - 1). A CTA waits only on the
CTA of the same key tile and the previous query head, which has the smaller blockIdx.y and so was
launched before it; with the dQ counters (which also wait only on earlier CTAs) the earliest
unfinished CTA never waits. Key tiles no query sees (steps = 0, the same for every head of the
group) skip the counter; their last rank writes the zeros.

Note [scrubbed K / V] (NaN / Inf in keys and values a row cannot see; common/nonfinite.py): K and V of the
CTA's key tile stay in shared memory for every step, so after they land all 256 consumer threads zero their
non-finite elements once and flag their keys (``scrub_kv``); the flags come back as NaN where the unscrubbed
tiles would have put one into a visible entry (S^T on a flagged K row, dS^T where P^T != 0 on a flagged V
row), and masked entries, P^T = dS^T = 0, meet only zeros in dP^T = V dO^T and dQ = dS K.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from cute_kernels import arch as _arch
from cute_kernels.common import flashmask as fm
from cute_kernels.common import nonfinite as nf
from cute_kernels.common.mask import apply_mask_kv_major
from cute_kernels.common.seqlen import SeqlenInfo
from cute_kernels.common.softmax import softcap_logit
from cute_kernels.common.tile_range import (QueryTileRange, first_key_tile, head_swizzled_tile, last_key_tile,
                                             normalize_window, swizzle_heads)
from cute_kernels.common.utils import (LOG2_E, acc_as_operand_a, acc_mn_view, convert_to_16bit,
                                       ld_acquire_gpu, red_release_add_gpu, reread_tid_x, select_modes,
                                       sm90_thread0_cols,
                                       stage_acc_16bit, transpose_view, wgmma_gemm, wgmma_smem_layout)
from cute_kernels.dtypes import cutlass_dtype

from .bwd_config import ACCUM_ROW_PAD, DQ_SEM_ROWS, HEAD_DIMS, KV_SEM_KEYS, BwdConfig, group_split

SMEM_BYTES_MAX = 232_448
TILE_N = 128  # keys per CTA, head_dim <= 128
WIDE_TILE_N = 64  # keys per CTA, head_dim 192 / 256 (the wide schedule)
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
PDS_EMPTY_BARRIER = 6  # wide schedule, one P^T / dS^T stage: both WGs' GEMMs of the last step have read it
KV_TURN_BARRIER = 7  # group split: both consumer WGs, around the dK / dV turn (Note [group split])
SCRUB_BARRIER = 9  # both consumer WGs: K / V scrubbed (Note [scrubbed K / V]), flags readable
KV_FREE_BARRIER = 8  # staged dK / dV epilogue: both consumer WGs done with K / V smem, then staged into it


@dataclass(frozen=True)
class Tiles:
    """Tiling of one config (module docstring): query rows per step, keys per CTA, the dQ split, the
    stages of the Q / dO pipelines and of the P^T / dS^T smem tiles, dQ staging rounds per step."""

    tile_m: int
    tile_n: int
    dq_split: str  # "m" | "n" | "single" (the 128-key schedule) | "wide" (the 64-key schedule)
    q_stages: int = STAGES
    do_stages: int = STAGES
    pds_stages: int = STAGES
    dq_rounds: int = 1

    @property
    def wide(self) -> bool:
        return self.dq_split == "wide"


def tile_config(cfg: BwdConfig) -> Tiles:
    """The ``Tiles`` of ``cfg`` (see the module docstring; smem per config in ``smem_bytes``)."""
    if cfg.head_dim <= 64:
        return Tiles(128, TILE_N, "m")
    if cfg.head_dim <= 96:
        return Tiles(64, TILE_N, "single")
    if cfg.head_dim <= 128:
        return Tiles(64, TILE_N, "n")
    if cfg.head_dim_v > 192:  # d 256: one dO stage, dQ staged in two rounds of 64 columns per WG
        return Tiles(64, WIDE_TILE_N, "wide", do_stages=1, pds_stages=1, dq_rounds=2)
    if cfg.head_dim_v > 128:  # d 192
        return Tiles(64, WIDE_TILE_N, "wide", pds_stages=1)
    return Tiles(64, WIDE_TILE_N, "wide")  # (192, 128)


def _smem_layout(dtype, shape: tuple, major_cols: int):
    """``wgmma_smem_layout`` with the swizzle atom chosen for ``major_cols`` contiguous columns instead of
    shape[1] (the atom then never straddles a block of major_cols columns)."""
    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, major_cols), dtype)
    return cute.tile_to_shape(atom, shape, tuple(range(len(shape))))


class FlashBwdSm90:
    def __init__(self, cfg: BwdConfig):
        reason = FlashBwdSm90.unsupported_reason(cfg)
        if reason is not None:
            raise ValueError(f"FlashBwdSm90: {reason}")
        self.cfg = cfg
        # Note [deterministic dQ, descending order]
        self.spt = cfg.deterministic and (cfg.causal or cfg.has_window)
        # Note [head swizzle]: the ascending order's dense grids.
        self.head_swizzle = cfg.deterministic and not self.spt and not cfg.varlen
        # Note [group split]: one query head per CTA, dK / dV summed over the group in head order.
        self.split = group_split(cfg)
        self.heads_per_cta = 1 if self.split else cfg.qhead_per_kvhead
        # FlashMask stage B (steps the column bounds skip load and compute nothing) on every schedule but
        # d 96's single-WG dQ, which spilled 1344 B with it (sm_90a); there skipped steps run fully masked.
        t = tile_config(cfg)
        self.fm_skip_steps = bool(cfg.startend) and t.dq_split != "single"
        self.dtype = cutlass_dtype(cfg.dtype)
        self.hdim = cfg.head_dim
        self.hdimv = cfg.head_dim_v
        t = tile_config(cfg)
        self.tiles = t
        self.wide = t.wide
        self.tile_m, self.tile_n, self.dq_split = t.tile_m, t.tile_n, t.dq_split
        self.q_stages, self.do_stages, self.pds_stages, self.dq_rounds = (t.q_stages, t.do_stages, t.pds_stages,
                                                                          t.dq_rounds)
        # dQ region of one staging WG per round: (rows, cols) and how many WGs stage one.
        if self.dq_split == "m":
            self.dq_rows, self.dq_cols, self.dq_wgs = self.tile_m // 2, self.hdim, 2
        elif self.dq_split == "n":
            self.dq_rows, self.dq_cols, self.dq_wgs = self.tile_m, self.hdim // 2, 2
        elif self.dq_split == "wide":
            self.dq_rows, self.dq_cols, self.dq_wgs = self.tile_m, self.hdim // 2 // self.dq_rounds, 2
        else:
            self.dq_rows, self.dq_cols, self.dq_wgs = self.tile_m, self.hdim, 1
        # Issue dQ = dS K before dK += dS^T Q and stage dQ while the dK GEMM runs (tile_m 64; at tile_m
        # 128 the live dQ accumulator spills). Not in deterministic mode, where it measured no faster.
        self.dq_before_dk = self.tile_m == 64 and not cfg.deterministic and not self.wide
        # Note [staged dK / dV epilogue]: dense (not varlen: a TMA box would cross into the next sequence)
        # MHA without a window or softcap, the d <= 128 schedule: where it was measured faster (MHA at short
        # S, few query tiles per CTA) and compiles spill-free (with a window, GQA or softcap, 11 of those
        # configs spilled 8 bytes in the main loop; GQA measured 0.98-1.04x with it).
        self.kv_tma_store = (not cfg.varlen and not self.split and not self.wide and not cfg.has_window
                             and not cfg.has_softcap and cfg.qhead_per_kvhead == 1)

    # ------------------------------------------------------------------ host-side facts
    @staticmethod
    def unsupported_reason(cfg: BwdConfig) -> str | None:
        if cfg.startend and cfg.varlen:
            return "FlashMask startend_row_indices with varlen"
        if _arch.family(cfg.arch) != 90:
            return f"FlashBwdSm90 is the SM90 kernel, got arch {cfg.arch}"
        if cfg.dtype not in ("bfloat16", "float16"):
            return f"dtype {cfg.dtype} (only bfloat16/float16)"
        dims = (cfg.head_dim, cfg.head_dim_v)
        if dims not in HEAD_DIMS:
            return (f"attention backward with head_dim {cfg.head_dim} / head_dim_v {cfg.head_dim_v} on SM90 is not "
                    f"implemented (implemented: {', '.join(f'{d}/{dv}' for d, dv in HEAD_DIMS)})")
        if cfg.qhead_per_kvhead < 1:
            return f"qhead_per_kvhead {cfg.qhead_per_kvhead}"
        return None

    @staticmethod
    def smem_bytes(cfg: BwdConfig) -> int:
        t = tile_config(cfg)
        d, dv = cfg.head_dim, cfg.head_dim_v
        q = t.q_stages * t.tile_m * d * 2
        do = t.do_stages * t.tile_m * dv * 2
        k = t.tile_n * d * 2
        v = t.tile_n * dv * 2
        ds = t.pds_stages * t.tile_n * t.tile_m * 2  # dS^T (and P^T in the wide schedule)
        dq = (t.tile_m * d // t.dq_rounds) * 4  # dQ staging of one round (all staging WGs)
        stats = (t.q_stages + t.do_stages) * t.tile_m * 4
        barriers = 8 * (2 * (t.q_stages + t.do_stages) + 2)
        tiles = (q, do, k, v, ds, ds, dq) if t.wide else (q, do, k, v, ds, dq)
        # FlashMask: the skipped query-tile ranges of each query head the CTA walks (4 int32 each)
        heads = 1 if group_split(cfg) else cfg.qhead_per_kvhead
        fm_skips = 16 * heads + 16 if cfg.startend else 0  # (an upper bound)
        flags = 2 * t.tile_n + 16 + 4 * 2 * THREADS_PER_WG + 16  # Note [scrubbed K / V]
        return sum(-(-x // 1024) * 1024 for x in tiles) + stats + barriers + fm_skips + flags + 1024

    # ------------------------------------------------------------------ host launch
    def _shared_storage(self, sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout, sdQ_layout):
        fields = {
            "mbar_q": cute.struct.MemRange[Int64, 2 * self.q_stages],
            "mbar_do": cute.struct.MemRange[Int64, 2 * self.do_stages],
            "mbar_kv": cute.struct.MemRange[Int64, 2],
            "sLSE": cute.struct.Align[cute.struct.MemRange[Float32, self.tile_m * self.q_stages], 128],
            "sdPsum": cute.struct.Align[cute.struct.MemRange[Float32, self.tile_m * self.do_stages], 128],
            "sKVFlags": cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, 2 * self.tile_n], 16],
            "sKVBits": cute.struct.Align[cute.struct.MemRange[Int32, 2 * THREADS_PER_WG], 16],
            "sQ": cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024],
            "sdO": cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdO_layout)], 1024],
            "sK": cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024],
            "sV": cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024],
            "sdS": cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdS_layout)], 1024],
            "sdQ": cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sdQ_layout)], 1024],
        }
        if self.wide:  # P^T (keys, rows), the same layout as dS^T
            fields["sP"] = cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdS_layout)], 1024]
        if self.fm_skip_steps:  # FlashMask: per query head walked, (first start, length, second start, length);
            # placed with the small fields (at the end it grew the struct by a 1024-byte alignment step)
            small = {k: fields.pop(k) for k in ("mbar_q", "mbar_do", "mbar_kv", "sLSE", "sdPsum", "sKVFlags", "sKVBits")}
            small["sFmSkips"] = cute.struct.Align[cute.struct.MemRange[Int32, 4 * self.heads_per_cta], 16]
            fields = {**small, **fields}
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSElog2: cute.Tensor, mdPsum: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor,
                 mdV: cute.Tensor, mCuSeqlensQ, mCuSeqlensK, mdQsem, mdKaccum, mdVaccum, mdKVsem,
                 softmax_scale: Float32, softcap: Float32, window_left: Int32, window_right: Int32,
                 max_seqlen_q: Int32, max_seqlen_k: Int32, stream, mStartend=None, mFmMinMax=None):
        """``mStartend`` / ``mFmMinMax``: a FlashMask build's column bounds [B, Hm, Sk, n] and their per
        key tile (tile_n) min / max [B, Hm, NT, 2n] (attention/fm_meta.py), else None."""
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

        if const_expr(self.wide):
            # Column halves of Q, K (dK, dQ) and dO (dV) are separate wgmma operands: swizzle atoms that
            # do not straddle a half (d 192: 96 = 3 x 32 columns, SW64).
            sQ_layout = _smem_layout(self.dtype, (self.tile_m, self.hdim, self.q_stages), self.hdim // 2)
            sdO_layout = _smem_layout(self.dtype, (self.tile_m, self.hdimv, self.do_stages), self.hdimv // 2)
            sK_layout = _smem_layout(self.dtype, (self.tile_n, self.hdim), self.hdim // 2)
        else:
            sQ_layout = wgmma_smem_layout(self.dtype, (self.tile_m, self.hdim, STAGES))
            sdO_layout = wgmma_smem_layout(self.dtype, (self.tile_m, self.hdimv, STAGES))
            sK_layout = wgmma_smem_layout(self.dtype, (self.tile_n, self.hdim))
        sV_layout = wgmma_smem_layout(self.dtype, (self.tile_n, self.hdimv))
        sdS_layout = wgmma_smem_layout(self.dtype, (self.tile_n, self.tile_m, self.pds_stages))  # (keys, rows)
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
        tma_atom_dK = tma_dK = tma_atom_dV = tma_dV = None
        if const_expr(self.kv_tma_store):  # dK / dV stored from the K / V buffers (their own layouts)
            s2g = cpasync.CopyBulkTensorTileS2GOp()
            tma_atom_dK, tma_dK = cpasync.make_tiled_tma_atom(s2g, select_modes(mdK, order), sK_layout,
                                                              (self.tile_n, self.hdim))
            tma_atom_dV, tma_dV = cpasync.make_tiled_tma_atom(s2g, select_modes(mdV, order), sV_layout,
                                                              (self.tile_n, self.hdimv))
        self.tx_q = cute.size_in_bytes(self.dtype, sel(sQ_layout)) + self.tile_m * 4
        self.tx_do = cute.size_in_bytes(self.dtype, sel(sdO_layout)) + self.tile_m * 4
        self.tx_kv = cute.size_in_bytes(self.dtype, sK_layout) + cute.size_in_bytes(self.dtype, sV_layout)
        self.shared_storage = self._shared_storage(sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout,
                                                   sdQ_layout)
        assert self.shared_storage.size_in_bytes() <= min(SMEM_BYTES_MAX, FlashBwdSm90.smem_bytes(cfg)), \
            (self.shared_storage.size_in_bytes(), FlashBwdSm90.smem_bytes(cfg))

        if const_expr(varlen):
            batch = mCuSeqlensK.shape[0] - 1
            num_kv_heads = mK.shape[1]
            num_heads = mQ.shape[1]
        else:
            batch = mK.shape[0]
            num_kv_heads = mK.shape[2]
            num_heads = mQ.shape[2]
        grid = (cute.ceil_div(max_seqlen_k, self.tile_n), num_heads if const_expr(self.split) else num_kv_heads,
                batch)
        fm_head_div = Int32(1)
        if const_expr(cfg.startend != ""):
            fm_head_div = num_heads // mStartend.shape[1]  # query heads per mask head
        self.kernel(tma_Q, tma_K, tma_V, tma_dO, tma_LSE, tma_dPsum, tma_dQ, mdK, mdV, mCuSeqlensQ,
                    mCuSeqlensK, mdQsem, mdKaccum, mdVaccum, mdKVsem, tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO, tma_atom_LSE,
                    tma_atom_dPsum, tma_atom_dQ, sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout,
                    sdQ_layout, softmax_scale, softcap, window_left, window_right,
                    mQt.shape[0], mKt.shape[0], tma_atom_dK, tma_dK, tma_atom_dV, tma_dV, mStartend, mFmMinMax,
                    fm_head_div).launch(
            grid=grid, block=[NUM_THREADS, 1, 1], smem=self.shared_storage.size_in_bytes(),
            stream=stream, min_blocks_per_mp=1)

    # ------------------------------------------------------------------ device
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
               mLSE: cute.Tensor, mdPsum: cute.Tensor, mdQacc: cute.Tensor, mdK: cute.Tensor,
               mdV: cute.Tensor, mCuSeqlensQ, mCuSeqlensK, mdQsem, mdKaccum, mdVaccum, mdKVsem,
               tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom,
               tma_atom_dO: cute.CopyAtom, tma_atom_LSE: cute.CopyAtom, tma_atom_dPsum: cute.CopyAtom,
               tma_atom_dQ: cute.CopyAtom, sQ_layout: cute.ComposedLayout, sdO_layout: cute.ComposedLayout,
               sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
               sdS_layout: cute.ComposedLayout, sdQ_layout: cute.ComposedLayout,
               softmax_scale: Float32, softcap: Float32, window_left: Int32, window_right: Int32,
               seqlen_q_static: Int32, seqlen_k_static: Int32, tma_atom_dK, tma_dK, tma_atom_dV, tma_dV,
               mStartend, mFmMinMax, fm_head_div: Int32):
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
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=self.q_stages, producer_group=producer,
            consumer_group=consumers, tx_count=self.tx_q, defer_sync=True)
        pipeline_do = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_do.data_ptr(), num_stages=self.do_stages, producer_group=producer,
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
        sLSE = storage.sLSE.get_tensor(cute.make_layout((self.tile_m, self.q_stages)))
        sdPsum = storage.sdPsum.get_tensor(cute.make_layout((self.tile_m, self.do_stages)))

        n_tile, head_y, batch_idx = cute.arch.block_idx()
        if const_expr(self.head_swizzle):
            nx, ny, nz = cute.arch.grid_dim()
            n_tile, head_y, batch_idx = head_swizzled_tile(
                n_tile, head_y, batch_idx, nx, ny, nz,
                swizzle_heads(seqlen_q_static, self.hdim, self.hdimv, self.dtype.width // 8))
        # The query heads this CTA walks: head0 + [0, heads_per_cta) (Note [group split])
        head_kv, head0 = head_y, head_y * cfg.qhead_per_kvhead
        if const_expr(self.split):
            head_kv, head0 = head_y // cfg.qhead_per_kvhead, head_y
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
            steps = num_m * self.heads_per_cta
            # Workspace row of this sequence's row 0 (bwd_config.accum_row_start).
            row0 = Int32(0)
            if const_expr(cfg.varlen):
                row0 = (seqlen.offset_q + ACCUM_ROW_PAD * batch_idx) // ACCUM_ROW_PAD * ACCUM_ROW_PAD
            fmask = None
            if const_expr(cfg.startend != ""):
                # FlashMask (stage A): every step applies the column bounds unless the key tile's min / max
                # leave the step's query tile whole; steps they skip are masked entirely (P = dS = 0).
                fmask = SimpleNamespace(mStartend=mStartend, mFmMinMax=mFmMinMax, batch=batch_idx, n_tile=n_tile,
                                        head_div=fm_head_div)
            # Steps that compute: the (query head, query tile) pairs the column bounds do not skip (stage B:
            # skipped steps load nothing and compute nothing; with deterministic dQ their writer still
            # takes its turn). ``steps`` stays the structural count (the dK / dV turn protocol).
            live_steps = steps
            if const_expr(self.fm_skip_steps):
                # One thread writes each walked head's merged skipped ranges to shared memory; every role
                # reads them there per step (kept in registers or recomputed per step they spilled).
                sSkips = storage.sFmSkips.get_tensor(cute.make_layout((4, self.heads_per_cta)))
                fmask.skips = sSkips
                if tidx == 0:
                    for hi in cutlass.range_constexpr(self.heads_per_cta):
                        sk = fm.merged_skips(qtiles.m_min, qtiles.m_max,
                                             self.fm_skip_ranges(fmask, head_y, hi, seqlen.seqlen_q))
                        for c in cutlass.range_constexpr(4):
                            sSkips[c, hi] = sk[c]
                cute.arch.barrier()
                live_steps = Int32(0)
                for hi in cutlass.range_constexpr(self.heads_per_cta):
                    live_steps = live_steps + self.fm_live_count(fmask, head_y, hi, qtiles, seqlen.seqlen_q)
            if warp_idx < 4:
                cute.arch.setmaxregister_decrease(PRODUCER_REGS)
                if warp_idx == 0:
                    self.load(mQ, mK, mV, mdO, mLSE, mdPsum, sQ, sK, sV, sdO, sLSE, sdPsum, tma_atom_Q,
                              tma_atom_K, tma_atom_V, tma_atom_dO, tma_atom_LSE, tma_atom_dPsum,
                              pipeline_q, pipeline_do, pipeline_kv, seqlen, qtiles, live_steps, row0, n_tile,
                              head_kv, head0, batch_idx, fmask, head_y)
                if warp_idx == 1:
                    self.store_dq(mdQacc, mdQsem, sdQ, tma_atom_dQ, seqlen, qtiles, live_steps, row0, left,
                                  right, n_tile, head0, batch_idx, fmask, head_y)
            else:
                cute.arch.setmaxregister_increase(CONSUMER_REGS)
                # the last four: the TMA store of Note [staged dK / dV epilogue] (None where not used)
                kv_out = (mdK, mdV, mdKaccum, mdVaccum, mdKVsem, tma_atom_dK, tma_dK, tma_atom_dV, tma_dV)
                sKVFlags = (storage.sKVFlags.get_tensor(cute.make_layout((self.tile_n, 2))),
                            storage.sKVBits.get_tensor(cute.make_layout(2 * THREADS_PER_WG)))
                if const_expr(self.wide):
                    sP = storage.sP.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
                    self.consume_wide(kv_out, sQ, sK, sV, sdO, sP, sdS, sdQ, sLSE, sdPsum, pipeline_q,
                                      pipeline_do, pipeline_kv, seqlen, qtiles, steps, left, right, n_tile,
                                      head_kv, head_y, batch_idx, tidx - THREADS_PER_WG, softmax_scale, softcap,
                                      mCuSeqlensK, fmask, live_steps, sKVFlags)
                else:
                    self.consume(kv_out, sQ, sK, sV, sdO, sdS, sdQ, sLSE, sdPsum, pipeline_q, pipeline_do,
                                 pipeline_kv, seqlen, qtiles, steps, left, right, n_tile, head_kv, head_y,
                                 batch_idx, tidx - THREADS_PER_WG, softmax_scale, softcap, mCuSeqlensK, fmask,
                                 live_steps, sKVFlags)

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
             head_kv: Int32, head0: Int32, batch_idx: Int32, fmask=None, head_y: Int32 = 0):
        """``steps``: the steps that compute (FlashMask: those the column bounds do not skip)."""
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
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
            # dO on a state of its own only where its stage count differs (wide schedule, d 256)
            state_do = None
            if const_expr(self.do_stages != self.q_stages):
                state_do = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.do_stages)
            for hi in cutlass.range(self.heads_per_cta, unroll=1):
                head = head0 + hi
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
                for mi in cutlass.range(self.fm_live_count(fmask, head_y, hi, qtiles, seqlen.seqlen_q), unroll=1):
                    m = self.fm_live_tile(fmask, head_y, hi, qtiles, mi, seqlen.seqlen_q)
                    if True:  # (the body's indentation of the step loop without FlashMask)
                        pipeline_q.producer_acquire(state)
                        bar_q = pipeline_q.producer_get_barrier(state)
                        cute.copy(tma_atom_Q, tQgQ[None, m], tQsQ[None, state.index], tma_bar_ptr=bar_q)
                        cute.copy(tma_atom_LSE, tLgL[None, m], tLsL[None, state.index], tma_bar_ptr=bar_q)
                        if const_expr(state_do is None):
                            pipeline_do.producer_acquire(state)
                            bar_do = pipeline_do.producer_get_barrier(state)
                            cute.copy(tma_atom_dO, tdOgdO[None, m], tdOsdO[None, state.index], tma_bar_ptr=bar_do)
                            cute.copy(tma_atom_dPsum, tPgP[None, m], tPsP[None, state.index], tma_bar_ptr=bar_do)
                        else:
                            pipeline_do.producer_acquire(state_do)
                            bar_do = pipeline_do.producer_get_barrier(state_do)
                            cute.copy(tma_atom_dO, tdOgdO[None, m], tdOsdO[None, state_do.index],
                                      tma_bar_ptr=bar_do)
                            cute.copy(tma_atom_dPsum, tPgP[None, m], tPsP[None, state_do.index], tma_bar_ptr=bar_do)
                            state_do.advance()
                        state.advance()

    # ------------------------------------------------------------------ dQ writer (warp 1)
    @cute.jit
    def store_dq(self, mdQacc, mdQsem, sdQ, tma_atom_dQ, seqlen: SeqlenInfo, qtiles: QueryTileRange,
                 steps: Int32, row0: Int32, left: Int32, right: Int32, n_tile: Int32, head0: Int32,
                 batch_idx: Int32, fmask=None, head_y: Int32 = 0):
        """``steps``: the steps that compute (FlashMask: those the column bounds do not skip); a skipped
        step reduces nothing but, with deterministic dQ, still takes and passes on its turn."""
        cfg = self.cfg
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
        for hi in cutlass.range(self.heads_per_cta, unroll=1):
            head = head0 + hi
            gdQ = cute.local_tile(mdQ_seq[None, None, head], (self.dq_rows, self.dq_cols), (None, None))
            tdQsdQ, tdQgdQ = cpasync.tma_partition(tma_atom_dQ, 0, one, cute.group_modes(sdQ, 0, 2),
                                                   cute.group_modes(gdQ, 0, 2))
            # Deterministic dQ: every query tile of the range takes its turn (a skipped one reduces nothing);
            # otherwise only the steps that compute, in the consumers' order.
            n_m = qtiles.m_max - qtiles.m_min
            if const_expr(not cfg.deterministic):
                n_m = self.fm_live_count(fmask, head_y, hi, qtiles, seqlen.seqlen_q)
            for mi in cutlass.range(n_m, unroll=1):
                m = qtiles.m_min + mi
                if const_expr(not cfg.deterministic):
                    m = self.fm_live_tile(fmask, head_y, hi, qtiles, mi, seqlen.seqlen_q)
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
                        cur = ld_acquire_gpu(sem_addr)
                        while cur != lock:
                            cur = ld_acquire_gpu(sem_addr)
                    cute.arch.sync_warp()
                live = True
                if const_expr(cfg.deterministic):
                    live = not self.fm_step_skipped(fmask, head_y, hi, m, seqlen.seqlen_q)
                if live:
                    # The whole warp issues (the TMA copy elects one lane itself; one active lane hangs). Region
                    # r goes out as soon as WG r staged it and is handed back once the TMA has read it.
                    # The wide schedule stages dQ in dq_rounds rounds: round j of WG r is column block
                    # r * dq_rounds + j.
                    for j in cutlass.range_constexpr(self.dq_rounds):
                        for r in cutlass.range_constexpr(self.dq_wgs):
                            cute.arch.barrier(barrier_id=DQ_FULL_BARRIER + r, number_of_threads=nbar)
                            if const_expr(self.dq_split == "m"):
                                cute.copy(tma_atom_dQ, tdQsdQ[None, r], tdQgdQ[None, m * 2 + r, 0])
                            elif const_expr(self.dq_split == "n"):
                                cute.copy(tma_atom_dQ, tdQsdQ[None, r], tdQgdQ[None, m, r])
                            elif const_expr(self.dq_split == "wide"):
                                cute.copy(tma_atom_dQ, tdQsdQ[None, r], tdQgdQ[None, m, r * self.dq_rounds + j])
                            else:
                                cute.copy(tma_atom_dQ, tdQsdQ[None, r], tdQgdQ[None, m, 0])
                            cute.arch.cp_async_bulk_commit_group()
                            cute.arch.cp_async_bulk_wait_group(0, read=True)
                            cute.arch.sync_warp()
                            if const_expr(j + 1 < self.dq_rounds):
                                cute.arch.barrier_arrive(barrier_id=DQ_EMPTY_BARRIER + r, number_of_threads=nbar)
                            else:
                                if step + 1 < steps:
                                    cute.arch.barrier_arrive(barrier_id=DQ_EMPTY_BARRIER + r, number_of_threads=nbar)
                if const_expr(cfg.deterministic):
                    cute.arch.cp_async_bulk_wait_group(0, read=False)
                    cute.arch.sync_warp()
                    if lane == 0:
                        cute.arch.fence_acq_rel_gpu()
                        red_release_add_gpu(sem_addr, Int32(1))
                    cute.arch.sync_warp()
                if live:
                    step = step + 1
        # The CTA's smem must outlive the reduces' reads (already waited for per region); their global
        # writes need not be waited for -- they complete before the kernel does (deterministic mode waited
        # for them per step, before each turn counter release).
        cute.arch.cp_async_bulk_wait_group(0, read=True)

    # ------------------------------------------------------------------ consumers
    @cute.jit
    def consume(self, kv_out, sQ, sK, sV, sdO, sdS, sdQ, sLSE, sdPsum, pipeline_q, pipeline_do, pipeline_kv,
                seqlen: SeqlenInfo, qtiles: QueryTileRange, steps: Int32, left: Int32, right: Int32,
                n_tile: Int32, head_kv: Int32, head_y: Int32, batch_idx: Int32, ctidx: Int32,
                softmax_scale: Float32, softcap: Float32, mCuSeqlensK, fmask=None, live_steps=None,
                sKVFlags=None):
        """``steps``: the structural step count (the dK / dV epilogue's protocol); ``live_steps``: the steps
        that compute (FlashMask: those the column bounds do not skip; None = ``steps``)."""
        cfg = self.cfg
        if const_expr(live_steps is None):
            live_steps = steps
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

        key_base = n_tile * self.tile_n + wg * KEYS_PER_WG
        sc = self.score_context(thr_sdp, (KEYS_PER_WG, self.tile_m), key_base, None, seqlen, left, right,
                                softmax_scale, softcap)
        nbar_dq = THREADS_PER_WG + 32

        if live_steps > 0:
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            pipeline_kv.consumer_wait(kv_state)
            self.scrub_kv(sK, sV, sKVFlags, ctidx, sc, n_tile)
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
            step = Int32(0)
            for hi in cutlass.range(self.heads_per_cta, unroll=1):
                fmh = self.fm_key_bounds(self.fm_head(fmask, head_y, hi), sc)
                for mi in cutlass.range(self.fm_live_count(fmask, head_y, hi, qtiles, seqlen.seqlen_q), unroll=1):
                    m = self.fm_live_tile(fmask, head_y, hi, qtiles, mi, seqlen.seqlen_q)
                    stage = state.index
                    ds_stage = step % STAGES
                    step_masked = self.step_masked(sc, qtiles, m)
                    fm_partial = self.fm_step_partial(fmh, sc, m)
                    acc_S, acc_dP = self.score_gemms(mma_sdp, acc_S_shape, tSrK, tSrQ, tPrV, tPrdO, pipeline_q, state,
                                                     pipeline_do, state)
                    self.probs_and_grads(acc_S, acc_dP, sc, m, step_masked, sLSE, sdPsum,
                                         stage, stage, self.tile_m == 128, fmh, fm_partial, sKVFlags[1])
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
        if const_expr(self.kv_tma_store):
            # Note [staged dK / dV epilogue]: every wgmma of both WGs has completed (each step ends in
            # wait_group(0)), so the K / V buffers are free once both WGs are here.
            cute.arch.barrier(barrier_id=KV_FREE_BARRIER, number_of_threads=2 * THREADS_PER_WG)
            self.stage_kv(acc_dK, softmax_scale, sK_w, mma_dkv, tid)
            self.stage_kv(acc_dV, None, sV_w, mma_dkv, tid)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=KV_FREE_BARRIER, number_of_threads=2 * THREADS_PER_WG)
            if ctidx == 0:
                for atom, mX, sX, dim in ((kv_out[5], kv_out[6], sK, self.hdim), (kv_out[7], kv_out[8], sV, self.hdimv)):
                    gX = cute.local_tile(self._seq_view(mX, seqlen.offset_k, batch_idx)[None, None, head_kv],
                                         (self.tile_n, dim), (n_tile, 0))
                    tXsX, tXgX = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2),
                                                       cute.group_modes(gX, 0, 2))
                    cute.copy(atom, tXsX, tXgX)
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)  # smem is read before the CTA exits
        else:
            self.finish_kv(kv_out, acc_dK, acc_dV, thr_dkv, thr_dkv, seqlen, mCuSeqlensK, key_base, n_tile,
                           head_kv, head_y, batch_idx, steps, ctidx, softmax_scale, self.hdim, self.hdimv, 0, 0)

    @cute.jit
    def stage_kv(self, acc, scale, sX_w, mma_dkv, tid: Int32):
        """Note [staged dK / dV epilogue]: acc (* scale) in q's dtype -> this WG's 64 rows of the K or V
        buffer (stmatrix, in the buffer's own swizzled layout), which one thread then TMA-stores whole
        (the box clips rows past Sk). dK goes to the K buffer and dV to the V buffer. Storing the wgmma
        fragments straight to global memory (2-byte pieces, 8 rows per warp instruction, as the varlen
        and group-split paths still do) is a per-CTA fixed cost that shows at short sequences, where a
        CTA runs few query tiles; FA4 stages through the free K / V buffers and TMA-stores too."""
        if const_expr(scale is not None):
            for i in cutlass.range_constexpr(cute.size(acc)):
                acc[i] = acc[i] * scale
        r16 = cute.make_rmem_tensor_like(acc, self.dtype)
        convert_to_16bit(acc, r16)
        stage_acc_16bit(r16, mma_dkv, tid, sX_w)

    # ------------------------------------------------------------------ consumers, wide schedule (d > 128)
    @cute.jit
    def consume_wide(self, kv_out, sQ, sK, sV, sdO, sP, sdS, sdQ, sLSE, sdPsum, pipeline_q, pipeline_do,
                     pipeline_kv, seqlen: SeqlenInfo, qtiles: QueryTileRange, steps: Int32, left: Int32,
                     right: Int32, n_tile: Int32, head_kv: Int32, head_y: Int32, batch_idx: Int32,
                     ctidx: Int32, softmax_scale: Float32, softcap: Float32, mCuSeqlensK, fmask=None,
                     live_steps=None, sKVFlags=None):
        """Both WGs see all 64 keys of the tile: WG w computes S^T / dP^T for query rows [32 w, 32 w + 32)
        of the step, writes P^T / dS^T to smem, then owns columns [w d / 2, (w + 1) d / 2) of dK, dV
        (SS wgmma over the whole P^T / dS^T) and of the dQ tile (Note [wide schedule]). ``live_steps`` as in
        ``consume``."""
        cfg = self.cfg
        if const_expr(live_steps is None):
            live_steps = steps
        dt = self.dtype
        wg = cute.arch.make_warp_uniform(ctidx // THREADS_PER_WG)
        tid = ctidx % THREADS_PER_WG
        K = warpgroup.OperandMajorMode.K
        MN = warpgroup.OperandMajorMode.MN
        rows_w = self.tile_m // 2
        dh, dvh = self.hdim // 2, self.hdimv // 2
        mma_sdp = sm90_utils.make_trivial_tiled_mma(dt, dt, K, K, Float32, atom_layout_mnk=(1, 1, 1),
                                                    tiler_mn=(self.tile_n, rows_w))
        mma_dk = sm90_utils.make_trivial_tiled_mma(dt, dt, K, MN, Float32, atom_layout_mnk=(1, 1, 1),
                                                   tiler_mn=(self.tile_n, dh))
        mma_dv = sm90_utils.make_trivial_tiled_mma(dt, dt, K, MN, Float32, atom_layout_mnk=(1, 1, 1),
                                                   tiler_mn=(self.tile_n, dvh))
        mma_dq = sm90_utils.make_trivial_tiled_mma(dt, dt, MN, MN, Float32, atom_layout_mnk=(1, 1, 1),
                                                   tiler_mn=(self.tile_m, self.dq_cols))
        thr_sdp = mma_sdp.get_slice(tid)
        thr_dk = mma_dk.get_slice(tid)
        thr_dv = mma_dv.get_slice(tid)
        thr_dq = mma_dq.get_slice(tid)

        # S^T = K Q_w^T, dP^T = V dO_w^T (this WG's query rows).
        sQ_w = cute.local_tile(sQ, (rows_w, self.hdim, self.q_stages), (wg, 0, 0))
        sdO_w = cute.local_tile(sdO, (rows_w, self.hdimv, self.do_stages), (wg, 0, 0))
        tSrK = thr_sdp.make_fragment_A(thr_sdp.partition_A(sK))
        tSrQ = thr_sdp.make_fragment_B(thr_sdp.partition_B(sQ_w))  # (.., .., k, stage)
        tPrV = thr_sdp.make_fragment_A(thr_sdp.partition_A(sV))
        tPrdO = thr_sdp.make_fragment_B(thr_sdp.partition_B(sdO_w))
        # dV_w += P^T dO[:, half w], dK_w += dS^T Q[:, half w] (all query rows of the step).
        sdOt_w = cute.local_tile(transpose_view(sdO), (dvh, self.tile_m, self.do_stages), (wg, 0, 0))
        sQt_w = cute.local_tile(transpose_view(sQ), (dh, self.tile_m, self.q_stages), (wg, 0, 0))
        tVrP = thr_dv.make_fragment_A(thr_dv.partition_A(sP))  # (.., .., k, pds stage)
        tVrdOt = thr_dv.make_fragment_B(thr_dv.partition_B(sdOt_w))
        tKrdS = thr_dk.make_fragment_A(thr_dk.partition_A(sdS))
        tKrQt = thr_dk.make_fragment_B(thr_dk.partition_B(sQt_w))
        acc_S_shape = thr_sdp.partition_shape_C((self.tile_n, rows_w))
        acc_dV = cute.make_rmem_tensor(thr_dv.partition_shape_C((self.tile_n, dvh)), Float32)
        acc_dK = cute.make_rmem_tensor(thr_dk.partition_shape_C((self.tile_n, dh)), Float32)
        acc_dV.fill(0.0)
        acc_dK.fill(0.0)

        # dQ[:, block] = dS K[:, block] for this WG's column blocks wg * dq_rounds + j.
        tdQrdS = thr_dq.make_fragment_A(thr_dq.partition_A(transpose_view(sdS)))  # (.., .., k, pds stage)
        sKt = transpose_view(sK)  # (D, keys)
        tdQrK = [thr_dq.make_fragment_B(thr_dq.partition_B(
            cute.local_tile(sKt, (self.dq_cols, self.tile_n), (wg * self.dq_rounds + j, 0))))
            for j in range(self.dq_rounds)]
        acc_dQ_shape = thr_dq.partition_shape_C((self.tile_m, self.dq_cols))
        tdQsdQ = thr_dq.partition_C(sdQ[None, None, wg])

        # P^T, dS^T of this WG's rows -> smem (stmatrix).
        st_atom = sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, dt, Float32)
        st_copy = cute.make_tiled_copy_C(st_atom, mma_sdp)
        thr_st = st_copy.get_slice(tid)
        tSsP = thr_st.partition_D(cute.local_tile(sP, (self.tile_n, rows_w, self.pds_stages), (0, wg, 0)))
        tSsdS = thr_st.partition_D(cute.local_tile(sdS, (self.tile_n, rows_w, self.pds_stages), (0, wg, 0)))

        key_base = n_tile * self.tile_n
        sc = self.score_context(thr_sdp, (self.tile_n, rows_w), key_base, wg * rows_w, seqlen, left, right,
                                softmax_scale, softcap)
        nbar_dq = THREADS_PER_WG + 32

        if live_steps > 0:
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            pipeline_kv.consumer_wait(kv_state)
            self.scrub_kv(sK, sV, sKVFlags, ctidx, sc, n_tile)
            state_q = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
            state_do = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.do_stages)
            step = Int32(0)
            for hi in cutlass.range(self.heads_per_cta, unroll=1):
                fmh = self.fm_key_bounds(self.fm_head(fmask, head_y, hi), sc)
                for mi in cutlass.range(self.fm_live_count(fmask, head_y, hi, qtiles, seqlen.seqlen_q), unroll=1):
                    m = self.fm_live_tile(fmask, head_y, hi, qtiles, mi, seqlen.seqlen_q)
                    sq = state_q.index
                    sd = state_do.index
                    ps = step % self.pds_stages
                    step_masked = self.step_masked(sc, qtiles, m)
                    fm_partial = self.fm_step_partial(fmh, sc, m)
                    acc_S, acc_dP = self.score_gemms(mma_sdp, acc_S_shape, tSrK, tSrQ, tPrV, tPrdO, pipeline_q,
                                                     state_q, pipeline_do, state_do)
                    self.probs_and_grads(acc_S, acc_dP, sc, m, step_masked, sLSE, sdPsum,
                                         sq, sd, False, fmh, fm_partial, sKVFlags[1])
                    rP = cute.make_rmem_tensor(acc_S_shape, dt)
                    rdS = cute.make_rmem_tensor(acc_S_shape, dt)
                    convert_to_16bit(acc_S, rP)
                    convert_to_16bit(acc_dP, rdS)
                    if const_expr(self.pds_stages == 1):
                        cute.arch.barrier(barrier_id=PDS_EMPTY_BARRIER, number_of_threads=2 * THREADS_PER_WG)
                    cute.copy(st_copy, thr_st.retile(rP), tSsP[None, None, None, ps])
                    cute.copy(st_copy, thr_st.retile(rdS), tSsdS[None, None, None, ps])
                    cute.arch.fence_view_async_shared()
                    cute.arch.barrier(barrier_id=DS_FULL_BARRIER, number_of_threads=2 * THREADS_PER_WG)
                    wgmma_gemm(mma_dv, acc_dV, tVrP[None, None, None, ps], tVrdOt[None, None, None, sd], False)
                    wgmma_gemm(mma_dk, acc_dK, tKrdS[None, None, None, ps], tKrQt[None, None, None, sq], False)
                    acc_dQ = []
                    for j in cutlass.range_constexpr(self.dq_rounds):
                        acc = cute.make_rmem_tensor(acc_dQ_shape, Float32)
                        wgmma_gemm(mma_dq, acc, tdQrdS[None, None, None, ps], tdQrK[j], True)
                        acc_dQ.append(acc)
                    warpgroup.wait_group(self.dq_rounds)  # dV and dK done: the Q and dO stages are free
                    pipeline_q.consumer_release(state_q)
                    pipeline_do.consumer_release(state_do)
                    for j in cutlass.range_constexpr(self.dq_rounds):
                        warpgroup.wait_group(self.dq_rounds - 1 - j)
                        # Staging free (warp 1 has read the previous round) -> write, hand to warp 1.
                        cute.arch.barrier(barrier_id=DQ_EMPTY_BARRIER + wg, number_of_threads=nbar_dq)
                        for i in cutlass.range_constexpr(cute.size(acc_dQ[j])):
                            tdQsdQ[i] = acc_dQ[j][i]
                        cute.arch.fence_view_async_shared()
                        cute.arch.barrier_arrive(barrier_id=DQ_FULL_BARRIER + wg, number_of_threads=nbar_dq)
                    state_q.advance()
                    state_do.advance()
                    step = step + 1

        # Epilogue: dK * scale, dV (this WG's column halves); keys past seqlen_k are not written.
        self.finish_kv(kv_out, acc_dK, acc_dV, thr_dk, thr_dv, seqlen, mCuSeqlensK, key_base, n_tile, head_kv,
                       head_y, batch_idx, steps, ctidx, softmax_scale, dh, dvh, wg * dh, wg * dvh)

    @cute.jit
    def scrub_kv(self, sK, sV, sKVFlags, ctidx: Int32, sc, n_tile: Int32):
        """Note [scrubbed K / V]: the CTA's K and V tiles stay in shared memory for every step, so both are
        scrubbed once, here, by all consumer threads (common/nonfinite.py): non-finite elements zeroed, their
        keys flagged. Each thread keeps its key rows' flags (bit r: K of ``sc.keys[r]``, bit 8 + r: its V) in
        its ``sKVBits`` word (in a register across the step loop it spilled), which ``probs_and_grads`` turns back into the NaN the unscrubbed tiles give the rows that see them:
        S^T = NaN on a flagged K row (before the mask), dS^T = NaN where P^T != 0 on a flagged V row. dQ = dS K
        then reads zeros where dS = 0, and dP^T reads no NaN where P^T = 0."""
        threads = 2 * THREADS_PER_WG
        sKVFlags, sKVBits = sKVFlags
        nf.scrub_rows(sK, sKVFlags[None, 0], ctidx, threads,
                      nf.threads_per_row(self.tile_n, self.hdim, threads, self.dtype))
        nf.scrub_rows(sV, sKVFlags[None, 1], ctidx, threads,
                      nf.threads_per_row(self.tile_n, self.hdimv, threads, self.dtype))
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=SCRUB_BARRIER, number_of_threads=threads)
        bits = Int32(0)
        for r in cutlass.range_constexpr(len(sc.keys)):
            local = sc.keys[r] - n_tile * self.tile_n
            bits = bits | (Int32(sKVFlags[local, 0]) << r) | (Int32(sKVFlags[local, 1]) << (8 + r))
        sKVBits[ctidx] = bits  # read back by this thread only

    @cute.jit
    def score_gemms(self, mma_sdp, acc_S_shape, tSrK, tSrQ, tPrV, tPrdO, pipeline_q, state_q, pipeline_do,
                    state_do):
        """S^T = K Q^T and dP^T = V dO^T of one step, each issued once its stage is full; returns with
        the dP^T wgmma still in flight."""
        acc_S = cute.make_rmem_tensor(acc_S_shape, Float32)
        acc_dP = cute.make_rmem_tensor(acc_S_shape, Float32)
        pipeline_q.consumer_wait(state_q)
        wgmma_gemm(mma_sdp, acc_S, tSrK, tSrQ[None, None, None, state_q.index], True)
        pipeline_do.consumer_wait(state_do)
        wgmma_gemm(mma_sdp, acc_dP, tPrV, tPrdO[None, None, None, state_do.index], True)
        warpgroup.wait_group(1)
        return acc_S, acc_dP

    @cute.jit
    def score_context(self, thr_sdp, shape, key_base: Int32, col0, seqlen: SeqlenInfo, left: Int32, right: Int32,
                      softmax_scale: Float32, softcap: Float32):
        """Coordinates of this thread's S^T elements of ``shape`` (keys as rows from ``key_base``, query
        rows as columns from ``col0``), the mask's bounds and the score scales (log2 units)."""
        cfg = self.cfg
        tScS_mn = acc_mn_view(thr_sdp.partition_C(cute.make_identity_tensor(shape)))
        keys = [key_base + tScS_mn[r, 0][0] for r in range(cute.size(tScS_mn, mode=[0]))]
        thr_col = tScS_mn[0, 0][1]  # query row of register column 0 within the step
        if const_expr(col0 is not None):
            thr_col = thr_col + col0
        sc = SimpleNamespace(keys=keys, thr_col=thr_col, cols=sm90_thread0_cols(shape[1]),
                             ncols=cute.size(tScS_mn, mode=[1]), seqlen=seqlen,
                             shift=seqlen.seqlen_k - seqlen.seqlen_q, left=left, right=right,
                             mask_right=const_expr(cfg.causal or cfg.has_window), softcap=softcap,
                             key_tail=key_base + shape[0] > seqlen.seqlen_k)
        if const_expr(cfg.has_softcap):
            sc.scale_log2 = Float32(LOG2_E)
            sc.softcap_in = softmax_scale / softcap
            sc.inv_cap_log2 = 1.0 / (softcap * LOG2_E)
        else:
            sc.scale_log2 = softmax_scale * LOG2_E
            sc.softcap_in = Float32(0.0)
            sc.inv_cap_log2 = Float32(0.0)
        return sc

    @cute.jit
    def step_masked(self, sc, qtiles: QueryTileRange, m: Int32):
        """Whether step ``m`` (query tile) needs the element mask: this WG's keys reach past seqlen_k, or
        the tile is cut by the right / left bound (``QueryTileRange.m_right_mask`` / ``m_left_mask``).
        On the other steps every element is visible, so skipping the mask changes no value."""
        masked = sc.key_tail
        if const_expr(sc.mask_right):
            masked = masked or m < qtiles.m_right_mask
        if const_expr(self.cfg.has_window):
            masked = masked or m >= qtiles.m_left_mask
        return masked

    @cute.jit
    def fm_head(self, fmask, head_y: Int32, hi: Int32):
        """FlashMask state of the query head the CTA walks at ``hi`` (None without a mask): the kernel's
        mask tensors and this head's mask head. The views are taken where they are used (probs_and_grads):
        held across the query-tile loop they spilled (8-18 registers of the 240)."""
        if const_expr(fmask is None):
            return None
        head = head_y + hi if const_expr(self.split) else head_y * self.cfg.qhead_per_kvhead + hi
        mh = head // fmask.head_div
        return SimpleNamespace(mStartend=fmask.mStartend, mFmMinMax=fmask.mFmMinMax, batch=fmask.batch,
                               n_tile=fmask.n_tile, mh=mh, key_bounds=None)

    @cute.jit
    def fm_skip_ranges(self, fmask, head_y: Int32, hi, seqlen_q: Int32):
        """``common/flashmask.skipped_query_tiles`` of the query head the CTA walks at ``hi``."""
        head = head_y + hi if const_expr(self.split) else head_y * self.cfg.qhead_per_kvhead + hi
        mh = head // fmask.head_div
        lo, hi_ = fm.load_tile_minmax(fmask.mFmMinMax[fmask.batch, mh, None, None], fmask.n_tile, self.cfg.startend)
        return fm.skipped_query_tiles(lo, hi_, self.cfg.startend, self.tile_m, seqlen_q)

    @cute.jit
    def fm_live_count(self, fmask, head_y: Int32, hi, qtiles: QueryTileRange, seqlen_q: Int32) -> Int32:
        """Steps of head ``hi`` that compute: the query tiles of ``qtiles`` the column bounds do not skip."""
        if const_expr(fmask is None or not self.fm_skip_steps):
            return qtiles.m_max - qtiles.m_min
        return fm.live_count(qtiles.m_min, qtiles.m_max, self.fm_skips(fmask, hi))

    @cute.jit
    def fm_live_tile(self, fmask, head_y: Int32, hi, qtiles: QueryTileRange, mi: Int32, seqlen_q: Int32) -> Int32:
        """The query tile of head ``hi``'s ``mi``-th computing step (the ranges are recomputed here from the
        key tile's min / max rather than kept live across the step loop)."""
        if const_expr(fmask is None or not self.fm_skip_steps):
            return qtiles.m_min + mi
        return fm.live_tile(mi, qtiles.m_min, self.fm_skips(fmask, hi))

    @cute.jit
    def fm_step_skipped(self, fmask, head_y: Int32, hi, m: Int32, seqlen_q: Int32):
        """Whether the column bounds skip step (head ``hi``, query tile ``m``) -- False without a mask. Every
        role (load, dQ writer, consumers) and the kernel's live step count read this one rule."""
        if const_expr(fmask is None or not self.fm_skip_steps):
            return False
        fa, fl, sa, sl = self.fm_skips(fmask, hi)
        return (m >= fa and m < fa + fl) or (m >= sa and m < sa + sl)

    def fm_skips(self, fmask, hi):
        """Head ``hi``'s merged skipped ranges (common/flashmask.merged_skips), from shared memory."""
        return tuple(fmask.skips[c, hi] for c in range(4))

    @cute.jit
    def fm_key_bounds(self, fmh, sc):
        """The column bounds of this thread's keys (``sc.keys``) for the head of ``fmh``: loaded once per
        head and kept in registers (2 keys x n values) instead of loaded in every step."""
        if const_expr(fmh is not None):
            bounds = fmh.mStartend[fmh.batch, fmh.mh, None, None]
            fmh.key_bounds = [fm.load_bounds(bounds, cutlass.min(key, sc.seqlen.seqlen_k - 1), self.cfg.startend)
                              for key in sc.keys]
        return fmh

    @cute.jit
    def fm_step_partial(self, fmh, sc, m: Int32):
        """Whether the column bounds cut query tile ``m`` against this CTA's key tile (False without a
        mask): not whole by the key tile's min / max (steps they skip are masked entirely)."""
        partial = False
        if const_expr(fmh is not None):
            m_start = m * self.tile_m
            lo, hi = fm.load_tile_minmax(fmh.mFmMinMax[fmh.batch, fmh.mh, None, None], fmh.n_tile,
                                         self.cfg.startend)
            _skip, whole = fm.classify_tile(m_start, cutlass.min(m_start + self.tile_m, sc.seqlen.seqlen_q),
                                            lo, hi, self.cfg.startend)
            partial = not whole
        return partial

    @cute.jit
    def probs_and_grads(self, acc_S, acc_dP, sc, m: Int32, masked, sLSE, sdPsum, s_lse: Int32, s_dps: Int32,
                        column_outer: cutlass.Constexpr, fmh=None, fm_partial=False, sKVBits=None):
        """acc_S: S^T -> P^T (softcap, exp2 against the rows' lse from sLSE stage ``s_lse``, mask where
        ``masked``); then, once every wgmma is done, acc_dP: dP^T -> dS^T (dpsum from sdPsum stage ``s_dps``).
        column_outer: query row (column) outer, so each lse / dpsum value is live for its column only
        (holding all 32 of each spilled at tile_m 128)."""
        cfg = self.cfg
        S = acc_mn_view(acc_S)
        if const_expr(cfg.has_softcap):
            for i in cutlass.range_constexpr(cute.size(acc_S)):
                acc_S[i] = softcap_logit(acc_S[i], sc.softcap_in, sc.softcap)
        nonfinite = sKVBits[reread_tid_x() - THREADS_PER_WG]
        if nonfinite & 0xFF != 0:
            # Note [scrubbed K / V]: a flagged key row's scores are NaN, as its unscrubbed K gave them.
            for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
                if (nonfinite >> r) & 1 != 0:
                    for c in cutlass.range_constexpr(cute.size(S, mode=[1])):
                        S[r, c] = Float32.nan
        dP = acc_mn_view(acc_dP)
        cols, ncols = sc.cols, sc.ncols
        if const_expr(column_outer):
            for c in cutlass.range_constexpr(ncols):
                lse_c = sLSE[sc.thr_col + cols[c], s_lse]
                for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
                    S[r, c] = cute.math.exp2(S[r, c] * sc.scale_log2 - lse_c, fastmath=True)
            self.mask_probs(S, sc, m, masked)
            warpgroup.wait_group(0)
            self.fm_zero_probs(S, sc, m, fm_partial, fmh)
            for c in cutlass.range_constexpr(ncols):
                dps_c = sdPsum[sc.thr_col + cols[c], s_dps]
                lse_c = sLSE[sc.thr_col + cols[c], s_lse] if const_expr(cfg.has_softcap) else None
                for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
                    dP[r, c] = self.grad_score(S[r, c], dP[r, c], dps_c, lse_c, sc.inv_cap_log2)
            if const_expr(not cfg.has_softcap):  # with softcap grad_score already gives P <= 0 (or NaN) dS = 0
                self.guard_masked_ds(S, dP, sc, sdPsum, s_dps)
        else:
            lse = [sLSE[sc.thr_col + cols[c], s_lse] for c in range(ncols)]
            for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
                for c in cutlass.range_constexpr(ncols):
                    S[r, c] = cute.math.exp2(S[r, c] * sc.scale_log2 - lse[c], fastmath=True)
            self.mask_probs(S, sc, m, masked)
            warpgroup.wait_group(0)
            self.fm_zero_probs(S, sc, m, fm_partial, fmh)
            dps = [sdPsum[sc.thr_col + cols[c], s_dps] for c in range(ncols)]
            for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
                for c in cutlass.range_constexpr(ncols):
                    dP[r, c] = self.grad_score(S[r, c], dP[r, c], dps[c], lse[c], sc.inv_cap_log2)
            if const_expr(not cfg.has_softcap):  # with softcap grad_score already gives P <= 0 (or NaN) dS = 0
                self.guard_masked_ds(S, dP, sc, sdPsum, s_dps)
        # read again rather than kept from the read above: live across the exp2 / dS loops it spilled (one LDS)
        nonfinite = sKVBits[reread_tid_x() - THREADS_PER_WG]
        if nonfinite >> 8 != 0:
            # Note [scrubbed K / V]: dS^T = NaN where a visible P^T meets a flagged value row (as dP^T = dO V^T
            # with the unscrubbed V gave it); P^T = 0 keeps its dS^T = 0.
            for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
                if (nonfinite >> (8 + r)) & 1 != 0:
                    for c in cutlass.range_constexpr(ncols):
                        dP[r, c] = Float32.nan if S[r, c] != Float32(0.0) else dP[r, c]

    @cute.jit
    def guard_masked_ds(self, P, dS, sc, sdPsum, s_dps: Int32):
        """dS^T = 0 where P^T = 0 in the columns (query rows) whose D is not finite: a row that sees a NaN / Inf
        value has a NaN or +-Inf out (NaN through a scrubbed tile, +-Inf through a tile nobody masks), so D =
        rowsum(dO * O) is too and P (dP - D) = 0 * NaN or 0 * Inf would carry it to the dK of keys the row cannot
        see (Note [scrubbed K / V]). Rare: the columns are tested first (the D values again from shared memory,
        d - d is 0 for every finite d; a per-element select in ``grad_score`` spilled 72 B at 240 registers)."""
        bad = Int32(0)
        for c in cutlass.range_constexpr(sc.ncols):
            d = sdPsum[sc.thr_col + sc.cols[c], s_dps]
            bad = bad | (Int32(0) if d - d == Float32(0.0) else Int32(1))
        if bad != 0:
            for c in cutlass.range_constexpr(sc.ncols):
                for r in cutlass.range_constexpr(cute.size(P, mode=[0])):
                    dS[r, c] = Float32(0.0) if P[r, c] == Float32(0.0) else dS[r, c]

    @cute.jit
    def mask_probs(self, P, sc, m: Int32, masked):
        """P^T = 0 where the seqlen / causal / window mask cuts step ``m`` (on ``masked`` steps): applied to the
        probabilities, not as -inf to the scores, so a masked pair stays 0 even where the row's lse is NaN (a
        row that saw a NaN / Inf key) -- Note [scrubbed K / V]. The same values otherwise."""
        if masked:
            apply_mask_kv_major(P, sc.cols, sc.keys, m * self.tile_m + sc.thr_col, sc.seqlen.seqlen_k,
                                sc.shift, sc.left, sc.right, sc.mask_right, self.cfg.has_window, 0.0)

    @cute.jit
    def fm_zero_probs(self, P, sc, m: Int32, fm_partial, fmh):
        """FlashMask: P^T = 0 where the column bounds mask the pair (on steps ``fm_partial``), so dS = 0
        there too; the same values as masking S^T with -inf before exp2. Applied after the step's GEMMs
        completed: masking S^T while dP^T was still in flight spilled 8-132 B at 240 registers."""
        if const_expr(fmh is not None):
            if fm_partial:
                fm.mask_kv_major_with_bounds(P, sc.cols, fmh.key_bounds, m * self.tile_m + sc.thr_col,
                                             self.cfg.startend, Float32(0.0))

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
    def finish_kv(self, kv_out, acc_dK, acc_dV, thr_dk, thr_dv, seqlen: SeqlenInfo, mCuSeqlensK, key_base: Int32,
                  n_tile: Int32, head_kv: Int32, head_y: Int32, batch_idx: Int32, steps: Int32, ctidx: Int32,
                  softmax_scale: Float32, dk_dim: cutlass.Constexpr, dv_dim: cutlass.Constexpr,
                  dk_col0: cutlass.Constexpr, dv_col0: cutlass.Constexpr):
        """dK * scale and dV of this thread's fragment out to global memory; with ``group_split`` summed over
        the group's heads in head order first (Note [group split])."""
        mdK, mdV, mdKacc, mdVacc, mdKVsem = kv_out[:5]
        geo = (seqlen, mCuSeqlensK, key_base, head_kv, batch_idx)
        if const_expr(not self.split):
            self.store_kv(acc_dK, softmax_scale, mdK, thr_dk, geo, dk_dim, dk_col0)
            self.store_kv(acc_dV, None, mdV, thr_dv, geo, dv_dim, dv_col0)
        else:
            G = self.cfg.qhead_per_kvhead
            rank = head_y % G
            if steps == 0:
                # No query sees these keys (the same for every head of the group): the last head writes
                # the zeros, no counter is touched.
                if rank == G - 1:
                    self.store_kv(acc_dK, softmax_scale, mdK, thr_dk, geo, dk_dim, dk_col0)
                    self.store_kv(acc_dV, None, mdV, thr_dv, geo, dv_dim, dv_col0)
            else:
                sem_idx = n_tile * self.tile_n // KV_SEM_KEYS
                sem_addr = (mdKVsem.iterator + cute.crd2idx((batch_idx, head_kv, sem_idx), mdKVsem.layout)).toint()
                if ctidx == 0:
                    cur = ld_acquire_gpu(sem_addr)
                    while cur != rank:
                        cur = ld_acquire_gpu(sem_addr)
                cute.arch.barrier(barrier_id=KV_TURN_BARRIER, number_of_threads=2 * THREADS_PER_WG)
                cute.arch.fence_acq_rel_gpu()
                if rank > 0:
                    self.add_kv(acc_dK, mdKacc, thr_dk, geo, dk_dim, dk_col0)
                    self.add_kv(acc_dV, mdVacc, thr_dv, geo, dv_dim, dv_col0)
                if rank == G - 1:
                    self.store_kv(acc_dK, softmax_scale, mdK, thr_dk, geo, dk_dim, dk_col0)
                    self.store_kv(acc_dV, None, mdV, thr_dv, geo, dv_dim, dv_col0)
                else:
                    self.store_kv(acc_dK, None, mdKacc, thr_dk, geo, dk_dim, dk_col0)
                    self.store_kv(acc_dV, None, mdVacc, thr_dv, geo, dv_dim, dv_col0)
                    cute.arch.fence_acq_rel_gpu()
                    cute.arch.barrier(barrier_id=KV_TURN_BARRIER, number_of_threads=2 * THREADS_PER_WG)
                    if ctidx == 0:
                        red_release_add_gpu(sem_addr, Int32(1))

    def _kv_tile(self, mX, thr_dkv, geo, dim: int, col0):
        """This thread's elements of rows key_base + [0, 64), columns col0 + [0, dim) of mX (dK / dV or
        their fp32 partials; same layout), as an (rows, cols) view, their coordinates and seqlen_k.
        Varlen: the sequence's first key row and length are read again from cu_seqlens_k here rather than
        kept live across the main loop (they made 12 d 64 / d 128 varlen configs spill 8-32 bytes).
        ``geo`` = (seqlen, mCuSeqlensK, key_base, head_kv, batch_idx)."""
        seqlen, mCuSeqlensK, key_base, head_kv, batch_idx = geo
        seqlen_k = seqlen.seqlen_k
        if const_expr(self.cfg.varlen):
            seqlen_k = mCuSeqlensK[batch_idx + 1] - mCuSeqlensK[batch_idx]
            mX_cur = cute.domain_offset((mCuSeqlensK[batch_idx], 0, 0), mX)[None, head_kv, None]
        else:
            mX_cur = mX[batch_idx, None, head_kv, None]
        gX = cute.local_tile(cute.domain_offset((key_base, col0), mX_cur), (KEYS_PER_WG, dim), (0, 0))
        tXgX = acc_mn_view(thr_dkv.partition_C(gX))
        tXcX = acc_mn_view(thr_dkv.partition_C(cute.make_identity_tensor((KEYS_PER_WG, dim))))
        return tXgX, tXcX, seqlen_k

    @cute.jit
    def store_kv(self, acc, scale, mX, thr_dkv, geo, dim: cutlass.Constexpr, col0):
        """acc (* scale) -> rows key_base + [0, 64), columns col0 + [0, dim) of mX, in mX's dtype (keys past
        seqlen_k not written)."""
        tXgX, tXcX, seqlen_k = self._kv_tile(mX, thr_dkv, geo, dim, col0)
        key_base = geo[2]
        if const_expr(scale is not None):
            for i in cutlass.range_constexpr(cute.size(acc)):
                acc[i] = acc[i] * scale
        if const_expr(mX.element_type == Float32):
            r_mn = acc_mn_view(acc)
        else:
            r16 = cute.make_rmem_tensor_like(acc, self.dtype)
            convert_to_16bit(acc, r16)
            r_mn = acc_mn_view(r16)
        for r in cutlass.range_constexpr(cute.size(r_mn, mode=[0])):
            if key_base + tXcX[r, 0][0] < seqlen_k:
                for c in cutlass.range_constexpr(cute.size(r_mn, mode=[1])):
                    tXgX[r, c] = r_mn[r, c]

    @cute.jit
    def add_kv(self, acc, mXacc, thr_dkv, geo, dim: cutlass.Constexpr, col0):
        """acc += the fp32 partial of the same elements in mXacc (rows past seqlen_k skipped)."""
        tXgX, tXcX, seqlen_k = self._kv_tile(mXacc, thr_dkv, geo, dim, col0)
        key_base = geo[2]
        a_mn = acc_mn_view(acc)
        for r in cutlass.range_constexpr(cute.size(a_mn, mode=[0])):
            if key_base + tXcX[r, 0][0] < seqlen_k:
                for c in cutlass.range_constexpr(cute.size(a_mn, mode=[1])):
                    a_mn[r, c] = a_mn[r, c] + tXgX[r, c]
