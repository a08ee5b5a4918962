"""SM90 FlashMask forward (``startend_row_indices``) on the GPU, through ``run_fwd`` (torch tensors).

Reference: the dense mask of tests/oracles/flashmask.py (``expand``: Paddle's column-interval
definition) applied to a float64 torch attention on the upcast inputs. Checks per mask type (the
generators of the oracle, scaled up), every layout with Sq != Sk, GQA with Hm = 1 / Hkv / Hq, empty
rows and empty query tiles, window + mask, block_logit (exact -inf pattern), a causal mask given as
startend == our causal kernel (bitwise), a causal document mask == varlen over the same documents,
and NaN in key tiles a query tile skips; the backward (dq, dk, dv against float32 autograd over the
dense mask, within 2x a same-precision autograd's error) per mask type and head dim, mask heads,
rows / keys without a partner, and the deterministic backward bitwise over 3 runs.

Tolerances: out within 2x the error of a same-precision eager computation (P rounded to bf16) plus
2e-3; lse 1e-3 + 1e-3 |ref| with the exact -inf pattern; block_logit 2e-3 + 1e-3 |ref|.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs a CUDA GPU; torch is used to drive the launchers")

from tests.conftest import sm90_gpu_marks  # noqa: E402
from tests.oracles import flashmask as F  # noqa: E402

pytestmark = sm90_gpu_marks()

LAYOUT = {(True, 1): "lts", (True, 2): "lts_lte", (False, 2): "lts_ute", (False, 4): "lts_lte_uts_ute"}
SENTINEL = 987654.0


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def device_arch() -> int:
    """The exact compute capability of the current GPU (90 here; 100 / 103 when tests/sm100 reuses this
    file's tests)."""
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def run_plain(q, k, v, causal, cu=None, max_s=None):
    """Our unmasked forward (dense, or varlen with ``cu``): (out, lse)."""
    from cute_kernels.attention.launch import fwd_config, run_fwd

    d, hq, hkv = q.shape[-1], q.shape[-2], k.shape[-2]
    cfg = fwd_config(device_arch(), q.dtype, d, v.shape[-1], hq // hkv, causal, False, False, 0, cu is not None)
    out = torch.empty(*q.shape[:-1], v.shape[-1], device="cuda", dtype=q.dtype)
    if cu is None:
        lse = torch.empty(q.shape[0], hq, q.shape[1], device="cuda", dtype=torch.float32)
        max_s = q.shape[1]
    else:
        lse = torch.empty(hq, q.shape[0], device="cuda", dtype=torch.float32)
    run_fwd(cfg, q, k, v, out, lse, None, cu, cu, softmax_scale=1.0 / math.sqrt(d), softcap=0.0,
            window_left=-1, window_right=-1, max_seqlen_q=max_s)
    return out, lse


def make_qkv(b, sq, sk, hq, hkv, d, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(b, s, h, d, device="cuda", generator=g).to(dtype)
                 for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))


def run_fm(q, k, v, se, causal, window=(-1, -1), block_size=0):
    """One masked forward through ``run_fwd`` (``se``: int32 numpy or cuda tensor [B, Hm, Sk, n]).
    Returns (out, lse, block_logit or None); block_logit starts at SENTINEL so unwritten entries show."""
    from cute_kernels.attention import fm_meta
    from cute_kernels.attention.launch import fm_meta_config, fwd_config, run_fwd

    se = torch.as_tensor(se, device="cuda", dtype=torch.int32).contiguous()
    b, sq, hq, d = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    layout = LAYOUT[(causal, se.shape[-1])]
    cfg = fwd_config(device_arch(), q.dtype, d, dv, hq // hkv, causal, tuple(window) != (-1, -1), False, block_size,
                     False, startend=layout)
    shapes = fm_meta.workspace_shapes(fm_meta_config(cfg), b, se.shape[1], sq, sk)
    ws = {name: torch.full(shape, -7, device="cuda", dtype=torch.int32) for name, (shape, _) in shapes.items()}
    out = torch.empty(b, sq, hq, dv, device="cuda", dtype=q.dtype)
    lse = torch.empty(b, hq, sq, device="cuda", dtype=torch.float32)
    bl = None
    if block_size:
        bl = torch.full((b, hq, sq, -(-sk // block_size)), SENTINEL, device="cuda", dtype=torch.float32)
    run_fwd(cfg, q, k, v, out, lse, bl, None, None, softmax_scale=1.0 / math.sqrt(d), softcap=0.0,
            window_left=window[0], window_right=window[1], max_seqlen_q=sq, startend=se, **ws)
    return out, lse, bl


def dense_ref(q, k, v, vis, block_size=0):
    """float64 attention over ``vis`` [B, Hq, Sq, Sk] (numpy or torch bool): (out, lse, block_logit,
    eager same-precision out)."""
    vis = torch.as_tensor(vis, device="cuda")
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    rep = hq // hkv
    qf = q.double().permute(0, 2, 1, 3)
    kf = k.double().repeat_interleave(rep, dim=2).permute(0, 2, 1, 3)
    vf = v.double().repeat_interleave(rep, dim=2).permute(0, 2, 1, 3)
    s = (qf @ kf.transpose(-1, -2)) / math.sqrt(d)
    s = s.masked_fill(~vis, -math.inf)
    lse = torch.logsumexp(s, dim=-1)  # -inf on empty rows
    p = torch.where(vis, torch.exp(s - torch.where(torch.isfinite(lse), lse, 0)[..., None]), 0.0)
    vz = torch.nan_to_num(vf, nan=0.0, posinf=0.0, neginf=0.0)
    out = (p @ vz).permute(0, 2, 1, 3)
    out_lp = (p.to(q.dtype).double() @ vz).permute(0, 2, 1, 3)
    bl = None
    if block_size:
        nb = -(-sk // block_size)
        pad = torch.full((b, hq, sq, nb * block_size - sk), -math.inf, device="cuda", dtype=s.dtype)
        bl = torch.cat([s, pad], dim=-1).view(b, hq, sq, nb, block_size).amax(-1)
    return out, lse, bl, out_lp


def check(q, k, v, se, causal, window=(-1, -1), block_size=0):
    se_np = np.asarray(se.cpu() if torch.is_tensor(se) else se)
    hq = q.shape[2]
    w = tuple(None if x < 0 else x for x in window)
    vis = F.per_query_head(F.expand(se_np, causal, q.shape[1], w), hq)
    out, lse, bl = run_fm(q, k, v, se_np, causal, window, block_size)
    out_ref, lse_ref, bl_ref, out_lp = dense_ref(q, k, v, vis, block_size)
    err = (out.double() - out_ref).abs().max().item()
    err_lp = (out_lp - out_ref).abs().max().item()
    assert not torch.isnan(out).any()
    assert err <= 2 * err_lp + 2e-3, f"out err {err:.3e} vs eager {err_lp:.3e}"
    inf_ref = torch.isneginf(lse_ref)
    assert torch.equal(torch.isneginf(lse), inf_ref), "lse -inf pattern"
    fin = ~inf_ref
    lerr = (lse.double()[fin] - lse_ref[fin]).abs()
    assert bool((lerr <= 1e-3 + 1e-3 * lse_ref[fin].abs()).all()), f"lse err {float(lerr.max()):.3e}"
    if inf_ref.any():
        assert float(out.float()[inf_ref.permute(0, 2, 1)].abs().max()) == 0.0, "empty rows must be 0"
    if block_size:
        assert not (bl == SENTINEL).any(), "block_logit entries left unwritten"
        assert torch.equal(torch.isneginf(bl), torch.isneginf(bl_ref)), "block_logit -inf pattern"
        f = ~torch.isneginf(bl_ref)
        berr = (bl.double()[f] - bl_ref[f]).abs()
        assert bool((berr <= 2e-3 + 1e-3 * bl_ref[f].abs()).all()), f"block_logit err {float(berr.max()):.3e}"
    return out, lse, bl


USER_MASKS = {
    "causal_document": lambda: F.causal_document([300, 77, 517, 130]),
    "bidirectional_document": lambda: F.bidirectional_document([256, 400, 368]),
    "share_question": lambda: F.share_question([(200, [150, 170]), (130, [180, 194])]),
    "sliding_window": lambda: F.sliding_window(1000, 200),
    "global_sliding_window": lambda: F.global_sliding_window(1024, 64, 150),
    "causal_blockwise": lambda: F.causal_blockwise([256, 200, 312, 256]),
    "prefix_lm": lambda: F.prefix_lm(1000, 333),
    "prefix_lm_documents": lambda: F.prefix_lm_documents([(400, 100), (300, 300), (324, 20)]),
    "random_eviction": lambda: F.random_eviction(777, seed=1),
}


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mask", sorted(USER_MASKS))
def test_user_masks(mask, d):
    se, causal, _ = USER_MASKS[mask]()
    s = se.shape[2]
    q, k, v = make_qkv(2, s, s, 4, 2, d, seed=d)
    check(q, k, v, np.repeat(se, 2, axis=0), causal)


@pytest.mark.parametrize("causal,cols", list(LAYOUT))
@pytest.mark.parametrize("sq,sk", [(300, 700), (700, 300)])
def test_random_masks_sq_ne_sk(causal, cols, sq, sk):
    rng = np.random.default_rng(sq + cols)
    se = F.random_mask(rng, 2, 2, sq, sk, causal, cols)
    q, k, v = make_qkv(2, sq, sk, 6, 2, 128, seed=cols)
    check(q, k, v, se, causal)


@pytest.mark.parametrize("hq,hkv,hm", [(8, 1, 1), (8, 1, 8), (4, 4, 4), (4, 4, 1), (8, 2, 8), (8, 2, 2)])
def test_mask_heads(hq, hkv, hm):
    rng = np.random.default_rng(hq * 100 + hkv * 10 + hm)
    se = F.random_mask(rng, 1, hm, 513, 513, False, 4)
    q, k, v = make_qkv(1, 513, 513, hq, hkv, 128, dtype=torch.float16)
    check(q, k, v, se, False)


def test_empty_rows_and_query_tiles():
    """Rows 256.. see nothing (whole query tiles with an empty key-tile range): out 0, lse -inf."""
    s = 640
    se = np.full((1, 1, s, 2), s, np.int32)
    se[..., 0] = 256  # causal [LTS, LTE): rows 256..639 masked everywhere
    se[0, 0, 5, :] = (0, s)  # key 5 hidden from every row
    q, k, v = make_qkv(1, s, s, 2, 2, 128)
    out, lse, _ = check(q, k, v, se, True)
    assert torch.isneginf(lse[:, :, 256:]).all() and (out[:, 256:] == 0).all()


@pytest.mark.parametrize("causal,window", [(True, (300, -1)), (False, (200, 100))])
def test_window_and_mask(causal, window):
    se = (F.causal_document if causal else F.bidirectional_document)([400, 600, 280])[0]
    q, k, v = make_qkv(1, 1280, 1280, 4, 4, 128)
    check(q, k, v, se, causal, window=window)


@pytest.mark.parametrize("mask", ["causal_document", "share_question"])  # the second has skipped tiles inside
@pytest.mark.parametrize("block_size", [16, 64, 256])                      # the range (masked, not skipped, here)
def test_block_logit(block_size, mask):
    se, causal, _ = (F.causal_document([190, 333, 501]) if mask == "causal_document"
                     else F.share_question([(200, [150, 170]), (130, [180, 194])]))
    q, k, v = make_qkv(1, se.shape[2], se.shape[2], 4, 2, 128)
    check(q, k, v, se, causal, block_size=block_size)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_causal_mask_as_startend_equals_causal_kernel(d):
    """LTS = Sq in every column: the bounds leave every tile whole, so the masked build runs exactly the
    causal kernel's arithmetic (bitwise equal out and lse)."""
    s = 1000
    q, k, v = make_qkv(2, s, s, 4, 2, d)
    se = np.full((2, 1, s, 1), s, np.int32)
    out, lse, _ = run_fm(q, k, v, se, True)
    out0, lse0 = run_plain(q, k, v, True)
    assert torch.equal(out, out0) and torch.equal(lse, lse0)


def test_document_mask_equals_varlen():
    docs = [300, 77, 517, 130, 1024]
    se, causal, _ = F.causal_document(docs)
    s = se.shape[2]
    q, k, v = make_qkv(1, s, s, 4, 2, 128)
    out, lse, _ = run_fm(q, k, v, se, True)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(docs)]), device="cuda", dtype=torch.int32)
    o2, lse2 = run_plain(q[0], k[0], v[0], True, cu=cu, max_s=max(docs))
    assert (out[0].float() - o2.float()).abs().max().item() <= 1e-2
    assert (lse[0] - lse2).abs().max().item() <= 1e-4
    # the backward: the masked call against the varlen backward over the same documents
    from tests.gpu.test_bwd_sm90 import run_bwd_ours

    g = torch.Generator(device="cuda").manual_seed(3)
    do = torch.randn(out.shape, device="cuda", generator=g).to(q.dtype)
    ours = run_fm_bwd(q, k, v, out, lse, do, se, True)
    vl = run_bwd_ours(q[0], k[0], v[0], o2, lse2, do[0], causal=True, cu_q=cu, cu_k=cu, max_sq=max(docs),
                      max_sk=max(docs), arch=device_arch())
    for label, a, b in zip(("dq", "dk", "dv"), ours, vl):
        err = (a[0].float() - b.float()).abs().max().item()
        assert err <= 2e-2 * max(1.0, b.float().abs().max().item()), f"{label}: masked vs varlen {err:.3e}"


def test_nan_in_skipped_key_tiles_does_not_leak():
    """Key tiles a query tile skips are never read: NaN / inf there leaves the other documents'
    outputs equal to a clean run (documents aligned to the 128-key tiles)."""
    se, causal, _ = F.causal_document([256, 256, 512])
    s = se.shape[2]
    q, k, v = make_qkv(1, s, s, 2, 2, 128)
    out0, lse0, _ = run_fm(q, k, v, se, True)
    k2, v2 = k.clone(), v.clone()
    k2[0, 300, :, 3] = float("nan")
    v2[0, 400, :, 1] = float("inf")
    out, lse, _ = run_fm(q, k2, v2, se, True)
    for rows in (slice(0, 256), slice(512, 1024)):
        assert torch.equal(out[:, rows], out0[:, rows]) and torch.equal(lse[:, :, rows], lse0[:, :, rows])
    assert not torch.isfinite(out[:, 256:512].float()).all()


def test_nan_in_partial_tiles_does_not_leak():
    """Documents that do not align to the 128-key tiles: the tile holding a document boundary is visited by
    both documents' query tiles, masked for part of its rows. NaN / Inf values and keys of the second
    document there must not reach the first document's rows (out, lse; dq, dk, dv of its keys) -- the kernels
    scrub masked tiles (common/nonfinite.py) -- while the second document's rows that see them stay
    non-finite. Without the scrub the forward's P = 0 times the NaN value gave NaN rows (H100, 2026-12-07)."""
    se, causal, _ = F.causal_document([200, 312])
    s = se.shape[2]
    q, k, v = make_qkv(1, s, s, 2, 2, 128)
    g = torch.Generator(device="cuda").manual_seed(5)
    do = torch.randn(q.shape, device="cuda", generator=g).to(q.dtype)
    out0, lse0, _ = run_fm(q, k, v, se, True)
    grads0 = run_fm_bwd(q, k, v, out0, lse0, do, se, True, deterministic=True)
    k2, v2 = k.clone(), v.clone()
    k2[0, 230, :, 3] = float("nan")  # key tile [128, 256): rows 128..199 (document 1) cannot see it
    v2[0, 240, :, 1] = float("inf")
    v2[0, 250, :, 5] = float("nan")
    out, lse, _ = run_fm(q, k2, v2, se, True)
    first = slice(0, 200)
    assert torch.equal(out[:, first], out0[:, first]) and torch.equal(lse[:, :, first], lse0[:, :, first])
    assert not torch.isfinite(out[:, 250:].float()).all(dim=-1).any()  # rows that see key 250 (and 240)
    grads = run_fm_bwd(q, k2, v2, out, lse, do, se, True, deterministic=True)
    for label, a, b in zip(("dq", "dk", "dv"), grads, grads0):
        assert torch.equal(a[:, first], b[:, first]), f"{label}: the first document changed"
    assert not torch.isfinite(grads[0][:, 250:].float()).all(dim=-1).any()


# ---------------------------------------------------------------------------------------------
# backward


def run_fm_bwd(q, k, v, out, lse, do, se, causal, window=(-1, -1), deterministic=False):
    """dq, dk, dv of a masked call through ``run_bwd`` (outputs and workspace poisoned first)."""
    from cute_kernels.attention import fm_meta
    from cute_kernels.attention.bwd_launch import bwd_config, fm_meta_config, run_bwd, workspace_shapes

    se = torch.as_tensor(se, device="cuda", dtype=torch.int32).contiguous()
    b, sq, hq, d = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    cfg = bwd_config(device_arch(), q.dtype, d, dv, hq // hkv, causal, tuple(window) != (-1, -1), False, False,
                     deterministic, False, startend=LAYOUT[(causal, se.shape[-1])])
    ws = {name: torch.full(shape, float("nan") if dt == "float32" else 12345, device="cuda",
                           dtype=getattr(torch, dt))
          for name, (shape, dt) in workspace_shapes(cfg, batch=b, seqlen_q=sq, num_heads=hq, seqlen_k=sk,
                                                    num_kv_heads=hkv).items()}
    shape, _ = fm_meta.workspace_shapes(fm_meta_config(cfg), b, se.shape[1], sq, sk)["fm_minmax"]
    minmax = torch.full(shape, -7, device="cuda", dtype=torch.int32)
    dq, dk, dv_ = (torch.full_like(x, float("nan")) for x in (q, k, v))
    run_bwd(cfg, do, q, k, v, out, lse, None, dq, dk, dv_, None, None, ws, softmax_scale=1.0 / math.sqrt(d),
            softcap=0.0, window_left=window[0], window_right=window[1], max_seqlen_q=sq, max_seqlen_k=sk,
            startend=se, fm_minmax=minmax)
    return dq, dk, dv_


def ref_grads(q, k, v, do, vis, dtype):
    """Autograd of the dense masked attention in ``dtype`` (float64: the reference; q's dtype: the
    same-precision comparison point, softmax in float32). Rows without keys give 0."""
    vis = torch.as_tensor(vis, device="cuda")
    qq, kk, vv = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    kf = kk.repeat_interleave(rep, dim=2).permute(0, 2, 1, 3)
    vf = vv.repeat_interleave(rep, dim=2).permute(0, 2, 1, 3)
    s = (qq.permute(0, 2, 1, 3) @ kf.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    live = vis.any(-1, keepdim=True)
    s = torch.where(vis, s, torch.full_like(s, -math.inf))
    s = torch.where(live, s, torch.zeros_like(s))
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    p = torch.softmax(s.to(acc), dim=-1).to(dtype) * live
    out = (p @ vf).permute(0, 2, 1, 3)
    (out.to(acc) * do.to(acc)).sum().backward()
    return qq.grad.to(acc), kk.grad.to(acc), vv.grad.to(acc)


def check_bwd(q, k, v, se, causal, window=(-1, -1), deterministic=False, seed=0):
    se_np = np.asarray(se)
    w = tuple(None if x < 0 else x for x in window)
    vis = F.per_query_head(F.expand(se_np, causal, q.shape[1], w), q.shape[2])
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    do = torch.randn(*q.shape[:-1], v.shape[-1], device="cuda", generator=g).to(q.dtype)
    out, lse, _ = run_fm(q, k, v, se_np, causal, window)
    ours = run_fm_bwd(q, k, v, out, lse, do, se_np, causal, window, deterministic)
    ref = ref_grads(q, k, v, do, vis, torch.float64)
    lowp = ref_grads(q, k, v, do, vis, q.dtype)
    for label, o, r, lp in zip(("dq", "dk", "dv"), ours, ref, lowp):
        assert not torch.isnan(o).any(), f"{label}: NaN (unwritten or bad)"
        err = (o.double() - r).abs().max().item()
        err_lp = (lp.double() - r).abs().max().item()
        atol = 1e-3 * max(1.0, r.abs().max().item()) + 1e-5
        assert err <= 2.0 * err_lp + atol, f"{label} err {err:.3e} vs same-precision {err_lp:.3e}"
    return ours, vis


BWD_MASKS = tuple(sorted(USER_MASKS))  # all nine


@pytest.mark.parametrize("d", [64, 128, 192, 256])
@pytest.mark.parametrize("mask", BWD_MASKS)
def test_backward_user_masks(mask, d):
    se, causal, _ = USER_MASKS[mask]()
    s = se.shape[2]
    q, k, v = make_qkv(1, s, s, 4, 2, d, seed=d)
    check_bwd(q, k, v, se, causal)


@pytest.mark.parametrize("causal,window", [(True, (300, -1)), (False, (200, 100))])
def test_backward_window_and_mask(causal, window):
    """The window and the column bounds together in the backward (the forward's test_window_and_mask)."""
    se = (F.causal_document if causal else F.bidirectional_document)([400, 600, 280])[0]
    q, k, v = make_qkv(1, 1280, 1280, 4, 2, 128)
    check_bwd(q, k, v, se, causal, window=window)


@pytest.mark.parametrize("causal,cols", list(LAYOUT))
def test_backward_random_masks_sq_ne_sk(causal, cols):
    rng = np.random.default_rng(cols + 10 * causal)
    for sq, sk in ((300, 700), (700, 300)):
        se = F.random_mask(rng, 1, 2, sq, sk, causal, cols)
        q, k, v = make_qkv(1, sq, sk, 4, 2, 128, seed=sq)
        check_bwd(q, k, v, se, causal)


@pytest.mark.parametrize("hq,hkv,hm", [(8, 2, 8), (8, 1, 1), (4, 4, 4), (8, 2, 2), (8, 2, 1)])
def test_backward_mask_heads(hq, hkv, hm):
    """Mask heads Hq / Hkv / 1 against GQA groups: (8, 2, 2) and (8, 2, 1) give the second kv head's group
    (query heads 4-7) mask head 1 resp. 0 (the SM100 backward steps the mask head with the query head
    instead of dividing, from head // (Hq // Hm) of the group's first head)."""
    rng = np.random.default_rng(hq + hm)
    se = F.random_mask(rng, 1, hm, 400, 400, False, 4)
    q, k, v = make_qkv(1, 400, 400, hq, hkv, 128, dtype=torch.float16)
    check_bwd(q, k, v, se, False)


def test_backward_rows_and_keys_without_partner():
    s = 640
    se = np.full((1, 1, s, 2), s, np.int32)
    se[..., 0] = 256  # rows 256.. see nothing
    se[0, 0, 5, :] = (0, s)  # key 5: no row sees it
    q, k, v = make_qkv(1, s, s, 2, 2, 128)
    (dq, dk, dv), _ = check_bwd(q, k, v, se, True)
    assert (dq[:, 256:] == 0).all() and (dk[:, 5] == 0).all() and (dv[:, 5] == 0).all()


@pytest.mark.parametrize("hkv", [4, 1])
def test_backward_deterministic_bitwise(hkv):
    """deterministic=True: three runs give bitwise equal dq, dk, dv (GQA with causal: the group-split
    path; MHA: the turn counters)."""
    se, causal, _ = F.causal_document([300, 77, 517, 130, 257])
    s = se.shape[2]
    q, k, v = make_qkv(2, s, s, 4, hkv, 128)
    se = np.repeat(se, 2, axis=0)
    g = torch.Generator(device="cuda").manual_seed(5)
    do = torch.randn(q.shape, device="cuda", generator=g).to(q.dtype)
    out, lse, _ = run_fm(q, k, v, se, causal)
    runs = [run_fm_bwd(q, k, v, out, lse, do, se, causal, deterministic=True) for _ in range(3)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)
    check_bwd(q, k, v, se, causal, deterministic=True)


def test_memcheck_cases():
    """Small forward + backward cases for compute-sanitizer (tests/gpu/run_memcheck.sh): a 4-column mask with
    Sq != Sk and a short last tile, a causal 2-column mask with empty rows, GQA with one mask head."""
    rng = np.random.default_rng(77)
    se = F.random_mask(rng, 1, 1, 200, 333, False, 4)
    q, k, v = make_qkv(1, 200, 333, 4, 2, 64)
    check(q, k, v, se, False)
    check_bwd(q, k, v, se, False)
    se = np.full((1, 1, 190, 2), 190, np.int32)
    se[..., 0] = 150
    q, k, v = make_qkv(1, 190, 190, 2, 1, 128)
    check(q, k, v, se, True, block_size=64)
    check_bwd(q, k, v, se, True)


@pytest.mark.parametrize("mask", ["share_question", "prefix_lm_documents"])
def test_head_dims_192_128(mask):
    """(192, 128) (its own build): forward against the fp64 oracle and the backward (deterministic, GQA) against
    fp64 gradients, with a mask whose visited tiles are partial (share-question) or 4-column (prefix-LM docs)."""
    se, causal, _ = USER_MASKS[mask]()
    s = se.shape[2]
    q, k, _ = make_qkv(1, s, s, 4, 2, 192, seed=3)
    v = make_qkv(1, s, s, 4, 2, 128, seed=4)[2]
    check(q, k, v, se, causal)
    check_bwd(q, k, v, se, causal, deterministic=True)
