"""SM100 (Blackwell) attention backward: dq / dk / dv of FlashBwdSm100 through bwd_launch.run_bwd.

    python -m pytest tests/sm100/test_bwd_sm100.py -q     # skips without a CC 10.0 / 10.3 GPU and torch

out / lse come from a torch fp32 forward of the same math (so a forward bug cannot hide or cause a
backward failure); the reference gradients are torch autograd of that math in fp32 on the upcast
inputs (TF32 off). Tolerance FA-style: max |ours - ref| <= 2 max |lowp - ref| + atol, lowp = the same
autograd in the inputs' 16-bit dtype. Outputs and workspace are poisoned (NaN / garbage) before each
run, so an element the kernels fail to write shows up. Features: masks (none, bottom-right causal,
window), GQA, Sq != Sk (not multiples of 128), rows without keys, keys no query sees, softcap, dlse,
fp16, head dims 64 / 96 / 128 and the wide schedule's 192 / 256 / (192, 128) (Note [SM100 wide schedule]:
64-row query tiles, transposed dQ chunks, two CTAs per key tile at 256), varlen with empty and unequal
documents, deterministic (bitwise over 3 runs). Nothing here has been run: no Blackwell GPU was available
when it was written.
"""

from __future__ import annotations

import math

import pytest

from tests.conftest import torch_cuda_arch
from tests.sm100.conftest import SM100_BUILDS

pytestmark = [pytest.mark.sm100,
              pytest.mark.skipif(torch_cuda_arch() not in SM100_BUILDS,
                                 reason="needs a compute-capability-10.0 (B200) or 10.3 (B300) GPU through torch: "
                                        "the kernels are sm_100a / sm_103a builds, which load only there")]


@pytest.fixture(scope="module")
def torch():
    t = pytest.importorskip("torch")
    old = t.backends.cuda.matmul.allow_tf32
    t.backends.cuda.matmul.allow_tf32 = False
    yield t
    t.backends.cuda.matmul.allow_tf32 = old


def _dt(torch, name):
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


def visible(torch, sq, sk, causal, window, device):
    """Row i sees key t iff i + sk - sq - left <= t <= i + sk - sq + right (bottom-right aligned)."""
    i = torch.arange(sq, device=device)[:, None]
    t = torch.arange(sk, device=device)[None, :]
    diag = i + sk - sq
    ok = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if causal:
        ok &= t <= diag
    left, right = window
    if left >= 0:
        ok &= t >= diag - left
    if right >= 0:
        ok &= t <= diag + right
    return ok


