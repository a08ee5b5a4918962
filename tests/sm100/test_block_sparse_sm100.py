"""SM100 (Blackwell) block_sparse_attention through the CuTe backend: the block-sparse tcgen05 forward
(cute_kernels/block_sparse/fwd_sm100.py) and the token path for the backward (Note [SM100 token path] in
paddle_fa4/block_sparse_cute.py: token rows by the planner's rule + the indexed-attention kernels).

    python -m pytest tests/sm100/test_block_sparse_sm100.py -q   # skips without Paddle on a CC 10.0 / 10.3 GPU

The glue is Paddle's, so this file needs Paddle with CUDA on the Blackwell GPU
(``PADDLE_FA4_SM100_FRAMEWORK=reference`` dry-runs the same checks on the CPU against the reference
backend: it checks the tests, not the kernels). out / lse / dq / dk / dv against the fp64 oracle over the
expanded token mask (tests/oracles/block_sparse.py), bf16, GQA and per-kv-head ids, -1 padding and
repeated ids, S not a multiple of 64, documents at bos % 64 != 0, causal and not, a learnable sink, the
forward over head dims 64 / 128 / 256 and 1 / 8 / 12 / 128 query heads per kv head (one and two Q
stages, stages past the tile's queries, an odd last block); backend="cute" must not fall back; bitwise
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


def _run(paddle, c, ids, cu, sink=None):
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
                                                     backend="reference" if DRY else "cute")
    dout = paddle.to_tensor(c["dout"], place=place).astype("bfloat16")
    paddle.autograd.backward([out], [dout])
    f32 = lambda t: t.astype("float32").numpy()  # noqa: E731
    got = (f32(out), lse.numpy(), f32(leaf[0].grad), f32(leaf[1].grad), f32(leaf[2].grad))
    return got if sink is None else got + (sink_t.grad.numpy(),)


@pytest.mark.parametrize("cu", [None, [0, 37, 300]], ids=["one-doc", "docs-bos37"])
@pytest.mark.parametrize("per_kv", [False, True], ids=["shared-ids", "per-kv-head-ids"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
def test_token_path_matches_oracle(per_kv, causal, cu):
    paddle = pytest.importorskip("paddle")
    rng = np.random.default_rng(11)
    b, s, hq, hkv, d = 1, 300, 16, 2, 128
    ids = orc.random_ids(rng, b, s, 4, 64, causal, cu, heads=hkv if per_kv else None, pad=0.2, dup=0.2)
    bf = lambda a: paddle.to_tensor(a.astype(np.float32)).astype("bfloat16").astype("float32").numpy()  # noqa: E731
    c = dict(q=bf(rng.standard_normal((b, s, hq, d))), k=bf(rng.standard_normal((b, s, hkv, d))),
             v=bf(rng.standard_normal((b, s, hkv, d))), dout=bf(rng.standard_normal((b, s, hq, d))), causal=causal)
    got = _run(paddle, c, ids, cu)
    again = _run(paddle, c, ids, cu)
    for a, a2 in zip(got, again):
        assert np.array_equal(a, a2, equal_nan=True)  # bitwise over two runs
    mask = orc.token_mask(ids, 64, causal, None if cu is None else np.asarray(cu))
    out, lse, _ = orc.attention(c["q"], c["k"], c["v"], mask)
    dq, dk, dv, _ = orc.gradients(c["q"], c["k"], c["v"], mask, c["dout"])
    assert np.array_equal(np.isneginf(got[1]), np.isneginf(lse))
    fin = np.isfinite(lse)
    assert _rel(got[0], out) <= OUT_TOL and np.abs(got[1][fin] - lse[fin]).max() <= 2e-3
    for name, g, w in (("dq", got[2], dq), ("dk", got[3], dk), ("dv", got[4], dv)):
        assert _rel(g, w) <= GRAD_TOL, (name, _rel(g, w))


def test_token_path_with_sink_matches_oracle():
    """A learnable sink folded in around the token path (Note [sink on the token path] in
    paddle_fa4/block_sparse_cute.py): out / lse / dq / dk / dv / dsink against the fp64 oracle, rows without keys
    (lse = the sink), documents, bitwise over two runs."""
    paddle = pytest.importorskip("paddle")
    rng = np.random.default_rng(12)
    b, s, hq, hkv, d, cu = 1, 300, 16, 2, 128, [0, 37, 300]
    ids = orc.random_ids(rng, b, s, 4, 64, True, cu, pad=0.2, dup=0.2)
    ids[0, 50:60] = -1  # rows without keys
    bf = lambda a: paddle.to_tensor(a.astype(np.float32)).astype("bfloat16").astype("float32").numpy()  # noqa: E731
    c = dict(q=bf(rng.standard_normal((b, s, hq, d))), k=bf(rng.standard_normal((b, s, hkv, d))),
             v=bf(rng.standard_normal((b, s, hkv, d))), dout=bf(rng.standard_normal((b, s, hq, d))), causal=True)
    sink = rng.standard_normal(hq).astype(np.float32)
    got = _run(paddle, c, ids, cu, sink)
    again = _run(paddle, c, ids, cu, sink)
    for a, a2 in zip(got, again):
        assert np.array_equal(a, a2, equal_nan=True)  # bitwise over two runs
    mask = orc.token_mask(ids, 64, True, np.asarray(cu))
    out, lse, _ = orc.attention(c["q"], c["k"], c["v"], mask, sink=sink.astype(np.float64))
    dq, dk, dv, dsink = orc.gradients(c["q"], c["k"], c["v"], mask, c["dout"], sink=sink.astype(np.float64))
    assert np.isfinite(got[1]).all() and np.abs(got[1] - lse).max() <= 2e-3
    assert np.allclose(got[1][0][:, 50:60], sink[:, None]) and not got[0][0, 50:60].any()
    assert _rel(got[0], out) <= OUT_TOL
    for name, g, w in (("dq", got[2], dq), ("dk", got[3], dk), ("dv", got[4], dv), ("dsink", got[5], dsink)):
        assert _rel(g, w) <= GRAD_TOL, (name, _rel(g, w))


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
