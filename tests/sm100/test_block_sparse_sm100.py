"""SM100 (Blackwell) block_sparse_attention through the CuTe backend: the block-sparse tcgen05 forward
(cute_kernels/block_sparse/fwd_sm100.py), the tcgen05 backward at head dim 128 (bwd_dq_sm100.py, exact_delta or
not; bwd_dkdv_sm100.py) and the token path for the other backwards (Note [SM100 token path] in
paddle_fa4/_cute/block_sparse.py: token rows by the planner's rule + the indexed-attention kernels).

    python -m pytest tests/sm100/test_block_sparse_sm100.py -q   # skips without Paddle on a CC 10.0 / 10.3 GPU

The glue is Paddle's, so this file needs Paddle with CUDA on the Blackwell GPU
(``PADDLE_FA4_SM100_FRAMEWORK=reference`` dry-runs the same checks on the CPU against the reference
backend: it checks the tests, not the kernels). out / lse / dq / dk / dv against the fp64 oracle over the
expanded token mask (tests/oracles/block_sparse.py), bf16, GQA and per-kv-head ids, -1 padding and
repeated ids, S not a multiple of 64, documents at bos % 64 != 0, causal and not, a learnable sink, the
forward over head dims 64 / 128 / 256 and 1 / 8 / 12 / 128 query heads per kv head (one and two Q
stages, stages past the tile's queries, an odd last block), the backward over the same row tiles at head dim
128 (and 64: the token path), several work tiles per persistent CTA, the dK/dV kernel's segment split;
backend="cute" must not fall back; bitwise
equal over two runs. Nothing here has been run on a Blackwell GPU: none was available when it was written.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

from tests.oracles import block_sparse as orc
from tests.sm100.conftest import SM100_BUILDS, paddle_cuda_arch

DRY = os.environ.get("PADDLE_FA4_SM100_FRAMEWORK") == "reference"
pytestmark = [pytest.mark.sm100,
              pytest.mark.skipif(not DRY and paddle_cuda_arch() not in SM100_BUILDS,
                                 reason="needs Paddle with CUDA on a compute-capability-10.0 (B200) or 10.3 (B300) "
                                        "GPU: the token path is Paddle glue (PADDLE_FA4_SM100_FRAMEWORK=reference "
                                        "dry-runs it on the CPU)")]

OUT_TOL, GRAD_TOL = 1e-2, 2e-2


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    fin = np.isfinite(b)
    return float(np.linalg.norm(a[fin] - b[fin]) / max(np.linalg.norm(b[fin]), 1e-30))


def _run(paddle, c, ids, cu, sink=None, exact_delta=False):
    import paddle_fa4

    place = "cpu" if DRY else "gpu"
    leaf = []
    for name in ("q", "k", "v"):
        t = paddle.to_tensor(c[name], place=place).astype("bfloat16")
        t.stop_gradient = False
        leaf.append(t)
    sink_t = None
    if sink is not None:
        sink_t = paddle.to_tensor(sink, place=place)
        sink_t.stop_gradient = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to the reference backend warns: not allowed here
        cu_t = None if cu is None else paddle.to_tensor(np.asarray(cu, np.int32), place=place)
        out, lse = paddle_fa4.block_sparse_attention(*leaf, paddle.to_tensor(ids, place=place), block_size=64,
                                                     causal=c["causal"], cu_seqlens=cu_t, sink=sink_t, return_lse=True,
                                                     exact_delta=exact_delta, backend="reference" if DRY else "cute")
    dout = paddle.to_tensor(c["dout"], place=place).astype("bfloat16")
    paddle.autograd.backward([out], [dout])
    f32 = lambda t: t.astype("float32").numpy()  # noqa: E731
    got = (f32(out), lse.numpy(), f32(leaf[0].grad), f32(leaf[1].grad), f32(leaf[2].grad))
    return got if sink is None else got + (sink_t.grad.numpy(),)


def _bf(paddle, a):
    return paddle.to_tensor(a.astype(np.float32)).astype("bfloat16").astype("float32").numpy()


def _check(got, c, ids, cu, causal, sink=None):
    """got (``_run``) against the fp64 oracle: lse's -inf pattern and values, out, and the gradients."""
    mask = orc.token_mask(ids, 64, causal, None if cu is None else np.asarray(cu))
    sk = None if sink is None else sink.astype(np.float64)
    out, lse, _ = orc.attention(c["q"], c["k"], c["v"], mask, sink=sk)
    dq, dk, dv, dsink = orc.gradients(c["q"], c["k"], c["v"], mask, c["dout"], sink=sk)
    assert np.array_equal(np.isneginf(got[1]), np.isneginf(lse))
    fin = np.isfinite(lse)
    assert _rel(got[0], out) <= OUT_TOL and np.abs(got[1][fin] - lse[fin]).max() <= 2e-3
    named = [("dq", got[2], dq), ("dk", got[3], dk), ("dv", got[4], dv)]
    if sink is not None:
        named.append(("dsink", got[5], dsink))
    for name, g, w in named:
        assert _rel(g, w) <= GRAD_TOL, (name, _rel(g, w))


