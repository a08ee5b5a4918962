"""SM100 (Blackwell) document-relative block_logit (``block_bos``): the forward against float64 references.

    python -m pytest tests/sm100/test_block_bos_sm100.py -q     # skips, with the reason, without an SM10x GPU
    PADDLE_FA4_SM100_FRAMEWORK=reference python -m pytest tests/sm100/test_block_bos_sm100.py -q   # CPU dry run

Rule (docs/api.md "block_logit with block_bos"): block ``j`` of row ``i`` holds keys
``[bos_i + j * bs, bos_i + (j + 1) * bs)``; keys before ``bos_i`` lie in no block; shape
``[B, Hq, Sq, ceil(Sk / bs)]``; every entry written (the buffer starts at SENTINEL), -inf exactly where the
block has no visible key. The kernel path (FlashFwdSm100 with ``block_bos``, common/block_logit.py's
one-row-per-thread section) splits each row's key tile at its own block starts, so the cases cover origins
on and off block boundaries, above and below the key tile (block sizes 16 ... 256 with 128-key tiles), rows
whose origin is past every key, FlashMask masks of each layout, causal / window, softcap, GQA and every head
dim. Origins are per row and arbitrary where the mask allows it: the kernel must not assume few distinct
origins per tile. Nothing here has been run on a GPU: the SM100 path is compile-verified only (docs/sm100.md).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.oracles import flashmask as F
from tests.sm100 import _harness as H
from tests.sm100.conftest import sm100_framework

pytestmark = [pytest.mark.sm100]

DOCS = [190, 333, 77, 501]  # starts 0, 190, 523, 600: no start on a 16-key boundary but 0 and 600


@pytest.fixture(scope="module")
def runner():
    return H.Runner(sm100_framework())


def doc_bos(doc_lens, batch=1):
    """[B, S] int32: each position's document start."""
    starts = np.concatenate([[0], np.cumsum(doc_lens)[:-1]])
    return np.repeat(np.repeat(starts, doc_lens)[None].astype(np.int32), batch, axis=0)


def check_bos(runner, q, k, v, bos, block_size, se=None, causal=False, window=(-1, -1), softcap=0.0,
              dtype="bfloat16"):
    """Run with ``block_bos`` and check block_logit (and out / lse) against the float64 reference."""
    b, sq, hq, _ = q.shape
    sk = k.shape[1]
    w = tuple(None if x < 0 else x for x in window)
    if se is None:
        vis = np.broadcast_to(F.window_visible(sq, sk, causal, w)[None, None], (b, hq, sq, sk))
    else:
        vis = F.per_query_head(F.expand(np.asarray(se), causal, sq, w), hq)
    out, lse, bl = runner.run(q, k, v, dtype=dtype, causal=causal, window=window, softcap=softcap,
                              block_size=block_size, startend=se, block_bos=bos)
    out_ref, lse_ref, bl_ref = H.reference_masked(q, k, v, vis, softcap=softcap, block_size=block_size,
                                                  block_bos=bos)
    H.check_block_logit(bl, bl_ref)
    if softcap == 0:  # softcap's tanh approximation: out / lse are test_fwd_sm100's (test_softcap)
        out_eager, _, _ = H.reference_masked(q, k, v, vis, eager_dtype=dtype)
        H.check_out_lse(out, lse, out_ref, lse_ref, out_eager)
    return out, lse, bl


def test_reference_matches_oracle():
    """The harness's masked reference agrees with the per-row fp64 oracle (tests/oracles/flashmask) with bos."""
    docs = [37, 90, 29]
    se, causal, _ = F.causal_document(docs)
    q, k, v = H.make_qkv(1, 156, 156, 2, 1, 64, seed=11)
    bos = doc_bos(docs)
    bos[0, 100:110] = 156  # rows whose origin is past every key: all -inf
    vis = F.per_query_head(F.expand(se, causal, 156), 2)
    o1, l1, b1 = H.reference_masked(q, k, v, vis, block_size=16, block_bos=bos)
    o2, l2, b2 = F.attention(q, k, v, vis, block_size=16, bos=bos)
    np.testing.assert_allclose(o1, o2, atol=1e-9)
    np.testing.assert_allclose(l1, l2, atol=1e-9)
    np.testing.assert_array_equal(np.isneginf(b1), np.isneginf(b2))
    np.testing.assert_allclose(b1[np.isfinite(b2)], b2[np.isfinite(b2)], atol=1e-9)
    assert np.isneginf(b1[0, :, 100:110]).all()


