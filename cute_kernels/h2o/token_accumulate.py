"""token_accumulate: one decode step of the heavy-hitter recurrence, in two kernels.

Per request b and kv head g, with n = seq_lens[b] tokens and the scored window
W = [bos, n - eos) (tokens; empty when n - eos <= bos):

    l_{h,t} = scale * q_h . k_t                        t in W, h < G (q-bar for GQA_MEAN_Q)
    P_{h,t} = softmax_{t in W}(l_{h,t})                 one softmax per head
    p_t     = P_t (mean_q) | max_h | sum_h | mean_h P_{h,t}
    hh_t   <- p_t + decay * hh_t                        t in W only; every other slot untouched

The window is softmaxed whenever it is non-empty (short rows included), so raw logits never
enter the state. The state is read and written in fp32 registers and rounded only on store.

Split over the window (one softmax needs the whole row first, so two launches):

    TokenLogits  grid (B*Hkv, n_chunks)  keys -> logits (log2 domain) into a workspace, and each
                                         chunk's (max, sum exp2) per head
    TokenUpdate  grid (B*Hkv, n_chunks)  merge the row's chunk statistics, then p_t and the
                                         state update for the chunk's tokens

Tensors:
    q             [B, Hq, D]                    bfloat16 / float16 / float32
    key_cache     [num_pages, Hkv, P, D]        bfloat16 / float16 / float32
    state         [num_pages, Hkv, P]           float32 (default) or bfloat16, updated in place
    block_tables  [B, max_pages] int32;  seq_lens [B] int32
    logits        [B, Hkv, R, n_chunks*CHUNK]   float32 workspace (R = 1 for mean_q, else G)
    stats         [B, Hkv, R, n_chunks, 2]      float32 workspace (chunk max, chunk sum)

Tokens of a logical page whose table entry lies outside [0, num_pages) are treated as absent
(probability 0, state never touched), so a bad table cannot cause an out-of-bounds access.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .common import NEG_BIG, combine_max_sum, exp2, group_sum, load_vec_f32, row_split, warp_max_sum

THREADS = 128
WARPS = THREADS // 32
CHUNK = 512  # window tokens per CTA (both kernels)
UNROLL = 4  # key rows in flight per thread

GQA_MEAN_Q = 0
GQA_MAX = 1
GQA_SUM = 2
GQA_MEAN_P = 3


def _bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


@dataclass(frozen=True)
class TokenConfig:
    arch: int
    q_dtype: str = "bfloat16"
    key_dtype: str = "bfloat16"
    state_dtype: str = "float32"
    num_kv_heads: int = 8
    group: int = 4
    head_dim: int = 128
    page_size: int = 16
    gqa: int = GQA_MEAN_Q

    @property
    def rows_per_head(self) -> int:
        """R: softmax rows per kv head (1 for mean_q, G otherwise)."""
        return 1 if self.gqa == GQA_MEAN_Q else self.group


def unsupported_reason(cfg: TokenConfig) -> str | None:
    if cfg.key_dtype not in ("bfloat16", "float16", "float32"):
        return f"key dtype {cfg.key_dtype}"
    if cfg.q_dtype not in ("bfloat16", "float16", "float32"):
        return f"q dtype {cfg.q_dtype}"
    if cfg.state_dtype not in ("float32", "bfloat16"):
        return f"state dtype {cfg.state_dtype}"
    if row_split(_bytes(cfg.key_dtype), cfg.head_dim) is None:
        return f"head_dim {cfg.head_dim} with {cfg.key_dtype} keys"
    if cfg.group > 64:
        return f"group size {cfg.group} > 64"
    return None


def workspace_shapes(batch: int, cfg: TokenConfig, max_pages: int) -> tuple[tuple, tuple]:
    """Shapes of the fp32 ``logits`` and ``stats`` workspaces for ``max_pages`` pages per request."""
    n_chunks = max(1, -(-max_pages * cfg.page_size // CHUNK))
    r = cfg.rows_per_head
    return ((batch, cfg.num_kv_heads, r, n_chunks * CHUNK), (batch, cfg.num_kv_heads, r, n_chunks, 2))


class TokenLogits:
    """Kernel 1: logits of the window's keys and per-chunk softmax statistics."""

    def __init__(self, cfg: TokenConfig):
        reason = unsupported_reason(cfg)
        if reason is not None:
            raise ValueError(f"token_accumulate: unsupported config: {reason}")
        self.cfg = cfg
        self.vec, self.lanes = row_split(_bytes(cfg.key_dtype), cfg.head_dim)
        self.tokens_per_pass = (THREADS // self.lanes)  # one token per lane group
        self.passes = CHUNK // (self.tokens_per_pass * UNROLL)
        self.R = cfg.rows_per_head

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mKey: cute.Tensor, mTable: cute.Tensor, mSeqLen: cute.Tensor,
                 mLogit: cute.Tensor, mStat: cute.Tensor, scale_log2: Float32, bos: Int32, eos: Int32,
                 stream):
        rows = mSeqLen.shape[0] * self.cfg.num_kv_heads
        self.kernel(mQ, mKey, mTable, mSeqLen, mLogit, mStat, scale_log2, bos, eos).launch(
            grid=[rows, mStat.shape[3], 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mKey: cute.Tensor, mTable: cute.Tensor, mSeqLen: cute.Tensor,
               mLogit: cute.Tensor, mStat: cute.Tensor, scale_log2: Float32, bos: Int32, eos: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        row, chunk, _ = cute.arch.block_idx()
        cfg = self.cfg
        vec, lanes, G, R, P = self.vec, self.lanes, cfg.group, self.R, cfg.page_size
        hkv = cfg.num_kv_heads
        b = row // hkv
        g = row - b * hkv
        grp = tidx // lanes  # token slot of this lane group within a pass
        lane = tidx - grp * lanes
        warp = tidx // 32
        num_pages = mKey.shape[0]
        max_tok = mTable.shape[1] * P  # a seq_len beyond the table never reads or writes past it

        smem = cutlass.memory.SmemAllocator()
        sStat = smem.allocate_tensor(Float32, cute.make_layout((WARPS, R, 2)), byte_alignment=16)

        w_end = mSeqLen[b] - eos
        t0 = bos + chunk * CHUNK
        if t0 < w_end:
            # (R, vec) fp32: this lane's slice of the query heads, times scale * log2(e).
            rQ = cute.make_rmem_tensor(cute.make_layout((R, vec)), Float32)
            rQ.fill(0.0)
            for h in cutlass.range_constexpr(G):
                qv = self._load_q(mQ[b, g * G + h, None], lane)
                for j in cutlass.range_constexpr(vec):
                    if cutlass.const_expr(cfg.gqa == GQA_MEAN_Q):
                        rQ[0, j] = rQ[0, j] + qv[j] * (scale_log2 * Float32(1.0 / G))
                    else:
                        rQ[h, j] = qv[j] * scale_log2
            # running (max, sum exp2) per softmax row, kept by lane 0 of each group only
            rMax = cute.make_rmem_tensor(cute.make_layout(R), Float32)
            rSum = cute.make_rmem_tensor(cute.make_layout(R), Float32)
            rMax.fill(NEG_BIG)
            rSum.fill(0.0)
            # (UNROLL, vec) keys in flight
            rK = cute.make_rmem_tensor(cute.make_layout((UNROLL, vec)), Float32)
            rT = cute.make_rmem_tensor(cute.make_layout(UNROLL), Int32)
            rOk = cute.make_rmem_tensor(cute.make_layout(UNROLL), Int32)
            for ps in cutlass.range(self.passes):
                # 1. issue UNROLL key loads (a masked token reads page 0 slot 0 and is dropped)
                for u in cutlass.range_constexpr(UNROLL):
                    t = t0 + (ps * UNROLL + u) * self.tokens_per_pass + grp
                    lp = t // P
                    phys = Int32(-1)
                    if (t < w_end) & (lp < mTable.shape[1]):
                        phys = mTable[b, lp]
                    ok = (phys >= 0) & (phys < num_pages)
                    safe_phys = Int32(cutlass.select_(ok, phys, 0))
                    safe_off = Int32(cutlass.select_(ok, t - lp * P, 0))
                    kv = load_vec_f32(mKey[safe_phys, g, safe_off, None], lane, vec)
                    for j in cutlass.range_constexpr(vec):
                        rK[u, j] = kv[j]
                    rT[u] = t
                    rOk[u] = Int32(cutlass.select_(ok, 1, 0))
                # 2. logits, workspace stores, running statistics
                for u in cutlass.range_constexpr(UNROLL):
                    t = rT[u]
                    for h in cutlass.range_constexpr(R):
                        acc = Float32(0.0)
                        for j in cutlass.range_constexpr(vec):
                            acc = acc + rQ[h, j] * rK[u, j]
                        acc = group_sum(acc, lanes)
                        logit = Float32(cutlass.select_(rOk[u] != 0, acc, NEG_BIG))
                        if (lane == 0) & (t < w_end) & (t < max_tok):
                            mLogit[b, g, h, t - bos] = logit
                            m_new = cute.arch.fmax(rMax[h], logit)
                            rSum[h] = rSum[h] * exp2(rMax[h] - m_new) + exp2(logit - m_new)
                            rMax[h] = m_new
            # 3. chunk statistics: warp, then CTA
            for h in cutlass.range_constexpr(R):
                m, s = warp_max_sum(rMax[h], rSum[h])
                if tidx % 32 == 0:
                    sStat[warp, h, 0] = m
                    sStat[warp, h, 1] = s
            cute.arch.sync_threads()
            if tidx < R:
                m = sStat[0, tidx, 0]
                s = sStat[0, tidx, 1]
                for w in cutlass.range_constexpr(1, WARPS):
                    m, s = combine_max_sum(m, s, sStat[w, tidx, 0], sStat[w, tidx, 1])
                mStat[b, g, tidx, chunk, 0] = m
                mStat[b, g, tidx, chunk, 1] = s

    @cute.jit
    def _load_q(self, qrow: cute.Tensor, lane: Int32):
        if cutlass.const_expr(_bytes(self.cfg.q_dtype) == _bytes(self.cfg.key_dtype)):
            return load_vec_f32(qrow, lane, self.vec)
        out = cute.make_rmem_tensor(cute.make_layout(self.vec), Float32)
        for j in cutlass.range_constexpr(self.vec):
            out[j] = qrow[lane * self.vec + j].to(Float32)
        return out


class TokenUpdate:
    """Kernel 2: merge the row's chunk statistics, then ``hh <- p + decay * hh`` on the chunk."""

    def __init__(self, cfg: TokenConfig):
        reason = unsupported_reason(cfg)
        if reason is not None:
            raise ValueError(f"token_accumulate: unsupported config: {reason}")
        self.cfg = cfg
        self.R = cfg.rows_per_head

    @cute.jit
    def __call__(self, mState: cute.Tensor, mTable: cute.Tensor, mSeqLen: cute.Tensor,
                 mLogit: cute.Tensor, mStat: cute.Tensor, decay: Float32, bos: Int32, eos: Int32,
                 stream):
        rows = mSeqLen.shape[0] * self.cfg.num_kv_heads
        self.kernel(mState, mTable, mSeqLen, mLogit, mStat, decay, bos, eos).launch(
            grid=[rows, mStat.shape[3], 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mState: cute.Tensor, mTable: cute.Tensor, mSeqLen: cute.Tensor,
               mLogit: cute.Tensor, mStat: cute.Tensor, decay: Float32, bos: Int32, eos: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        row, chunk, _ = cute.arch.block_idx()
        cfg = self.cfg
        R, P, G = self.R, cfg.page_size, cfg.group
        hkv = cfg.num_kv_heads
        b = row // hkv
        g = row - b * hkv
        warp = tidx // 32
        num_pages = mState.shape[0]

        smem = cutlass.memory.SmemAllocator()
        sStat = smem.allocate_tensor(Float32, cute.make_layout((WARPS, R, 2)), byte_alignment=16)

        w_end = mSeqLen[b] - eos
        t0 = bos + chunk * CHUNK
        if t0 < w_end:
            n_chunks = cutlass.min((w_end - bos + CHUNK - 1) // CHUNK, mStat.shape[3])
            # 1. merge the (max, sum) of the row's chunks: thread i takes chunks i, i + 128, ...
            rMax = cute.make_rmem_tensor(cute.make_layout(R), Float32)
            rInv = cute.make_rmem_tensor(cute.make_layout(R), Float32)
            for h in cutlass.range_constexpr(R):
                m = Float32(NEG_BIG)
                s = Float32(0.0)
                c = tidx
                while c < n_chunks:
                    m, s = combine_max_sum(m, s, mStat[b, g, h, c, 0], mStat[b, g, h, c, 1])
                    c += THREADS
                m, s = warp_max_sum(m, s)
                if tidx % 32 == 0:
                    sStat[warp, h, 0] = m
                    sStat[warp, h, 1] = s
            cute.arch.sync_threads()
            for h in cutlass.range_constexpr(R):
                m = sStat[0, h, 0]
                s = sStat[0, h, 1]
                for w in cutlass.range_constexpr(1, WARPS):
                    m, s = combine_max_sum(m, s, sStat[w, h, 0], sStat[w, h, 1])
                rMax[h] = m
                rInv[h] = Float32(1.0) / s
            # 2. probabilities and the state update, one token per thread per pass
            for i in cutlass.range(CHUNK // THREADS):
                t = t0 + i * THREADS + tidx
                lp = t // P
                if (t < w_end) & (lp < mTable.shape[1]):
                    phys = mTable[b, lp]
                    if (phys >= 0) & (phys < num_pages):
                        p = Float32(0.0)
                        for h in cutlass.range_constexpr(R):
                            ph = exp2(mLogit[b, g, h, t - bos] - rMax[h]) * rInv[h]
                            if cutlass.const_expr(cfg.gqa == GQA_MAX):
                                p = cute.arch.fmax(p, ph)
                            else:
                                p = p + ph
                        if cutlass.const_expr(cfg.gqa == GQA_MEAN_P):
                            p = p * Float32(1.0 / G)
                        off = t - lp * P
                        hh = mState[phys, g, off].to(Float32)
                        mState[phys, g, off] = (p + decay * hh).to(mState.element_type)
