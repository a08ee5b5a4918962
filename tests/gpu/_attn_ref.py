"""fp32 torch reference of the attention forward (out, lse, block_logit) for the H200 tests.

Independent of the kernels: plain einsum/softmax in fp32 on upcast inputs (TF32 off), explicit
bottom-right masks. Row i of a sequence (Sq, Sk) sees key t iff
    t < Sk, i + Sk - Sq - wl <= t (wl >= 0), t <= i + Sk - Sq + wr (wr >= 0; causal: wr = 0).
"""

from __future__ import annotations

import math

import torch


def visible_mask(sq: int, sk: int, causal: bool, window=(-1, -1), device="cuda") -> torch.Tensor:
    i = torch.arange(sq, device=device)[:, None]
    t = torch.arange(sk, device=device)[None, :]
    shift = sk - sq
    vis = torch.ones(sq, sk, dtype=torch.bool, device=device)
    wl, wr = window
    if causal:
        wr = 0 if wr < 0 else min(wr, 0)
    if wr >= 0:
        vis &= t <= i + shift + wr
    if wl >= 0:
        vis &= t >= i + shift - wl
    return vis


def attention_ref(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, scale=None, block_size=0,
                  nb=None, low_precision=False):
    """q (B, Sq, Hq, D), k/v (B, Sk, Hkv, D) -> out (B, Sq, Hq, Dv) fp32, lse (B, Hq, Sq), bl (B, Hq, Sq, nb).

    ``low_precision``: S and P V with 16-bit operands (P rounded to the input dtype), the
    "eager same-precision" comparison point for the output tolerance.
    """
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    rep = hq // hkv
    kf = k.repeat_interleave(rep, dim=2)
    vf = v.repeat_interleave(rep, dim=2)
    qf = q.float()
    kf = kf.float()
    vf = vf.float()
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    vis = visible_mask(sq, sk, causal, window, q.device)
    s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    p = torch.nan_to_num(p, nan=0.0)
    if low_precision:
        p = p.to(q.dtype).float()
    out = torch.einsum("bhqk,bkhd->bqhd", p, vf)
    if low_precision:
        out = out.to(q.dtype).float()
    bl = None
    if block_size:
        nb = nb if nb is not None else -(-sk // block_size)
        pad = nb * block_size - sk
        sp = torch.nn.functional.pad(s, (0, pad), value=float("-inf"))
        bl = sp.view(b, hq, sq, nb, block_size).amax(dim=-1)
    return out, lse, bl
