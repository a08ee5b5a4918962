"""Paged split-KV decode attention: one memory-bound kernel for SM90 and SM100 (warp MMA + cp.async).

Grid ``(B * Hkv * row_blocks, num_splits)``; one CTA of 4 warps per (sequence b, kv head h, row
block, split). GQA packing: the ``G * Sq`` query rows of kv head h (row m = s * G + g, query head
h * G + g, query token s) share the MMA's M (16 rows per m16 tile, 1 or 2 tiles per CTA; more rows
take more row blocks, which read the keys again, mostly from L2).

Key groups. At d <= 128 each warp is its own key group (4 groups). At d 256 (``cfg.d_split`` 2) the
warps pair up (2 groups): both warps of a pair read the same keys and compute the same S = Q K^T
over the whole head dim, and each accumulates its own half of O's columns (D / 2 = 128 fp32 columns,
64 registers a lane instead of 128, which had ptxas spilling at the 255-register limit).

Keys. The keys a (b, h) sees are ``[K0, L)`` with L = seqlens[b, h] (clamped to the table's reach; with
``cfg.dense_index`` every h reads ``seqlens[b]`` and ``table[b, j]``, a kv-head stride of 0 at compile time)
and K0 the first key any row's window reaches, rounded down to ``key_align`` (block_logit's block, or
one 16-key step). The split count S is a launch-time value: split ``sp`` takes the ``sp``-th of S
chunks of ``ceil((L - K0) / S)`` keys rounded up to ``key_groups * key_align``, and each key group a
contiguous quarter (d 256: half) of its CTA's chunk. The partition depends on L and S only, so the
result is a deterministic function of the inputs and S (bitwise repeatable), and short sequences
still spread over all warps.

Loads. Each key group runs its own cp.async ring (``cfg.stages`` steps of 16 keys: a K tile and a V
tile, rows of 16-byte chunks swizzled by ``chunk ^ (row % 8)``). A warp alone syncs with
``__syncwarp``; a d 256 pair loads one half of the columns each (its own half of V, which only it
reads, and half of K) and meets at one named barrier per step (see ``_step``). Every lane gathers its 16-byte chunks
straight from the page table: key t of (b, h) is row ``t % P`` of page ``table[b, h, t // P]``, at
element offset ``page * stride_page + h * stride_h + row * stride_row`` (the three layouts differ
only in strides; "contiguous" is page b, row t). A key t >= L, a page id outside [0, num_pages) or a
table slot past L is never dereferenced: its chunk is zero-filled (cp.async source size 0). So no
stale value of an unused page tail or unlisted page reaches shared memory, and V rows of keys no
row can see are exact zeros (P = 0 times a NaN V would be NaN).

Math per warp step (16 keys): S = Q K^T by ``mma.sync m16n8k16`` (K fragments by ldmatrix, Q
fragments held in registers or re-read), softcap (``common.softmax.softcap_logit``), the masks of
``common.mask.apply_mask`` (key past L, bottom-right causal / window), block_logit's running block
max, the online softmax of ``common.softmax.OnlineSoftmax`` (quad rows: 4 lanes per row), P packed
to 16 bits in registers and O += P V (V fragments by ldmatrix.trans).

Epilogue. The key groups' (O, row max, row sum) go through shared memory (the drained ring) and are
merged in group order, then written either as the final output (bf16/fp16 ``out [B, Sq, Hq, D]``,
fp32 ``lse [B, Hq, Sq]``) or as fp32 split partials (``o_part [S, B, Sq, Hq, D]`` normalised per
split, ``lse_part [S, B, Sq, Hq]``) that ``combine.py`` merges in split order. A row with no
visible key gets O = 0 and lse = -inf (also in a partial).

block_logit ``[B, Hq, Sq, nb]``: each warp keeps a running max per row over the steps of the current
block and stores it (times softmax_scale unless softcap already scaled it) when the block ends (in a
d 256 pair only the first warp stores; both hold the same maxima); key group ranges start on block
boundaries, so every block in [K0 / bs, ceil(L / bs)) is written by exactly one warp. The CTA of split 0 writes -inf to the blocks outside that range (before the window, past
L). Every entry is written exactly once with plain stores (no pre-fill, no atomics).
"""

from __future__ import annotations