def _case(paddle, rng, s, hq, hkv, d, causal):
    return dict(q=_bf(paddle, rng.standard_normal((1, s, hq, d))), k=_bf(paddle, rng.standard_normal((1, s, hkv, d))),
                v=_bf(paddle, rng.standard_normal((1, s, hkv, d))),
                dout=_bf(paddle, rng.standard_normal((1, s, hq, d))), causal=causal)


@pytest.mark.parametrize("d", [64, 128], ids=["d64-token-path", "d128-kernels"])
@pytest.mark.parametrize("cu", [None, [0, 37, 300]], ids=["one-doc", "docs-bos37"])
@pytest.mark.parametrize("per_kv", [False, True], ids=["shared-ids", "per-kv-head-ids"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
def test_backward_matches_oracle(per_kv, causal, cu, d):
    """Head dim 128: the block-sparse tcgen05 dQ and dK/dV kernels; 64: the token path. Bitwise over two runs."""
    paddle = pytest.importorskip("paddle")
    rng = np.random.default_rng(11)
    s, hkv = 300, 2
    ids = orc.random_ids(rng, 1, s, 4, 64, causal, cu, heads=hkv if per_kv else None, pad=0.2, dup=0.2)
    c = _case(paddle, rng, s, 16, hkv, d, causal)
    got = _run(paddle, c, ids, cu)
    again = _run(paddle, c, ids, cu)
    for a, a2 in zip(got, again):
        assert np.array_equal(a, a2, equal_nan=True)  # bitwise over two runs
    _check(got, c, ids, cu, causal)


@pytest.mark.parametrize("d", [64, 128], ids=["d64-token-path", "d128-kernels"])
def test_backward_with_sink_matches_oracle(d):
    """A learnable sink (folded in around the token path at head dim 64, Note [sink on the token path] in
    paddle_fa4/_cute/block_sparse.py; in the forward kernel's lse at 128, the kernels' backward needing nothing
    more): out / lse / dq / dk / dv / dsink against the fp64 oracle, rows without keys (lse = the sink),
    documents, bitwise over two runs."""
    paddle = pytest.importorskip("paddle")
    rng = np.random.default_rng(12)
    s, hq, hkv, cu = 300, 16, 2, [0, 37, 300]
    ids = orc.random_ids(rng, 1, s, 4, 64, True, cu, pad=0.2, dup=0.2)
    ids[0, 50:60] = -1  # rows without keys
    c = _case(paddle, rng, s, hq, hkv, d, True)
    sink = rng.standard_normal(hq).astype(np.float32)
    got = _run(paddle, c, ids, cu, sink)
    again = _run(paddle, c, ids, cu, sink)
    for a, a2 in zip(got, again):
        assert np.array_equal(a, a2, equal_nan=True)  # bitwise over two runs
    assert np.isfinite(got[1]).all()
    assert np.allclose(got[1][0][:, 50:60], sink[:, None]) and not got[0][0, 50:60].any()
    assert not got[2][0, 50:60].any()  # rows without keys: zero dq
    _check(got, c, ids, cu, True, sink)


@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2), (10, 2), (16, 2), (24, 2), (128, 1)],
                         ids=["G1", "G2", "G5", "G8", "G12", "G128"])
