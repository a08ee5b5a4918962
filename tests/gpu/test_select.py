"""Selection kernels on the H200 through the compiled launchers (torch tensors) vs the fp64 oracle.

Exact comparisons throughout: the contract on ids is exact (ties, -1 padding, ordering). The one
exception is head_agg="sum", whose fp32 logaddexp may swap blocks whose fp64 sums agree to 1e-4
(``_assert_sum_selection``); everything else about those rows is still exact.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs a CUDA GPU; torch is used to drive the launchers")

from tests.conftest import torch_cuda_arch  # noqa: E402
from tests.oracles import selection as oracle  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch_cuda_arch() is None or torch_cuda_arch() < 90,
                       reason="needs a CUDA GPU with compute capability >= 9.0"),
]


def _select(bl, lse, topk, hs, sink, local, causal_limit=None, poison=True, head_agg="max"):
    from cute_kernels.select.launch import run_select_topk_blocks

    b, _, sq, _ = bl.shape
    out = torch.full((b, hs, sq, topk), 12345 if poison else -1, dtype=torch.int32, device="cuda")
    run_select_topk_blocks(torch.from_numpy(bl).cuda(), torch.from_numpy(lse).cuda(), out,
                           sink_blocks=sink, local_blocks=local, causal_limit=causal_limit, head_agg=head_agg)
    torch.cuda.synchronize()
    return out.cpu().numpy()


def _assert_sum_selection(got, bl, lse, topk, hs, sink, local, causal_limit=None, tol=1e-4):
    """``got`` equals the fp64 oracle's head_agg="sum" ids, except that a row may swap unforced
    blocks whose oracle scores are within ``tol`` of the row's cut (the last unforced pick)."""
    want = oracle.select_topk_blocks(bl, lse, topk, hs, sink, local, causal_limit=causal_limit, head_agg="sum")
    assert got.shape == want.shape
    group = bl.shape[1] // hs
    swapped = 0
    for b, g, i in zip(*np.nonzero((got != want).any(-1))):
        row_got, row_want = got[b, g, i], want[b, g, i]
        n = int((row_want >= 0).sum())  # ascending ids, then -1: as many as the oracle's
        assert (row_got[n:] == -1).all() and (row_got[:n] >= 0).all() and (np.diff(row_got[:n]) > 0).all(), \
            (b, g, i, row_got, row_want)
        scores, visible = oracle._group_row(bl[b, g * group:(g + 1) * group, i].astype(np.float64),
                                            lse[b, g * group:(g + 1) * group, i].astype(np.float64), "sum")
        vis = np.nonzero(visible)[0]
        forced = {j for j in vis if j < sink or j > vis.max() - local}
        picks = [scores[j] for j in row_want if j >= 0 and j not in forced]
        cut = min(picks) if picks else np.nan
        for j in set(row_got.tolist()) ^ set(row_want.tolist()):
            assert j >= 0 and j not in forced and abs(scores[j] - cut) <= tol, (b, g, i, j, scores[j], cut)
        swapped += 1
    print(f"head_agg='sum': {swapped} of {got[..., 0].size} rows swap near-equal blocks")


# (b, hq, sq, sk, block_size, hs, topk, sink, local, window, ties)
CASES = [
    pytest.param(2, 4, 37, 300, 16, 1, 5, 1, 2, None, False, id="all-heads-nb19-vec1"),
    pytest.param(1, 8, 50, 512, 16, 2, 4, 0, 1, None, True, id="gqa-8to2-ties-vec4"),
    pytest.param(1, 8, 33, 64, 16, 8, 3, 0, 0, None, False, id="per-head"),
    pytest.param(1, 4, 20, 1000, 16, 2, 7, 1, 1, 300, False, id="window"),
    pytest.param(2, 2, 70, 40, 16, 1, 8, 0, 0, None, True, id="sq-gt-sk-empty-rows"),
    pytest.param(1, 2, 5, 250, 32, 1, 20, 2, 2, None, False, id="topk-gt-nb"),
    pytest.param(1, 3, 1, 1, 64, 1, 2, 1, 1, None, False, id="one-token"),
    pytest.param(1, 2, 96, 96 * 16, 16, 1, 16, 0, 0, None, True, id="all-ties"),
    pytest.param(1, 4, 6, 2048 * 64, 64, 2, 64, 1, 2, None, False, id="nb2048-topk64"),
    pytest.param(1, 32, 200, 32768, 64, 1, 16, 1, 2, None, False, id="hysparse-32k-rows"),
    pytest.param(1, 4, 9, 2047 * 16, 16, 1, 33, 0, 3, None, True, id="nb2047-vec1-topk33"),
]


