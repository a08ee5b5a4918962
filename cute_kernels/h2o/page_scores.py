"""page_scores: query-aware score of every page of every request and kv head (no softmax).

For request b, kv head g, logical page j < n_pages = ceil(seq_lens[b] / P), physical page
p = block_tables[b, j], summaries (mu, M, m) = summary[p, g, 0:3, :] and the G query heads
q_h = q[b, g * G + h, :]:

    GQA_MEAN_Q:  qb = mean_h q_h
                 out = w_avg * (qb . mu) + w_peak * sum_d max(qb_d * M_d, qb_d * m_d)
    GQA_MAX:     out = w_avg * max_h (q_h . mu) + w_peak * max_h sum_d max(q_h,d * M_d, q_h,d * m_d)
                 (the max over heads is taken for each term separately, as upstream)

``out[b, g, j] = -inf`` for ``j >= n_pages`` and for table entries outside ``[0, num_pages)``.

Tensors:
    q             [B, Hq, D]  bfloat16 / float16 / float32 (Hq = Hkv * G)
    summary       [num_pages, Hkv, 3, D] float32 or bfloat16 (mean, max, min)
    block_tables  [B, max_pages] int32
    seq_lens      [B] int32 (tokens)
    out           [B, Hkv, max_pages] float32

Grid (B * Hkv, ceil(max_pages / pages_per_cta)). A page's summary rows are split over
``lanes`` lanes (16-byte vectors); a warp scores 32 / lanes pages at once and loops. The query
slice of each head stays in registers (fp32) for the whole CTA.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .common import group_sum, load_vec_f32, row_split

THREADS = 128
ITERS = 4  # pages each lane group scores per CTA

GQA_MEAN_Q = 0
GQA_MAX = 1


@dataclass(frozen=True)
class PageScoresConfig:
    arch: int
    q_dtype: str = "bfloat16"
    summary_dtype: str = "float32"
    num_kv_heads: int = 8
    group: int = 4
    head_dim: int = 128
    page_size: int = 16
    gqa: int = GQA_MEAN_Q


def unsupported_reason(cfg: PageScoresConfig) -> str | None:
    if cfg.summary_dtype not in ("float32", "bfloat16"):
        return f"summary dtype {cfg.summary_dtype}"
    if cfg.q_dtype not in ("bfloat16", "float16", "float32"):
        return f"q dtype {cfg.q_dtype}"
    for dt in (cfg.summary_dtype, cfg.q_dtype):
        if row_split(4 if dt == "float32" else 2, cfg.head_dim) is None:
            return f"head_dim {cfg.head_dim} with {dt}"
    if cfg.group > 64:
        return f"group size {cfg.group} > 64"
    return None


def pages_per_cta(cfg: PageScoresConfig) -> int:
    _, lanes = row_split(4 if cfg.summary_dtype == "float32" else 2, cfg.head_dim)
    return (THREADS // lanes) * ITERS


class PageScores:
    def __init__(self, cfg: PageScoresConfig):
        reason = unsupported_reason(cfg)
        if reason is not None:
            raise ValueError(f"page_scores: unsupported config: {reason}")
        self.cfg = cfg
        self.vec, self.lanes = row_split(4 if cfg.summary_dtype == "float32" else 2, cfg.head_dim)
        self.groups_per_cta = THREADS // self.lanes
        self.pages_per_cta = self.groups_per_cta * ITERS
        self.n_q = 1 if cfg.gqa == GQA_MEAN_Q else cfg.group

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mSum: cute.Tensor, mTable: cute.Tensor, mSeqLen: cute.Tensor,
                 mOut: cute.Tensor, w_avg: Float32, w_peak: Float32, stream):
        # mQ: (B, Hq, D); mSum: (num_pages, Hkv, 3, D); mTable: (B, max_pages); mOut: (B, Hkv, max_pages)
        rows = mOut.shape[0] * self.cfg.num_kv_heads
        tiles = cute.ceil_div(mOut.shape[2], self.pages_per_cta)
        self.kernel(mQ, mSum, mTable, mSeqLen, mOut, w_avg, w_peak).launch(
            grid=[rows, tiles, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mSum: cute.Tensor, mTable: cute.Tensor, mSeqLen: cute.Tensor,
               mOut: cute.Tensor, w_avg: Float32, w_peak: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        row, tile, _ = cute.arch.block_idx()
        cfg = self.cfg
        vec, lanes, G = self.vec, self.lanes, cfg.group
        hkv = cfg.num_kv_heads
        b = row // hkv
        g = row - b * hkv
        grp = tidx // lanes
        lane = tidx - grp * lanes
        num_pages = mSum.shape[0]
        max_pages = mOut.shape[2]
        n_pages = (mSeqLen[b] + cfg.page_size - 1) // cfg.page_size

        # This lane's slice of the query heads (fp32): (n_q, vec); "mean_q" keeps only q-bar.
        rQ = cute.make_rmem_tensor(cute.make_layout((self.n_q, vec)), Float32)
        rQ.fill(0.0)
        for h in cutlass.range_constexpr(G):
            qv = self._load_q(mQ[b, g * G + h, None], lane)
            for j in cutlass.range_constexpr(vec):
                if cutlass.const_expr(cfg.gqa == GQA_MEAN_Q):
                    rQ[0, j] = rQ[0, j] + qv[j] * Float32(1.0 / G)
                else:
                    rQ[h, j] = qv[j]

        for it in cutlass.range_constexpr(ITERS):
            j_page = tile * self.pages_per_cta + it * self.groups_per_cta + grp
            phys = Int32(-1)
            if j_page < n_pages:
                phys = mTable[b, j_page]
            score = Float32(float("-inf"))
            if (phys >= 0) & (phys < num_pages):
                mu = load_vec_f32(mSum[phys, g, 0, None], lane, vec)
                mx = load_vec_f32(mSum[phys, g, 1, None], lane, vec)
                mn = load_vec_f32(mSum[phys, g, 2, None], lane, vec)
                avg = Float32(-3.0e38)
                peak = Float32(-3.0e38)
                for h in cutlass.range_constexpr(self.n_q):
                    a = Float32(0.0)
                    pk = Float32(0.0)
                    for j in cutlass.range_constexpr(vec):
                        a = a + rQ[h, j] * mu[j]
                        pk = pk + cute.arch.fmax(rQ[h, j] * mx[j], rQ[h, j] * mn[j])
                    a = group_sum(a, lanes)
                    pk = group_sum(pk, lanes)
                    avg = cute.arch.fmax(avg, a)
                    peak = cute.arch.fmax(peak, pk)
                score = w_avg * avg + w_peak * peak
            if (lane == 0) & (j_page < max_pages):
                mOut[b, g, j_page] = score

    @cute.jit
    def _load_q(self, qrow: cute.Tensor, lane: Int32):
        # The query may be narrower than the summary (bf16 q, fp32 summary): read this lane's
        # ``vec`` elements whatever the query's own vector width is.
        if cutlass.const_expr(self.cfg.q_dtype == self.cfg.summary_dtype or
                              (self.cfg.q_dtype != "float32" and self.cfg.summary_dtype != "float32")):
            return load_vec_f32(qrow, lane, self.vec)
        out = cute.make_rmem_tensor(cute.make_layout(self.vec), Float32)
        for j in cutlass.range_constexpr(self.vec):
            out[j] = qrow[lane * self.vec + j].to(Float32)
        return out
