"""SM90 attention backward on the H200, through cute_kernels.attention.bwd_launch.run_bwd.

out / lse come from our forward (run_fwd). Reference gradients: torch autograd of the same attention
math in fp32 on the upcast inputs (TF32 off; ``_attn_ref.visible_mask`` for the masks). Tolerance
FA-style: |ours - ref|_max <= 2 |lowp - ref|_max + atol, lowp = the same autograd in the inputs'
16-bit dtype. FA4 b36's error on the same inputs is printed next to ours where FA4 runs the case.
Outputs and workspace are poisoned (NaN / garbage) before each run, so an unwritten element shows.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch", reason="needs a CUDA GPU; torch is used to drive the launchers")

from tests.conftest import sm90_gpu_marks  # noqa: E402
from tests.gpu._fwd_launch import make_qkv, run_ours  # noqa: E402

pytestmark = sm90_gpu_marks()


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


DT = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: (head_dim, head_dim_v) of the 128-key schedule and of the wide one (d 192 / 256 / (192, 128)).
NARROW = [(64, 64), (96, 96), (128, 128)]
WIDE = [(192, 192), (256, 256), (192, 128)]


def dims_id(dims):
    d, dv = dims
    return f"d{d}" if d == dv else f"d{d}-{dv}"


def dims_params(dims):
    return pytest.mark.parametrize("dims", dims, ids=[dims_id(x) for x in dims])


def make_qkv_dv(b, sq, sk, hq, hkv, dims, dtype=torch.bfloat16, seed=0):
    """make_qkv with V of head_dim_v columns (its own generator when head_dim_v != head_dim)."""
    d, dv = dims
    q, k, v = make_qkv(b, sq, sk, hq, hkv, d, dtype=dtype, seed=seed)
    if dv != d:
        g = torch.Generator(device="cuda").manual_seed(seed + 100)
        v = torch.randn(b, sk, hkv, dv, device="cuda", generator=g).to(dtype)
    return q, k, v


def ref_attention(q, k, v, *, causal, window, softcap, scale):
    """Dense (B, S, H, D) attention for autograd: returns (out, lse) in q's dtype precision chain."""
    from tests.gpu._attn_ref import visible_mask

    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    rep = hq // hkv
    kf = k.repeat_interleave(rep, dim=2)
    vf = v.repeat_interleave(rep, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kf).float() * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    vis = visible_mask(sq, sk, causal, window, q.device)
    s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - lse_safe[..., None])
    out = torch.einsum("bhqk,bkhd->bqhd", p.to(q.dtype), vf)
    return out, lse


def ref_grads(q, k, v, do, dlse, *, upcast, **kw):
    dt = torch.float32 if upcast else q.dtype
    qq, kk, vv = [x.detach().to(dt).requires_grad_() for x in (q, k, v)]
    out, lse = ref_attention(qq, kk, vv, **kw)
    loss = (out.float() * do.float()).sum()
    if dlse is not None:
        lse_fin = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        loss = loss + (lse_fin * dlse).sum()
    loss.backward()
    return qq.grad.float(), kk.grad.float(), vv.grad.float()


def poison_like(x):
    if x.dtype.is_floating_point:
        return torch.full_like(x, float("nan"))
    return torch.full_like(x, 12345)


def run_bwd_ours(q, k, v, out, lse, do, *, causal=False, window=(-1, -1), softcap=0.0, scale=None,
                 deterministic=False, dlse=None, cu_q=None, cu_k=None, max_sq=None, max_sk=None, arch=90):
    from cute_kernels.attention.bwd_launch import bwd_config, run_bwd, workspace_shapes

    varlen = cu_q is not None
    d, dv = q.shape[-1], v.shape[-1]
    hq, hkv = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    has_window = tuple(window) != (-1, -1)
    cfg = bwd_config(arch, q.dtype, d, dv, hq // hkv, causal, has_window, softcap > 0, varlen, deterministic,
                     dlse is not None)
    if varlen:
        batch = cu_q.shape[0] - 1
        shapes = workspace_shapes(cfg, batch=batch, seqlen_q=0, num_heads=hq, total_q=q.shape[0],
                                  seqlen_k=max_sk, num_kv_heads=hkv, total_k=k.shape[0])
    else:
        batch, max_sq, max_sk = q.shape[0], q.shape[1], k.shape[1]
        shapes = workspace_shapes(cfg, batch=batch, seqlen_q=q.shape[1], num_heads=hq, seqlen_k=max_sk,
                                  num_kv_heads=hkv)
    ws = {}
    for name, (shape, dtn) in shapes.items():
        t = torch.empty(shape, device=q.device, dtype=getattr(torch, dtn))
        ws[name] = poison_like(t)
    dq, dk, dv_ = poison_like(q), poison_like(k), poison_like(v)
    run_bwd(cfg, do, q, k, v, out, lse, dlse, dq, dk, dv_, cu_q, cu_k, ws, softmax_scale=scale, softcap=softcap,
            window_left=window[0], window_right=window[1], max_seqlen_q=max_sq, max_seqlen_k=max_sk)
    return dq, dk, dv_