@pytest.mark.parametrize("b,hq,sq,sk,bs,hs,topk,sink,local,window,ties", CASES)
def test_select_matches_oracle(b, hq, sq, sk, bs, hs, topk, sink, local, window, ties):
    rng = np.random.default_rng(1)
    bl, lse = oracle.causal_block_logit(rng, b, hq, sq, sk, bs, window=window, ties=ties)
    want = oracle.select_topk_blocks(bl, lse, topk, hs, sink, local)
    np.testing.assert_array_equal(_select(bl, lse, topk, hs, sink, local), want)


@pytest.mark.parametrize("hs,sink,local,topk", [(1, 1, 1, 4), (2, 0, 2, 3), (4, 0, 0, 9), (1, 2, 0, 2)])
def test_nan_rule_matches_oracle(hs, sink, local, topk):
    """NaN block_logit = unseen, NaN/+inf lse = seen but unranked (kept only when forced)."""
    rng = np.random.default_rng(5)
    bl, lse = oracle.causal_block_logit(rng, 1, 4, 64, 64 * 16, 16)
    bl[0, :, 0:8, 0:2] = np.nan
    bl[0, 1, 8:16, ::3] = np.nan
    lse[0, :, 16:24] = np.nan
    lse[0, 0, 24:32] = np.nan
    lse[0, 2, 32:40] = np.inf
    mask = rng.random(bl.shape) < 0.05
    bl[mask] = np.nan
    want = oracle.select_topk_blocks(bl, lse, topk, hs, sink, local)
    np.testing.assert_array_equal(_select(bl, lse, topk, hs, sink, local), want)


SUM_CASES = [c for c in CASES if c.id in ("all-heads-nb19-vec1", "gqa-8to2-ties-vec4", "window", "all-ties",
                                         "nb2048-topk64", "hysparse-32k-rows")] + [
    pytest.param(1, 4, 9, 1023 * 16, 16, 1, 33, 0, 3, None, False, id="nb1023-vec1-topk33"),  # vec 1
    pytest.param(1, 4, 5, 2047 * 16, 16, 1, 64, 1, 2, None, False, id="nb2047-vec1-topk64"),  # vec 1, nb_cap 2048
]


@pytest.mark.parametrize("b,hq,sq,sk,bs,hs,topk,sink,local,window,ties", SUM_CASES)
def test_head_agg_sum_matches_oracle(b, hq, sq, sk, bs, hs, topk, sink, local, window, ties):
    rng = np.random.default_rng(1)
    bl, lse = oracle.causal_block_logit(rng, b, hq, sq, sk, bs, window=window, ties=ties)
    got = _select(bl, lse, topk, hs, sink, local, head_agg="sum")
    _assert_sum_selection(got, bl, lse, topk, hs, sink, local)
    if hq // hs > 1 and not ties:  # the kernel really sums: its ids are not max's
        assert (got != oracle.select_topk_blocks(bl, lse, topk, hs, sink, local)).any()


def test_head_agg_sum_picks_the_most_total_weight():
    """Head 0 puts weight 0.9 on block 0, heads 1 and 2 put 0.6 each on block 1: max takes 0, sum 1."""
    w = np.array([[0.9, 0.05], [0.1, 0.6], [0.1, 0.6]], np.float32)
    bl = np.ascontiguousarray(np.log(w)[None, :, None, :])
    lse = np.zeros((1, 3, 1), np.float32)
    assert _select(bl, lse, 1, 1, 0, 0).ravel().tolist() == [0]
    assert _select(bl, lse, 1, 1, 0, 0, head_agg="sum").ravel().tolist() == [1]


@pytest.mark.parametrize("hs,sink,local,topk", [(1, 1, 1, 4), (2, 0, 2, 3), (1, 2, 0, 2)])
def test_head_agg_sum_nan_rule_and_read_limit(hs, sink, local, topk):
    """The NaN rule of "max" holds for "sum" (unseen / unranked heads add weight 0), and so does the
    causal read limit (bytes past the diagonal poisoned)."""
    rng = np.random.default_rng(5)
    bl, lse = oracle.causal_block_logit(rng, 1, 4, 64, 64 * 16, 16)
    bl[0, :, 0:8, 0:2] = np.nan
    bl[0, 1, 8:16, ::3] = np.nan
    lse[0, :, 16:24] = np.nan
    lse[0, 0, 24:32] = np.nan
    lse[0, 2, 32:40] = np.inf
    bl[rng.random(bl.shape) < 0.05] = np.nan
    _assert_sum_selection(_select(bl, lse, topk, hs, sink, local, head_agg="sum"), bl, lse, topk, hs, sink, local)
    poisoned = np.where(np.isneginf(bl), np.float32(50.0), bl)
    got = _select(poisoned, lse, topk, hs, sink, local, causal_limit=(16, 64 * 16), head_agg="sum")
    _assert_sum_selection(got, bl, lse, topk, hs, sink, local)


