"""Document-relative block_logit (``block_bos``) on the SM90 forward, against float64 references.

NOT RUN YET: written in a session without GPU time; the kernel path is compile-verified only
(sm_90a, 0 spills). Run with ``pytest tests/gpu/test_block_bos.py`` on a Hopper GPU.

Rule (docs/api.md "block_logit with block_bos"): block ``j`` of row ``i`` holds keys
``[bos_i + j * bs, bos_i + (j + 1) * bs)``; keys before ``bos_i`` lie in no block; shape
``[B, Hq, Sq, ceil(Sk / bs)]``; every entry written (the buffer starts at SENTINEL), -inf exactly where the
block has no visible key. The reference here gathers each row's shifted blocks from the dense float64 S
(the reference backend's ``_block_max_relative`` rule); one small case also goes through the
fp64 numpy oracle (``tests/oracles/flashmask.attention`` with ``bos``). Origins are per row and arbitrary
(not only document starts, not monotone) where the mask allows it: the kernel must not assume few
distinct origins per tile.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs a CUDA GPU; torch is used to drive the launchers")

from tests.conftest import sm90_gpu_marks  # noqa: E402
from tests.gpu import test_flashmask as G  # noqa: E402
from tests.oracles import flashmask as F  # noqa: E402

pytestmark = sm90_gpu_marks()


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def run_bos(q, k, v, bos, block_size, se=None, causal=False, window=(-1, -1), softcap=0.0):
    """One forward with ``block_bos`` through ``run_fwd``; (out, lse, block_logit), block_logit pre-filled
    with SENTINEL so unwritten entries show."""
    from cute_kernels.attention import fm_meta
    from cute_kernels.attention.launch import fm_meta_config, fwd_config, run_fwd

    b, sq, hq, d = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    layout = "" if se is None else G.LAYOUT[(causal, se.shape[-1])]
    cfg = fwd_config(G.device_arch(), q.dtype, d, dv, hq // hkv, causal, tuple(window) != (-1, -1), softcap > 0,
                     block_size, False, startend=layout, block_bos=True)
    kw = {}
    if se is not None:
        se = torch.as_tensor(se, device="cuda", dtype=torch.int32).contiguous()
        shapes = fm_meta.workspace_shapes(fm_meta_config(cfg), b, se.shape[1], sq, sk)
        kw = {name: torch.full(shape, -7, device="cuda", dtype=torch.int32) for name, (shape, _) in shapes.items()}
        kw["startend"] = se
    bos_t = torch.as_tensor(bos, device="cuda", dtype=torch.int32).contiguous()
    out = torch.empty(b, sq, hq, dv, device="cuda", dtype=q.dtype)
    lse = torch.empty(b, hq, sq, device="cuda", dtype=torch.float32)
    bl = torch.full((b, hq, sq, -(-sk // block_size)), G.SENTINEL, device="cuda", dtype=torch.float32)
    run_fwd(cfg, q, k, v, out, lse, bl, None, None, softmax_scale=1.0 / math.sqrt(d), softcap=float(softcap),
            window_left=window[0], window_right=window[1], max_seqlen_q=sq, block_bos=bos_t, **kw)
    return out, lse, bl


def relative_block_max(s, bos, block_size):
    """``s [B, Hq, Sq, Sk]`` float64 (-inf where masked), ``bos [B, Sq]`` -> ``[B, Hq, Sq, nb]``: the
    document-relative block maxima (keys before bos in no block)."""
    b, hq, sq, sk = s.shape
    nb = -(-sk // block_size)
    bos = torch.as_tensor(bos, device=s.device, dtype=torch.int64)
    u = torch.arange(nb * block_size, device=s.device)[None, None, :] + bos[:, :, None]  # [B, Sq, W]
    valid = u < sk
    idx = torch.where(valid, u, torch.zeros_like(u))[:, None].expand(b, hq, sq, nb * block_size)
    g = torch.gather(s, 3, idx).masked_fill(~valid[:, None], -math.inf)
    return g.view(b, hq, sq, nb, block_size).amax(-1)


def dense_scores(q, k, vis, softcap=0.0):
    """float64 masked S = scale q k^T (softcapped) [B, Hq, Sq, Sk]."""
    vis = torch.as_tensor(vis, device="cuda")
    d, rep = q.shape[-1], q.shape[2] // k.shape[2]
    qf = q.double().permute(0, 2, 1, 3)
    kf = k.double().repeat_interleave(rep, dim=2).permute(0, 2, 1, 3)
    s = (qf @ kf.transpose(-1, -2)) / math.sqrt(d)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    return s.masked_fill(~vis, -math.inf)


def check_bos(q, k, v, bos, block_size, se=None, causal=False, window=(-1, -1), softcap=0.0):
    b, sq, hq, _ = q.shape
    sk = k.shape[1]
    w = tuple(None if x < 0 else x for x in window)
    if se is None:
        vis = np.ascontiguousarray(np.broadcast_to(F.window_visible(sq, sk, causal, w)[None, None], (b, hq, sq, sk)))
    else:
        vis = F.per_query_head(F.expand(np.asarray(se), causal, sq, w), hq)
    out, lse, bl = run_bos(q, k, v, bos, block_size, se, causal, window, softcap)
    ref = relative_block_max(dense_scores(q, k, vis, softcap), bos, block_size)
    assert not (bl == G.SENTINEL).any(), "block_logit entries left unwritten"
    assert torch.equal(torch.isneginf(bl), torch.isneginf(ref)), "block_logit -inf pattern"
    f = ~torch.isneginf(ref)
    berr = (bl.double()[f] - ref[f]).abs()
    assert bool((berr <= 2e-3 + 1e-3 * ref[f].abs()).all()), f"block_logit err {float(berr.max()):.3e}"
    if softcap == 0:  # out / lse are the plain forward's: same check as without block_bos
        out_ref, lse_ref, _, out_lp = G.dense_ref(q, k, v, vis)
        err = (out.double() - out_ref).abs().max().item()
        assert err <= 2 * (out_lp - out_ref).abs().max().item() + 2e-3, f"out err {err:.3e}"
        assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref)), "lse -inf pattern"
        fin = ~torch.isneginf(lse_ref)
        assert bool(((lse.double()[fin] - lse_ref[fin]).abs() <= 1e-3 + 1e-3 * lse_ref[fin].abs()).all())
    return out, lse, bl


def doc_bos(doc_lens, batch=1):
    """[B, S] int32: each position's document start."""
    starts = np.concatenate([[0], np.cumsum(doc_lens)[:-1]])
    return np.repeat(np.repeat(starts, doc_lens)[None].astype(np.int32), batch, axis=0)


