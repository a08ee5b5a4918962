"""update_page_summary: per-page mean / max / min of the keys of the pages written this step.

For every slot ``s = page * P + off`` of ``slot_mapping`` that ends a run of the step's writes into
its page (the next entry is not ``s + 1`` on the same page), with ``c = off + 1`` tokens present:

    summary[page, h, 0, :] = mean_{t < c} key_cache[page, h, t, :]
    summary[page, h, 1, :] =  max_{t < c} key_cache[page, h, t, :]
    summary[page, h, 2, :] =  min_{t < c} key_cache[page, h, t, :]

A page's tokens are written in offset order (Paddle's block attention does), so offsets ``0..off``
hold the page's keys: a partial last page is summarised as it stands and is refreshed when its
next token lands. Exactly one CTA writes each page per step, so there is no race.

Tensors:
    key_cache     [num_pages, Hkv, P, D]   bfloat16 / float16 / float32
    slot_mapping  [N] int32; slots < 0 or >= num_pages * P are padding (ignored)
    summary       [num_pages, Hkv, 3, D]   float32 (default) or bfloat16, updated in place

One CTA per slot; thread ``i`` owns kv head ``i // lanes`` and the ``i % lanes``-th 16-byte vector
of ``D``, walking the ``c`` tokens of the page (coalesced 16-byte loads, fp32 accumulation).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .common import load_vec_f32, row_split, store_vec


@dataclass(frozen=True)
class PageSummaryConfig:
    arch: int
    key_dtype: str = "bfloat16"
    summary_dtype: str = "float32"
    num_kv_heads: int = 8
    page_size: int = 16
    head_dim: int = 128


def _bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def unsupported_reason(cfg: PageSummaryConfig) -> str | None:
    if cfg.key_dtype not in ("bfloat16", "float16", "float32"):
        return f"key dtype {cfg.key_dtype}"
    if cfg.summary_dtype not in ("float32", "bfloat16"):
        return f"summary dtype {cfg.summary_dtype}"
    for dt in (cfg.key_dtype, cfg.summary_dtype):
        if row_split(_bytes(dt), cfg.head_dim) is None:
            return f"head_dim {cfg.head_dim} with {dt} (need D/(16 B / elem) a power of two <= 32)"
    return None


class PageSummary:
    def __init__(self, cfg: PageSummaryConfig):
        reason = unsupported_reason(cfg)
        if reason is not None:
            raise ValueError(f"update_page_summary: unsupported config: {reason}")
        self.cfg = cfg
        # Key vectors and summary vectors may differ in width: the thread grid follows the key,
        # each thread then stores its key slice as one or two summary vectors.
        self.vec, self.lanes = row_split(_bytes(cfg.key_dtype), cfg.head_dim)
        self.out_vec = row_split(_bytes(cfg.summary_dtype), cfg.head_dim)[0]
        self.threads = cfg.num_kv_heads * self.lanes  # <= 32 * Hkv
        self.threads_padded = max(32, ((self.threads + 31) // 32) * 32)

    @cute.jit
    def __call__(self, mKey: cute.Tensor, mSlot: cute.Tensor, mSummary: cute.Tensor, stream):
        # mKey: (num_pages, Hkv, P, D); mSlot: (N,); mSummary: (num_pages, Hkv, 3, D)
        self.kernel(mKey, mSlot, mSummary).launch(
            grid=[mSlot.shape[0], 1, 1], block=[self.threads_padded, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mKey: cute.Tensor, mSlot: cute.Tensor, mSummary: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        i, _, _ = cute.arch.block_idx()
        P = self.cfg.page_size
        vec = self.vec
        n_slots = mSlot.shape[0]
        num_pages = mKey.shape[0]
        slot = mSlot[i]
        page = slot // P
        off = slot - page * P
        # The run goes on when the next write is the next offset of the same page.
        nxt = mSlot[cutlass.min(i + 1, n_slots - 1)]
        continues = (i + 1 < n_slots) & (nxt == slot + 1) & (off + 1 < P)
        cont = Int32(cutlass.select_(continues, 1, 0))
        if (slot >= 0) & (page < num_pages) & (tidx < self.threads) & (cont == 0):
            head = tidx // self.lanes
            lane = tidx - head * self.lanes
            acc_sum = cute.make_rmem_tensor(cute.make_layout(vec), Float32)
            acc_max = cute.make_rmem_tensor(cute.make_layout(vec), Float32)
            acc_min = cute.make_rmem_tensor(cute.make_layout(vec), Float32)
            acc_sum.fill(0.0)
            acc_max.fill(-3.0e38)
            acc_min.fill(3.0e38)
            count = off + 1
            for t in cutlass.range(count):
                v = load_vec_f32(mKey[page, head, t, None], lane, vec)
                for j in cutlass.range_constexpr(vec):
                    acc_sum[j] = acc_sum[j] + v[j]
                    acc_max[j] = cute.arch.fmax(acc_max[j], v[j])
                    acc_min[j] = -cute.arch.fmax(-acc_min[j], -v[j])
            inv = Float32(1.0) / Float32(count)
            for j in cutlass.range_constexpr(vec):
                acc_sum[j] = acc_sum[j] * inv
            self._store(mSummary[page, head, 0, None], lane, acc_sum)
            self._store(mSummary[page, head, 1, None], lane, acc_max)
            self._store(mSummary[page, head, 2, None], lane, acc_min)

    @cute.jit
    def _store(self, row: cute.Tensor, lane: Int32, vals: cute.Tensor):
        # This thread owns elements [lane * vec, (lane + 1) * vec) of the row; written as
        # vec / out_vec summary vectors (fp32 summary of bf16 keys: two 16-byte stores).
        n_out = self.vec // self.out_vec
        if cutlass.const_expr(n_out == 0):
            # fp32 keys into a bf16 summary: half a summary vector per thread, scalar stores
            for j in cutlass.range_constexpr(self.vec):
                row[lane * self.vec + j] = vals[j].to(row.element_type)
        elif cutlass.const_expr(n_out == 1):
            store_vec(row, lane, vals, self.out_vec)
        else:
            for k in cutlass.range_constexpr(n_out):
                part = cute.make_rmem_tensor(cute.make_layout(self.out_vec), Float32)
                for j in cutlass.range_constexpr(self.out_vec):
                    part[j] = vals[k * self.out_vec + j]
                store_vec(row, lane * n_out + k, part, self.out_vec)