@pytest.mark.parametrize("sq,sk", [(300, 300 * 8), (64, 40), (128, 512)], ids=["square", "sq>sk", "sq<sk"])
def test_causal_read_limit_ignores_bytes_past_the_diagonal(sq, sk):
    rng = np.random.default_rng(2)
    bl, lse = oracle.causal_block_logit(rng, 1, 8, sq, sk, 16)
    poisoned = np.where(np.isneginf(bl), np.float32(50.0), bl)
    want = oracle.select_topk_blocks(bl, lse, 6, 2, 1, 2)
    got = _select(poisoned, lse, 6, 2, 1, 2, causal_limit=(16, sk))
    np.testing.assert_array_equal(got, want)


def test_varlen_rows_as_one_batch():
    """Varlen [Hq, total_q, nb] runs as [1, Hq, total_q, nb]: diagonal blocks per row from -inf."""
    rng = np.random.default_rng(3)
    parts, lses = [], []
    for sq, sk in [(30, 30), (5, 700), (17, 17)]:
        bl, lse = oracle.causal_block_logit(rng, 1, 4, sq, sk, 16)
        parts.append(np.concatenate([bl, np.full((1, 4, sq, 44 - bl.shape[-1]), -np.inf, np.float32)], -1))
        lses.append(lse)
    bl, lse = np.concatenate(parts, 2), np.concatenate(lses, 2)
    want = oracle.select_topk_blocks(bl[0], lse[0], 5, 2, 1, 1)
    np.testing.assert_array_equal(_select(bl, lse, 5, 2, 1, 1)[0], want)


def test_unaligned_base_pointer_and_determinism():
    """A 4-byte-offset block_logit takes the scalar-load config; two runs are bitwise equal."""
    from cute_kernels.select.launch import run_select_topk_blocks

    rng = np.random.default_rng(4)
    bl, lse = oracle.causal_block_logit(rng, 1, 4, 64, 64 * 16, 16)
    flat = torch.empty(bl.size + 1, device="cuda")
    view = flat[1:].view(bl.shape)
    view.copy_(torch.from_numpy(bl))
    outs = []
    for _ in range(2):
        out = torch.empty((1, 1, 64, 8), dtype=torch.int32, device="cuda")
        run_select_topk_blocks(view, torch.from_numpy(lse).cuda(), out, sink_blocks=1, local_blocks=1)
        outs.append(out.cpu().numpy())
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], oracle.select_topk_blocks(bl, lse, 8, None, 1, 1))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hs,sq,sk,bs,topk", [(1, 37, 300, 16, 5), (2, 64, 40, 32, 3), (1, 10, 10, 64, 2),
                                              (2, 130, 4096, 64, 16), (1, 3, 5000, 256, 64)],
                         ids=["sq<sk", "sq>sk", "sk<block", "hysparse", "two-tiles"])