def test_backward_row_tiles_match_oracle(hq, hkv):
    """The SM100 backward kernels' row tiles at head dim 128: each Q stage of the forward's window a step of
    its own (one or two per window, the 32-query window of G 1 / 2 with idle lanes, the uneven stages of G 5,
    idle lanes past QS * GC for G 12, head chunks of 64 for G 128), key steps of two blocks in the dQ kernel
    (odd counts: topk 3): out / lse / gradients against the fp64 oracle, bitwise over two runs."""
    _bitwise_and_oracle(17 + hq, 200, hq, hkv, 3, [0, 45, 200])


def _bitwise_and_oracle(seed: int, s: int, hq: int, hkv: int, topk: int, cu):
    """Causal, d 128, bf16: two runs bitwise equal, then against the fp64 oracle (``_check``)."""
    paddle = pytest.importorskip("paddle")
    rng = np.random.default_rng(seed)
    ids = orc.random_ids(rng, 1, s, topk, 64, True, cu, pad=0.2, dup=0.2)
    c = _case(paddle, rng, s, hq, hkv, 128, True)
    got = _run(paddle, c, ids, cu)
    again = _run(paddle, c, ids, cu)
    for a, a2 in zip(got, again):
        assert np.array_equal(a, a2, equal_nan=True)
    _check(got, c, ids, cu, True)


@pytest.mark.parametrize("hq,hkv", [(8, 8), (32, 4)], ids=["G1", "G8"])
def test_persistent_tiles_match_oracle(hq, hkv):
    """More work tiles than SMs (256: 32 windows x stages x kv heads), so each CTA of the persistent forward and
    dQ kernels runs several tiles in turn: the per-tile pipeline phases, the dQ kernel's two S buffers reset per
    tile, its delta one tile ahead (Note [SM100 dQ roles]) and the dQ accumulator's reuse. Gradients against the
    fp64 oracle, bitwise over two runs."""
    _bitwise_and_oracle(23 + hq, 1024, hq, hkv, 4, [0, 300, 1024])


