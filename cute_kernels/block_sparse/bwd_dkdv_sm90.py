"""BlockSparseBwdDKDVSm90: Hopper dK / dV of block-sparse attention, key-major, deterministic.

    dv_c = sum_rows P[row, c] dO[row],   dk_c = scale * sum_rows dS[row, c] q[row]

over the rows (query, head) that see key c, with P and dS as in ``bwd_dq_sm90.py``. One CTA per
(segment of selected key block r of index set s, kv head h, batch b; Note [key block segments]):
the block's rows ``[key_start, key_end)`` (clipped at its document's end) stay in shared memory
while the CTA walks its share of the block's (query tile, slot) pairs of the plan's key-major
transpose in ascending tile order (x the head chunks for G > 64). Keys no query selects are not
visited: the caller passes dk / dv zero-filled.

    WG 0, warp 0   producer: K, V of the block once; per step (pair x head chunk) the tile's Q and dO
                   rows (one TMA box of GC head rows per tile query each; queries past S repeat the
                   last one, whose columns are masked) into stage step % 4
    WG 0, warps 1-2 row producers (Note [row facts in shared memory]), one step each in turn: the 64
                   rows' lse (log2 units), delta and key limit into the step's stage, then its arrival
                   on the stage's full barrier (which counts it next to the TMA bytes)
    WG 1, WG 2     Note [two pair streams]: WG w takes the steps of parity w - 1 (stages w - 1,
                   w + 1): S^T = K Q^T and dP^T = V dO^T (wgmma m64n64, keys as M: Note [keys as the M
                   dimension] in indexed/bwd_dkdv_sm90.py), P^T, dV += P^T dO, dS^T = P^T (dP^T - delta),
                   dK += dS^T Q (A from registers), its own dK / dV partial in registers

Note [two pair streams]: the two consumer WGs work on different steps, so neither recomputes the
other's S^T and both run the whole step (an earlier split, one WG dV and one dK on the same step,
computed S^T twice and left the dV WG idle a third of the time). After the last step WG 1 passes
its dK partial and WG 2 its dV partial through the idle Q stages; WG 1 stores dV, WG 2 dK. Each
element is the sum of its two partials, each summed in the plan's order over a split of the steps
that only the plan decides: bitwise reproducible, no atomics, one write per element.

Note [key block segments]: selections are skewed (an early block is listed by many more query tiles
than a late one: ~5x the mean for block 0 of a causal 16K selection; MQA 64 has one CTA per block
and kv head, 256 at 16K), so one CTA per key block ends the grid on a tail. Block r's n pairs go
to CTAs x = r * SEGMENTS + k, k < nseg (``segment_split``): with L0 = max(ceil(n / SEGMENTS), min_seg)
(``min_seg`` a runtime argument, ``launch.default_min_segment_pairs``), the segment length is
L = ceil(n / ceil(n / L0)) <= L0 and nseg = ceil(n / L) <= SEGMENTS: segment k takes pairs
[k L, min(n, (k + 1) L)), every one non-empty, all of L pairs but the last (83 pairs at L0 = 64: 42 + 41,
where L0 itself would give 64 + 19); the others exit. With nseg > 1, segment k waits until the block's counter ``seg_sem[s, r, h]`` (zeroed by the caller) equals k, adds the fp32 sum of segments 0 .. k - 1 that
``dk_part`` / ``dv_part`` hold for the block's rows, and stores the sum there and bumps the counter,
or (k = nseg - 1) writes dK * scale and dV. A segment waits only on the previous one, a lower
blockIdx.x, launched before it. The order of every sum is fixed by the plan: bitwise reproducible.

Note [tile-ordered segments]: in that key-block-major order the CTAs running at one time (one per SM) hold
neighbouring key blocks, which trained (and the bench's "local") selections rarely list from the same query
tiles, so each step's Q and dO rows came from DRAM (Run AN1: L2 hit 3 % for the latent at 16K, 27 % for GQA at
64K). With the plan's ``key_order`` ([NS, KCAP * SEGMENTS], built by the planner, ``config.segment_split`` at
``config.ORDERED_MIN_SEGMENT_PAIRS``) CTA x of set s runs segment ``key_order[s, x]``: the live segments sorted by
their first query tile (then by id), the dead ones last. The CTAs of the segments a query tile's neighbourhood
starts then run together and read the same rows, once from DRAM. It is a permutation of the ids and keeps each
block's segments in k order (their first tiles ascend with k; a segment dead for the plan's min_seg but live for
another sorts after the block's live ones), so segment k still waits only on a CTA launched before it, whatever
``min_seg`` the launch uses; the segments and their sums are the same, so dK / dV are bitwise those of the
key-block-major order. The SM100 kernel (bwd_dkdv_sm100.py) runs the same order (never measured there). H200
(Run AO4, docs/benchmarks.md): the kernel alone 1.02-1.10x on the bench's local
selections (GQA 16K 1.02x, 64K 1.03x, MQA 64 1.10x, latent 1.02-1.03x), 1.03x / 1.08x on per-query random ones.

Note [row facts in shared memory]: each step needs, per tile row, lse, delta and which of the block's
keys the row sees; read by the consumers from global memory (two dependent loads: the pair's tile and
selection bits, then the rows' limits and lse), their latency stood in the step's critical path
(the profile in docs/benchmarks.md, "Block-sparse attention"). Warps 1 and 2 of the producer warpgroup,
idle otherwise, load them up to STAGES steps ahead and store ``lse * log2(e)``, ``delta`` and ``lim`` (keys
[0, lim) of the block are seen; 0 for a row that does not count) into the stage, and the consumers read
shared memory after the stage's wait. With one row warp its per-step chain of dependent global loads
(pair -> tile -> rows) bounded the step rate, and the consumers waited on the stages' full barriers for
46 % of their samples (ncu, 2026-12-03); so two warps take the steps in turn, one per consumer WG
(Note [row warps and parity waits]; issuing a step's rows' loads before its stage's wait as well spilled
in the 24 registers a producer thread has), and the TMA warp loads the next step's tile index one step
ahead.

Note [row warps and parity waits]: an mbarrier wait names a phase by its parity only, so a producer's
wait for round r of a stage also passes when only round r - 2 has completed. One producer walking the
steps in order never gets that far ahead; row warps that skip each other's steps can. With ROW_WARPS = 2
warp w takes the steps of parity w, i.e. exactly those of consumer WG w (Note [two pair streams]): at
step j it has seen step j - 6 released (its wait for step j - 2), and WG w releases its steps in order,
so j - 8 -- round r - 1 of j's stage -- is released as well and the wait for round r cannot alias. (Three
row warps would not have that: a warp at step j knows only of j - 7 and j - 10, so round r - 1 may be
open, round r - 2 done, and the wait passes while j - 8's row facts are still read -- the first version
did that, and the H200 tests caught it: MQA 64 dK / dV differed between runs, then a launch failure.
Waiting for round r - 1 first fixed it but spilled in the producers' 24 registers.)

Note [row fact chain]: a row warp's step is a chain of dependent global reads (the pair's tile and slot, then the
tile's selection bits, then each row's q_limit, lse and delta), and with two row warps each has two consumer
steps' time for its own. ncu's source counters (Run AP2, GQA 64K) showed the chain as five round trips: the
compiler put the lse and delta reads of a row behind its ``live`` test (a branch), after its q_limit had returned,
and the consumers waited for their stage's row facts in about 13 % of their samples, the row warps in about 60 %
of theirs on those reads. Now the three reads of a row are issued together whatever ``live`` is (every index is in
bounds; the select comes after), a lane's two rows one after the other (both at once spilled in the producers' 24
registers), and the next step's tile and slot are read before the stage wait, its bits right after the arrival: a
step's facts take two round trips (one per row of a lane), the bits' overlaps the next wait. H200 (Run AP4): the
GQA kernel 1.045x at 16K, 1.094x at 64K (local selection), 1.011x at 64K (random); MQA 64 0.992x, latent 0.982x
(within their rounds' spread); bitwise equal. The consumers then waited on their row facts' shared-memory reads
(lse, limits, delta), issued after the S^T / dP^T GEMMs (Run AP2: those reads throttled in the MIO queue, and the
first use of lse stalled in about 6 % of the consumers' samples); they are now read right after the stage's wait,
before the GEMMs (Run AP7: GQA 1.000x / 0.999x at 16K / 64K, MQA 64 1.036x; bitwise equal). The SM100 dK/dV
kernel's row-fact warp (bwd_dkdv_sm100.py, ``load_facts``) had the same chain, one warp for 128 rows: it now
shares the rule (``row_fact``: a row's limit, lse and delta, read together) and reads its next step's tile ahead
the same way, its four rows per lane at once (no register limit there); compile-verified only, never run.

Columns (tile rows) of S^T are masked per pair: a column counts iff it is a real row (not past the
tile's queries, not one of the 64 - WQ * GC idle rows, which are zeroed once so that 0 * row stays 0)
whose query selected the block (its bit), and key c < that query's ``q_limit``.
"""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from cute_kernels.common.utils import (LOG2_E, acc_as_operand_a, acc_mn_view, convert_to_16bit, ld_acquire_gpu,
                                       red_release_add_gpu, sm90_thread0_cols, transpose_view, wgmma_gemm,
                                       wgmma_smem_layout)

