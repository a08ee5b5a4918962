"""Shared by the SM90 forward GPU tests: inputs and one launch through ``run_fwd`` (torch tensors)."""

from __future__ import annotations

import math

import torch

#: Pre-fill of block_logit buffers: any entry still equal to it was never written.
SENTINEL = 987654.0


def make_qkv(b, sq, sk, hq, hkv, d, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.float32, generator=g).to(dtype)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.float32, generator=g).to(dtype)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.float32, generator=g).to(dtype)
    return q, k, v


def run_ours(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, block_size=0, fill=None, scale=None,
             cu_q=None, cu_k=None, max_sq=None, max_sk=None, bl_offset=0, out_tail=0, arch=90):
    """One forward through ``run_fwd``; block_logit (block_size > 0) starts filled with ``fill``
    (default SENTINEL) so unwritten entries show. ``bl_offset`` > 0: block_logit is a contiguous view
    starting that many fp32 into a larger SENTINEL-filled storage (an under-aligned buffer; the skipped head must stay untouched).
    ``out_tail`` > 0 (batch 1, not varlen): out is the contiguous head of a SENTINEL-filled storage with that
    many more elements behind it (the caller checks they stay untouched).
    ``arch``: the kernel's compute capability (90; tests/sm100 pass their GPU's).
    Returns (out, lse, block_logit or None)."""
    from cute_kernels.attention.launch import fwd_config, run_fwd

    varlen = cu_q is not None
    d, dv = q.shape[-1], v.shape[-1]
    hq, hkv = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    has_window = tuple(window) != (-1, -1)
    cfg = fwd_config(arch, q.dtype, d, dv, hq // hkv, causal, has_window, softcap > 0, block_size, varlen)
    out_shape = (*q.shape[:-1], dv)
    if out_tail:
        assert cu_q is None and q.shape[0] == 1, "out_tail: batch 1, not varlen (out must stay contiguous)"
        out = torch.full((math.prod(out_shape) + out_tail,), SENTINEL, device=q.device, dtype=q.dtype)
        out = out[:math.prod(out_shape)].view(out_shape)
    else:
        out = torch.empty(out_shape, device=q.device, dtype=q.dtype)
    if varlen:
        total_q = q.shape[0]
        lse = torch.empty(hq, total_q, device=q.device, dtype=torch.float32)
        sk_for_nb = max_sk
        bl_shape = (hq, total_q)
    else:
        b, sq = q.shape[0], q.shape[1]
        max_sq = sq
        lse = torch.empty(b, hq, sq, device=q.device, dtype=torch.float32)
        sk_for_nb = k.shape[1]
        bl_shape = (b, hq, sq)
    bl = None
    if block_size:
        nb = -(-sk_for_nb // block_size)
        numel = math.prod(bl_shape) * nb
        storage = torch.full((bl_offset + numel,), SENTINEL, device=q.device, dtype=torch.float32)
        bl = storage[bl_offset:].view(*bl_shape, nb)
        if fill is not None:
            bl.fill_(fill)
    run_fwd(cfg, q, k, v, out, lse, bl, cu_q, cu_k, softmax_scale=scale, softcap=softcap,
            window_left=window[0], window_right=window[1], max_seqlen_q=max_sq)
    return out, lse, bl