def fa4_grads(q, k, v, do, *, causal, window, softcap, scale, deterministic=False):
    """FA4 b36's dq, dk, dv on the same inputs (None when FA4 is not installed or rejects the case)."""
    try:
        from flash_attn.cute.interface import flash_attn_func
    except Exception:
        return None
    try:
        qq, kk, vv = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        kw = dict(causal=causal, softmax_scale=scale, softcap=softcap, deterministic=deterministic)
        if tuple(window) != (-1, -1):
            kw["window_size"] = (None if window[0] < 0 else window[0], None if window[1] < 0 else window[1])
        res = flash_attn_func(qq, kk, vv, **kw)
        o = res[0] if isinstance(res, tuple) else res
        o.backward(do)
        return qq.grad.float(), kk.grad.float(), vv.grad.float()
    except Exception as exc:  # FA4 does not run every case on SM90
        print(f"  FA4: {type(exc).__name__}: {str(exc)[:100]}")
        return None


def check_grads(name, ours, ref, lowp, fa4=None, factor=2.0):
    msgs = []
    for label, o, r, lp, f in zip(("dq", "dk", "dv"), ours, ref, lowp, fa4 or (None,) * 3):
        assert not torch.isnan(o).any(), f"{name}: NaN (unwritten or bad) in {label}"
        err = (o.float() - r).abs().max().item()
        err_lp = (lp - r).abs().max().item()
        atol = 1e-3 * max(1.0, r.abs().max().item()) + 1e-5
        fa = "" if f is None else f" fa4 {(f - r).abs().max().item():.2e}"
        msgs.append(f"{label} {err:.2e} (lowp {err_lp:.2e}{fa})")
        assert err <= factor * err_lp + atol, f"{name}: {label} err {err:.3e} vs lowp {err_lp:.3e}"
    print(f"  {name}: " + ", ".join(msgs))


def dense_case(b, sq, sk, hq, hkv, d, dtype="bf16", causal=False, window=(-1, -1), softcap=0.0,
               deterministic=False, with_dlse=False, seed=0, fa4=True):
    """``d``: head_dim or (head_dim, head_dim_v)."""
    dims = tuple(d) if isinstance(d, (tuple, list)) else (d, d)
    d, dv = dims
    q, k, v = make_qkv_dv(b, sq, sk, hq, hkv, dims, dtype=DT[dtype], seed=seed)
    scale = 1.0 / math.sqrt(d)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    do = torch.randn(b, sq, hq, dv, device="cuda", generator=g).to(q.dtype)
    out, lse, _ = run_ours(q, k, v, causal=causal, window=window, softcap=softcap, scale=scale)
    dlse = torch.randn(lse.shape, device="cuda", generator=g) if with_dlse else None
    if dlse is not None:
        dlse = dlse.masked_fill(torch.isinf(lse), 0.0)
    ours = run_bwd_ours(q, k, v, out, lse, do, causal=causal, window=window, softcap=softcap, scale=scale,
                        deterministic=deterministic, dlse=dlse)
    kw = dict(causal=causal, window=window, softcap=softcap, scale=scale)
    ref = ref_grads(q, k, v, do, dlse, upcast=True, **kw)
    lowp = ref_grads(q, k, v, do, dlse, upcast=False, **kw)
    fa = fa4_grads(q, k, v, do, deterministic=deterministic, **kw) if fa4 and dlse is None else None
    name = (f"b{b} sq{sq} sk{sk} h{hq}/{hkv} {dims_id(dims)} {dtype} causal={causal} win={window} cap={softcap} "
            f"det={deterministic} dlse={with_dlse}")
    check_grads(name, ours, ref, lowp, fa)
    return ours