from .common import THREADS_PER_WG, BlockSparseSm90, shared_storage, smem_tensors
from .config import BLOCK_SIZE, SEGMENTS, TILE_M, BwdConfig, segment_split  # noqa: F401 (re-exported)

STAGES = 4  # Q / dO row stages: 2 per consumer WG (Note [two pair streams])
REDUCE_BARRIER = 1  # both consumer WGs, around the exchange of their dK / dV partials and the segment turn
ROW_WARPS = 2  # warps 1, 2 of the producer warpgroup take turns as row producers (Note [row warps and parity waits])


def regs(head_dim: int) -> tuple[int, int]:
    """setmaxnreg split (producer WG, each consumer WG) over 384 threads: p + 2 c <= 3 * 168, the registers
    the launch gives each thread (an increase past what the CTA holds never returns). Head dims <= 64 need
    fewer consumer registers (64-column dK / dV partials); their producer warps spilled in 24 (seen with
    three row warps), so they take 56 / 224."""
    return (24, 240) if head_dim > 64 else (56, 224)


class BlockSparseBwdDKDVSm90(BlockSparseSm90):
    #: Q / dO row stages and row producer warps of ``load`` / ``load_rows`` (the latent kernel, bwd_dkv_latent_sm90.py,
    #: has room for one stage and walks it with one row warp).
    stages = STAGES
    row_warps = ROW_WARPS

    @staticmethod
    def smem_bytes(cfg: BwdConfig) -> int:
        rows = STAGES * TILE_M * (cfg.head_dim + cfg.head_dim_v) * 2
        kv = BLOCK_SIZE * (cfg.head_dim + cfg.head_dim_v) * 2
        return rows + kv + 5 * 1024 + 8 * (2 + 2 * STAGES) + 12 * TILE_M * STAGES + 32

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
                 mDelta: cute.Tensor, mTileMask: cute.Tensor, mQLimit: cute.Tensor, mKeyStart: cute.Tensor,
                 mKeyEnd: cute.Tensor, mKeyCount: cute.Tensor, mKeyPtr: cute.Tensor, mKeyTile: cute.Tensor,
                 mKeySlot: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, mdKpart: cute.Tensor,
                 mdVpart: cute.Tensor, mSegSem: cute.Tensor, softmax_scale: Float32, min_seg: Int32, stream,
                 mOrder: cute.Tensor = None):
        sQ_layout = wgmma_smem_layout(self.dtype, (TILE_M, self.dk, STAGES))
        sdO_layout = wgmma_smem_layout(self.dtype, (TILE_M, self.dv, STAGES))
        sK_layout = wgmma_smem_layout(self.dtype, (self.tile_n, self.dk))
        sV_layout = wgmma_smem_layout(self.dtype, (self.tile_n, self.dv))
        tma_atom_Q, tma_Q, rows_q = self.rows_tma(mQ, self.dk, sQ_layout)
        tma_atom_dO, tma_dO, rows_do = self.rows_tma(mdO, self.dv, sdO_layout)
        tma_atom_K, tma_K = self.kv_tma(mK, sK_layout, self.dk)
        tma_atom_V, tma_V = self.kv_tma(mV, sV_layout, self.dv)
        self.tx_bytes_kv = self.tile_n * (self.dk + self.dv) * 2
        self.tx_bytes_rows = self.wq * self.gc * (self.dk + self.dv) * 2
        words = {"row_f": (Float32, 2 * TILE_M * STAGES), "row_lim": (Int32, TILE_M * STAGES)}
        self.shared_storage = shared_storage(self.dtype, {"mbar_kv": 1, "mbar_rows": 2 * STAGES}, words,
                                             sQ=sQ_layout, sdO=sdO_layout, sK=sK_layout, sV=sV_layout)
        grid = (mKeyStart.shape[1] * SEGMENTS, mK.shape[2], mQ.shape[0])
        atoms = (tma_atom_Q, tma_atom_dO, tma_atom_K, tma_atom_V)
        plan = (mTileMask, mQLimit, mKeyStart, mKeyEnd, mKeyCount, mKeyPtr, mKeyTile, mKeySlot)
        self.kernel(tma_Q, tma_dO, tma_K, tma_V, mLSE, mDelta, plan, (mdK, mdV, mdKpart, mdVpart, mSegSem), atoms, sQ_layout, sdO_layout,
                    sK_layout, sV_layout, rows_q, rows_do, softmax_scale, min_seg, mOrder).launch(
            grid=grid, block=[3 * THREADS_PER_WG, 1, 1], smem=self.shared_storage.size_in_bytes(), stream=stream,
            min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mdO: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mLSE: cute.Tensor,
               mDelta: cute.Tensor, plan: tuple, outs: tuple, atoms: tuple,
               sQ_layout: cute.ComposedLayout, sdO_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, rows_q: cute.ComposedLayout, rows_do: cute.ComposedLayout,
               softmax_scale: Float32, min_seg: Int32, mOrder: cute.Tensor):
        mTileMask, mQLimit, mKeyStart, mKeyEnd, mKeyCount, mKeyPtr, mKeyTile, mKeySlot = plan
        warp_idx, tidx, storage = self.allocate(atoms)
        sQ, sdO, sK, sV = smem_tensors(storage, sQ=sQ_layout, sdO=sdO_layout, sK=sK_layout, sV=sV_layout)
        sRowF, sRowLim, mbar_kv = self.prepare_rows(storage, sQ, sdO, tidx)
        # Full barrier: the TMA warp's arrive-and-expect-tx and the row producer's arrival (Note [row facts
        # in shared memory]).
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 2)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, THREADS_PER_WG // 32)  # one WG per stage
        pipeline_rows = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_rows.data_ptr(), num_stages=STAGES, producer_group=producer,
            consumer_group=consumers, tx_count=self.tx_bytes_rows, defer_sync=False)

        blk = self.key_block(mQ, mK, mKeyStart, mKeyEnd, mKeyCount, mKeyPtr, min_seg, mOrder)
        if blk.live:
            if warp_idx < 4:
                cute.arch.setmaxregister_decrease(regs(self.dk)[0])
                if warp_idx == 0:
                    self.load(mQ, mdO, mK, mV, mKeyTile, sK, sV, atoms, rows_q, rows_do, storage.sQ.data_ptr(),
                              storage.sdO.data_ptr(), mbar_kv, pipeline_rows, blk)
                elif warp_idx <= ROW_WARPS:
                    self.load_rows(mLSE, mDelta, mTileMask, mQLimit, mKeyTile, mKeySlot, sRowF, sRowLim,
                                   pipeline_rows, blk, warp_idx - 1)
            else:
                cute.arch.setmaxregister_increase(regs(self.dk)[1])
                self.consume(outs, sQ, sdO, sK, sV, sRowF, sRowLim, mbar_kv, pipeline_rows, blk, warp_idx // 4 - 1,
                             tidx % THREADS_PER_WG, softmax_scale, storage.sQ.data_ptr())

    @cute.jit
    def prepare_rows(self, storage, sQ, sdO, tidx: Int32):
        """The row-fact views (``row_fact_tensors``), the idle rows zeroed (``zero_idle_rows``) and the key block's
        barrier (one arrival) initialised: (sRowF, sRowLim, mbar_kv)."""
        sRowF, sRowLim = self.row_fact_tensors(storage)
        self.zero_idle_rows(sQ, sdO, tidx)
        mbar_kv = storage.mbar_kv.data_ptr()
        if tidx == 0:
            cute.arch.mbarrier_init(mbar_kv, 1)
        cute.arch.mbarrier_init_fence()
        return sRowF, sRowLim, mbar_kv

    def row_fact_tensors(self, storage):
        """(row, lse | delta, stage) and (row, stage) views of the row-fact words (Note [row facts in shared
        memory])."""
        return (cute.make_tensor(storage.row_f.data_ptr(), cute.make_layout((TILE_M, 2, self.stages))),
                cute.make_tensor(storage.row_lim.data_ptr(), cute.make_layout((TILE_M, self.stages))))

    @cute.jit
    def zero_idle_rows(self, sQ, sdO, tidx: Int32):
        """Idle rows (past WQ * GC) are never loaded: zero them in every stage once (0 * row must stay 0)."""
        used = self.wq * self.gc
        if const_expr(used < TILE_M):
            for i in cutlass.range(tidx, (TILE_M - used) * self.dk * self.stages, 3 * THREADS_PER_WG):
                sQ[used + i % (TILE_M - used), (i // (TILE_M - used)) % self.dk,
                   i // ((TILE_M - used) * self.dk)] = self.dtype(0.0)
            for i in cutlass.range(tidx, (TILE_M - used) * self.dv * self.stages, 3 * THREADS_PER_WG):
                sdO[used + i % (TILE_M - used), (i // (TILE_M - used)) % self.dv,
                    i // ((TILE_M - used) * self.dv)] = self.dtype(0.0)
            cute.arch.fence_view_async_shared()

    @cute.jit
    def key_block(self, mQ, mK, mKeyStart, mKeyEnd, mKeyCount, mKeyPtr, min_seg: Int32, mOrder=None):
        """This CTA's key block (index set s, block r, kv head h, batch b), its rows [start, end) and its
        segment's pairs [p0, p1) (Note [key block segments]; with ``mOrder``, the plan's ``key_order``: Note
        [tile-ordered segments]); ``live``: the CTA has work."""
        x, h, b = cute.arch.block_idx()
        s = b
        if const_expr(self.cfg.per_kv_head):
            s = b * mK.shape[2] + h
        if const_expr(mOrder is not None):
            x = mOrder[s, x]
        r, seg = x // SEGMENTS, x % SEGMENTS
        kcap = mKeyStart.shape[1]
        p0, p1 = mKeyPtr[s * kcap + r], mKeyPtr[s * kcap + r + 1]
        seg_len, nseg = segment_split(p1 - p0, min_seg, cutlass.max)
        return SimpleNamespace(s=s, r=r, h=h, b=b, seqlen=mQ.shape[2], live=r < mKeyCount[s] and seg < nseg,
                               start=mKeyStart[s, r], end=mKeyEnd[s, r], p0=p0 + seg * seg_len,
                               p1=cutlass.min(p1, p0 + (seg + 1) * seg_len), seg=seg, nseg=nseg, order=mOrder)

    def segment_ids(self, blk):
        """(r, seg) of this CTA's segment at its turn (Note [key block segments]). With a key_order the id is read
        again there (an ``ld.acquire``, which the compiler cannot merge with the first read): kept in a register
        over the steps instead, it cost the latent kernel's consumers a spilled register (ptxas, 2026-12-04)."""
        if const_expr(blk.order is None):
            return blk.r, blk.seg
        x = ld_acquire_gpu((blk.order.iterator + cute.crd2idx((blk.s, cute.arch.block_idx()[0]),
                                                              blk.order.layout)).toint())
        return x // SEGMENTS, x % SEGMENTS

    # ------------------------------------------------------------------ producer
    @cute.jit
    def load_keys(self, mK, mV, tma_atom_K, tma_atom_V, sK, sV, mbar_kv, blk):
        """K and V of the block, once, completing on ``mbar_kv`` (mV None: the latent, whose V is K's leading
        columns)."""
        if cute.arch.lane_idx() == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(mbar_kv, self.tx_bytes_kv)
        for atom, mX, sX, d in ((tma_atom_K, mK, sK, self.dk), (tma_atom_V, mV, sV, self.dv)):
            if const_expr(mX is not None):
                gX = cute.local_tile(cute.domain_offset((blk.start, 0), mX[None, None, blk.h, blk.b]),
                                     (self.tile_n, d), (0, 0))
                tXsX, tXgX = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2),
                                                   cute.group_modes(gX, 0, 2))
                cute.copy(atom, tXgX, tXsX, tma_bar_ptr=mbar_kv)

    @cute.jit
    def load(self, mQ, mdO, mK, mV, mKeyTile, sK, sV, atoms, rows_q, rows_do, sQ_base, sdO_base, mbar_kv,
             pipeline_rows, blk):
        tma_atom_Q, tma_atom_dO, tma_atom_K, tma_atom_V = atoms
        self.load_keys(mK, mV, tma_atom_K, tma_atom_V, sK, sV, mbar_kv, blk)
        # Per (pair, head chunk): the tile's Q and dO rows into the next stage. The next step's query
        # tile is loaded one step ahead (its latency stood in every step; Note [row facts in shared memory]).
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        n = (blk.p1 - blk.p0) * self.chunks
        tile = mKeyTile[blk.p0]
        for i in cutlass.range(n, unroll=1):
            q0, head0, tile = self.step_rows(mKeyTile, blk, i, n, tile)
            self.stage_rows(pipeline_rows, state, ((tma_atom_Q, mQ, sQ_base, rows_q, self.dk),
                                                   (tma_atom_dO, mdO, sdO_base, rows_do, self.dv)), q0, head0, blk)
            state.advance()

    @cute.jit
    def step_rows(self, mKeyTile, blk, i: Int32, n: Int32, tile: Int32):
        """Step ``i`` of ``n`` (pair ``i // chunks``, head chunk ``i % chunks``) whose query tile is ``tile``: its
        first query, its first query head, and the query tile of step ``i + 1`` (read one step ahead; the last
        step's again at the end)."""
        return (tile * self.wq, blk.h * self.cfg.group + (i % self.chunks) * self.gc,
                mKeyTile[blk.p0 + cutlass.min(i + 1, n - 1) // self.chunks])

    @cute.jit
    def stage_rows(self, pipe, state, operands: tuple, q0: Int32, head0: Int32, blk):
        """Acquire ``state``'s stage of ``pipe`` and load the step's rows of each of ``operands`` ((atom, tensor,
        smem base, box, d) each: Q and / or dO) into it, query by query; the caller advances ``state``."""
        pipe.producer_acquire(state)
        bar = pipe.producer_get_barrier(state)
        for j in cutlass.range(self.wq, unroll=1):
            for atom, mX, base, box, d in operands:
                self.row_box(atom, mX, base, box, d, bar, state.index, q0, j, head0, blk)

    @cute.jit
    def row_box(self, atom, mX, base, box, d: cutlass.Constexpr, bar, stage: Int32, q0: Int32, j: Int32, head0: Int32,
                blk):
        """TMA of tile query ``q0 + j``'s GC head rows of ``mX`` (Q or dO) into rows [j GC, j GC + GC) of ``stage``
        of the buffer at ``base``, completing on ``bar``; a query past S loads the last one again (its columns
        are masked)."""
        t = cutlass.min(q0 + j, blk.seqlen - 1)
        off = stage * (TILE_M * d) + j * self.gc * 64
        dst = cute.make_tensor(cute.recast_ptr(base + off, box.inner), box.outer)
        src = cute.local_tile(mX[None, None, t, blk.b], (self.gc, d), (head0 // self.gc, 0))
        tS, tG = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(dst, 0, 2),
                                       cute.group_modes(src, 0, 2))
        cute.copy(atom, tG, tS, tma_bar_ptr=bar)

    @cute.jit
    def load_rows(self, mLSE, mDelta, mTileMask, mQLimit, mKeyTile, mKeySlot, sRowF, sRowLim, pipeline_rows, blk,
                  wr: Int32):
        """Row producer warp ``wr`` (0..R-1, warps 1..R, R = ``row_warps``): steps wr, wr + R, ...: each lane's
        two tile rows' facts into the step's stage (Note [row facts in shared memory]); rows that do not count
        (idle rows past WQ * GC, queries past S, queries that did not select the block) get lim 0 and
        lse = delta = 0 (finite: 0 * delta stays 0). The warps take turns, so R steps' chains of
        global round trips are in flight at once."""
        lane = cute.arch.lane_idx()
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        for _ in cutlass.range(wr, unroll=1):
            state.advance()
        n = (blk.p1 - blk.p0) * self.chunks
        # Note [row fact chain]: the step's tile and selection bits are read one step ahead.
        p = blk.p0 + cutlass.min(wr, n - 1) // self.chunks
        w = mKeyTile[p]
        bits = mTileMask[blk.s, w, mKeySlot[p]]
        for i in cutlass.range(wr, n, self.row_warps, unroll=1):
            pn = blk.p0 + cutlass.min(i + self.row_warps, n - 1) // self.chunks
            w_next, slot_next = mKeyTile[pn], mKeySlot[pn]
            head0 = blk.h * self.cfg.group + (i % self.chunks) * self.gc
            pipeline_rows.sync_object_empty.wait(state.index, state.phase)  # Note [row warps and parity waits]
            for rr in cutlass.range(TILE_M // 32, unroll=1):  # Note [row fact chain]
                self.row_facts(mLSE, mDelta, mQLimit, sRowF, sRowLim, blk, lane + 32 * rr, w, bits, head0, state.index)
            cute.arch.sync_warp()
            if lane == 0:
                cute.arch.mbarrier_arrive(pipeline_rows.producer_get_barrier(state))
            for _ in cutlass.range_constexpr(self.row_warps):
                state.advance()
            w = w_next
            bits = mTileMask[blk.s, w_next, slot_next]

    @cute.jit
    def row_facts(self, mLSE, mDelta, mQLimit, sRowF, sRowLim, blk, row: Int32, w: Int32, bits: Int32, head0: Int32,
                  stage: Int32):
        """Tile row ``row``'s facts (``load_rows``) into ``stage``."""
        qi = row // self.gc
        q = w * self.wq + qi
        head = head0 + row - qi * self.gc  # < h * G + G also for idle rows: every load in bounds
        live = row < self.wq * self.gc and q < blk.seqlen
        live = live and ((bits >> qi) & 1) != 0
        limit, lse_log2, delta = self.row_fact(mLSE, mDelta, mQLimit, blk, q, head, live)
        sRowLim[row, stage] = limit
        sRowF[row, 0, stage] = lse_log2
        sRowF[row, 1, stage] = delta

    @cute.jit
    def row_fact(self, mLSE, mDelta, mQLimit, blk, q: Int32, head: Int32, live):
        """(key limit, lse * log2(e), delta) of query ``q``'s row of ``head`` for the key block of ``blk``: keys
        [0, limit) of the block are seen; (0, 0, 0) where ``live`` is false (the row does not count). Also the
        SM100 kernel's rule (bwd_dkdv_sm100.py, ``load_facts``). Note [row fact chain]: the three reads are issued
        together whatever ``live`` is (q is clamped to the sequence, ``head`` must be in bounds), the select
        comes after."""
        t = cutlass.min(q, blk.seqlen - 1)
        q_limit, lse, delta = mQLimit[blk.b, t], mLSE[blk.b, head, t], mDelta[blk.b, head, t]
        limit = cutlass.min(cutlass.max(q_limit - blk.start, 0), BLOCK_SIZE)
        return (limit if live else Int32(0), lse * LOG2_E if live else Float32(0.0),
                delta if live else Float32(0.0))

    # ------------------------------------------------------------------ consumers
    @cute.jit
    def consume(self, outs, sQ, sdO, sK, sV, sRowF, sRowLim, mbar_kv, pipeline_rows, blk, wg: Int32, ctidx: Int32,
                softmax_scale: Float32, red_base):
        """Consumer WG ``wg`` takes steps wg, wg + 2, ... of the segment (stages wg, wg + 2 of the 4) and
        sums its own dK / dV; then the two partials meet in shared memory (Note [two pair streams]) and
        the segments' sums in global memory (Note [key block segments])."""
        mdK, mdV, mdKpart, mdVpart, mSegSem = outs
        mma_s = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, Float32,
            atom_layout_mnk=(1, 1, 1), tiler_mn=(64, TILE_M))
        mma_dk, mma_dv = self._mma_rs(self.dk), self._mma_rs(self.dv)
        thr_s = mma_s.get_slice(ctidx)
        wg_s, wg_dk, wg_dv = mma_s.get_slice(0), mma_dk.get_slice(0), mma_dv.get_slice(0)
        tSrK = wg_s.make_fragment_A(wg_s.partition_A(sK))
        tSrV = wg_s.make_fragment_A(wg_s.partition_A(sV))
        tSrQ = wg_s.make_fragment_B(wg_s.partition_B(sQ))  # (.., .., k, stage)
        tSrdO = wg_s.make_fragment_B(wg_s.partition_B(sdO))
        tVrdOt = wg_dv.make_fragment_B(wg_dv.partition_B(transpose_view(sdO)))
        tKrQt = wg_dk.make_fragment_B(wg_dk.partition_B(transpose_view(sQ)))
        tVrP = wg_dv.make_fragment_A(wg_dv.partition_shape_A((self.tile_n, TILE_M)))
        tKrdS = wg_dk.make_fragment_A(wg_dk.partition_shape_A((self.tile_n, TILE_M)))
        acc_shape = wg_s.partition_shape_C((self.tile_n, TILE_M))
        acc_dK = cute.make_rmem_tensor(wg_dk.partition_shape_C((self.tile_n, self.dk)), Float32)
        acc_dV = cute.make_rmem_tensor(wg_dv.partition_shape_C((self.tile_n, self.dv)), Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)
        ctx = self.key_context(thr_s, sRowF, sRowLim, blk, softmax_scale)
        cute.arch.mbarrier_wait(mbar_kv, 0)
        n = (blk.p1 - blk.p0) * self.chunks
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
        if wg == 1:
            state.advance()
        for j in cutlass.range((n - wg + 1) // 2, unroll=1):
            acc_S = cute.make_rmem_tensor(acc_shape, Float32)
            acc_dP = cute.make_rmem_tensor(acc_shape, Float32)
            pipeline_rows.consumer_wait(state)
            col = self.columns(ctx, state.index)  # Note [row fact chain]: before the GEMMs queue up
            delta = self.deltas(ctx, state.index)
            self.gemm(mma_s, acc_S, tSrK, tSrQ[None, None, None, state.index], True, -1)
            self.gemm(mma_s, acc_dP, tSrV, tSrdO[None, None, None, state.index], True, -1)
            warpgroup.wait_group(1)
            acc_S_mn = acc_mn_view(acc_S)
            self.probs(ctx, acc_S_mn, col)
            convert_to_16bit(acc_as_operand_a(acc_S), tVrP)
            self.gemm(mma_dv, acc_dV, tVrP, tVrdOt[None, None, None, state.index], False, 1)  # dP done
            acc_dP_mn = acc_mn_view(acc_dP)
            for k in cutlass.range_constexpr(2):
                for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                    # dS^T, 0 where P^T = 0: a non-finite value row of this key (dP^T) or delta of a row that
                    # cannot see it must not reach its dK as 0 * NaN (common/nonfinite.py)
                    p = acc_S_mn[k, c]
                    acc_dP_mn[k, c] = Float32(0.0) if p == Float32(0.0) else p * (acc_dP_mn[k, c] - delta[c])
            convert_to_16bit(acc_as_operand_a(acc_dP), tKrdS)
            self.gemm(mma_dk, acc_dK, tKrdS, tKrQt[None, None, None, state.index], False, 0)
            pipeline_rows.consumer_release(state)
            state.advance()
            state.advance()
        # Note [two pair streams]: WG 1 hands its dV partial to WG 0 and WG 0 its dK partial to WG 1 through
        # the (now idle) Q stages; each adds the other's and stores one of the two (a + b = b + a exactly, and
        # the split of the steps is fixed by the plan: bitwise reproducible).
        cute.arch.barrier(barrier_id=REDUCE_BARRIER, number_of_threads=2 * THREADS_PER_WG)
        nk, nv = cute.size(acc_dK), cute.size(acc_dV)
        red = cute.make_tensor(cute.recast_ptr(red_base, dtype=Float32),
                               cute.make_layout((THREADS_PER_WG, nk + nv), stride=(1, THREADS_PER_WG)))
        if wg == 0:
            for e in cutlass.range_constexpr(nk):
                red[ctidx, e] = acc_dK[e]
        else:
            for e in cutlass.range_constexpr(nv):
                red[ctidx, nk + e] = acc_dV[e]
        cute.arch.barrier(barrier_id=REDUCE_BARRIER, number_of_threads=2 * THREADS_PER_WG)
        if wg == 0:
            for e in cutlass.range_constexpr(nv):
                acc_dV[e] = acc_dV[e] + red[ctidx, nk + e]
        else:
            for e in cutlass.range_constexpr(nk):
                acc_dK[e] = acc_dK[e] + red[ctidx, e]
        thr_dk, thr_dv = mma_dk.get_slice(ctidx), mma_dv.get_slice(ctidx)
        if blk.nseg == 1:
            if wg == 0:
                self.store_keys(ctx, acc_dV, mdV, thr_dv, self.dv, Float32(1.0))
            else:
                self.store_keys(ctx, acc_dK, mdK, thr_dk, self.dk, softmax_scale)
        else:
            # Note [key block segments]: segment k adds the fp32 sum segments 0 .. k - 1 left, in turn.
            r, seg = self.segment_ids(blk)
            sem_addr = (mSegSem.iterator + cute.crd2idx((blk.s, r, blk.h), mSegSem.layout)).toint()
            if wg == 0 and ctidx == 0:
                cur = ld_acquire_gpu(sem_addr)
                while cur != seg:
                    cur = ld_acquire_gpu(sem_addr)
            cute.arch.barrier(barrier_id=REDUCE_BARRIER, number_of_threads=2 * THREADS_PER_WG)
            cute.arch.fence_acq_rel_gpu()
            if seg > 0:
                if wg == 0:
                    self.add_keys(ctx, acc_dV, mdVpart, thr_dv, self.dv)
                else:
                    self.add_keys(ctx, acc_dK, mdKpart, thr_dk, self.dk)
            if seg == blk.nseg - 1:
                if wg == 0:
                    self.store_keys(ctx, acc_dV, mdV, thr_dv, self.dv, Float32(1.0))
                else:
                    self.store_keys(ctx, acc_dK, mdK, thr_dk, self.dk, softmax_scale)
            else:
                if wg == 0:
                    self.store_keys(ctx, acc_dV, mdVpart, thr_dv, self.dv, Float32(1.0))
                else:
                    self.store_keys(ctx, acc_dK, mdKpart, thr_dk, self.dk, Float32(1.0))
                cute.arch.fence_acq_rel_gpu()
                cute.arch.barrier(barrier_id=REDUCE_BARRIER, number_of_threads=2 * THREADS_PER_WG)
                if wg == 0 and ctidx == 0:
                    red_release_add_gpu(sem_addr, Int32(1))

    def key_context(self, thr_s, sRowF, sRowLim, blk, softmax_scale: Float32):
        """This thread's two keys (rows of S^T), its first column and column offsets, the scale and the row facts
        of a consumer's steps."""
        tScS_mn = acc_mn_view(thr_s.partition_C(cute.make_identity_tensor((self.tile_n, TILE_M))))
        return SimpleNamespace(key=[tScS_mn[i, 0][0] for i in range(2)], thr_col=tScS_mn[0, 0][1],
                               cols=sm90_thread0_cols(TILE_M), scale_log2=softmax_scale * LOG2_E,
                               sRowF=sRowF, sRowLim=sRowLim, blk=blk)

    def _mma_rs(self, cols: int):
        return sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN, Float32,
            atom_layout_mnk=(1, 1, 1), tiler_mn=(64, cols), a_source=warpgroup.OperandSource.RMEM)

    @cute.jit
    def gemm(self, tiled_mma, acc, tCrA, tCrB, zero_init: cutlass.Constexpr, wait: cutlass.Constexpr):
        wgmma_gemm(tiled_mma, acc, tCrA, tCrB, zero_init)
        if const_expr(wait >= 0):
            warpgroup.wait_group(wait)

    @cute.jit
    def columns(self, ctx, stage: Int32):
        """Per register column (a tile row) of the step in ``stage``: which of this thread's two keys the
        column keeps (bit c + 16 k of ``keep``: key k < the row's ``lim``, Note [row facts in shared
        memory]; one register instead of 16 limits) and lse in log2 units."""
        ncol = len(ctx.cols)
        assert ncol <= 16
        col = SimpleNamespace(keep=Int32(0), lse=cute.make_rmem_tensor((ncol,), Float32))
        for c in cutlass.range_constexpr(ncol):
            row = ctx.thr_col + ctx.cols[c]
            lim = ctx.sRowLim[row, stage]
            for k in cutlass.range_constexpr(2):
                if ctx.key[k] < lim:
                    col.keep = col.keep | Int32(1 << (c + 16 * k))
            col.lse[c] = ctx.sRowF[row, 0, stage]
        return col

    @cute.jit
    def deltas(self, ctx, stage: Int32):
        """delta of each register column of the step in ``stage`` (as ``columns``)."""
        delta = cute.make_rmem_tensor((len(ctx.cols),), Float32)
        for c in cutlass.range_constexpr(len(ctx.cols)):
            delta[c] = ctx.sRowF[ctx.thr_col + ctx.cols[c], 1, stage]
        return delta

    @cute.jit
    def probs(self, ctx, acc_mn, col):
        """P^T in place: exp2(S^T scale log2e - lse) where the column counts and key < its limit, else 0."""
        for k in cutlass.range_constexpr(2):
            for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                keep = ((col.keep >> (c + 16 * k)) & 1) != 0
                p = cute.math.exp2(acc_mn[k, c] * ctx.scale_log2 - col.lse[c], fastmath=True)
                acc_mn[k, c] = p if keep else Float32(0.0)

    @cute.jit
    def store_keys(self, ctx, acc, mX, thr_mma, cols: cutlass.Constexpr, scale: Float32, col0: cutlass.Constexpr = 0):
        """acc * scale (64 keys x cols) as rows [start, end), columns [col0, col0 + cols) of ``mX [B, S, Hkv, *]``
        (16-bit, or the fp32 segment partials)."""
        blk = ctx.blk
        acc_mn = acc_mn_view(acc)
        for k in cutlass.range_constexpr(2):
            acc_mn[k, None].store(acc_mn[k, None].load() * scale)
        if const_expr(mX.element_type == Float32):
            rX_mn = acc_mn
        else:
            rX = cute.make_rmem_tensor_like(acc, self.dtype)
            convert_to_16bit(acc, rX)
            rX_mn = acc_mn_view(rX)
        tXcX_mn = acc_mn_view(thr_mma.partition_C(cute.make_identity_tensor((self.tile_n, cols))))
        for k in cutlass.range_constexpr(2):
            key = blk.start + tXcX_mn[k, 0][0]
            if key < blk.end:
                gX = mX[blk.b, key, blk.h, None]
                if const_expr(col0 != 0):
                    gX = cute.domain_offset((col0,), gX)
                for c in cutlass.range_constexpr(cute.size(rX_mn, mode=[1])):
                    gX[tXcX_mn[k, c][1]] = rX_mn[k, c]

    @cute.jit
    def add_keys(self, ctx, acc, mXpart, thr_mma, cols: cutlass.Constexpr, col0: cutlass.Constexpr = 0):
        """acc += rows [start, end), columns [col0, col0 + cols) of the fp32 segment partial ``mXpart [B, S, Hkv, *]``
        (the elements ``store_keys`` wrote)."""
        blk = ctx.blk
        acc_mn = acc_mn_view(acc)
        tXcX_mn = acc_mn_view(thr_mma.partition_C(cute.make_identity_tensor((self.tile_n, cols))))
        for k in cutlass.range_constexpr(2):
            key = blk.start + tXcX_mn[k, 0][0]
            if key < blk.end:
                gX = mXpart[blk.b, key, blk.h, None]
                if const_expr(col0 != 0):
                    gX = cute.domain_offset((col0,), gX)
                for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                    acc_mn[k, c] = acc_mn[k, c] + gX[tXcX_mn[k, c][1]]