def _peak_on_key0(c, hkv, logit=12.0):
    """Every query gets ``logit`` (scaled) more on key 0 of its kv head (the caller lists block 0 for every
    query): weight ~0.99 and up there, the rows where delta = rowsum(dout * out) loses dS (docs/api.md,
    "Gradients of peaked rows")."""
    q, k = c["q"].astype(np.float64), c["k"].astype(np.float64)
    k0 = k[:, 0]  # [B, Hkv, D]
    step = (logit / q.shape[-1] ** -0.5) * k0 / (k0 * k0).sum(-1, keepdims=True)
    c["q"] = (q + np.repeat(step, q.shape[2] // hkv, axis=1)[:, None]).astype(np.float32)
    return c


@pytest.mark.parametrize("hq,hkv,s,topk", [(32, 4, 300, 3), (8, 8, 1024, 4), (128, 1, 200, 3)],
                         ids=["G8-odd-blocks", "G1-persistent", "G128"])
def test_exact_delta_on_peaked_rows(hq, hkv, s, topk):
    """exact_delta=True at head dim 128 runs the SM100 dQ kernel's two sweeps (Note [SM100 exact delta] in
    bwd_dq_sm100.py: delta = rowsum(P dP) from its own P and dP, exchanged between the two softmax WGs, written
    for the dK/dV kernel) on rows peaked on one key: out / lse / dq / dk / dv against the fp64 oracle, bitwise
    over two runs; without exact_delta the same case's dq must be far off (the case is peaked enough to tell).
    Row tiles of one and two Q stages, an odd last block (topk 3), several tiles per persistent CTA (G 1, 1024
    tokens), head chunks of 64 (G 128)."""
    paddle = pytest.importorskip("paddle")
    rng = np.random.default_rng(31 + hq)
    cu = None  # one document: key 0 is every query's
    ids = orc.random_ids(rng, 1, s, topk, 64, True, cu, pad=0.0, dup=0.0)
    ids[..., -1] = 0  # every query lists block 0
    c = _peak_on_key0(_case(paddle, rng, s, hq, hkv, 128, True), hkv)
    c["q"] = _bf(paddle, c["q"])
    got = _run(paddle, c, ids, cu, exact_delta=True)
    again = _run(paddle, c, ids, cu, exact_delta=True)
    for a, a2 in zip(got, again):
        assert np.array_equal(a, a2, equal_nan=True)  # bitwise over two runs
    _check(got, c, ids, cu, True)
    if not DRY:  # the reference backend's delta is always rowsum(P dP)
        mask = orc.token_mask(ids, 64, True, cu)
        dq = orc.gradients(c["q"], c["k"], c["v"], mask, c["dout"])[0]
        plain = _run(paddle, c, ids, cu)
        assert _rel(plain[2], dq) > 5 * GRAD_TOL, "the case is not peaked enough to tell the two deltas apart"


@pytest.mark.skipif(DRY, reason="drives the dK/dV launcher directly (no reference backend)")
def test_dkdv_segments_match_oracle():
    """Note [key block segments] on SM100: a key block listed by many query tiles split over several CTAs
    (min_segment_pairs 1: one pair per segment, up to 8 segments) gives dk / dv equal to the oracle's, and
    bitwise equal over two runs (the segments add in turn) and to a third run with the plan's key_order (Note
    [tile-ordered segments]: another CTA for each segment, the same sums)."""
    paddle = pytest.importorskip("paddle")
    import paddle_fa4
    from cute_kernels.block_sparse.launch import bwd_config, dkdv_workspace_shapes, run_bwd_dkdv, run_bwd_dq
    from paddle_fa4._bridge import kernel_arg

    rng = np.random.default_rng(19)
    s, hq, hkv, d = 640, 16, 2, 128
    ids = np.full((1, s, 2), -1, np.int32)
    ids[0, :, 0] = 0  # every query selects block 0: all 20 query tiles (32 queries each) list it
    ids[0, 64:, 1] = rng.integers(1, 10, s - 64) % (np.arange(64, s) // 64 + 1)
    c = _case(paddle, rng, s, hq, hkv, d, True)
    t = lambda a: paddle.to_tensor(a, place="gpu").astype("bfloat16")  # noqa: E731
    q, k, v, dout = t(c["q"]), t(c["k"]), t(c["v"]), t(c["dout"])
    ids_t = paddle.to_tensor(ids, place="gpu")
    plan = paddle_fa4.block_sparse_plan(ids_t, heads_per_kv=hq // hkv, block_size=64, head_dim_v=d)
    out, lse = paddle_fa4.block_sparse_attention(q, k, v, ids_t, block_size=64, plan=plan, return_lse=True,
                                                 backend="cute")
    cfg = bwd_config(q, k, v, per_kv_head=False, arch=paddle_cuda_arch())
    a = kernel_arg
    delta = paddle.empty([1, hq, s], dtype="float32")
    dq = paddle.empty(q.shape, dtype=q.dtype)
    run_bwd_dq(cfg, a(q), a(k), a(v), a(out), a(dout), a(lse), a(delta), a(plan.tile_start), a(plan.tile_mask),
               a(plan.tile_count), a(plan.q_limit), a(dq), d ** -0.5)
    runs = []
    for order in (None, None, plan.key_order):
        dk, dv = paddle.zeros(k.shape, dtype=k.dtype), paddle.zeros(v.shape, dtype=v.dtype)
        ws = {n: (paddle.zeros if z else paddle.empty)(sh, dtype=dt)
              for n, (sh, dt, z) in dkdv_workspace_shapes(k, v, plan.key_start).items()}
        run_bwd_dkdv(cfg, a(q), a(k), a(v), a(dout), a(lse), a(delta), a(plan.tile_mask), a(plan.q_limit),
                     a(plan.key_start), a(plan.key_end), a(plan.key_count), a(plan.key_ptr), a(plan.key_tile),
                     a(plan.key_slot), a(dk), a(dv), a(ws["dk_part"]), a(ws["dv_part"]), a(ws["seg_sem"]), d ** -0.5,
                     min_segment_pairs=1, key_order=None if order is None else a(order))
        runs.append((dk.astype("float32").numpy(), dv.astype("float32").numpy()))
    assert all(np.array_equal(x, y) for r in runs[1:] for x, y in zip(runs[0], r))
    mask = orc.token_mask(ids, 64, True, None)
    _, want_dk, want_dv, _ = orc.gradients(c["q"], c["k"], c["v"], mask, c["dout"])
    assert _rel(runs[0][0], want_dk) <= GRAD_TOL and _rel(runs[0][1], want_dv) <= GRAD_TOL


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (16, 2), (24, 2), (128, 1)], ids=["G1", "G8", "G12", "G128"])
def test_forward_row_tiles_match_oracle(d, hq, hkv):
    """The forward kernel's row tiles (Q stages of 128 // GC queries, one or two per tile, the 32-query
    window, head chunks of 64 for G 128) and key steps of two blocks (odd counts: topk 3 of 64-token
    blocks): out / lse against the fp64 oracle, bitwise over two runs; no gradient asked."""
    paddle = pytest.importorskip("paddle")
    import paddle_fa4

    rng = np.random.default_rng(13 + d + hq)
    b, s, causal, cu = 1, 200, True, [0, 45, 200]
    ids = orc.random_ids(rng, b, s, 3, 64, causal, cu, pad=0.2, dup=0.2)
    place = "cpu" if DRY else "gpu"
    arrays = [rng.standard_normal((b, s, h, d)).astype(np.float32) for h in (hq, hkv, hkv)]
    runs = []
    for _ in range(2):
        q, k, v = (paddle.to_tensor(a, place=place).astype("bfloat16") for a in arrays)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out, lse = paddle_fa4.block_sparse_attention(
                q, k, v, paddle.to_tensor(ids, place=place), block_size=64, causal=causal,
                cu_seqlens=paddle.to_tensor(np.asarray(cu, np.int32), place=place), return_lse=True,
                backend="reference" if DRY else "cute")
        runs.append((out.astype("float32").numpy(), lse.numpy()))
    assert all(np.array_equal(a, a2, equal_nan=True) for a, a2 in zip(runs[0], runs[1]))
    bf = lambda a: paddle.to_tensor(a).astype("bfloat16").astype("float32").numpy()  # noqa: E731
    mask = orc.token_mask(ids, 64, causal, np.asarray(cu))
    want_out, want_lse, _ = orc.attention(*(bf(a) for a in arrays), mask)
    got_out, got_lse = runs[0]
    assert np.array_equal(np.isneginf(got_lse), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    assert _rel(got_out, want_out) <= OUT_TOL and np.abs(got_lse[fin] - want_lse[fin]).max() <= 2e-3


@pytest.mark.parametrize("keys", [(30, 36), (70, 131, 200)], ids=["doc1-tail", "doc2-inside"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("d", [64, 128], ids=["d64", "d128"])
def test_forward_values_a_row_cannot_see_never_reach_it(keys, value, d):
    """Note [scrubbed value steps, SM100] (block_sparse/fwd_sm100.py): value rows inside listed blocks poisoned
    (the SM90 test's geometry, tests/gpu/test_block_sparse.py): rows that see none of them get the out and lse of a
    run with finite rows there, bitwise; a row that sees one gets a non-finite out. (The SM100 dQ kernel does not
    scrub yet, docs/api.md: forward only.)"""
    paddle = pytest.importorskip("paddle")
    import paddle_fa4

    place = "cpu" if DRY else "gpu"
    cu = [0, 37, 320]
    ids = orc.random_ids(np.random.default_rng(9), 1, 320, 2, 64, True, cu, heads=None, pad=0.2, dup=0.1)
    c = _case(paddle, np.random.default_rng(13), 320, 16, 2, d, True)
    mask = orc.token_mask(ids, 64, True, np.asarray(cu))[0, 0]
    seeing = mask[:, list(keys)].any(axis=1)
    assert seeing.sum() >= 7 and (~seeing).sum() > 100

    def fwd(v):
        t = [paddle.to_tensor(a, place=place).astype("bfloat16") for a in (c["q"], c["k"], v)]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback to the reference backend
            out, lse = paddle_fa4.block_sparse_attention(
                *t, paddle.to_tensor(ids, place=place), block_size=64, causal=True,
                cu_seqlens=paddle.to_tensor(np.asarray(cu, np.int32), place=place), return_lse=True,
                backend="reference" if DRY else "cute")
        return out.astype("float32").numpy(), lse.numpy()

    clean = fwd(c["v"])
    bad = c["v"].copy()
    bad[:, list(keys)] = value
    out, lse = fwd(bad)
    rows = ~seeing
    assert np.isfinite(out[:, rows]).all() and np.array_equal(out[:, rows], clean[0][:, rows])
    assert np.array_equal(lse[:, :, rows], clean[1][:, :, rows])
    assert not np.isfinite(out[:, seeing]).all(axis=-1).any(), "a row that sees a poisoned value is finite"


@pytest.mark.parametrize("keys", [(30, 36), (70, 131, 200)], ids=["doc1-tail", "doc2-inside"])
@pytest.mark.parametrize("poisoned", ["k", "v"])
@pytest.mark.parametrize("exact_delta", [False, True], ids=["delta", "exact_delta"])
def test_backward_keys_a_row_cannot_see_never_reach_it(keys, poisoned, exact_delta):
    """Head dim 128 (the tcgen05 dQ / dK dV kernels; Note [non-finite keys, SM100 dQ] in bwd_dq_sm100.py): key or
    value rows inside listed blocks NaN; rows that see none of them get the out, lse and dq of a run with finite
    rows there, keys only such rows see the same dk / dv (bitwise); a row that sees one gets a non-finite dq."""
    paddle = pytest.importorskip("paddle")
    cu = [0, 37, 320]
    ids = orc.random_ids(np.random.default_rng(9), 1, 320, 2, 64, True, cu, heads=None, pad=0.2, dup=0.1)
    c = _case(paddle, np.random.default_rng(14), 320, 16, 2, 128, True)
    mask = orc.token_mask(ids, 64, True, np.asarray(cu))[0, 0]
    seeing = mask[:, list(keys)].any(axis=1)
    listed = mask.any(axis=0)
    clean_keys = listed & ~mask[seeing].any(axis=0)
    assert (~seeing).sum() > 100 and clean_keys.sum() > 30
    clean = _run(paddle, c, ids, cu, exact_delta=exact_delta)
    bad = dict(c, **{poisoned: c[poisoned].copy()})
    bad[poisoned][:, list(keys)] = np.nan
    got = _run(paddle, bad, ids, cu, exact_delta=exact_delta)
    rows = ~seeing
    for name, i, sel in (("out", 0, rows), ("dq", 2, rows), ("dk", 3, clean_keys), ("dv", 4, clean_keys)):
        a, b = got[i][:, sel], clean[i][:, sel]
        assert np.isfinite(a).all() and np.array_equal(a, b), name
    assert np.array_equal(got[1][:, :, rows], clean[1][:, :, rows])
    assert not np.isfinite(got[2][:, seeing]).all(axis=-1).any(), "dq: a row that sees a poisoned key is finite"
