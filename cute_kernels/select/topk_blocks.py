"""select_topk_blocks: per query row, the top-k key blocks by log-weight merged over a head group.

    w[b, g, i, j] = max over heads h of group g of (block_logit[b, h, i, j] - lse[b, h, i])
                    (head_agg="sum": log of the sum over the heads of exp(block_logit - lse))
                    (-inf where block_logit is -inf: no visible key in the block)
    out[b, g, i, :] = the topk blocks j with the largest w, ties to the lower j, after forcing
                    j < sink_blocks and j > diag - local_blocks (diag = last visible block) in;
                    ascending, -1 padded; invisible blocks are never chosen

Tensors:
    mBlockLogit  [B, Hq, Sq, nb] float32 (varlen callers pass [1, Hq, total_q, nb])
    mLSE         [B, Hq, Sq] float32, natural log
    mOut         [B, Hs, Sq, topk] int32; Hs = Hq // group_size

One warp per output row (b, g, i), four warps per CTA. The warp streams the group's heads once,
holding the row's nb log-weights in registers (lane l owns blocks m*32*vec + l*vec + v, so every
load of the warp is one contiguous 128*vec-byte segment); nothing but the int32 ids is written, so
the [B, Hq, Sq, nb] log-weight tensor never exists. Then:

    1. load     w = max over the group's heads of (block_logit - lse), vectorised, branch-free
                (out-of-range chunks re-read the row's last chunk and are masked to -inf);
                head_agg="sum" merges with a running logaddexp instead, see Note [sum of weights]
    2. diag     warp max of the last visible block id
    3. force    sink and local blocks that are visible get w = +inf (they sort first)
    4. select   topk rounds of a warp arg-max over the keys (w, -j) strictly below the previous
                pick; see Note [selection without a heap]
    5. write    a block is chosen iff its key is >= the last pick; its slot is its rank among the
                chosen blocks, counted with warp ballots, so ids come out ascending

Note [selection without a heap]
    Keys (w, -j) are distinct, so "the k-th largest key" is well defined and the chosen set is
    exactly the keys >= the k-th pick. Each round every lane scans its registers for its best key
    below the previous pick (no register is ever written, so nothing is indexed dynamically), and a
    5-step butterfly picks the warp's best. Rounds whose best is -inf change nothing, which is
    how rows with fewer than topk visible blocks end up -1 padded.

Note [NaN scores]
    One rule for every selection op (docs/api.md, "NaN"): NaN never takes a slot a number could
    take and forced blocks are kept. Here a register holds -inf (no head sees the block: NaN
    block_logit counts as unseen), UNRANKED = -FLT_MAX (some head sees it but none ranks it: its
    block_logit - lse is NaN or -inf, i.e. the row's lse is NaN or +inf) or the group's best
    log-weight; the three are ordered, so the max over heads is a plain fmax. UNRANKED counts as
    visible for the diagonal and for forcing, but the selection and the write only take values
    above it, so an unforced unranked block is never picked nor written. (A genuine log-weight of
    -FLT_MAX or below, i.e. |block_logit - lse| beyond fp32's range, is unranked too.)

Note [sum of weights]
    head_agg="sum" ranks a block by log(sum_h exp(w_h)) over the heads that rank it. Each register
    keeps that log and takes the next head with logaddexp(a, b) = hi + log(1 + exp(lo - hi)) (one
    ex2 and one lg2 on the MUFU pipe per block and head; no second accumulator). An unseen (-inf)
    or unranked (UNRANKED) side adds weight 0 without a branch or select: lo - hi is then -inf or
    about -FLT_MAX, exp of it 0, and the result hi; UNRANKED + UNRANKED = -FLT_MAX + ln 2 rounds
    back to -FLT_MAX and -inf + -inf (lo - hi NaN, clamped to 0) stays -inf. So the three-value
    order and the NaN rule are max's. (A select on "both ranked" made ptxas spill 8-24 bytes.) The
    logs are fp32 approximations (a few ulp per head): ids can differ from an exact sum only
    between blocks whose sums are that close.
    Registers at nb_cap 2048: 182-222 with scalar loads (vec = 1; Note [load offsets per head]: before,
    ptxas kept the 64 clamped 64-bit load offsets live through the head loop and "sum" spilled 96-328 B
    there, so it stopped at nb_cap 1024), 232-246 with 16-byte rows (vec = 4).

Note [load offsets per head]
    With scalar loads (vec = 1) each lane reads nb_cap / 32 clamped slots of every head's row; the
    clamped offsets depend on the lane and nb only, so ptxas computed them once as 64-bit values and
    kept all of them live through the head loop (CUDA 13: 16 B spilled at nb_cap 512 with "sum").
    The head loop reads the lane again (a volatile %tid.x read) so that the offsets are recomputed per
    head: a select and a multiply-add per slot, next to a global load each.

With ``causal_rows`` the row reads only blocks up to (i + Sk - Sq) // block_size (the causal read
limit the caller vouches for) and treats the rest as -inf: half the bytes for causal self-attention.

Supported: nb <= nb_cap <= 2048, topk <= 64 (see ``unsupported_reason``). Any Hq, any group size.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cute_kernels.common.utils import reread_tid_x

#: Output rows (warps) per CTA.
WARPS_PER_CTA = 4
#: Largest nb (2,048 blocks = 128K keys at block 64) and topk the register-resident kernel takes.
NB_MAX = 2048
TOPK_MAX = 64
#: Register value of a block some head sees but none ranks (Note [NaN scores]): -FLT_MAX, below
#: every log-weight a real score can have and above -inf (= unseen), so fmax merges heads as is.
UNRANKED = -3.4028234663852886e38
#: A block id larger than any real one (sorts after every real id on equal weights).
_NO_BLOCK = 1 << 30
#: How a group's heads merge: max of the log-weights, or log of the sum of the weights.
HEAD_AGG = ("max", "sum")
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


@dataclass(frozen=True)
class TopkBlocksConfig:
    arch: int
    group_size: int  # heads maxed into one output row (Hq // Hs), static: the head loop is unrolled
    nb_cap: int  # register slots per row, a power of two >= 32 * vec; nb <= nb_cap
    topk: int
    vec: int = 4  # fp32 per lane per load: 4 when nb % 4 == 0 (16-byte rows), else 1
    causal_rows: bool = False  # read only blocks <= (i + Sk - Sq) // block_size; the rest is -inf
    head_agg: str = "max"  # "max" or "sum" (Note [sum of weights]); one head: the same, use "max"

    @property
    def chunks(self) -> int:
        """Loads per lane per head."""
        return self.nb_cap // (32 * self.vec)

    @property
    def per_lane(self) -> int:
        """Log-weights each lane holds."""
        return self.nb_cap // 32


def nb_cap_for(nb: int, vec: int) -> int:
    """Smallest power-of-two capacity >= nb that a warp of ``vec``-wide loads covers."""
    cap = 32 * vec
    while cap < nb:
        cap *= 2
    return cap


class TopkBlocks:
    def __init__(self, cfg: TopkBlocksConfig):
        reason = self.unsupported_reason(cfg)
        if reason is not None:
            raise ValueError(f"select_topk_blocks: {reason}")
        self.cfg = cfg

    @staticmethod
    def unsupported_reason(cfg: TopkBlocksConfig) -> str | None:
        if cfg.vec not in (1, 4):
            return f"vec must be 1 or 4, got {cfg.vec}"
        if cfg.nb_cap > NB_MAX or cfg.nb_cap < 32 * cfg.vec or cfg.nb_cap & (cfg.nb_cap - 1):
            return f"nb_cap must be a power of two in [{32 * cfg.vec}, {NB_MAX}], got {cfg.nb_cap}"
        if not 1 <= cfg.topk <= TOPK_MAX:
            return f"topk must be in [1, {TOPK_MAX}], got {cfg.topk}"
        if cfg.group_size < 1:
            return f"group_size must be >= 1, got {cfg.group_size}"
        if cfg.head_agg not in HEAD_AGG:
            return f"head_agg must be one of {HEAD_AGG}, got {cfg.head_agg!r}"
        return None

    @cute.jit
    def __call__(self, mBlockLogit: cute.Tensor, mLSE: cute.Tensor, mOut: cute.Tensor,
                 sink_blocks: Int32, local_blocks: Int32, seqlen_k_minus_q: Int32, block_size: Int32,
                 stream):
        # mBlockLogit: (B, Hq, Sq, nb); mLSE: (B, Hq, Sq); mOut: (B, Hs, Sq, topk)
        # seqlen_k_minus_q, block_size: the causal read limit, used only when cfg.causal_rows
        n_rows = mOut.shape[0] * mOut.shape[1] * mOut.shape[2]
        grid = cute.ceil_div(n_rows, WARPS_PER_CTA)
        self.kernel(mBlockLogit, mLSE, mOut, sink_blocks, local_blocks, seqlen_k_minus_q, block_size).launch(
            grid=[grid, 1, 1], block=[32 * WARPS_PER_CTA, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mBlockLogit: cute.Tensor, mLSE: cute.Tensor, mOut: cute.Tensor,
               sink_blocks: Int32, local_blocks: Int32, seqlen_k_minus_q: Int32, block_size: Int32):
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        bidx, _, _ = cute.arch.block_idx()
        num_groups = mOut.shape[1]
        seqlen_q = mOut.shape[2]
        row = bidx * WARPS_PER_CTA + warp
        if row < mOut.shape[0] * num_groups * seqlen_q:
            i = row % seqlen_q
            bg = row // seqlen_q
            group = bg % num_groups
            batch = bg // num_groups
            # (per_lane,) fp32: log-weights of blocks m*32*vec + lane*vec + v at slot m*vec + v
            tWrW = cute.make_rmem_tensor((self.cfg.per_lane,), Float32)
            nb_row = mBlockLogit.shape[3]  # blocks this row reads
            if cutlass.const_expr(self.cfg.causal_rows):
                # Blocks past (i + Sk - Sq) // block_size hold no visible key: skip their bytes.
                # (Written without a negative floor division: a row seeing no key reads nothing.)
                last_key = i + seqlen_k_minus_q
                nb_row = Int32(cutlass.select_(last_key < 0, 0, last_key // block_size + 1))
                nb_row = Int32(cutlass.select_(nb_row < mBlockLogit.shape[3], nb_row, mBlockLogit.shape[3]))
            self.load_log_weight(mBlockLogit, mLSE, tWrW, batch, group, i, nb_row, lane)
            self.force_sink_local(tWrW, sink_blocks, local_blocks, lane)
            last_v, last_j = self.select(tWrW, lane)
            self.write_ids(tWrW, mOut, batch, group, i, last_v, last_j, lane)

    @cute.jit
    def block_id(self, lane: Int32, m: int, v: int) -> Int32:
        return m * 32 * self.cfg.vec + lane * self.cfg.vec + v

    @cute.jit
    def load_log_weight(self, mBlockLogit: cute.Tensor, mLSE: cute.Tensor, tWrW: cute.Tensor,
                        batch: Int32, group: Int32, i: Int32, nb: Int32, lane: Int32):
        """tWrW <- the group's heads' log-weights of blocks < nb merged by max or sum (others -inf)."""
        cfg = self.cfg
        # Chunks that hold a block < nb; at least 1 so the clamped loads below stay in the row.
        n_vec = (nb + cfg.vec - 1) // cfg.vec
        n_vec = Int32(cutlass.select_(n_vec > 0, n_vec, 1))
        neg_inf = Float32(-Float32.inf)
        unranked = Float32(UNRANKED)
        for e in cutlass.range_constexpr(cfg.per_lane):
            tWrW[e] = neg_inf
        # (per_lane,) fp32: one head's raw block_logit slots
        tWrRaw = cute.make_rmem_tensor((cfg.per_lane,), Float32)
        unroll = max(1, min(cfg.group_size, 8 // cfg.chunks))
        for g in cutlass.range(cfg.group_size, unroll=unroll):
            # Note [load offsets per head]: scalar-load rows take the lane afresh in every head
            lane_h = reread_tid_x() % 32 if cutlass.const_expr(cfg.vec == 1) else lane
            head = group * cfg.group_size + g
            lse = mLSE[batch, head, i]
            gRow = mBlockLogit[batch, head, i, None]  # (nb,)
            # 1. issue every load of the head first (clamped in range, so no branch around them)
            for m in cutlass.range_constexpr(cfg.chunks):
                chunk = Int32(cutlass.select_(m * 32 + lane_h < n_vec, m * 32 + lane_h, n_vec - 1))
                cute.autovec_copy(cute.local_tile(gRow, (cfg.vec,), (chunk,)),
                                  cute.local_tile(tWrRaw, (cfg.vec,), (m,)))
            # 2. log-weight and the merge over heads under the NaN rule (Note [NaN scores])
            for m in cutlass.range_constexpr(cfg.chunks):
                for v in cutlass.range_constexpr(cfg.vec):
                    e = m * cfg.vec + v
                    x = tWrRaw[e]
                    seen = (x > neg_inf) & (self.block_id(lane_h, m, v) < nb)  # False for NaN x
                    diff = x - lse  # NaN or -inf when lse is NaN or +inf: seen but unranked
                    val = Float32(cutlass.select_(seen, Float32(cutlass.select_(diff > unranked, diff, unranked)),
                                                  neg_inf))
                    if cutlass.const_expr(cfg.head_agg == "sum"):
                        tWrW[e] = self.log_add(tWrW[e], val)
                    else:
                        tWrW[e] = cute.arch.fmax(tWrW[e], val)

    @cute.jit
    def log_add(self, a: Float32, b: Float32) -> Float32:
        """log(exp(a) + exp(b)); max(a, b) when either is -inf or UNRANKED (Note [sum of weights])."""
        hi = cute.arch.fmax(a, b)
        d = cute.arch.fmin(cute.arch.fmin(a, b) - hi, Float32(0.0))  # <= 0; NaN (inf - inf) -> 0
        t = cute.math.exp2(d * Float32(_LOG2E), fastmath=True)
        return hi + cute.math.log2(Float32(1.0) + t, fastmath=True) * Float32(_LN2)

    @cute.jit
    def force_sink_local(self, tWrW: cute.Tensor, sink_blocks: Int32, local_blocks: Int32, lane: Int32):
        cfg = self.cfg
        neg_inf = Float32(-Float32.inf)
        # The row's diagonal block is its last visible one (for causal rows (i + Sk - Sq) // block).
        # Visible = above -inf (UNRANKED included: kept when forced, never ranked).
        last = Int32(-1)
        for m in cutlass.range_constexpr(cfg.chunks):
            for v in cutlass.range_constexpr(cfg.vec):
                j = self.block_id(lane, m, v)
                last = Int32(cutlass.select_(tWrW[m * cfg.vec + v] > neg_inf, j, last))
        diag = cute.arch.warp_reduction_max(last)
        for m in cutlass.range_constexpr(cfg.chunks):
            for v in cutlass.range_constexpr(cfg.vec):
                e = m * cfg.vec + v
                j = self.block_id(lane, m, v)
                forced = (tWrW[e] > neg_inf) & ((j < sink_blocks) | (j > diag - local_blocks))
                tWrW[e] = Float32(cutlass.select_(forced, Float32(Float32.inf), tWrW[e]))

    @cute.jit
    def select(self, tWrW: cute.Tensor, lane: Int32):
        """The topk-th largest key (w, -j) of the row, or (+inf, -1) when nothing is visible.

        See Note [selection without a heap].
        """
        cfg = self.cfg
        pick_v = Float32(Float32.inf)
        pick_j = Int32(-1)
        for _ in cutlass.range(cfg.topk):
            best_v = Float32(UNRANKED)  # only ranked values (or forced +inf) are candidates
            best_j = Int32(_NO_BLOCK)
            # lane's best key strictly below the previous pick; ascending j keeps the lower id on ties
            for m in cutlass.range_constexpr(cfg.chunks):
                for v in cutlass.range_constexpr(cfg.vec):
                    x = tWrW[m * cfg.vec + v]
                    j = self.block_id(lane, m, v)
                    below = (x < pick_v) | ((x == pick_v) & (j > pick_j))
                    better = below & (x > best_v)
                    best_v = Float32(cutlass.select_(better, x, best_v))
                    best_j = Int32(cutlass.select_(better, j, best_j))
            # warp arg-max, lower id on equal weight: every lane ends with the same (best_v, best_j)
            for offset in cutlass.range_constexpr(5):
                other_v = cute.arch.shuffle_sync_bfly(best_v, offset=16 >> offset)
                other_j = cute.arch.shuffle_sync_bfly(best_j, offset=16 >> offset)
                take = (other_v > best_v) | ((other_v == best_v) & (other_j < best_j))
                best_v = Float32(cutlass.select_(take, other_v, best_v))
                best_j = Int32(cutlass.select_(take, other_j, best_j))
            found = best_v > Float32(UNRANKED)
            pick_v = Float32(cutlass.select_(found, best_v, pick_v))
            pick_j = Int32(cutlass.select_(found, best_j, pick_j))
        return pick_v, pick_j

    @cute.jit
    def write_ids(self, tWrW: cute.Tensor, mOut: cute.Tensor, batch: Int32, group: Int32, i: Int32,
                  last_v: Float32, last_j: Int32, lane: Int32):
        cfg = self.cfg
        lanes_below = (Int32(1) << lane) - 1
        base = Int32(0)  # chosen blocks in earlier chunks (warp-uniform)
        for m in cutlass.range_constexpr(cfg.chunks):
            chosen = []
            below = Int32(0)
            total = Int32(0)
            for v in cutlass.range_constexpr(cfg.vec):
                x = tWrW[m * cfg.vec + v]
                j = self.block_id(lane, m, v)
                pred = (x > Float32(UNRANKED)) & ((x > last_v) | ((x == last_v) & (j <= last_j)))
                ballot = cute.arch.vote_ballot_sync(pred)
                below = below + cute.arch.popc(ballot & lanes_below)
                total = total + cute.arch.popc(ballot)
                chosen.append(pred)
            own = Int32(0)
            for v in cutlass.range_constexpr(cfg.vec):
                rank = base + below + own
                if chosen[v] & (rank < cfg.topk):
                    mOut[batch, group, i, rank] = self.block_id(lane, m, v)
                own = own + Int32(cutlass.select_(chosen[v], 1, 0))
            base = base + total
        for q in cutlass.range_constexpr((cfg.topk + 31) // 32):
            slot = q * 32 + lane
            if (slot < cfg.topk) & (slot >= base):
                mOut[batch, group, i, slot] = Int32(-1)