def attention(torch, q, k, v, *, causal, window, softcap, scale):
    """(B, S, H, D) attention in q's dtype chain: (out, natural-log lse with -inf on empty rows)."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    kf = k.repeat_interleave(hq // hkv, dim=2)
    vf = v.repeat_interleave(hq // hkv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kf).float() * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~visible(torch, sq, sk, causal, window, q.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - lse_safe[..., None])
    out = torch.einsum("bhqk,bkhd->bqhd", p.to(q.dtype), vf)
    return out, lse


def ref_grads(torch, q, k, v, do, dlse, *, upcast, **kw):
    dt = torch.float32 if upcast else q.dtype
    qq, kk, vv = [x.detach().to(dt).requires_grad_() for x in (q, k, v)]
    out, lse = attention(torch, qq, kk, vv, **kw)
    loss = (out.float() * do.float()).sum()
    if dlse is not None:
        loss = loss + (torch.where(torch.isinf(lse), torch.zeros_like(lse), lse) * dlse).sum()
    loss.backward()
    return qq.grad.float(), kk.grad.float(), vv.grad.float()


def poison_like(torch, x):
    return torch.full_like(x, float("nan")) if x.dtype.is_floating_point else torch.full_like(x, 12345)


def run_ours(torch, q, k, v, out, lse, do, *, causal=False, window=(-1, -1), softcap=0.0, scale,
             deterministic=False, dlse=None, cu_q=None, cu_k=None, max_sq=None, max_sk=None):
    from cute_kernels.attention.bwd_launch import bwd_config, run_bwd, workspace_shapes

    varlen = cu_q is not None
    hq, hkv = q.shape[-2], k.shape[-2]
    cfg = bwd_config(torch_cuda_arch(), q.dtype, q.shape[-1], v.shape[-1], hq // hkv, causal, tuple(window) != (-1, -1),
                     softcap > 0, varlen, deterministic, dlse is not None)
    # num_kv_heads / seqlen_k: the group-split workspace of the SM90 kernels (this harness also drives them)
    if varlen:
        shapes = workspace_shapes(cfg, batch=cu_q.shape[0] - 1, seqlen_q=0, num_heads=hq, total_q=q.shape[0],
                                  seqlen_k=max_sk, num_kv_heads=hkv, total_k=k.shape[0])
    else:
        max_sq, max_sk = q.shape[1], k.shape[1]
        shapes = workspace_shapes(cfg, batch=q.shape[0], seqlen_q=q.shape[1], num_heads=hq, seqlen_k=max_sk,
                                  num_kv_heads=hkv)
    ws = {name: poison_like(torch, torch.empty(shape, device=q.device, dtype=getattr(torch, dtn)))
          for name, (shape, dtn) in shapes.items()}
    dq, dk, dv = poison_like(torch, q), poison_like(torch, k), poison_like(torch, v)
    run_bwd(cfg, do, q, k, v, out, lse, dlse, dq, dk, dv, cu_q, cu_k, ws, softmax_scale=scale, softcap=softcap,
            window_left=window[0], window_right=window[1], max_seqlen_q=max_sq, max_seqlen_k=max_sk)
    torch.cuda.synchronize()
    return dq, dk, dv


def check_grads(torch, name, ours, ref, lowp, factor=2.0):
    msgs = []
    for label, o, r, lp in zip(("dq", "dk", "dv"), ours, ref, lowp):
        assert not torch.isnan(o).any(), f"{name}: NaN (unwritten or bad) in {label}"
        err = (o.float() - r).abs().max().item()
        err_lp = (lp - r).abs().max().item()
        atol = 1e-3 * max(1.0, r.abs().max().item()) + 1e-5
        msgs.append(f"{label} {err:.2e} (lowp {err_lp:.2e})")
        assert err <= factor * err_lp + atol, f"{name}: {label} err {err:.3e} vs lowp {err_lp:.3e}"
    print(f"  {name}: " + ", ".join(msgs))


def dense_case(torch, b, sq, sk, hq, hkv, d, dtype="bf16", causal=False, window=(-1, -1), softcap=0.0,
               deterministic=False, with_dlse=False, seed=0, dv=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = _dt(torch, dtype)
    dv = dv or d
    q = torch.randn(b, sq, hq, d, device="cuda", generator=g).to(dt)
    k = torch.randn(b, sk, hkv, d, device="cuda", generator=g).to(dt)
    v = torch.randn(b, sk, hkv, dv, device="cuda", generator=g).to(dt)
    do = torch.randn(b, sq, hq, dv, device="cuda", generator=g).to(dt)
    scale = 1.0 / math.sqrt(d)
    kw = dict(causal=causal, window=window, softcap=softcap, scale=scale)
    with torch.no_grad():
        out, lse = attention(torch, q.float(), k.float(), v.float(), **kw)
    out = out.to(dt).contiguous()  # the einsum's output is permuted; the launcher takes dense tensors
    lse = lse.contiguous()
    dlse = None
    if with_dlse:
        dlse = torch.randn(lse.shape, device="cuda", generator=g).masked_fill(torch.isinf(lse), 0.0)
    ours = run_ours(torch, q, k, v, out, lse, do, deterministic=deterministic, dlse=dlse, **kw)
    ref = ref_grads(torch, q, k, v, do, dlse, upcast=True, **kw)
    lowp = ref_grads(torch, q, k, v, do, dlse, upcast=False, **kw)
    check_grads(torch, f"b{b} sq{sq} sk{sk} h{hq}/{hkv} d{d}/{dv} {dtype} causal={causal} win={window} "
                       f"cap={softcap} det={deterministic} dlse={with_dlse}", ours, ref, lowp)
    return ours


@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
@pytest.mark.parametrize("gqa", [False, True])
def test_dense(torch, d, mask, gqa):
    hq, hkv = (8, 2) if gqa else (4, 4)
    window = (100, 30) if mask == "window" else (-1, -1)
    dense_case(torch, 2, 517, 300, hq, hkv, d, causal=mask == "causal", window=window)
    dense_case(torch, 1, 256, 1024, hq, hkv, d, causal=mask == "causal", window=window, seed=3)


_WIDE = [(192, 192), (256, 256), (192, 128)]


@pytest.mark.parametrize("d, dv", _WIDE)
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
@pytest.mark.parametrize("gqa", [False, True])
def test_dense_wide(torch, d, dv, mask, gqa):
    """The wide schedule: Sq / Sk not multiples of 64 or 128, more query tiles than one, GQA groups."""
    hq, hkv = (8, 2) if gqa else (4, 4)
    window = (100, 30) if mask == "window" else (-1, -1)
    dense_case(torch, 2, 517, 300, hq, hkv, d, causal=mask == "causal", window=window, dv=dv)
    dense_case(torch, 1, 200, 1000, hq, hkv, d, causal=mask == "causal", window=window, seed=3, dv=dv)


@pytest.mark.parametrize("d, dv", _WIDE)
def test_wide_fp16_softcap_dlse_deterministic(torch, d, dv):
    dense_case(torch, 1, 333, 333, 4, 2, d, dtype="fp16", causal=True, dv=dv)
    dense_case(torch, 1, 300, 500, 8, 2, d, window=(64, 16), softcap=5.0, seed=8, dv=dv)
    dense_case(torch, 2, 300, 260, 4, 2, d, with_dlse=True, seed=7, dv=dv)
    for mask in ("none", "causal"):
        dense_case(torch, 1, 700, 900, 8, 2, d, causal=mask == "causal", deterministic=True, seed=9, dv=dv)


@pytest.mark.parametrize("d, dv", _WIDE)
def test_wide_deterministic_bitwise(torch, d, dv):
    """Bitwise equal over 3 runs (d 256: the two head-dim slices of a key tile take turns too)."""
    g = torch.Generator(device="cuda").manual_seed(12)
    q = torch.randn(1, 512, 4, d, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(1, 2048, 2, d, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn(1, 2048, 2, dv, device="cuda", generator=g).to(torch.bfloat16)
    do = torch.randn(1, 512, 4, dv, device="cuda", generator=g).to(torch.bfloat16)
    kw = dict(causal=True, window=(-1, -1), softcap=0.0, scale=1.0 / math.sqrt(d))
    assert_bitwise_over_3_runs(torch, q, k, v, do, kw)


@pytest.mark.parametrize("d", [64, 128])
def test_fp16_softcap_dlse(torch, d):
    dense_case(torch, 2, 333, 333, 4, 2, d, dtype="fp16", causal=True)
    dense_case(torch, 1, 400, 700, 4, 4, d, softcap=15.0, seed=5)
    dense_case(torch, 1, 400, 400, 8, 2, d, causal=True, softcap=10.0, seed=6)
    dense_case(torch, 1, 300, 500, 8, 2, d, window=(64, 16), softcap=5.0, seed=8)
    dense_case(torch, 2, 300, 260, 4, 2, d, with_dlse=True, seed=7)


def test_rows_without_keys(torch):
    # Sq > Sk, causal bottom-right: rows i < Sq - Sk see no key (lse = -inf) -> zero dQ, no NaN.
    dq, dk, dv = dense_case(torch, 1, 700, 200, 4, 4, 128, causal=True)
    assert torch.count_nonzero(dq[:, :500]) == 0
    # a window that leaves keys unseen: dK / dV of those keys are exactly 0 (whole unseen key tiles too)
    dq, dk, dv = dense_case(torch, 1, 256, 1024, 2, 2, 64, window=(10, 0))
    assert torch.count_nonzero(dk[:, :700]) == 0 and torch.count_nonzero(dv[:, :700]) == 0


@pytest.mark.parametrize("d", [64, 128])
def test_deterministic(torch, d):
    for mask in ("none", "causal", "window"):
        window = (300, 50) if mask == "window" else (-1, -1)
        dense_case(torch, 2, 700, 900, 8, 2, d, causal=mask == "causal", window=window, deterministic=True)


@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_bitwise(torch, causal):
    g = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = [torch.randn(1, s, h, 128, device="cuda", generator=g).to(torch.bfloat16)
               for s, h in ((512, 4), (4096, 2), (4096, 2))]
    do = torch.randn(q.shape, device="cuda", generator=g).to(torch.bfloat16)
    kw = dict(causal=causal, window=(-1, -1), softcap=0.0, scale=1.0 / math.sqrt(128))
    assert_bitwise_over_3_runs(torch, q, k, v, do, kw)


def assert_bitwise_over_3_runs(torch, q, k, v, do, kw):
    """The deterministic backward of one case, three times: dq / dk / dv bitwise equal."""
    with torch.no_grad():
        out, lse = attention(torch, q.float(), k.float(), v.float(), **kw)
    runs = [run_ours(torch, q, k, v, out.to(q.dtype).contiguous(), lse.contiguous(), do, deterministic=True, **kw)
            for _ in range(3)]
    for r in runs[1:]:
        for a, b_ in zip(runs[0], r):
            assert torch.equal(a, b_), "deterministic backward differs between runs"


def _varlen_case(torch, lens_q, lens_k, hq, hkv, d, causal=False, window=(-1, -1), deterministic=False, seed=0,
                 dv=None):
    dt = torch.bfloat16
    dv = dv or d
    g = torch.Generator(device="cuda").manual_seed(seed)
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq, hq, d, device="cuda", generator=g).to(dt)
    k = torch.randn(tk, hkv, d, device="cuda", generator=g).to(dt)
    v = torch.randn(tk, hkv, dv, device="cuda", generator=g).to(dt)
    do = torch.randn(tq, hq, dv, device="cuda", generator=g).to(dt)
    cu_q = torch.tensor([0] + [sum(lens_q[:i + 1]) for i in range(len(lens_q))], device="cuda", dtype=torch.int32)
    cu_k = torch.tensor([0] + [sum(lens_k[:i + 1]) for i in range(len(lens_k))], device="cuda", dtype=torch.int32)
    scale = 1.0 / math.sqrt(d)
    kw = dict(causal=causal, window=window, softcap=0.0, scale=scale)
    out = torch.zeros(tq, hq, dv, device="cuda", dtype=dt)
    lse = torch.full((hq, tq), float("-inf"), device="cuda")
    for i, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        a, ka = int(cu_q[i]), int(cu_k[i])
        if lq and lk:
            with torch.no_grad():
                o, l_ = attention(torch, q[None, a:a + lq].float(), k[None, ka:ka + lk].float(),
                                  v[None, ka:ka + lk].float(), **kw)
            out[a:a + lq], lse[:, a:a + lq] = o[0].to(dt), l_[0]  # copied into the dense buffers
    dq, dk, dv = run_ours(torch, q, k, v, out, lse, do, deterministic=deterministic, cu_q=cu_q, cu_k=cu_k,
                          max_sq=max(lens_q), max_sk=max(lens_k), **kw)
    for i, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        sl_q = slice(int(cu_q[i]), int(cu_q[i]) + lq)
        sl_k = slice(int(cu_k[i]), int(cu_k[i]) + lk)
        if lk == 0:
            assert lq == 0 or torch.count_nonzero(dq[sl_q]) == 0
            continue
        if lq == 0:
            assert torch.count_nonzero(dk[sl_k]) == 0 and torch.count_nonzero(dv[sl_k]) == 0
            continue
        args = [x[None] for x in (q[sl_q], k[sl_k], v[sl_k], do[sl_q])]
        ref = ref_grads(torch, *args, None, upcast=True, **kw)
        lowp = ref_grads(torch, *args, None, upcast=False, **kw)
        check_grads(torch, f"varlen doc {i} ({lq}, {lk}) causal={causal} win={window} det={deterministic}",
                    (dq[sl_q][None], dk[sl_k][None], dv[sl_k][None]), ref, lowp)
    assert not torch.isnan(dq).any() and not torch.isnan(dk).any() and not torch.isnan(dv).any()


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_varlen(torch, d, mask, deterministic):
    lens_q = [130, 0, 257, 64, 1, 300]
    lens_k = [200, 50, 100, 0, 129, 300]
    window = (60, 20) if mask == "window" else (-1, -1)
    _varlen_case(torch, lens_q, lens_k, 4, 2, d, causal=mask == "causal", window=window,
                 deterministic=deterministic)


@pytest.mark.parametrize("d, dv", _WIDE)
@pytest.mark.parametrize("deterministic", [False, True])
def test_varlen_wide(torch, d, dv, deterministic):
    _varlen_case(torch, [130, 0, 257, 64, 1, 300], [200, 50, 100, 0, 129, 300], 4, 2, d, causal=True,
                 deterministic=deterministic, dv=dv)


def test_varlen_d96_mha(torch):
    _varlen_case(torch, [77, 190, 0], [300, 190, 33], 2, 2, 96, causal=True)
