"""Run the SM100 forward with Paddle or torch tensors, and a vectorised float64 numpy reference.

``run(...)`` takes numpy inputs (float32 values already representable in the input dtype), runs
the kernel, and returns numpy ``(out, lse, block_logit)``. The reference ``reference(...)`` is an
independent float64 computation (einsum, explicit bottom-right masks, per-block max by reshape);
it agrees with ``tests/oracles/attention.py`` (checked on small shapes by
``test_reference_matches_oracle``) and is fast enough for the multi-tile shapes.
"""

from __future__ import annotations

import math

import numpy as np

SENTINEL = 987654.0
#: FlashMask layout of a mask with (causal, columns): the launcher's config name for it
LAYOUT = {(True, 1): "lts", (True, 2): "lts_lte", (False, 2): "lts_ute", (False, 4): "lts_lte_uts_ute"}
DTYPES = {"bfloat16": None, "float16": np.float16}


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 array rounded (to nearest even) to the values of ``dtype``, kept as float32."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def make_qkv(b, sq, sk, hq, hkv, d, dtype="bfloat16", seed=0, varlen=False, q_scale=1.0):
    rng = np.random.default_rng(seed)
    shape_q = (sq, hq, d) if varlen else (b, sq, hq, d)
    shape_k = (sk, hkv, d) if varlen else (b, sk, hkv, d)
    q = round_to(rng.standard_normal(shape_q) * q_scale, dtype)
    k = round_to(rng.standard_normal(shape_k), dtype)
    v = round_to(rng.standard_normal(shape_k), dtype)
    return q, k, v


def visible(sq: int, sk: int, causal: bool, window) -> np.ndarray:
    left, right = window
    i = np.arange(sq)[:, None]
    t = np.arange(sk)[None, :]
    diag = i + sk - sq
    ok = t < sk
    if causal:
        ok = ok & (t <= diag)
    if left is not None and left >= 0:
        ok = ok & (t >= diag - left)
    if right is not None and right >= 0:
        ok = ok & (t <= diag + right)
    return ok