import operator

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from cute_kernels.common.mask import apply_mask
from cute_kernels.common.softmax import OnlineSoftmax, exp2_reference, softcap_logit
from cute_kernels.common.utils import LN_2, LOG2_E, row_allreduce, tree_max
from cute_kernels.dtypes import cutlass_dtype

from .config import KEYS_PER_STEP, WARPS, DecodeConfig, unsupported_reason
from .ptx import cp_async_16, ldsm_x4, mma_16816, pack2

KW = KEYS_PER_STEP


class DecodeFwd:
    def __init__(self, cfg: DecodeConfig):
        reason = unsupported_reason(cfg)
        if reason is not None:
            raise NotImplementedError(f"decode attention: {reason}")
        self.cfg = cfg
        self.dtype = cutlass_dtype(cfg.dtype)
        self.bf16 = cfg.dtype == "bfloat16"
        self.D = cfg.head_dim
        self.MT = cfg.m_tiles
        self.MB = cfg.rows_per_cta
        self.S = cfg.stages
        self.DS = cfg.d_split
        self.KG = cfg.key_groups
        self.DO = self.D // self.DS  # O columns of one warp
        self.chunks = self.D // 8  # 16-byte chunks per row
        ld_chunks = self.DO // 8  # chunks of a K / V row one warp loads (its own columns' share)
        self.rows_per_instr = max(1, 32 // ld_chunks)
        self.lanes_per_row = min(32, ld_chunks)
        self.tile_bytes = KW * self.D * 2

    # ------------------------------------------------------------------ host side of the launch
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mSeq: cute.Tensor, mTable,
                 mO: cute.Tensor, mLse: cute.Tensor, mBL, softmax_scale: Float32, softcap: Float32,
                 window_left: Int32, window_right: Int32, stream):
        cfg = self.cfg
        bh = mSeq.shape[0] * self._kv_heads(mSeq, mK)
        splits = mO.shape[0] if const_expr(cfg.split) else 1
        # d 256: one CTA per SM is all ptxas may assume (.minnctapersm 1); without it the CUDA 12 ptxas for sm_100a
        # capped the warp pairs' kernel at 168 registers (3 CTAs of 128 threads) and spilled 8 B. Shared memory
        # allows 2 CTAs per SM, which 255 registers still do.
        # SM100 (every config) and d 64: the same hint. Without it the CUDA 13 ptxas capped d 64 configs at 128
        # registers (4 CTAs per SM, which the ~100 KB of shared memory never allows) and spilled: 32 B in five
        # dense-index split configs on sm_100a, 8 B in the two softcap + window + block_logit ones on sm_90a. The
        # sm_90a d 128 configs, which take 165-251 registers without it, keep their GPU-verified allocation.
        occupancy = ({"min_blocks_per_mp": 1} if const_expr(cfg.d_split > 1 or cfg.arch >= 100 or cfg.head_dim <= 64)
                     else {})
        self.kernel(mQ, mK, mV, mSeq, mTable, mO, mLse, mBL, softmax_scale, softcap, window_left,
                    window_right).launch(grid=[bh * cfg.row_blocks, splits, 1], block=[32 * WARPS, 1, 1],
                                         smem=cfg.smem_bytes, stream=stream, **occupancy)

    # ------------------------------------------------------------------ device
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mSeq: cute.Tensor, mTable,
               mO: cute.Tensor, mLse: cute.Tensor, mBL, softmax_scale: Float32, softcap: Float32,
               window_left: Int32, window_right: Int32):
        cfg = self.cfg
        D, MT, MB, S, G, Sq = self.D, self.MT, self.MB, self.S, cfg.group, cfg.seqlen_q
        DS, KG, DO = self.DS, self.KG, self.DO
        ROWS = cfg.rows
        tidx, _, _ = cute.arch.thread_idx()
        bidx, sp, _ = cute.arch.block_idx()
        _, n_splits, _ = cute.arch.grid_dim()
        lane = tidx % 32
        wn = tidx // 32
        # key group of this warp and its share of O's columns (d_split 1: group = warp, all columns)
        kg = wn
        dh = 0
        if const_expr(DS > 1):
            kg = wn // DS
            dh = wn % DS
        hkv = self._kv_heads(mSeq, mK)
        rb = bidx % cfg.row_blocks
        bh = bidx // cfg.row_blocks
        b = bh // hkv
        h = bh - b * hkv

        # ---- shared memory: Q tile, then the warps' rings (reused by the merge)
        smem = cutlass.memory.SmemAllocator()
        sQ = smem.allocate_tensor(cutlass.Int32, cute.make_layout(cfg.q_bytes // 4), byte_alignment=128)
        sW = smem.allocate_tensor(Float32, cute.make_layout(max(cfg.ring_bytes, cfg.merge_bytes) // 4),
                                  byte_alignment=128)
        q_base = sQ.iterator.toint()
        ring_base = sW.iterator.toint() + kg * (S * 2 * self.tile_bytes)

        # ---- sequence facts
        if const_expr(cfg.layout == "contiguous"):
            cap = mK.shape[1]
        else:
            cap = self._table_slots(mTable) * cfg.page_size
        L = cutlass.max(cutlass.min(self._seqlen(mSeq, b, h), cap), 0)
        kmin = Int32(0)
        if const_expr(cfg.mask_left):
            kmin = cutlass.max(L - Sq - window_left, 0)
        A = cfg.key_align
        K0 = (kmin // A) * A
        span = cutlass.max(L - K0, 0)
        gran = KG * A
        chunk = ((span + n_splits - 1) // n_splits + gran - 1) // gran * gran
        per_warp = chunk // KG
        w_start = K0 + sp * chunk + kg * per_warp
        l_up = (L + KW - 1) // KW * KW
        w_end = cutlass.min(w_start + per_warp, l_up)
        n_steps = cutlass.max(w_end - w_start, 0) // KW

        # ---- Q tile -> smem (rows past G * Sq zero-filled), swizzled like K / V
        q_row0 = rb * MB
        for it in cutlass.range_constexpr((MB * self.chunks) // (32 * WARPS)):
            idx = it * 32 * WARPS + tidx
            r = idx // self.chunks
            c = idx % self.chunks
            m = q_row0 + r
            ok = m < ROWS
            s = m // G
            g = m - s * G
            qoff = Int64(0)
            if ok:
                qoff = (Int64(b) * mQ.shape[1] + s) * mQ.shape[2] * D + Int64(h * G + g) * D + c * 8
            cp_async_16(q_base + r * (D * 2) + ((c ^ (r % 8)) * 16), mQ.iterator.toint() + qoff * 2,
                        cutlass.select_(ok, Int32(16), Int32(0)))
        cute.arch.cp_async_commit_group()

        # ---- cache strides (elements, 64-bit)
        if const_expr(cfg.layout == "hnd"):  # [pages, Hkv, P, D]
            st_page = Int64(hkv) * (cfg.page_size * D)
            st_h = Int64(cfg.page_size * D)
            st_row = Int64(D)
        elif const_expr(cfg.layout == "nhd"):  # [pages, P, Hkv, D]
            st_page = Int64(hkv) * (cfg.page_size * D)
            st_h = Int64(D)
            st_row = Int64(hkv) * D
        else:  # contiguous [B, Sk, Hkv, D]: page b, row t
            st_page = Int64(mK.shape[1]) * hkv * D
            st_h = Int64(D)
            st_row = Int64(hkv) * D
        num_pages = mK.shape[0]
        k_gbase = mK.iterator.toint()
        v_gbase = mV.iterator.toint()
        ld_row = lane // self.lanes_per_row
        ld_chunk = lane % self.lanes_per_row
        if const_expr(DS > 1):
            ld_chunk = ld_chunk + dh * (DO // 8)  # this warp's columns of K and V

        # ---- fragments and state
        rQ = cute.make_rmem_tensor(cute.make_layout((MT, D // 16, 4)), Int32)
        rO = cute.make_rmem_tensor(cute.make_layout((MT, DO // 8, 4)), Float32)
        rO.fill(0.0)
        acc = cute.make_rmem_tensor(cute.make_layout((2 * MT, 2 * (KW // 8))), Float32)
        rBL = cute.make_rmem_tensor(cute.make_layout(2 * MT), Float32)
        rBL.fill(-Float32.inf)
        if const_expr(cfg.softcap):
            scale_log2 = Float32(LOG2_E)
            softcap_in = softmax_scale / softcap
            bl_scale = Float32(1.0)
        else:
            scale_log2 = softmax_scale * LOG2_E
            softcap_in = Float32(0.0)
            bl_scale = softmax_scale
        sm = OnlineSoftmax(scale_log2, 2 * MT, 4)
        sm.reset()
        # packed row of each accumulator row of this thread, and its query token (for the masks)
        rows_m = [q_row0 + (r // 2) * 16 + (r % 2) * 8 + lane // 4 for r in range(2 * MT)]
        rows_s = [rm // G for rm in rows_m]
        cols = [(c // 2) * 8 + c % 2 for c in range(2 * (KW // 8))]
        shift = L - Sq

        # Q fragments (A operand): matrices (rows 0-7 | 8-15) x (d 0-7 | 8-15) of each k16
        q_lrow = (lane % 8) + 8 * ((lane // 8) % 2)
        q_lchunk = lane // 16
        # ---- prologue: steps 0 .. S-2 in flight
        for st in cutlass.range_constexpr(S - 1):
            if st < n_steps:
                self._load_step(w_start + st * KW, st, ring_base, mTable, b, h, L, kmin, num_pages, k_gbase,
                                v_gbase, st_page, st_h, st_row, ld_row, ld_chunk)
            cute.arch.cp_async_commit_group()

        cute.arch.cp_async_wait_group(S - 1)  # Q's group (the oldest) has landed; the prologue's may not
        cute.arch.sync_threads()
        if const_expr(cfg.q_in_regs):
            for mt in cutlass.range_constexpr(MT):
                for kk in cutlass.range_constexpr(D // 16):
                    r = mt * 16 + q_lrow
                    fr = ldsm_x4(q_base + r * (D * 2) + (((2 * kk + q_lchunk) ^ (r % 8)) * 16))
                    for i in cutlass.range_constexpr(4):
                        rQ[mt, kk, i] = fr[i]

        k_lrow = (lane % 8) + 8 * (lane // 16)  # K: matrices (keys 0-7 | 8-15) x (d chunk 2kk | 2kk+1)
        k_lchunk = (lane // 8) % 2
        v_lrow = (lane % 8) + 8 * ((lane // 8) % 2)  # V^T: (keys 0-7 | 8-15) x (d chunk 2j | 2j+1)
        v_lchunk = lane // 16
        # byte offset of this warp's V columns in a V row (the swizzle permutes chunks within aligned groups of 8,
        # so each half of a row keeps its own chunks)
        v_col = 0
        sw = None
        if const_expr(DS > 1):
            v_col = dh * (DO * 2)
            # d 256's fragment addresses: chunk (2 kk + c) ^ (row % 8) = 8 (kk // 4) + ((2 (kk % 4) + c) ^ (row % 8)),
            # so four registers per operand (kk % 4) and the 128-byte group (kk // 4) as the ldmatrix immediate
            sw = dict(k=[k_lrow * (D * 2) + (((2 * rr + k_lchunk) ^ (lane % 8)) * 16) for rr in range(4)],
                      v=[v_lrow * (D * 2) + v_col + (((2 * rr + v_lchunk) ^ (lane % 8)) * 16) for rr in range(4)],
                      q=[q_base + q_lrow * (D * 2) + (((2 * rr + q_lchunk) ^ (lane % 8)) * 16) for rr in range(4)])
        ctx = dict(n_steps=n_steps, w_start=w_start, w_end=w_end, ring_base=ring_base, q_base=q_base, mTable=mTable,
                   b=b, h=h, L=L, kmin=kmin, num_pages=num_pages, k_gbase=k_gbase, v_gbase=v_gbase, st_page=st_page,
                   st_h=st_h, st_row=st_row, ld_row=ld_row, ld_chunk=ld_chunk, lane=lane, k_lrow=k_lrow,
                   k_lchunk=k_lchunk, v_lrow=v_lrow, v_lchunk=v_lchunk, sw=sw, kg=kg, dh=dh, q_lrow=q_lrow,
                   q_lchunk=q_lchunk, rQ=rQ, rO=rO,
                   acc=acc, rBL=rBL, sm=sm, softcap_in=softcap_in, softcap=softcap, cols=cols, rows_s=rows_s,
                   rows_m=rows_m, shift=shift, window_left=window_left, window_right=window_right, mBL=mBL,
                   bl_scale=bl_scale)
        for i in cutlass.range(n_steps, unroll=1):
            self._step(i, ctx)

        if const_expr(cfg.split):  # let the combine (a programmatic dependent) launch while this grid drains
            cute.arch.griddepcontrol_launch_dependents()
        # ---- merge the key groups' (O, max, sum) through shared memory, in group order
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()
        o_words = KG * MB * D
        o_col = 0
        if const_expr(DS > 1):
            o_col = dh * DO  # this warp's columns
        for mt in cutlass.range_constexpr(MT):
            for nd in cutlass.range_constexpr(DO // 8):
                for j in cutlass.range_constexpr(4):
                    r = mt * 16 + lane // 4 + 8 * (j // 2)
                    if const_expr(DS > 1):
                        sW[(kg * MB + r) * D + o_col + nd * 8 + (lane % 4) * 2 + j % 2] = rO[mt, nd, j]
                    else:
                        sW[(kg * MB + r) * D + nd * 8 + (lane % 4) * 2 + j % 2] = rO[mt, nd, j]
        for r in cutlass.range_constexpr(2 * MT):
            tot = row_allreduce(sm.row_sum[r], 4, operator.add)
            if const_expr(DS > 1):
                if (lane % 4 == 0) & (dh == 0):  # a pair holds the same (max, sum): its first warp writes them
                    rr = (r // 2) * 16 + (r % 2) * 8 + lane // 4
                    sW[o_words + kg * MB + rr] = sm.row_max[r]
                    sW[o_words + KG * MB + kg * MB + rr] = tot
            else:
                if lane % 4 == 0:
                    rr = (r // 2) * 16 + (r % 2) * 8 + lane // 4
                    sW[o_words + kg * MB + rr] = sm.row_max[r]
                    sW[o_words + KG * MB + kg * MB + rr] = tot
        cute.arch.sync_threads()
        n_valid = cutlass.min(ROWS - q_row0, MB)
        for idx in cutlass.range(tidx, n_valid * D, 32 * WARPS, unroll=1):
            r = idx // D
            d = idx - r * D
            mx = sW[o_words + r]
            for w in cutlass.range_constexpr(1, KG):
                mx = cute.arch.fmax(mx, sW[o_words + w * MB + r])
            m_ref = exp2_reference(mx)
            tot = Float32(0.0)
            o = Float32(0.0)
            for w in cutlass.range_constexpr(KG):
                wt = cute.math.exp2((sW[o_words + w * MB + r] - m_ref) * scale_log2, fastmath=True)
                tot = tot + wt * sW[o_words + KG * MB + w * MB + r]
                o = o + wt * sW[(w * MB + r) * D + d]
            empty = tot == 0.0 or tot != tot
            o = Float32(0.0) if empty else o / tot
            lse = -Float32.inf if empty else (m_ref * scale_log2 + cute.math.log2(tot, fastmath=True)) * LN_2
            m = q_row0 + r
            s = m // G
            hq = h * G + (m - s * G)
            if const_expr(cfg.split):
                mO[sp, b, s, hq, d] = o
                if d == 0:
                    mLse[sp, b, s, hq] = lse
            else:
                mO[b, s, hq, d] = o.to(self.dtype)
                if d == 0:
                    mLse[b, hq, s] = lse

        # ---- block_logit: -inf for the blocks no warp visits (split 0's CTA)
        if const_expr(cfg.block_size > 0):
            if sp == 0:
                nb = mBL.shape[3]
                bs = cfg.block_size
                lo_cnt = cutlass.min(K0 // bs, nb)
                hi_start = cutlass.max((L + bs - 1) // bs, lo_cnt)
                if span == 0:
                    lo_cnt = nb
                    hi_start = nb
                hi_cnt = cutlass.max(nb - hi_start, 0)
                n_fill = lo_cnt + hi_cnt
                for idx in cutlass.range(tidx, n_valid * n_fill, 32 * WARPS, unroll=1):
                    r = idx // n_fill
                    k = idx - r * n_fill
                    j = k if k < lo_cnt else hi_start + (k - lo_cnt)
                    m = q_row0 + r
                    s = m // G
                    mBL[b, h * G + (m - s * G), s, j] = -Float32.inf

    @cute.jit
    def _step(self, i: Int32, ctx: dict):
        """One pipeline step of a warp: issue the load S - 1 steps ahead, wait for step ``i``, consume it.

        d_split 2: the group's two warps each load their own half of the K and V columns; both read all of K, each
        only its own half of V. One named barrier of the pair per step, after this warp's copies of step ``i`` have
        landed: it makes the partner's K half visible, and it follows both warps' reads of step ``i - 1``, whose slot
        the load issued next overwrites."""
        cfg = self.cfg
        D, MT, S, DS, DO = self.D, self.MT, self.S, self.DS, self.DO
        n_steps, w_start, w_end, ring_base, q_base = (ctx[k] for k in ("n_steps", "w_start", "w_end", "ring_base",
                                                                        "q_base"))
        lane, k_lrow, k_lchunk, v_lrow, v_lchunk, q_lrow, q_lchunk = (
            ctx[k] for k in ("lane", "k_lrow", "k_lchunk", "v_lrow", "v_lchunk", "q_lrow", "q_lchunk"))
        rQ, rO, acc, rBL, sm, cols = (ctx[k] for k in ("rQ", "rO", "acc", "rBL", "sm", "cols"))
        softcap_in, softcap = ctx["softcap_in"], ctx["softcap"]
        mTable, b, h, L = ctx["mTable"], ctx["b"], ctx["h"], ctx["L"]
        if const_expr(DS > 1):
            cute.arch.cp_async_wait_group(S - 2)  # this warp's copies of step i have landed
            cute.arch.barrier(barrier_id=1 + ctx["kg"], number_of_threads=32 * DS)
        else:
            cute.arch.sync_warp()  # every lane is done reading the slot the next load overwrites
        nxt = i + S - 1
        if nxt < n_steps:
            self._load_step(w_start + nxt * KW, nxt % S, ring_base, mTable, b, h, L, ctx["kmin"], ctx["num_pages"],
                            ctx["k_gbase"], ctx["v_gbase"], ctx["st_page"], ctx["st_h"], ctx["st_row"],
                            ctx["ld_row"], ctx["ld_chunk"])
        cute.arch.cp_async_commit_group()
        if const_expr(DS == 1):
            cute.arch.cp_async_wait_group(S - 1)
            cute.arch.sync_warp()
        t0 = w_start + i * KW
        sK = ring_base + (i % S) * (2 * self.tile_bytes)
        sV = sK + self.tile_bytes
        # S = Q K^T
        acc.fill(0.0)
        sw = ctx["sw"]
        for kk in cutlass.range_constexpr(D // 16):
            if const_expr(DS > 1):
                kb = ldsm_x4(sK + sw["k"][kk % 4], offset=(kk // 4) * 128)
            else:
                kb = ldsm_x4(sK + k_lrow * (D * 2) + (((2 * kk + k_lchunk) ^ (lane % 8)) * 16))
            for mt in cutlass.range_constexpr(MT):
                if const_expr(cfg.q_in_regs):
                    qa = [rQ[mt, kk, j] for j in range(4)]
                elif const_expr(DS > 1):
                    qa = ldsm_x4(sw["q"][kk % 4], offset=mt * 16 * (D * 2) + (kk // 4) * 128)
                else:
                    r = mt * 16 + q_lrow
                    qa = ldsm_x4(q_base + r * (D * 2) + (((2 * kk + q_lchunk) ^ (r % 8)) * 16))
                for nb in cutlass.range_constexpr(2):
                    c0 = nb * 2
                    res = mma_16816(qa, kb[2 * nb], kb[2 * nb + 1],
                                    (acc[2 * mt, c0], acc[2 * mt, c0 + 1], acc[2 * mt + 1, c0],
                                     acc[2 * mt + 1, c0 + 1]), self.bf16)
                    acc[2 * mt, c0] = res[0]
                    acc[2 * mt, c0 + 1] = res[1]
                    acc[2 * mt + 1, c0] = res[2]
                    acc[2 * mt + 1, c0 + 1] = res[3]
        if const_expr(cfg.softcap):
            for r in cutlass.range_constexpr(2 * MT):
                for c in cutlass.range_constexpr(len(cols)):
                    acc[r, c] = softcap_logit(acc[r, c], softcap_in, softcap)
        apply_mask(acc, cols, ctx["rows_s"], t0 + (lane % 4) * 2, L, ctx["shift"], ctx["window_left"],
                   ctx["window_right"], True, cfg.mask_right, cfg.mask_left)
        local_max = None
        if const_expr(cfg.block_size > 0):
            local_max = []
            for r in cutlass.range_constexpr(2 * MT):
                mr = row_allreduce(tree_max([acc[r, c] for c in range(len(cols))]), 4, cute.arch.fmax)
                rBL[r] = cute.arch.fmax(rBL[r], mr)
                local_max.append(mr)
        row_scale = sm.update(acc, False, local_max)
        for mt in cutlass.range_constexpr(MT):
            for nd in cutlass.range_constexpr(DO // 8):
                for j in cutlass.range_constexpr(4):
                    rO[mt, nd, j] = rO[mt, nd, j] * row_scale[2 * mt + j // 2]
        # P (A operand of P V) from the S accumulator, one k16 = the step's 16 keys
        pa = []
        for mt in cutlass.range_constexpr(MT):
            pa.append([pack2(acc[2 * mt, 0], acc[2 * mt, 1], self.bf16),
                       pack2(acc[2 * mt + 1, 0], acc[2 * mt + 1, 1], self.bf16),
                       pack2(acc[2 * mt, 2], acc[2 * mt, 3], self.bf16),
                       pack2(acc[2 * mt + 1, 2], acc[2 * mt + 1, 3], self.bf16)])
        for jd in cutlass.range_constexpr(DO // 16):
            if const_expr(DS > 1):
                vb = ldsm_x4(sV + sw["v"][jd % 4], True, offset=(jd // 4) * 128)
            else:
                vb = ldsm_x4(sV + v_lrow * (D * 2) + (((2 * jd + v_lchunk) ^ (lane % 8)) * 16), True)
            for mt in cutlass.range_constexpr(MT):
                for half in cutlass.range_constexpr(2):
                    nd = 2 * jd + half
                    res = mma_16816(pa[mt], vb[2 * half], vb[2 * half + 1],
                                    (rO[mt, nd, 0], rO[mt, nd, 1], rO[mt, nd, 2], rO[mt, nd, 3]), self.bf16)
                    for j in cutlass.range_constexpr(4):
                        rO[mt, nd, j] = res[j]
        if const_expr(cfg.block_size > 0):
            t_end = t0 + KW
            if (t_end % cfg.block_size == 0) | (t_end >= w_end):
                self._store_block_logit(ctx["mBL"], rBL, ctx["rows_m"], b, h, t0 // cfg.block_size, ctx["bl_scale"],
                                        lane, ctx["dh"])
                rBL.fill(-Float32.inf)

    @cute.jit
    def _load_step(self, t0: Int32, slot: Int32, ring_base: Int32, mTable, b: Int32, h: Int32, L: Int32,
                   kmin: Int32, num_pages: Int32, k_gbase: Int64, v_gbase: Int64, st_page: Int64, st_h: Int64,
                   st_row: Int64, ld_row: Int32, ld_chunk: Int32):
        """Issue this lane's cp.async chunks of the K and V tiles of keys [t0, t0 + 16) into ``slot``.

        Keys outside [kmin, L) are zero-filled and their table slots never read: past L nothing exists, and
        before the left window (kmin) an engine may already have recycled the pages (their ids valid, their
        contents another request's, NaN included)."""
        cfg = self.cfg
        P = cfg.page_size
        sK = ring_base + slot * (2 * self.tile_bytes)
        sV = sK + self.tile_bytes
        head_off = Int64(h) * st_h + ld_chunk * 8
        row32 = Int32(st_row)  # a row's stride within a page (or sequence) fits 32 bits
        step_ok = t0 < L
        if const_expr(cfg.mask_left):
            step_ok = step_ok & (t0 + KW > kmin)
        # 64-bit base of the step's first row; rows add 32-bit offsets (fewer live 64-bit values)
        if const_expr(cfg.layout == "contiguous"):
            step_base = Int64(b) * st_page + Int64(t0) * st_row + head_off
        elif const_expr(P >= KW):  # the step's 16 keys share one page
            step_page = Int32(0)
            if step_ok:
                step_page = self._page_id(mTable, b, h, t0 // P)
            step_ok = step_ok & (step_page >= 0) & (step_page < num_pages)
            step_base = Int64(step_page) * st_page + Int64(t0 % P) * st_row + head_off
        elif const_expr(P >= self.rows_per_instr):  # P in {1, 8} here: each lane's rows of one page group
            # share a page whose slot index is a compile-time function of the row (t0 % 16 == 0, P | 16)
            grp_base = []
            grp_ok = []
            for gi in cutlass.range_constexpr(KW // P):
                pg = Int32(0)
                g_ok = t0 + gi * P < L
                if const_expr(cfg.mask_left):
                    g_ok = g_ok & (t0 + (gi + 1) * P > kmin)
                if g_ok:
                    pg = self._page_id(mTable, b, h, t0 // P + gi)
                grp_ok.append(g_ok & (pg >= 0) & (pg < num_pages))
                grp_base.append(Int64(pg) * st_page + head_off)
        for it in cutlass.range_constexpr(KW // self.rows_per_instr):
            r = it * self.rows_per_instr + ld_row
            t = t0 + r
            ok = t < L
            if const_expr(cfg.mask_left):
                ok = ok & (t >= kmin)
            if const_expr(cfg.layout == "contiguous"):
                goff = step_base + r * row32
            elif const_expr(P >= KW):
                ok = ok & step_ok
                goff = step_base + r * row32
            elif const_expr(P >= self.rows_per_instr):
                gi = (it * self.rows_per_instr) // P
                ok = ok & grp_ok[gi]
                goff = grp_base[gi] + ((it * self.rows_per_instr) % P + ld_row) * row32
            else:  # P = 1 with several rows per instruction: one table read per row
                page = Int32(0)
                if ok:
                    page = self._page_id(mTable, b, h, t // P)
                ok = ok & (page >= 0) & (page < num_pages)
                goff = Int64(page) * st_page + Int64(t % P) * st_row + head_off
            goff = cutlass.select_(ok, goff, Int64(0)) * 2
            soff = r * (self.D * 2) + ((ld_chunk ^ (r % 8)) * 16)
            nbytes = cutlass.select_(ok, Int32(16), Int32(0))
            cp_async_16(sK + soff, k_gbase + goff, nbytes)
            cp_async_16(sV + soff, v_gbase + goff, nbytes)

    @cute.jit
    def _store_block_logit(self, mBL, rBL, rows_m: list, b: Int32, h: Int32, j: Int32, bl_scale: Float32,
                           lane: Int32, dh):
        """Quad leader lanes store; with d_split 2 only the group's first warp (both hold the same maxima)."""
        if const_expr(self.DS > 1):
            if (lane % 4 == 0) & (dh == 0):
                self._store_block_logit_rows(mBL, rBL, rows_m, b, h, j, bl_scale)
        else:
            if lane % 4 == 0:
                self._store_block_logit_rows(mBL, rBL, rows_m, b, h, j, bl_scale)

    @cute.jit
    def _store_block_logit_rows(self, mBL, rBL, rows_m: list, b: Int32, h: Int32, j: Int32, bl_scale: Float32):
        cfg = self.cfg
        if j < mBL.shape[3]:
            for r in cutlass.range_constexpr(len(rows_m)):
                m = rows_m[r]
                if m < cfg.rows:
                    s = m // cfg.group
                    mBL[b, h * cfg.group + (m - s * cfg.group), s, j] = rBL[r] * bl_scale

    # ------------------------------------------------------------------ index tensors (trace-time helpers)
    # Per kv head (cfg.dense_index False): seqlens [B, Hkv], table [B, Hkv, n]. Dense: seqlens [B], table [B, n],
    # read by every kv head of the sequence (a kv-head stride of 0 known at compile time: no stride term).
    def _kv_heads(self, mSeq, mK):
        """Hkv: the lengths' second extent, or with dense lengths the cache's kv-head extent."""
        if self.cfg.dense_index:
            return mK.shape[1] if self.cfg.layout == "hnd" else mK.shape[2]
        return mSeq.shape[1]

    def _seqlen(self, mSeq, b, h):
        return mSeq[b] if self.cfg.dense_index else mSeq[b, h]

    def _table_slots(self, mTable):
        return mTable.shape[1] if self.cfg.dense_index else mTable.shape[2]

    def _page_id(self, mTable, b, h, j):
        return mTable[b, j] if self.cfg.dense_index else mTable[b, h, j]
