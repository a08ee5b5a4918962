"""Strided inputs through the Paddle CuTe glue on the H200: bitwise the result of contiguous inputs.

The glue (paddle_fa4/_cute/attention.py, selection.py) is driven with torch CUDA tensors: its
allocator seam ``paddle_fa4._bridge.empty`` is pointed at torch and ``arch_of`` at 90, everything
else (kernel_input copies, stage_output / commit_output of strided out-parameters, the launchers)
is the real path. Each case runs once with strided views (slices of a fused qkv projection,
transposed dout, dq/dk/dv and block_logit as views into wider buffers, a misaligned contiguous
view) and once with contiguous clones, and requires bitwise equal results, the caller's inputs
unchanged and the rest of every out-parameter's base buffer untouched. (CPU twin with fake
launchers: tests/cpu/test_strided.py.)
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch", reason="needs a CUDA GPU; torch is used to drive the launchers")

from tests.conftest import sm90_gpu_marks  # noqa: E402

pytestmark = sm90_gpu_marks()

SENTINEL = 987654.0


@pytest.fixture
def glue(monkeypatch):
    from paddle_fa4 import _bridge
    from paddle_fa4._cute import attention as attn_glue
    from paddle_fa4._cute import selection as sel_glue

    def empty(shape, dtype, like):
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        return torch.empty(list(shape), dtype=dtype, device=like.device)

    monkeypatch.setattr(_bridge, "empty", empty)
    for mod in (attn_glue, sel_glue):
        monkeypatch.setattr(mod, "arch_of", lambda t: 90)
    return attn_glue, sel_glue


def _spec(b, sq, sk, hq, hkv, d, *, causal, block_size=0, varlen=False, total_q=None, total_k=None):
    from paddle_fa4._spec import AttnFwdSpec

    return AttnFwdSpec(batch=b, seqlen_q=sq, seqlen_k=sk, total_q=total_q or b * sq, total_k=total_k or b * sk,
                       num_heads=hq, num_heads_k=hkv, head_dim=d, head_dim_v=d, dtype="bfloat16", varlen=varlen,
                       softmax_scale=1.0 / math.sqrt(d), softcap=0.0, causal=causal, window_left=None,
                       window_right=0 if causal else None, block_size=block_size,
                       num_blocks=-(-sk // block_size) if block_size else 0, pack_gqa=False)


def _fused_qkv(b, s, h, d, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    fused = torch.randn(b, s, 3, h, d, device="cuda", generator=g).to(torch.bfloat16)
    q, k, v = fused[:, :, 0], fused[:, :, 1], fused[:, :, 2]
    assert not any(x.is_contiguous() for x in (q, k, v))
    return fused, q, k, v


def _fwd(attn_glue, spec, q, k, v, block_logit=None):
    out = torch.empty(*q.shape[:-1], v.shape[-1], device="cuda", dtype=q.dtype)
    lse = torch.empty(spec.lse_shape(), device="cuda", dtype=torch.float32)
    attn_glue.flash_attn_fwd(spec, q, k, v, out, lse, block_logit, None, None)
    torch.cuda.synchronize()
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
def test_fwd_strided_qkv_and_block_logit_bitwise(glue, causal):
    attn_glue, _ = glue
    b, s, h, d, bs = 2, 384, 4, 128, 64
    fused, q, k, v = _fused_qkv(b, s, h, d)
    fused_before = fused.clone()
    spec = _spec(b, s, s, h, h, d, causal=causal, block_size=bs)
    nb = spec.num_blocks
    wide = torch.full((b, h, s, nb + 3), SENTINEL, device="cuda")  # block_logit = wide[..., 1:nb+1]
    bl_view = wide[..., 1:nb + 1]
    out, lse = _fwd(attn_glue, spec, q, k, v, bl_view)
    bl_ref = torch.full((b, h, s, nb), SENTINEL, device="cuda")
    out_ref, lse_ref = _fwd(attn_glue, spec, q.clone(), k.clone(), v.clone(), bl_ref)
    assert torch.equal(out, out_ref) and torch.equal(lse, lse_ref)
    assert torch.equal(bl_view, bl_ref)  # copied back into the caller's strided view, bitwise
    assert bool((wide[..., 0] == SENTINEL).all()) and bool((wide[..., nb + 1:] == SENTINEL).all())
    assert torch.equal(fused, fused_before) and not q.is_contiguous()


def test_fwd_misaligned_contiguous_view_bitwise(glue):
    attn_glue, _ = glue
    b, s, h, d = 1, 256, 2, 64
    _, q, k, v = _fused_qkv(b, s, h, d, seed=1)
    flat = torch.empty(q.numel() + 1, device="cuda", dtype=q.dtype)
    q_off = flat[1:].view(q.shape)  # contiguous but 2 bytes past a 16-byte boundary
    q_off.copy_(q)
    assert q_off.is_contiguous() and q_off.data_ptr() % 16 != 0
    spec = _spec(b, s, s, h, h, d, causal=True)
    out, lse = _fwd(attn_glue, spec, q_off, k, v)
    out_ref, lse_ref = _fwd(attn_glue, spec, q.clone(), k.clone(), v.clone())
    assert torch.equal(out, out_ref) and torch.equal(lse, lse_ref)


@pytest.mark.parametrize("deterministic", [False, True])
def test_bwd_strided_inputs_and_out_params_bitwise(glue, deterministic):
    attn_glue, _ = glue
    b, s, h, d = 2, 256, 4, 128
    fused, q, k, v = _fused_qkv(b, s, h, d, seed=2)
    spec = _spec(b, s, s, h, h, d, causal=True)
    out, lse = _fwd(attn_glue, spec, q.clone(), k.clone(), v.clone())
    g = torch.Generator(device="cuda").manual_seed(3)
    dout = torch.randn(b, h, s, d, device="cuda", generator=g).to(torch.bfloat16).transpose(1, 2)  # strided
    inputs_before = [x.clone() for x in (fused, dout)]
    grads = torch.full((b, s, 3, h, d), 7.0, device="cuda", dtype=torch.bfloat16)
    dq, dk, dv = grads[:, :, 0], grads[:, :, 1], grads[:, :, 2]
    got = attn_glue.flash_attn_bwd(spec, dout, q, k, v, out, lse, None, dq, dk, dv, None, None,
                                   deterministic=deterministic)
    want = attn_glue.flash_attn_bwd(spec, dout.contiguous(), q.clone(), k.clone(), v.clone(), out, lse, None,
                                    None, None, None, None, None, deterministic=deterministic)
    torch.cuda.synchronize()
    assert got[0] is dq and got[1] is dk and got[2] is dv
    if deterministic:  # non-deterministic dq may differ run to run in its last bits (atomics)
        assert torch.equal(dq, want[0])
    assert torch.equal(dk, want[1]) and torch.equal(dv, want[2])
    assert torch.equal(fused, inputs_before[0]) and torch.equal(dout, inputs_before[1])
    assert not dout.is_contiguous()


def test_select_topk_blocks_strided_bitwise(glue):
    _, sel_glue = glue
    g = torch.Generator(device="cuda").manual_seed(4)
    b, hq, sq, nb = 2, 8, 300, 40
    wide = torch.randn(b, hq, sq, nb + 5, device="cuda", generator=g)
    bl = wide[..., 2:nb + 2]
    lse = (torch.rand(b, sq, hq, device="cuda", generator=g) + 3.0).transpose(1, 2)  # [B, Hq, Sq] strided
    before = (wide.clone(), lse.clone())
    out = torch.empty(b, 2, sq, 8, device="cuda", dtype=torch.int32)
    sel_glue.select_topk_blocks(bl, lse, out, 8, 2, 1, 2)
    ref = torch.empty_like(out)
    sel_glue.select_topk_blocks(bl.contiguous(), lse.contiguous(), ref, 8, 2, 1, 2)
    torch.cuda.synchronize()
    assert torch.equal(out, ref)
    assert torch.equal(wide, before[0]) and torch.equal(lse, before[1]) and not lse.is_contiguous()


def test_blocks_to_indices_strided_bitwise(glue):
    _, sel_glue = glue
    g = torch.Generator(device="cuda").manual_seed(5)
    wide = torch.randint(-1, 20, (1, 2, 128, 32), device="cuda", dtype=torch.int32, generator=g)
    blk = wide[..., ::2]  # [1, 2, 128, 16] strided
    out = torch.empty(1, 2, 128, 16 * 64, device="cuda", dtype=torch.int32)
    sel_glue.blocks_to_indices(blk, out, 64, 1200, True)
    ref = torch.empty_like(out)
    sel_glue.blocks_to_indices(blk.contiguous(), ref, 64, 1200, True)
    torch.cuda.synchronize()
    assert torch.equal(out, ref)