def _masked_softmax_pv(s, vv, spec: str, eager_dtype):
    """(out, lse) of the masked scores ``s`` (-inf where not visible; keys on the last axis) and values ``vv``
    (``spec`` the P @ V einsum): fp64, a row with no visible key gets out 0 and lse -inf; ``eager_dtype``
    rounds P and out like an eager framework would."""
    m = s.max(-1, keepdims=True) if s.shape[-1] else np.full(s.shape[:-1] + (1,), -np.inf)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m_safe)
    den = p.sum(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.where(den[..., 0] > 0, np.log(den[..., 0]) + m_safe[..., 0], -np.inf)
        pn = p / np.where(den > 0, den, 1.0)
        if eager_dtype is not None:
            pn = round_to(pn, eager_dtype).astype(np.float64)
        out = np.where(den > 0, np.einsum(spec, pn, vv), 0.0)
        if eager_dtype is not None:
            out = round_to(out, eager_dtype).astype(np.float64)
    return out, lse


def _reference_one(q, k, v, scale, causal, window, softcap, block_size, nb, eager_dtype=None):
    """q [Sq, Hq, D], k/v [Sk, Hkv, D] -> out [Sq, Hq, D], lse [Hq, Sq], bl [Hq, Sq, nb] (float64).

    ``eager_dtype``: round the probabilities and the output to that 16-bit dtype (the "eager
    same-precision" result whose error sets the output tolerance, as in FA4's tests).
    """
    sq, hq, _ = q.shape
    sk, hkv, _ = k.shape
    rep = hq // hkv
    kk = np.repeat(k.astype(np.float64), rep, axis=1)
    vv = np.repeat(v.astype(np.float64), rep, axis=1)
    s = np.einsum("qhd,khd->hqk", q.astype(np.float64), kk) * scale
    if softcap > 0:
        s = softcap * np.tanh(s / softcap)
    vis = visible(sq, sk, causal, window)
    s = np.where(vis[None], s, -np.inf)
    out, lse = _masked_softmax_pv(s, vv, "hqk,khd->hqd", eager_dtype)
    bl = None
    if block_size:
        pad = nb * block_size - sk
        sp = np.concatenate([s, np.full((hq, sq, pad), -np.inf)], axis=-1) if pad > 0 else s[..., :nb * block_size]
        bl = sp.reshape(hq, sq, nb, block_size).max(-1)
    return out.transpose(1, 0, 2), lse, bl


def reference(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, scale=None, block_size=0,
              cu_q=None, cu_k=None, max_sk=None, eager_dtype=None):
    """float64 out/lse/block_logit in the kernel's layouts (padded or varlen)."""
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    extra = (eager_dtype,)
    if cu_q is None:
        b, sq, hq, _ = q.shape
        sk = k.shape[1]
        nb = -(-sk // block_size) if block_size else 0
        parts = [_reference_one(q[i], k[i], v[i], scale, causal, window, softcap, block_size, nb, *extra)
                 for i in range(b)]
        out = np.stack([p[0] for p in parts])
        lse = np.stack([p[1] for p in parts])
        bl = np.stack([p[2] for p in parts]) if block_size else None
        return out, lse, bl
    total_q, hq, _ = q.shape
    nb = -(-max_sk // block_size) if block_size else 0
    out = np.zeros((total_q, hq, v.shape[-1]))
    lse = np.full((hq, total_q), -np.inf)
    bl = np.full((hq, total_q, nb), -np.inf) if block_size else None
    for i in range(len(cu_q) - 1):
        a, e, ka, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        o, l, b_ = _reference_one(q[a:e], k[ka:ke], v[ka:ke], scale, causal, window, softcap, block_size, nb,
                                  *extra)
        out[a:e], lse[:, a:e] = o, l
        if block_size:
            bl[:, a:e] = b_
    return out, lse, bl


class Runner:
    """The SM100 forward on one framework's tensors; inputs and outputs are numpy arrays.

    ``framework``: "paddle" (paddle_fa4.flash_attn_fwd, backend "cute"), "torch" (run_fwd), or
    "reference" (Paddle CPU tensors through paddle_fa4's reference backend: a dry run of this
    suite's own logic on a machine without a GPU, never a check of the kernel).
    """

    def __init__(self, framework: str):
        self.framework = framework

    # -- tensors
    def _to_device(self, x: np.ndarray, dtype: str):
        if self.framework == "torch":
            import torch

            tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                   "int32": torch.int32}[dtype]
            return torch.from_numpy(np.ascontiguousarray(x)).to("cuda").to(tdt)
        import paddle

        place = paddle.CPUPlace() if self.framework == "reference" else paddle.CUDAPlace(0)
        return paddle.to_tensor(np.ascontiguousarray(x), place=place).astype(dtype)

    def _to_numpy(self, t) -> np.ndarray:
        if t is None:
            return None
        if self.framework == "torch":
            return t.detach().float().cpu().numpy()
        return t.astype("float32").numpy()

    def synchronize(self) -> None:
        if self.framework == "torch":
            import torch

            torch.cuda.synchronize()
        elif self.framework == "paddle":
            import paddle

            paddle.device.cuda.synchronize()

    # -- the call
    def run(self, q, k, v, *, dtype="bfloat16", causal=False, window=(-1, -1), softcap=0.0, scale=None,
            block_size=0, fill=SENTINEL, cu_q=None, cu_k=None, max_sq=None, max_sk=None, pack_gqa=None,
            startend=None, block_bos=None):
        """``startend``: a FlashMask mask int32 ``[B, Hm, Sk, n]`` (dense only); ``block_bos``: int32
        ``[B, Sq]`` document-relative block origins (dense, with ``block_size``)."""
        varlen = cu_q is not None
        d = q.shape[-1]
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        hq, hkv = q.shape[-2], k.shape[-2]
        if varlen:
            total_q = q.shape[0]
            lse_shape, bl_rows = (hq, total_q), (hq, total_q)
            nb_keys = max_sk
        else:
            b, sq = q.shape[:2]
            max_sq = sq
            lse_shape, bl_rows = (b, hq, sq), (b, hq, sq)
            nb_keys = k.shape[1]
        tq, tk, tv = (self._to_device(x, dtype) for x in (q, k, v))
        bl = None
        if block_size:
            nb = -(-nb_keys // block_size)
            bl = self._to_device(np.full((*bl_rows, nb), fill, dtype=np.float32), "float32")
        cq = self._to_device(np.asarray(cu_q, dtype=np.int32), "int32") if varlen else None
        ck = self._to_device(np.asarray(cu_k, dtype=np.int32), "int32") if varlen else None
        if self.framework in ("paddle", "reference"):
            import paddle_fa4

            wl = None if window[0] < 0 else window[0]
            wr = None if window[1] < 0 else window[1]
            kwargs = dict(softmax_scale=scale, causal=causal, window_size=(wl, wr), softcap=softcap,
                          block_logit=bl, block_size=block_size or 64, pack_gqa=pack_gqa,
                          backend="cute" if self.framework == "paddle" else "reference")
            if varlen:
                kwargs.update(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=max_sq, max_seqlen_k=max_sk)
            if startend is not None:
                kwargs["startend_row_indices"] = self._to_device(np.asarray(startend, np.int32), "int32")
            if block_bos is not None:
                kwargs["block_bos"] = self._to_device(np.asarray(block_bos, np.int32), "int32")
            res = paddle_fa4.flash_attn_fwd(tq, tk, tv, **kwargs)
            out, lse = res[0], res[1]
        else:
            import torch

            from cute_kernels.attention.launch import fwd_config, run_fwd

            from tests.conftest import torch_cuda_arch

            layout = "" if startend is None else LAYOUT[(causal, np.shape(startend)[-1])]
            cfg = fwd_config(torch_cuda_arch(), dtype, d, v.shape[-1], hq // hkv, causal, tuple(window) != (-1, -1),
                             softcap > 0, block_size, varlen, startend=layout, block_bos=block_bos is not None)
            out = torch.empty(*tq.shape[:-1], tv.shape[-1], device="cuda", dtype=tq.dtype)
            lse = torch.empty(*lse_shape, device="cuda", dtype=torch.float32)
            mask_kw = {}
            if startend is not None:  # the FlashMask bounds and the launch's metadata workspace
                from cute_kernels.attention import fm_meta
                from cute_kernels.attention.launch import fm_meta_config

                se = self._to_device(np.asarray(startend, np.int32), "int32")
                shapes = fm_meta.workspace_shapes(fm_meta_config(cfg), q.shape[0], se.shape[1], q.shape[1],
                                                  k.shape[1])
                mask_kw = {name: torch.full(shape, -7, device="cuda", dtype=torch.int32)
                           for name, (shape, _) in shapes.items()}
                mask_kw["startend"] = se
            if block_bos is not None:
                mask_kw["block_bos"] = self._to_device(np.asarray(block_bos, np.int32), "int32")
            run_fwd(cfg, tq, tk, tv, out, lse, bl, cq, ck, softmax_scale=scale, softcap=softcap,
                    window_left=window[0], window_right=window[1], max_seqlen_q=max_sq, **mask_kw)
        self.synchronize()
        return self._to_numpy(out), self._to_numpy(lse), self._to_numpy(bl)


def reference_masked(q, k, v, vis, *, softcap=0.0, scale=None, block_size=0, block_bos=None, eager_dtype=None):
    """float64 out/lse/block_logit of dense q/k/v ``[B, S, H, D]`` under any visibility ``vis [B, Hq, Sq, Sk]``
    (FlashMask masks expanded by tests/oracles/flashmask.expand); with ``block_bos [B, Sq]`` block j of row i
    is the max over keys [bos_i + j bs, bos_i + (j + 1) bs) (keys before bos_i in no block)."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    rep = hq // hkv
    kk = np.repeat(k.astype(np.float64), rep, axis=2)
    vv = np.repeat(v.astype(np.float64), rep, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), kk) * scale
    if softcap > 0:
        s = softcap * np.tanh(s / softcap)
    s = np.where(vis, s, -np.inf)
    out, lse = _masked_softmax_pv(s, vv, "bhqk,bkhd->bhqd", eager_dtype)
    bl = None
    if block_size:
        nb = -(-sk // block_size)
        origin = np.zeros((b, sq), np.int64) if block_bos is None else np.asarray(block_bos, np.int64)
        keys = origin[:, :, None] + np.arange(nb * block_size)[None, None, :]  # [B, Sq, nb * bs]
        inside = keys < sk
        idx = np.broadcast_to(np.where(inside, keys, 0)[:, None], (b, hq, sq, nb * block_size))
        g = np.where(inside[:, None], np.take_along_axis(s, idx, axis=3), -np.inf)
        bl = g.reshape(b, hq, sq, nb, block_size).max(-1)
    return out.transpose(0, 2, 1, 3), lse, bl


def check_block_logit(bl: np.ndarray, bl_ref: np.ndarray) -> None:
    """Every entry written; exact -inf pattern; |err| <= 2e-3 + 1e-3 |ref| on finite entries."""
    assert bl.shape == bl_ref.shape, (bl.shape, bl_ref.shape)
    assert not np.isnan(bl).any(), "NaN in block_logit"
    assert not (bl == SENTINEL).any(), f"{int((bl == SENTINEL).sum())} block_logit entries left unwritten"
    inf_a, inf_r = np.isneginf(bl), np.isneginf(bl_ref)
    if not np.array_equal(inf_a, inf_r):
        idx = tuple(int(i) for i in np.argwhere(inf_a != inf_r)[0])
        raise AssertionError(f"-inf pattern differs at {int((inf_a != inf_r).sum())} entries, first {idx}: "
                             f"{bl[idx]!r} vs {bl_ref[idx]!r}")
    fin = ~inf_r
    err = np.abs(bl[fin] - bl_ref[fin])
    tol = 2e-3 + 1e-3 * np.abs(bl_ref[fin])
    assert (err <= tol).all(), f"block_logit max err {float(err.max()):.3e}"


def check_out_lse(out, lse, out_ref, lse_ref, out_eager) -> None:
    """lse within 1e-3 + 1e-3 |ref| with the exact -inf pattern; out within 2x the error of the
    same-precision eager result + 2e-3 (FA4's rule); rows with no visible key give out == 0."""
    inf_a, inf_r = np.isneginf(lse), np.isneginf(lse_ref)
    assert np.array_equal(inf_a, inf_r), f"lse -inf pattern differs at {int((inf_a != inf_r).sum())} rows"
    fin = ~inf_r
    lerr = np.abs(lse[fin] - lse_ref[fin])
    assert (lerr <= 1e-3 + 1e-3 * np.abs(lse_ref[fin])).all(), f"lse max err {float(lerr.max()):.3e}"
    assert not np.isnan(out).any(), "NaN in out"
    err = float(np.abs(out - out_ref).max(initial=0.0))
    err_eager = float(np.abs(out_eager - out_ref).max(initial=0.0))
    assert err <= 2 * err_eager + 2e-3, f"out max err {err:.3e} vs eager {err_eager:.3e}"