@dims_params(NARROW + WIDE)
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
@pytest.mark.parametrize("gqa", [False, True])
def test_dense(dims, mask, gqa):
    hq, hkv = (8, 2) if gqa else (4, 4)
    window = (100, 30) if mask == "window" else (-1, -1)
    dense_case(2, 517, 300, hq, hkv, dims, causal=mask == "causal", window=window)
    # FA4 once per config (its compile dominates the wide cases)
    dense_case(1, 256, 1024, hq, hkv, dims, causal=mask == "causal", window=window, seed=3, fa4=dims in NARROW)


@dims_params([(64, 64), (128, 128)] + WIDE)
def test_fp16_softcap_dlse(dims):
    dense_case(2, 333, 333, 4, 2, dims, dtype="fp16", causal=True)
    dense_case(1, 400, 700, 4, 4, dims, softcap=15.0, seed=5)
    dense_case(1, 400, 400, 4, 4, dims, causal=True, softcap=10.0, seed=6)
    dense_case(2, 300, 260, 4, 2, dims, with_dlse=True, seed=7)


@dims_params([(128, 128), (256, 256), (192, 128)])
def test_rows_without_keys(dims):
    # Sq > Sk, causal bottom-right: rows i < Sq - Sk see no key (lse = -inf) -> zero dQ, no NaN.
    dq, dk, dv = dense_case(1, 700, 200, 4, 4, dims, causal=True, fa4=False)
    assert torch.count_nonzero(dq[:, :500]) == 0
    # window that leaves key columns unseen: dK / dV of those keys are exactly 0
    small = (64, 64) if dims == (128, 128) else dims
    dq, dk, dv = dense_case(1, 256, 1024, 2, 2, small, window=(10, 0), fa4=False)
    assert torch.count_nonzero(dk[:, :700]) == 0 and torch.count_nonzero(dv[:, :700]) == 0


@dims_params(NARROW + WIDE)
def test_deterministic(dims):
    """Deterministic dQ (causal / window: the descending order, Note [deterministic dQ, descending order])."""
    for mask in ("none", "causal", "window"):
        window = (300, 50) if mask == "window" else (-1, -1)
        dense_case(2, 700, 900, 8, 2, dims, causal=mask == "causal", window=window, deterministic=True,
                   fa4=dims in NARROW)


def _det_runs(deterministic, n=3, dims=(128, 128), mask="none", hkv=2):
    q, k, v = make_qkv_dv(1, 512, 4096, 4, hkv, dims, seed=11)
    do = torch.randn(*q.shape[:-1], dims[1], device="cuda", dtype=q.dtype)
    causal = mask == "causal"
    window = (700, 100) if mask == "window" else (-1, -1)
    out, lse, _ = run_ours(q, k, v, causal=causal, window=window)
    return [run_bwd_ours(q, k, v, out, lse, do, causal=causal, window=window, deterministic=deterministic)
            for _ in range(n)]


@dims_params([(64, 64), (128, 128), (256, 256), (192, 128)])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_deterministic_bitwise(dims, mask):
    runs = _det_runs(True, 3, dims=dims, mask=mask)
    for r in runs[1:]:
        for a, b_ in zip(runs[0], r):
            assert torch.equal(a, b_), "deterministic backward differs between runs"


@dims_params([(64, 64), (128, 128)])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_deterministic_bitwise_mha(dims, mask):
    """MHA without a window: the kernel that stores dK / dV through shared memory and TMA
    (bwd_sm90's Note [staged dK / dV epilogue]); the GQA cases above take the direct stores."""
    runs = _det_runs(True, 3, dims=dims, mask=mask, hkv=4)
    for r in runs[1:]:
        for a, b_ in zip(runs[0], r):
            assert torch.equal(a, b_), "deterministic backward differs between runs"


