"""Gradient error of attention's backward on peaked rows by how D = rowsum(P dP) is obtained (numpy, CPU).

    python bench/delta_numerics.py

A model of the kernels' arithmetic (bf16 q, k, v, dout; float32 S, P, lse; bf16 P into the forward's PV
GEMM; out rounded to bf16; bf16 P and dS into the backward GEMMs, float32 accumulation) on one causal
head, S 1024, d 128, with key 0 made a sink whose logit is ``gap`` above the rest on a fraction of the
rows. For three ways to get D it prints the relative L2 error of dq, dk, dv (and of dk's sink row)
against the float64 gradients of the exact attention:

    D from bf16 out            rowsum(dO * out): what FA4 and the CuTe kernels compute
    D with residual (fp32 O)   rowsum(dO * O) with the forward's float32 O (out plus its rounding residual)
    D = sum P dP (fp32)        from the backward's own float32 P and dP (what the reference backends do)

Not a benchmark: a numerics study (docs/api.md, "Gradients of peaked rows").
"""

from __future__ import annotations

import numpy as np


def bf16(x):
    """Round float32 to the nearest bf16 (ties to even), returned as float32."""
    x = np.asarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def run(S=1024, D=128, gap=0.0, frac=1.0, causal=True, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v, do = (bf16(rng.standard_normal((S, D))) for _ in range(4))
    scale = D ** -0.5
    if gap:
        # key 0 a sink: logit(q_i, k_0) ~ gap above the rest for a fraction of rows
        u = rng.standard_normal(D)
        u /= np.linalg.norm(u)
        rows = rng.random(S) < frac
        q, k = q.astype(np.float64), k.astype(np.float64)
        k[0] = u * (gap / scale)  # logit of key 0 = gap on rows with q . u = 1
        q[rows] = q[rows] - np.outer(q[rows] @ u, u) + u
        q, k = bf16(q), bf16(k)
    q64, k64, v64, do64 = (a.astype(np.float64) for a in (q, k, v, do))
    s = q64 @ k64.T * scale
    if causal:
        s = np.where(np.tril(np.ones((S, S), bool)), s, -np.inf)
    p = np.exp(s - s.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    o = p @ v64
    dp = do64 @ v64.T
    dl = (do64 * o).sum(1, keepdims=True)
    ds = p * (dp - dl)
    ref = (ds @ k64 * scale, ds.T @ q64 * scale, p.T @ do64)
    # kernel model: fp32 S/P, bf16 P into PV (forward), out = bf16(O); backward P fp32, dS fp32, bf16 operands
    s32 = (q.astype(np.float32) @ k.T.astype(np.float32)) * np.float32(scale)
    if causal:
        s32 = np.where(np.tril(np.ones((S, S), bool)), s32, -np.inf).astype(np.float32)
    lse = (np.log(np.exp(s32 - s32.max(1, keepdims=True)).sum(1, keepdims=True)) + s32.max(1, keepdims=True)).astype(np.float32)
    p32 = np.exp(s32 - lse).astype(np.float32)
    o32 = (bf16(p32) @ v).astype(np.float32)
    out = bf16(o32)
    dp32 = (do @ v.T).astype(np.float32)
    res = {}
    for name, o_for_d in (("D from bf16 out", out), ("D with residual (fp32 O)", o32), ("D = sum P dP (fp32)", None)):
        if o_for_d is None:
            d32 = (p32 * dp32).sum(1, keepdims=True).astype(np.float32)
        else:
            d32 = (do * o_for_d).sum(1, keepdims=True).astype(np.float32)
        ds32 = (p32 * (dp32 - d32)).astype(np.float32)
        g = ((bf16(ds32) @ k) * np.float32(scale), (bf16(ds32).T @ q) * np.float32(scale), bf16(p32).T @ do)
        rel = [float(np.linalg.norm(a - b) / np.linalg.norm(b)) for a, b in zip(g, ref)]
        rel_k0 = float(np.linalg.norm(g[1][0] - ref[1][0]) / np.linalg.norm(ref[1][0]))
        res[name] = rel + [rel_k0]
    p0 = float(p[:, 0][1:].mean())
    return p0, res

def main():
    for gap, frac in ((0, 1), (8, 1.0), (12, 1.0), (16, 1.0), (12, 0.5), (20, 1.0)):
        p0, res = run(gap=gap, frac=frac)
        print(f"gap {gap:>2} frac {frac}: mean P(sink) {p0:.5f}")
        for n, r in res.items():
            print(f"   {n:28s} dq {r[0]:.2e} dk {r[1]:.2e} dv {r[2]:.2e} dk[sink] {r[3]:.2e}")


if __name__ == "__main__":
    main()