def test_blocks_to_indices_matches_oracle(causal, hs, sq, sk, bs, topk):
    from cute_kernels.select.launch import run_blocks_to_indices

    rng = np.random.default_rng(5)
    nb = -(-sk // bs)
    blk = rng.integers(-1, nb + 2, size=(2, hs, sq, topk)).astype(np.int32)
    blk[0, 0, 0, 0] = np.iinfo(np.int32).max  # overflowing ids are padding too
    out = torch.full((2, hs, sq, topk * bs), 777, dtype=torch.int32, device="cuda")
    run_blocks_to_indices(torch.from_numpy(blk).cuda(), out, block_size=bs, seqlen_k=sk, causal=causal)
    torch.cuda.synchronize()
    want = oracle.blocks_to_indices(blk, bs, sk, causal=causal)
    got = out.cpu().numpy()
    np.testing.assert_array_equal(got[:, 0] if hs == 1 else got, want)


def test_select_then_indices_round_trip():
    from cute_kernels.select.launch import run_blocks_to_indices

    rng = np.random.default_rng(6)
    sq, sk, bs = 96, 96 * 4, 16
    bl, lse = oracle.causal_block_logit(rng, 1, 8, sq, sk, bs)
    blk = _select(bl, lse, 4, 2, 0, 1)
    out = torch.empty((1, 2, sq, 4 * bs), dtype=torch.int32, device="cuda")
    run_blocks_to_indices(torch.from_numpy(blk).cuda(), out, block_size=bs, seqlen_k=sk)
    ids = out.cpu().numpy()
    for g in range(2):
        for i in range(sq):
            chosen = set(blk[0, g, i][blk[0, g, i] >= 0].tolist())
            row = ids[0, g, i]
            assert set((row[row >= 0] // bs).tolist()) == chosen
            assert row[row >= 0].max() <= i + sk - sq


def test_runs_on_current_stream():
    """Inputs valid and results read only on a busy side stream (tests/gpu/_streams.py)."""
    from cute_kernels.select.launch import run_select_topk_blocks

    from tests.gpu._streams import side_stream_run

    rng = np.random.default_rng(7)
    bl, lse = oracle.causal_block_logit(rng, 1, 4, 32, 512, 16)

    def launch(blt, lset):
        out = torch.full((1, 1, 32, 4), 5, dtype=torch.int32, device="cuda")
        run_select_topk_blocks(blt, lset, out)
        return out

    (got,) = side_stream_run((torch.from_numpy(bl).cuda(), torch.from_numpy(lse).cuda()), launch,
                             poison=(float("-inf"), float("nan")))
    np.testing.assert_array_equal(got.numpy(), oracle.select_topk_blocks(bl, lse, 4))


def test_chunked_plan_equals_one_shot_with_our_forward():
    """The chunked driver's plan (paddle_fa4.selection.chunk_plan) on the CuTe forward + selection:
    ids bit for bit equal to one forward over all rows + one selection. Last in the file: it runs
    the attention forward kernel, whose failure must not disturb the selection tests above."""
    import math

    from cute_kernels.attention.launch import fwd_config, run_fwd, unsupported_reason
    from cute_kernels.select.launch import run_select_topk_blocks
    from paddle_fa4.selection import chunk_plan

    s, hq, hkv, d, bs, topk = 1000, 4, 2, 64, 64, 4
    cfg = fwd_config(torch_cuda_arch(), "bfloat16", d, d, hq // hkv, True, False, False, bs, False)
    reason = unsupported_reason(cfg)
    if reason is not None:
        pytest.skip(f"attention forward unavailable: {reason}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, s, h, d, device="cuda", generator=gen).to(torch.bfloat16) for h in (hq, hkv, hkv))

    def forward(qc, kc, vc):
        sq, sk = qc.shape[1], kc.shape[1]
        out = torch.empty_like(qc)
        lse = torch.empty(1, hq, sq, device="cuda")
        bl = torch.empty(1, hq, sq, -(-sk // bs), device="cuda")
        run_fwd(cfg, qc, kc, vc, out, lse, bl, None, None, softmax_scale=1 / math.sqrt(d), softcap=0.0,
                window_left=-1, window_right=0, max_seqlen_q=sq)
        return out, lse, bl

    out1, lse1, bl1 = forward(q, k, v)
    ids1 = torch.empty(1, hkv, s, topk, dtype=torch.int32, device="cuda")
    run_select_topk_blocks(bl1, lse1, ids1, sink_blocks=1, local_blocks=1)
    ids2 = torch.full_like(ids1, 99)
    out2, lse2 = torch.zeros_like(out1), torch.full_like(lse1, float("-inf"))
    for c0, c1, keys, read_limit in chunk_plan(s, s, 333, True):
        o, l, bl = forward(q[:, c0:c1].contiguous(), k[:, :keys].contiguous(), v[:, :keys].contiguous())
        blk = torch.empty(1, hkv, c1 - c0, topk, dtype=torch.int32, device="cuda")
        run_select_topk_blocks(bl, l, blk, sink_blocks=1, local_blocks=1,
                               causal_limit=(bs, keys) if read_limit else None)
        out2[:, c0:c1], lse2[:, :, c0:c1], ids2[:, :, c0:c1] = o, l, blk
    torch.cuda.synchronize()
    print(f"chunked vs one-shot: out bitwise {torch.equal(out1, out2)}, lse bitwise {torch.equal(lse1, lse2)}, "
          f"max |dlse| {(lse1 - lse2).abs().max().item():.3g}")
    assert torch.equal(ids1, ids2)
    torch.testing.assert_close(lse2, lse1, rtol=0, atol=1e-5)