@dims_params([(128, 128), (256, 256)])
def test_nondeterministic_differs(dims):
    """The case of test_deterministic_bitwise has the power to fail: the default (atomic-order) dQ
    path changes bits between runs there (32 / 64 key tiles reduce into every query tile)."""
    runs = _det_runs(False, 8, dims=dims)
    same = all(torch.equal(runs[0][0], r[0]) for r in runs[1:])
    assert not same, "non-deterministic dQ was bitwise stable over 8 runs (test has no power)"
    for r in runs[1:]:  # dK / dV are deterministic by construction in both modes
        assert torch.equal(runs[0][1], r[1]) and torch.equal(runs[0][2], r[2])


def _varlen_case(lens_q, lens_k, hq, hkv, d, causal=False, window=(-1, -1), deterministic=False, seed=0):
    dims = tuple(d) if isinstance(d, (tuple, list)) else (d, d)
    d, dv = dims
    dt = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(seed)
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq, hq, d, device="cuda", generator=g).to(dt)
    k = torch.randn(tk, hkv, d, device="cuda", generator=g).to(dt)
    v = torch.randn(tk, hkv, dv, device="cuda", generator=g).to(dt)
    do = torch.randn(tq, hq, dv, device="cuda", generator=g).to(dt)
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), device="cuda", dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), device="cuda", dtype=torch.int32)
    scale = 1.0 / math.sqrt(d)
    out, lse, _ = run_ours(q, k, v, causal=causal, window=window, scale=scale, cu_q=cu_q, cu_k=cu_k,
                           max_sq=max(lens_q), max_sk=max(lens_k))
    dq, dk, dv = run_bwd_ours(q, k, v, out, lse, do, causal=causal, window=window, scale=scale,
                              deterministic=deterministic, cu_q=cu_q, cu_k=cu_k, max_sq=max(lens_q),
                              max_sk=max(lens_k))
    kw = dict(causal=causal, window=window, softcap=0.0, scale=scale)
    for i, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        sq0, sk0 = int(cu_q[i]), int(cu_k[i])
        sl_q, sl_k = slice(sq0, sq0 + lq), slice(sk0, sk0 + lk)
        if lk == 0:
            assert lq == 0 or torch.count_nonzero(dq[sl_q]) == 0
            continue
        if lq == 0:
            assert torch.count_nonzero(dk[sl_k]) == 0 and torch.count_nonzero(dv[sl_k]) == 0
            continue
        args = [x[None] for x in (q[sl_q], k[sl_k], v[sl_k], do[sl_q])]
        ref = ref_grads(*args, None, upcast=True, **kw)
        lowp = ref_grads(*args, None, upcast=False, **kw)
        check_grads(f"varlen {dims_id(dims)} doc {i} ({lq}, {lk}) causal={causal} win={window} det={deterministic}",
                    (dq[sl_q][None], dk[sl_k][None], dv[sl_k][None]), ref, lowp)
    assert not torch.isnan(dq).any() and not torch.isnan(dk).any() and not torch.isnan(dv).any()


@dims_params([(64, 64), (128, 128), (192, 192), (192, 128)])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_varlen(dims, mask, deterministic):
    lens_q = [130, 0, 257, 64, 1, 300]
    lens_k = [200, 50, 100, 0, 129, 300]
    window = (60, 20) if mask == "window" else (-1, -1)
    _varlen_case(lens_q, lens_k, 4, 2, dims, causal=mask == "causal", window=window, deterministic=deterministic)


@dims_params([(96, 96), (256, 256)])
def test_varlen_mha(dims):
    _varlen_case([77, 190, 0], [300, 190, 33], 2, 2, dims, causal=True)


@dims_params([(128, 128), (256, 256), (192, 128)])
def test_zero_queries(dims):
    # No query at all: dK = dV = 0, written by the zero kernel (the main kernel does not run).
    q, k, v = make_qkv_dv(2, 0, 100, 4, 2, dims)
    do = torch.empty(*q.shape[:-1], dims[1], device="cuda", dtype=q.dtype)
    out = torch.empty_like(do)
    lse = torch.empty(2, 4, 0, device="cuda")
    dq, dk, dv = run_bwd_ours(q, k, v, out, lse, do)
    assert torch.count_nonzero(dk) == 0 and torch.count_nonzero(dv) == 0 and not torch.isnan(dk).any()
