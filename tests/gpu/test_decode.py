"""Hopper: the decode glue (paddle_fa4/_cute/decode.py) and kernels with torch tensors vs an fp64 oracle.

The glue is driven with torch CUDA tensors (``_bridge.empty`` pointed at torch, filling every
buffer with NaN so an output entry the kernels never write fails the comparison). Covered: page
sizes 1/16/64/128, ragged lengths (0, 1, not a multiple of P), padding page ids (-1, huge), NaN in
unused page tails and unlisted pages, Sq 1/2/4/16 bottom-right causal, window, softcap, G 1/4/8/16
and MQA (G 64), D 64/128/256 (d 256's warp pairs: GQA groups, page sizes 1/8/16 and contiguous,
block_logit, window + softcap, split and unsplit), bf16/fp16, the three cache layouts, per-kv-head (sparse) tables,
block_logit's exact -inf pattern, split vs unsplit within tolerance and each bitwise repeatable over
3 runs, ``h2o.select_pages``'s kernel output fed in as it is, CUDA-graph capture then replay with changed lengths, FA's dense [B] / [B, n] index form (read in
place by every kv head) bitwise equal to the per-kv-head form.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs a CUDA GPU; torch is used to drive the launchers")

from tests.conftest import torch_cuda_arch  # noqa: E402
from tests.oracles.decode_gpu import decode_reference  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch_cuda_arch() is None or torch_cuda_arch() < 90,
                                 reason="needs a CUDA GPU of compute capability >= 9.0")]

HUGE_ID = 2 ** 30


@pytest.fixture
def glue(monkeypatch):
    from paddle_fa4 import _bridge
    from paddle_fa4._cute import decode as dec

    def empty(shape, dtype, like, place=None):
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        return torch.full(list(shape), float("nan"), dtype=dtype, device=like.device)

    monkeypatch.setattr(_bridge, "empty", empty)
    monkeypatch.setattr(dec, "device_of", lambda t: (torch_cuda_arch(), t.device.index or 0, t.device))
    return dec


def make_case(seed, *, lens, hkv=2, group=4, sq=1, d=128, page=16, layout="hnd", dtype=torch.bfloat16,
              per_head=False, extra_pages=3, pad="mixed"):
    """q, caches (NaN in every slot no sequence uses), seqlens [B, Hkv], table [B, Hkv, n] (None: contiguous)."""
    rng = np.random.default_rng(seed)
    lens = np.asarray(lens, dtype=np.int64)
    if lens.ndim == 1:
        lens = np.repeat(lens[:, None], hkv, axis=1)
    bsz = lens.shape[0]
    hq = hkv * group
    q = torch.as_tensor(rng.standard_normal((bsz, sq, hq, d)), dtype=torch.float32).to(dtype).cuda()
    if layout == "contiguous":
        sk = int(lens.max()) + 5
        k = torch.randn(bsz, sk, hkv, d, dtype=torch.float32).to(dtype)
        v = torch.randn(bsz, sk, hkv, d, dtype=torch.float32).to(dtype)
        for b in range(bsz):
            for h in range(hkv):
                k[b, lens[b, h]:, h] = float("nan")
                v[b, lens[b, h]:, h] = float("nan")
        return q, k.cuda(), v.cuda(), torch.as_tensor(lens, dtype=torch.int32).cuda(), None
    need = -(-lens // page)
    n = int(need.max()) + 2
    owners = [(b, h) for b in range(bsz) for h in range(hkv)] if per_head else [(b, None) for b in range(bsz)]
    total = sum(int(need[b, h if h is not None else 0]) for b, h in owners) + extra_pages
    perm = rng.permutation(total)
    table = np.empty((bsz, hkv, n), dtype=np.int64)
    # padding past each sequence: -1, a huge id, or a mix
    fill = {"neg": -1, "huge": HUGE_ID}.get(pad)
    for b in range(bsz):
        for h in range(hkv):
            table[b, h] = fill if fill is not None else np.where(np.arange(n) % 2 == 0, -1, HUGE_ID)
    shape = (total, hkv, page, d) if layout == "hnd" else (total, page, hkv, d)
    k = torch.full(shape, float("nan"), dtype=torch.float32)
    v = torch.full(shape, float("nan"), dtype=torch.float32)
    at = 0
    for b, h in owners:
        heads = [h] if h is not None else list(range(hkv))
        cnt = int(need[b, heads[0]])
        ids = perm[at:at + cnt]
        at += cnt
        for hh in heads:
            table[b, hh, :cnt] = ids
            for j, pid in enumerate(ids):
                rows = min(page, int(lens[b, hh]) - j * page)  # rows past the length stay NaN
                src_k = torch.randn(rows, d)
                src_v = torch.randn(rows, d)
                if layout == "hnd":
                    k[pid, hh, :rows], v[pid, hh, :rows] = src_k, src_v
                else:
                    k[pid, :rows, hh], v[pid, :rows, hh] = src_k, src_v
    return (q, k.to(dtype).cuda(), v.to(dtype).cuda(), torch.as_tensor(lens, dtype=torch.int32).cuda(),
            torch.as_tensor(table, dtype=torch.int32).cuda())


def _np(t):
    return None if t is None else t.detach().float().cpu().numpy().astype(np.float64)


def run_glue(dec, case, *, layout="hnd", causal=True, left=-1, right=-1, softcap=0.0, splits=1, bs=0):
    q, k, v, seq, table = case
    scale = 1.0 / math.sqrt(q.shape[-1])
    return dec.decode_fwd(q, k, v, seq, table, layout=layout, softmax_scale=scale, causal=causal,
                          window_left=left, window_right=0 if causal else right, softcap=softcap,
                          num_splits=splits, return_lse=True, block_logit_size=bs or None)


def reference(case, *, layout="hnd", causal=True, left=-1, right=-1, softcap=0.0, bs=0, nb=0):
    q, k, v, seq, table = case
    scale = 1.0 / math.sqrt(q.shape[-1])
    return decode_reference(_np(q), _np(k), _np(v), seq.cpu().numpy(), None if table is None else table.cpu().numpy(),
                            layout=layout, scale=scale, window_left=left, window_right=0 if causal else right,
                            softcap=softcap, block_size=bs, nb=nb)


def check(got, ref, dtype, bs=0):
    out, lse, blk = (_np(x) for x in got)
    r_out, r_lse, r_blk = ref
    assert np.isfinite(out).all(), "out has NaN / unwritten entries"
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    err = np.abs(out - r_out).max()
    assert err <= tol * max(1.0, np.abs(r_out).max()), f"out max err {err}"
    assert np.array_equal(np.isneginf(lse), np.isneginf(r_lse)), "lse -inf pattern"
    fin = np.isfinite(r_lse)
    assert not np.isnan(lse).any()
    assert np.abs(lse[fin] - r_lse[fin]).max(initial=0.0) <= 2e-3 * max(1.0, np.abs(r_lse[fin]).max(initial=1.0))
    if bs:
        assert blk.shape == r_blk.shape
        assert not np.isnan(blk).any(), "block_logit has unwritten entries"
        assert np.array_equal(np.isneginf(blk), np.isneginf(r_blk)), "block_logit -inf pattern"
        fin = np.isfinite(r_blk)
        assert np.abs(blk[fin] - r_blk[fin]).max(initial=0.0) <= 2e-3 * max(1.0, np.abs(r_blk[fin]).max(initial=1.0))


def _nb(case, layout, bs):
    q, k, v, seq, table = case
    sk = k.shape[1] if layout == "contiguous" else table.shape[2] * (k.shape[2] if layout == "hnd" else k.shape[1])
    return -(-sk // bs)


def full_check(dec, case, *, splits=(1, 3), layout="hnd", bs=0, repeat=3, **kw):
    ref = reference(case, layout=layout, bs=bs, nb=_nb(case, layout, bs) if bs else 0, **kw)
    outs = {}
    for s in splits:
        runs = [run_glue(dec, case, layout=layout, splits=s, bs=bs, **kw) for _ in range(repeat)]
        check(runs[0], ref, case[0].dtype, bs)
        for r in runs[1:]:
            for a, b in zip(runs[0], r):
                if a is not None:
                    assert torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a.view(torch.int32),
                                       b.view(torch.uint8) if b.dtype != torch.float32 else b.view(torch.int32)), \
                        f"not bitwise repeatable (splits={s})"
        outs[s] = runs[0]
    if len(outs) > 1:
        a, b = outs[splits[0]], outs[splits[1]]
        assert (a[0].float() - b[0].float()).abs().max().item() <= 2e-2
        if bs:
            assert torch.equal(a[2], b[2]), "block_logit depends on the split count"
    return outs


LENS = [0, 1, 17, 300, 1000, 64]


def test_paged_basic_ragged_nan_padding(glue):
    full_check(glue, make_case(0, lens=LENS), splits=(1, 3))


@pytest.mark.parametrize("page", [1, 8, 64, 128])
def test_page_sizes(glue, page):
    full_check(glue, make_case(page, lens=[0, 1, page + 3, 700, 5 * page - 1], page=page), splits=(1, 4))


@pytest.mark.parametrize("sq,group", [(2, 4), (4, 8), (16, 4)])
def test_multi_token_causal(glue, sq, group):
    full_check(glue, make_case(10 + sq, lens=[3, 40, 517], sq=sq, group=group), splits=(1, 3))


def test_window_softcap(glue):
    full_check(glue, make_case(20, lens=[0, 5, 130, 900], sq=4), causal=False, left=100, right=2, softcap=30.0,
               splits=(1, 3))


@pytest.mark.parametrize("group,hkv", [(1, 4), (8, 2), (16, 2), (64, 1)])
def test_gqa_groups_and_mqa(glue, group, hkv):
    full_check(glue, make_case(30 + group, lens=[1, 77, 600], group=group, hkv=hkv), splits=(1, 2))


@pytest.mark.parametrize("d", [64, 256])
def test_head_dims(glue, d):
    full_check(glue, make_case(40 + d, lens=[0, 33, 400], d=d, sq=2), splits=(1, 3))


def test_d256_page1_and_d64_page8(glue):
    """The grouped page reads of P < 16 (one table read per page group of a lane's rows)."""
    full_check(glue, make_case(45, lens=[0, 5, 200], d=256, page=1, sq=2), splits=(1, 3))
    full_check(glue, make_case(46, lens=[7, 8, 333], d=64, page=8, group=8), splits=(1, 3))


@pytest.mark.parametrize("layout,page,group,sq,bs,dtype,left,softcap", [
    ("hnd", 8, 8, 4, 64, torch.bfloat16, -1, 0.0),  # 32 rows: two row blocks; page groups of 8 per warp half
    ("contiguous", 0, 16, 1, 128, torch.bfloat16, 100, 30.0),  # 16 rows, window + softcap + block_logit
    ("nhd", 16, 1, 1, 16, torch.float16, -1, 0.0),  # one row, a block_logit block per step
    ("hnd", 1, 4, 2, 32, torch.float16, 60, 0.0),  # P 1 (a table read per row) with a left window
])
def test_d256_warp_pairs(glue, layout, page, group, sq, bs, dtype, left, softcap):
    """d 256 runs two warps per key range, each with half of O's columns (config.d_split): GQA groups, row blocks,
    split / unsplit (the block maxima bitwise equal across split counts, every entry written once), page sizes
    1 / 8 / 16 and the contiguous cache, window + softcap, bf16 and fp16. Lengths leave one pair with no keys, end
    mid-step and mid-block."""
    case = make_case(130 + page + group, lens=[0, 3, 45, 777], d=256, page=max(page, 1), group=group, sq=sq,
                     layout=layout, dtype=dtype)
    full_check(glue, case, layout=layout, bs=bs, causal=left < 0, left=left, right=0, softcap=softcap,
               splits=(1, 3))


def test_fp16(glue):
    full_check(glue, make_case(50, lens=[9, 250, 1000], dtype=torch.float16), splits=(1, 3))


@pytest.mark.parametrize("bs,sq,left", [(64, 4, -1), (16, 1, 90), (128, 2, 300)])
def test_block_logit(glue, bs, sq, left):
    case = make_case(60 + bs, lens=[0, 1, 70, 333, 1200], sq=sq, page=16)
    full_check(glue, case, bs=bs, causal=left < 0, left=left, right=0, splits=(1, 4))


@pytest.mark.parametrize("layout", ["nhd", "contiguous"])
def test_layouts(glue, layout):
    case = make_case(70, lens=[0, 1, 31, 450], layout=layout, page=32)
    full_check(glue, case, layout=layout, splits=(1, 3))


def test_recycled_pages_before_window(glue):
    """Pages wholly before every row's left window may already be recycled (valid ids, another request's
    contents: NaN here). They are never read, also where a warp's keys start on a block_logit block (bs 64 > P 16)
    or a page is smaller than a load step (P 8)."""
    left = 100
    for page, bs in ((16, 64), (8, 0)):
        case = make_case(120 + page, lens=[500, 1000], page=page, sq=2)
        q, k, v, seq, table = case
        for b in range(seq.shape[0]):
            kmin = int(seq[b, 0]) - q.shape[1] - left
            for j in range(kmin // page):
                pid = int(table[b, 0, j])
                k[pid] = float("nan")
                v[pid] = float("nan")
        full_check(glue, case, bs=bs, causal=False, left=left, right=0, splits=(1, 3))


def test_per_kv_head_tables(glue):
    """Sparse decode's form: each (sequence, kv head) lists its own pages and length."""
    lens = np.array([[0, 5, 300, 64], [129, 1, 0, 1000]])
    full_check(glue, make_case(80, lens=lens, hkv=4, per_head=True), splits=(1, 3))


def dense_form(case):
    """The case's per-kv-head index tensors as FA's dense ``[B]`` lengths / ``[B, n]`` table (every kv head of a
    sequence shares them: make_case without per_head), fresh compact tensors."""
    q, k, v, seq, table = case
    assert bool((seq == seq[:, :1]).all()) and (table is None or bool((table == table[:, :1]).all()))
    return q, k, v, seq[:, 0].contiguous(), None if table is None else table[:, 0].contiguous()


def _bitwise_equal(a, b):
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            assert torch.equal(x.view(torch.int16) if x.element_size() == 2 else x.view(torch.int32),
                               y.view(torch.int16) if y.element_size() == 2 else y.view(torch.int32))


@pytest.mark.parametrize("layout,page,hkv,group,sq,bs,left", [
    ("hnd", 16, 4, 4, 1, 0, -1),
    ("hnd", 64, 2, 8, 4, 64, -1),
    ("hnd", 1, 2, 4, 2, 0, -1),  # one table read per key row
    ("hnd", 8, 8, 1, 1, 16, 50),  # page groups of a lane's rows; a left window
    ("nhd", 32, 4, 2, 2, 0, -1),
    ("contiguous", 0, 4, 4, 1, 64, -1),
])
def test_dense_index_form_equals_per_kv_head(glue, layout, page, hkv, group, sq, bs, left):
    """FA's dense [B] lengths / [B, n] table read in place by every kv head (kernels compiled with dense_index,
    no expanded copy) give bitwise the per-kv-head [B, Hkv] / [B, Hkv, n] result (split and unsplit), and both
    match the oracle; Hkv > 1 so a wrong kv-head stride would read another head's row."""
    case = make_case(200 + page + hkv, lens=[0, 1, 37, 300, 129], hkv=hkv, group=group, sq=sq,
                     page=page or 16, layout=layout)
    dense = dense_form(case)
    kw = dict(layout=layout, bs=bs, causal=left < 0, left=left, right=0)
    ref = reference(case, nb=_nb(case, layout, bs) if bs else 0, **kw)
    for s in (1, 3):
        per_head = run_glue(glue, case, splits=s, **kw)
        got = run_glue(glue, dense, splits=s, **kw)
        check(got, ref, case[0].dtype, bs)
        _bitwise_equal(got, per_head)


def test_dense_index_reaches_the_launcher_uncopied(glue, monkeypatch):
    """The glue hands the launcher the caller's compact dense index tensors themselves (no expand, no copy);
    a strided one (a column slice of a wider table) goes through one compact copy, same result."""
    from cute_kernels.decode import launch

    case = dense_form(make_case(210, lens=[5, 300, 64], hkv=4, page=16))
    q, k, v, seq, table = case
    seen = []
    real = launch.decode_launcher

    def spy_launcher(*a, **kw):  # the glue's plan holds the launch function: record what it is called with
        fn = real(*a, **kw)

        def launch_fn(*args):
            seen.append((args[3], args[4]))
            return fn(*args)
        return launch_fn

    monkeypatch.setattr(launch, "decode_launcher", spy_launcher)
    monkeypatch.setattr(glue, "_PLANS", {})  # plans built here hold the spy; dropped after the test
    want = run_glue(glue, case, splits=1)
    # the same storage (torch tensors are passed detached: a new object over the caller's memory)
    for got_t, user_t in zip(seen[-1], (seq, table)):
        assert got_t.data_ptr() == user_t.data_ptr() and tuple(got_t.shape) == tuple(user_t.shape)
    wide = torch.full((table.shape[0], table.shape[1] + 5), -1, dtype=torch.int32, device=table.device)
    wide[:, :table.shape[1]] = table
    strided = wide[:, :table.shape[1]]
    assert not strided.is_contiguous()
    got = run_glue(glue, (q, k, v, seq, strided), splits=1)
    copied = seen[-1][1]
    assert copied.data_ptr() != wide.data_ptr() and copied.is_contiguous() and tuple(copied.shape) == tuple(table.shape)
    _bitwise_equal(got, want)


@pytest.mark.parametrize("splits", [17, 40, 70, 128])
def test_combine_many_splits(glue, splits):
    """The combine's warps per row (1 per 16 splits, up to 8: combine.warps_per_row) and its staged loads: a row's
    splits spread over 2-8 warps whose part sums are added in part order; against the oracle, bitwise repeatable,
    and within tolerance of the unsplit result (ragged lengths: empty splits and rows)."""
    full_check(glue, make_case(90 + splits, lens=[0, 5, 3000, 9000], group=8, hkv=1), splits=(1, splits))


def test_auto_splits_long(glue):
    """num_splits=None at a length where the host picks many splits; against the oracle and repeatable."""
    case = make_case(90, lens=[8000], hkv=2, group=4, page=64)
    ref = reference(case)
    a = run_glue(glue, case, splits=None)
    b = run_glue(glue, case, splits=None)
    check(a, ref, torch.bfloat16)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("eos", [1, 0])
def test_select_pages_output_feeds_sparse_decode(glue, eos):
    """``h2o.select_pages``'s CuTe kernel output (``sparse_block_tables [B, Hkv, K]`` with -1 slots,
    ``sparse_seq_lens [B, Hkv]``) handed to the decode kernels as it is, on the GPU: against the fp64 oracle over
    the pages it lists, split and unsplit, bitwise repeatable; the cache's unused page tails hold NaN (the real
    last page is partial), and with ``eos = 0`` the last page is in the list only where the top-k picked it."""
    from cute_kernels.h2o import launch as H

    page, hkv, topk, bos = 16, 2, 5, 1
    q, k, v, seq, table = make_case(120 + eos, lens=[16 * 40 + 7, 16 * 12 + 1, 5, 16 * 9], hkv=hkv, group=4,
                                    page=page, pad="neg")
    tables, lens = table[:, 0].contiguous(), seq[:, 0].contiguous()  # FA's [B, n] / [B] form of the same cache
    rng = np.random.default_rng(7)
    scores = torch.as_tensor(rng.standard_normal((lens.shape[0], hkv, tables.shape[1])), dtype=torch.float32,
                             device=q.device)
    width = bos + topk + eos
    sel = torch.full((lens.shape[0], hkv, width), 99, dtype=torch.int32, device=q.device)
    sel_lens = torch.full((lens.shape[0], hkv), 99, dtype=torch.int32, device=q.device)
    H.run_select_pages(scores, tables, lens, sel, sel_lens, page_size=page, topk=topk, bos=bos, eos=eos)
    assert (sel == -1).any(), "the case should leave unused slots (-1) in the short requests' rows"
    full_check(glue, (q, k, v, sel_lens, sel), splits=(1, 3))


def test_cuda_graph_replay_with_new_lengths(glue):
    case = make_case(100, lens=[50, 700, 3], extra_pages=2)
    q, k, v, seq, table = case
    n_max = table.shape[2] * k.shape[2]
    run_glue(glue, case, splits=3)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, lse, _ = run_glue(glue, case, splits=3)
    for lens in ([50, 700, 3], [0, 10, 3], [49, 699, 1]):
        assert max(lens) <= n_max
        seq.copy_(torch.as_tensor(np.repeat(np.array(lens)[:, None], seq.shape[1], 1), dtype=torch.int32))
        g.replay()
        torch.cuda.synchronize()
        # pages past the new (shorter) lengths are legal data, only the tails of the original case are NaN
        check((out, lse, None), reference(case), torch.bfloat16)


def test_memcheck_cases(glue):
    """Small paged / tail-NaN / padding-id cases (run under compute-sanitizer by the GPU script)."""
    for pad in ("neg", "huge"):
        case = make_case(110, lens=[0, 3, 45], page=16, pad=pad, extra_pages=1)
        ref = reference(case, bs=16, nb=_nb(case, "hnd", 16))
        check(run_glue(glue, case, splits=2, bs=16), ref, torch.bfloat16, 16)
    case = make_case(111, lens=[5, 20], page=1, pad="huge")
    check(run_glue(glue, case, splits=1), reference(case), torch.bfloat16)