DOCS = [190, 333, 77, 501]  # starts 0, 190, 523, 600: no start on a 16-key boundary but 0 and 600


@pytest.mark.parametrize("block_size", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("causal", [True, False])
def test_documents(block_size, causal):
    """HySparse's full layer on packed documents: a document mask and each row's document start."""
    se = (F.causal_document if causal else F.bidirectional_document)(DOCS)[0]
    q, k, v = G.make_qkv(1, se.shape[2], se.shape[2], 4, 2, 128, seed=block_size)
    check_bos(q, k, v, doc_bos(DOCS), block_size, se, causal)


@pytest.mark.parametrize("d,block_size", [(64, 16), (64, 128), (256, 64), (256, 256)])
def test_head_dims(d, block_size):
    """d 64 (the 128-row tile block_bos takes) and d 256 (64-key tiles: a block of 256 spans 4 tiles)."""
    se = F.causal_document(DOCS)[0]
    q, k, v = G.make_qkv(2, se.shape[2], se.shape[2], 4, 4, d, seed=d)
    bos = doc_bos(DOCS, 2)
    bos[1] = np.minimum(bos[1] + 5, np.arange(bos.shape[1]))  # second batch row: origins off the document starts
    check_bos(q, k, v, bos, block_size, np.repeat(se, 2, axis=0), True)


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (300, -1)),
                                           (False, (200, 100))])
@pytest.mark.parametrize("sq,sk", [(700, 700), (300, 700), (700, 300)])
def test_arbitrary_origins_no_mask(causal, window, sq, sk):
    """Random per-row origins in [0, Sk] (Sk: a row with no block), no FlashMask mask: every row of a tile
    may have its own origin, keys before it are attended to but in no block."""
    rng = np.random.default_rng(sq * 7 + sk + causal)
    bos = rng.integers(0, sk + 1, size=(2, sq)).astype(np.int32)
    bos[:, :3] = (0, sk, sk - 1)
    q, k, v = G.make_qkv(2, sq, sk, 6, 2, 128, seed=sq + sk)
    for bs in (16, 64):
        check_bos(q, k, v, bos, bs, causal=causal, window=window)


@pytest.mark.parametrize("cols", [2, 4])
def test_random_mask_and_origins(cols):
    """A random non-causal FlashMask mask (tiles skipped inside the range) with random origins, GQA Hk = 1."""
    rng = np.random.default_rng(cols)
    se = F.random_mask(rng, 1, 1, 513, 513, False, cols)
    bos = rng.integers(0, 514, size=(1, 513)).astype(np.int32)
    q, k, v = G.make_qkv(1, 513, 513, 8, 1, 128, dtype=torch.float16, seed=cols)
    check_bos(q, k, v, bos, 32, se, False)


def test_softcap():
    se = F.causal_document(DOCS)[0]
    q, k, v = G.make_qkv(1, se.shape[2], se.shape[2], 2, 2, 128, seed=3)
    check_bos(q, k, v, doc_bos(DOCS), 32, se, True, softcap=20.0)


def test_oracle_small():
    """A small case against the fp64 numpy oracle (F.attention with bos)."""
    docs = [37, 90, 29]
    se, causal, _ = F.causal_document(docs)
    q, k, v = G.make_qkv(1, 156, 156, 2, 1, 64, seed=11)
    bos = doc_bos(docs)
    _out, _lse, bl = run_bos(q, k, v, bos, 16, se, causal)
    vis = F.per_query_head(F.expand(se, causal, 156), 2)
    _o, _l, bl_ref = F.attention(q.float().cpu().numpy(), k.float().cpu().numpy(), v.float().cpu().numpy(), vis,
                                 block_size=16, bos=bos)
    bl = bl.cpu().double().numpy()
    assert np.array_equal(np.isneginf(bl), np.isneginf(bl_ref))
    f = ~np.isneginf(bl_ref)
    assert np.all(np.abs(bl[f] - bl_ref[f]) <= 2e-3 + 1e-3 * np.abs(bl_ref[f]))


def test_without_bos_origin_zero_matches_absolute():
    """block_bos of zeros gives the absolute block_logit of the build without block_bos."""
    se = F.causal_document(DOCS)[0]
    q, k, v = G.make_qkv(1, se.shape[2], se.shape[2], 4, 2, 128, seed=5)
    for bs in (16, 64, 256):
        _o, _l, rel = run_bos(q, k, v, np.zeros((1, se.shape[2]), np.int32), bs, se, True)
        _o, _l, ab = G.run_fm(q, k, v, se, True, block_size=bs)
        assert torch.equal(rel, ab)