@pytest.mark.parametrize("block_size", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("causal", [True, False])
def test_documents(runner, block_size, causal):
    """HySparse's full layer on packed documents: a document mask and each row's document start."""
    se = (F.causal_document if causal else F.bidirectional_document)(DOCS)[0]
    s = se.shape[2]
    q, k, v = H.make_qkv(1, s, s, 4, 2, 128, seed=block_size)
    check_bos(runner, q, k, v, doc_bos(DOCS), block_size, se, causal)


@pytest.mark.parametrize("d,dv,block_size", [(64, 64, 16), (64, 64, 256), (192, 192, 32), (256, 256, 64),
                                             (256, 256, 256), (192, 128, 128)])
def test_head_dims(runner, d, dv, block_size):
    """Every head dim (q_stage 2 at d <= 128 and for (192, 128), 1 above); origins off the document starts
    in the second batch row."""
    se = np.repeat(F.causal_document(DOCS)[0], 2, axis=0)
    s = se.shape[2]
    q, k, _ = H.make_qkv(2, s, s, 4, 4, d, seed=d + block_size)
    v = H.make_qkv(2, s, s, 4, 4, dv, seed=d + 1)[2]
    bos = doc_bos(DOCS, 2)
    bos[1] = np.minimum(bos[1] + 5, np.arange(s))
    check_bos(runner, q, k, v, bos, block_size, se, True)


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (300, -1)),
                                           (False, (200, 100))])
@pytest.mark.parametrize("sq,sk", [(700, 700), (300, 700), (700, 300)])
def test_arbitrary_origins_no_mask(runner, causal, window, sq, sk):
    """Random per-row origins in [0, Sk] (Sk: a row with no block), no FlashMask mask: every row of a tile may
    have its own origin; keys before it are attended to but lie in no block."""
    rng = np.random.default_rng(sq * 7 + sk + causal)
    bos = rng.integers(0, sk + 1, size=(2, sq)).astype(np.int32)
    bos[:, :4] = (0, sk, sk - 1, 128)
    q, k, v = H.make_qkv(2, sq, sk, 6, 2, 128, seed=sq + sk)
    for bs in (16, 128, 256):
        check_bos(runner, q, k, v, bos, bs, causal=causal, window=window)


@pytest.mark.parametrize("cols", [2, 4])
def test_random_mask_and_origins(runner, cols):
    """A random non-causal FlashMask mask with random origins, GQA Hk = 1, fp16."""
    rng = np.random.default_rng(cols)
    se = F.random_mask(rng, 1, 1, 513, 513, False, cols)
    bos = rng.integers(0, 514, size=(1, 513)).astype(np.int32)
    q, k, v = H.make_qkv(1, 513, 513, 8, 1, 128, dtype="float16", seed=cols)
    for bs in (32, 256):
        check_bos(runner, q, k, v, bos, bs, se, False, dtype="float16")


@pytest.mark.parametrize("block_size", [16, 256])
def test_softcap(runner, block_size):
    se = F.causal_document(DOCS)[0]
    s = se.shape[2]
    q, k, v = H.make_qkv(1, s, s, 2, 2, 128, seed=3, q_scale=4.0)
    check_bos(runner, q, k, v, doc_bos(DOCS), block_size, se, True, softcap=20.0)


@pytest.mark.parametrize("block_size", [16, 64, 256])
def test_origin_zero_matches_absolute(runner, block_size):
    """block_bos of zeros gives bitwise the block_logit, out and lse of the build without block_bos (the
    relative path's maxima are exact fmax, and its tile max is the plain row max)."""
    se = F.causal_document(DOCS)[0]
    s = se.shape[2]
    q, k, v = H.make_qkv(1, s, s, 4, 2, 128, seed=5)
    o1, l1, rel = runner.run(q, k, v, causal=True, block_size=block_size, startend=se,
                             block_bos=np.zeros((1, s), np.int32))
    o2, l2, ab = runner.run(q, k, v, causal=True, block_size=block_size, startend=se)
    assert np.array_equal(rel, ab) and np.array_equal(o1, o2) and np.array_equal(l1, l2)


def test_origins_shift_block_ids(runner):
    """An origin that is a multiple of the block size shifts the absolute blocks by whole blocks: row i's
    relative block j is absolute block j + bos_i / bs (checked on the kernel's own outputs)."""
    s, bs = 640, 64
    q, k, v = H.make_qkv(1, s, s, 2, 2, 128, seed=8)
    bos = (np.arange(s, dtype=np.int32)[None] // 192) * 128  # 0, 128, 256, 384 by row group
    _o, _l, rel = runner.run(q, k, v, causal=True, block_size=bs, block_bos=bos)
    _o, _l, ab = runner.run(q, k, v, causal=True, block_size=bs)
    nb = ab.shape[-1]
    for i in range(s):
        sh = int(bos[0, i]) // bs
        assert np.array_equal(rel[0, :, i, :nb - sh], ab[0, :, i, sh:]), i
        assert np.isneginf(rel[0, :, i, nb - sh:]).all(), i
