"""float64 numpy oracle of ``flash_attn_bwd``: the exact gradients of ``<dout, out> + <dlse, lse>``.

Written from the forward's semantics (``tests/oracles/attention.py``) and the softmax Jacobian, one
(head, query row) at a time, independently of the implementation's closed form: the gradient of
the softmax input is ``p_t (dout . v_t - sum_u p_u dout . v_u) + dlse p_t`` (the implementation
forms ``rowsum(dout * out) - dlse`` instead), chained through softcap and the scale by hand.
:func:`finite_difference` checks this oracle itself against the forward oracle.
"""

from __future__ import annotations

import numpy as np

from .attention import attention, visible


def _one_sequence(q, k, v, dout, dlse, scale, causal, window, softcap):
    """``q [Sq, Hq, D]``, ``k [Sk, Hkv, D]``, ``v/dout`` like k / out, ``dlse [Hq, Sq]`` (float64)."""
    sq, hq, _ = q.shape
    sk, hkv, _ = k.shape
    group = hq // hkv
    mask = visible(sq, sk, causal, window)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for h in range(hq):
        g = h // group
        for i in range(sq):
            keys = np.nonzero(mask[i])[0]
            if keys.size == 0:
                continue
            raw = scale * (k[keys, g, :] @ q[i, h, :])  # [n]
            if softcap > 0:
                logits = softcap * np.tanh(raw / softcap)
                dlogit_draw = 1.0 - np.tanh(raw / softcap) ** 2
            else:
                logits, dlogit_draw = raw, np.ones_like(raw)
            w = np.exp(logits - logits.max())
            p = w / w.sum()
            dp = v[keys, g, :] @ dout[i, h, :]  # d<dout, out> / dp_t
            dlogit = p * (dp - p @ dp) + dlse[h, i] * p  # softmax and log-sum-exp Jacobians
            draw = dlogit * dlogit_draw
            dq[i, h] += scale * (draw @ k[keys, g, :])
            dk[keys, g, :] += scale * np.outer(draw, q[i, h, :])
            dv[keys, g, :] += np.outer(p, dout[i, h, :])
    return dq, dk, dv


def attention_bwd(q, k, v, dout, dlse=None, softmax_scale=None, causal=False, window=(None, None),
                  softcap=0.0, cu_seqlens_q=None, cu_seqlens_k=None):
    """``(dq, dk, dv)`` float64 in the layouts of q, k, v (padded or varlen, as the forward oracle).

    ``dlse`` has lse's layout (``[B, Hq, Sq]`` / ``[Hq, total_q]``) or is None (zero).
    """
    q, k, v, dout = (np.asarray(x, dtype=np.float64) for x in (q, k, v, dout))
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    args = (scale, causal, window, softcap)
    if cu_seqlens_q is None:
        b, sq, hq = q.shape[:3]
        dlse = np.zeros((b, hq, sq)) if dlse is None else np.asarray(dlse, dtype=np.float64)
        parts = [_one_sequence(q[i], k[i], v[i], dout[i], dlse[i], *args) for i in range(b)]
        return tuple(np.stack([p[j] for p in parts]) for j in range(3))
    total_q, hq = q.shape[:2]
    dlse = np.zeros((hq, total_q)) if dlse is None else np.asarray(dlse, dtype=np.float64)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    cu_q, cu_k = np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k)
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        g = _one_sequence(q[q0:q1], k[k0:k1], v[k0:k1], dout[q0:q1], dlse[:, q0:q1], *args)
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = g[0], dk[k0:k1] + g[1], dv[k0:k1] + g[2]
    return dq, dk, dv


def loss(q, k, v, dout, dlse=None, **kw):
    """``<dout, out> + <dlse, lse>`` of the forward oracle (rows with lse -inf add nothing)."""
    out, lse, _ = attention(q, k, v, **kw)
    total = float(np.sum(np.asarray(dout, dtype=np.float64) * out))
    if dlse is not None:
        finite = np.isfinite(lse)
        total += float(np.sum(np.asarray(dlse, dtype=np.float64)[finite] * lse[finite]))
    return total


def finite_difference(q, k, v, dout, dlse, which: str, index, eps: float = 1e-6, **kw) -> float:
    """Central difference of :func:`loss` w.r.t. entry ``index`` of input ``which`` ("q", "k", "v")."""
    arrays = {"q": np.array(q, dtype=np.float64), "k": np.array(k, dtype=np.float64),
              "v": np.array(v, dtype=np.float64)}
    base = arrays[which][index]
    values = []
    for delta in (eps, -eps):
        arrays[which][index] = base + delta
        values.append(loss(arrays["q"], arrays["k"], arrays["v"], dout, dlse, **kw))
    arrays[which][index] = base
    return (values[0] - values[1]) / (2 * eps)
