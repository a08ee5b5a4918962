"""First contact with a GPU: launch every kernel family once on tiny inputs and say what broke.

    python -m cute_kernels.selftest                 # on a B200 / B300 (or any GPU we build for)
    python -m cute_kernels.selftest --mode sm90     # the SM90 kernels, on an H200 (tests this tool)
    python -m cute_kernels.selftest --list          # the cases, without a GPU
    python -m cute_kernels.selftest --canary        # also two cases that must be reported as HUNG / MISMATCH

Each case runs in its own subprocess under a watchdog (``--timeout`` seconds, compile included):
a kernel that never finishes is killed and reported HUNG with the last phase it reached
(``compile``: still compiling; ``sync``: launched and never completed, i.e. a pipeline handshake
that never happened) and, for the SM100 kernels (run as their edge-trace builds, common/trace.py)
and the hang canary, which pipeline edge each role of each CTA was waiting on (e.g. ``mma: waiting
on s.empty in 148 CTAs (@3: 148)``); a wrong output MISMATCH with its worst element, a CUDA error or
exception ERROR, a dead process CRASH; the next case starts in a fresh process (a fresh CUDA
context). The report names the kernel, its compile config and the command that reproduces the case
alone (for compute-sanitizer / cuda-gdb).

References are float64 numpy on the host, from the same 16-bit inputs: attention forward (out, lse,
block_logit) and backward (dq, dk, dv from the reference out / lse), indexed attention (forward and
backward), block-sparse attention (forward and backward; its plan and reference are the repository's
``tests/oracles/block_sparse.py``, so run it from a checkout). Tensors come from Paddle or torch (``--framework``; auto = whichever has CUDA), the
kernels take either. Exit status: 0 all passed, 1 some case failed, 2 nothing could run (no GPU, a
part without a build, no framework with CUDA).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from cute_kernels import arch as _arch

DEFAULT_TIMEOUT_S = 300


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "helpers" | "fwd" | "bwd" | "indexed" | "block_sparse" | "decode" | "canary_hang" | "canary_mismatch"
    params: dict = field(default_factory=dict)
    canary: bool = False


_VARLEN = [(200, 250), (77, 77), (1, 129)]  # (seqlen_q, seqlen_k) per sequence
CASES = [
    Case("helpers", "helpers"),
    Case("fwd", "fwd", dict(b=2, sq=300, sk=300, hq=4, hkv=4, d=128)),
    Case("fwd_block_logit_causal", "fwd", dict(b=1, sq=384, sk=384, hq=4, hkv=2, d=128, causal=True, block_size=64)),
    Case("fwd_varlen_causal", "fwd", dict(seqs=_VARLEN, hq=2, hkv=2, d=128, causal=True, block_size=128)),
    Case("fwd_window_softcap_fp16", "fwd", dict(dtype="float16", b=1, sq=200, sk=333, hq=8, hkv=2, d=64,
                                                 window=(64, 32), softcap=30.0, block_size=32)),
    Case("fwd_d256", "fwd", dict(b=1, sq=257, sk=257, hq=2, hkv=2, d=256, causal=True, block_size=256)),
    Case("bwd_causal_gqa", "bwd", dict(b=1, sq=300, sk=300, hq=4, hkv=2, d=128, causal=True)),
    Case("bwd_causal_gqa_det", "bwd", dict(b=1, sq=300, sk=300, hq=8, hkv=2, d=128, causal=True, deterministic=True)),
    Case("bwd_varlen_window_det", "bwd", dict(seqs=_VARLEN, hq=2, hkv=2, d=64, window=(100, 30), deterministic=True)),
    Case("bwd_d256_causal_det", "bwd", dict(b=1, sq=200, sk=333, hq=4, hkv=2, d=256, causal=True, deterministic=True)),
    Case("bwd_d192_window", "bwd", dict(b=1, sq=300, sk=300, hq=2, hkv=2, d=192, window=(100, 30))),
    Case("indexed", "indexed", dict(b=1, lq=130, lkv=300, hq=8, hkv=2, d=128, width=40)),
    # block-sparse attention (HySparse): forward, dQ and dK/dV, G 8, d 128 (the SM90 or SM100 kernels), documents
    # at bos % 64 != 0, -1 padding and repeated ids, an odd last block; and the dQ kernel's exact_delta sweeps
    Case("block_sparse", "block_sparse", dict(b=1, s=300, hq=16, hkv=2, d=128, topk=3, cu=(0, 37, 300))),
    Case("block_sparse_exact_delta", "block_sparse",
         dict(b=1, s=300, hq=16, hkv=2, d=128, topk=3, cu=(0, 37, 300), exact_delta=True)),
    # paged split-KV decode (one warp-MMA kernel for SM90 and SM100): P 16, G 4, Sq 2 causal, ragged lengths
    # (0, 1, not a multiple of P), -1 / huge padding ids, NaN in page tails and unlisted pages, 3 splits + combine,
    # block_logit 64
    Case("decode_paged_split", "decode", dict(lens=(0, 1, 37, 300), hkv=2, g=4, sq=2, d=128, page=16, splits=3,
                                                block_size=64)),
    # the same with FA's dense [B] lengths / [B, n] table (one kernel variant reads them for every kv head), Hkv 4
    Case("decode_paged_dense", "decode", dict(lens=(0, 1, 37, 300), hkv=4, g=4, sq=2, d=128, page=16, splits=3,
                                                block_size=64, dense=True)),
    # one kv head (G 8) over 40 splits: the combine's warps per row (3 here) and its cp.async-staged partials
    Case("decode_many_splits", "decode", dict(lens=(0, 5, 3000, 9000), hkv=1, g=8, sq=1, d=128, page=16, splits=40,
                                                block_size=64, dense=True)),
    Case("canary_hang", "canary_hang", canary=True),
    Case("canary_mismatch", "canary_mismatch", dict(b=1, sq=130, sk=130, hq=2, hkv=2, d=64), canary=True),
]
BY_NAME = {c.name: c for c in CASES}


# ============================================================================ parent: watchdog + report
def run_child(cmd: list, timeout: float) -> dict:
    """Run one case's process; its stdout carries ``PHASE <name>`` lines and one ``RESULT <json>``.

    Returns the result dict, or a synthesised one: ``hung`` (killed after ``timeout``; ``phase`` = the
    last phase printed), ``crash`` (exited without a result). ``seconds`` is always set.
    """
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        hung = False
    except subprocess.TimeoutExpired:
        proc.kill()
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # stuck in the driver; the OS reaps it later
            out, err = "", ""
        hung = True
    seconds = round(time.monotonic() - start, 1)
    phases = [ln.split(None, 1)[1].strip() for ln in out.splitlines() if ln.startswith("PHASE ")]
    results = [ln[len("RESULT "):] for ln in out.splitlines() if ln.startswith("RESULT ")]
    if hung:
        res = dict(status="hung", phase=phases[-1] if phases else "start", seconds=seconds,
                   message=f"no result after {timeout:g} s")
        edges = edge_report(out)
        if edges:
            res["edges"] = edges
        return res
    if results:
        res = json.loads(results[-1])
        res["seconds"] = seconds
        return res
    tail = (err or out).strip().splitlines()[-6:]
    return dict(status="crash", phase=phases[-1] if phases else "start", seconds=seconds,
                message=f"exit status {proc.returncode}: " + " | ".join(tail))


def edge_report(out: str) -> list:
    """The last edge trace a child printed (``TRACE`` schema, last ``EDGES`` words), decoded: one line per
    role saying which pipeline edge its CTAs wait on (common/trace.summarize); [] without a trace."""
    from cute_kernels.common import trace

    schema = [ln[len("TRACE "):] for ln in out.splitlines() if ln.startswith("TRACE ")]
    words = [ln[len("EDGES "):] for ln in out.splitlines() if ln.startswith("EDGES ")]
    if not schema or not words:
        return []
    sch = json.loads(schema[-1])
    w = {int(k): v for k, v in json.loads(words[-1]).items()}
    return trace.summarize(w, sch["roles"], sch["edges"])


def _child_cmd(case: str, framework: str, mode: str) -> list:
    return [sys.executable, "-m", "cute_kernels.selftest", "--child", case, "--framework", framework,
            "--mode", mode]


def _hint(res: dict) -> str:
    if res["status"] != "hung":
        return res.get("message", "")
    phase = res.get("phase")
    if phase == "sync":
        why = "launched and never finished: a pipeline handshake that never completed (deadlock)"
        if res.get("edges"):
            why += "; where each role waits (edge trace): " + " | ".join(res["edges"])
    elif phase == "compile":
        why = "still compiling (raise --timeout if the host is slow)"
    else:
        why = f"stopped in phase '{phase}'"
    return f"{res.get('message', '')}; {why}"


def format_report(header: str, rows: list) -> str:
    """The table: one line per case, then the detail of each failure and how to reproduce it."""
    lines = [header, f"{'case':<26} {'result':<9} {'time':>7}  kernel / config"]
    for name, res, cmd in rows:
        status = {"ok": "ok", "mismatch": "MISMATCH", "hung": "HUNG", "error": "ERROR",
                  "crash": "CRASH"}.get(res["status"], res["status"].upper())
        kernel = f"{res.get('kernel', '?')} {res.get('config', '')}"
        lines.append(f"{name:<26} {status:<9} {res['seconds']:>6.1f}s  {kernel}")
        if res["status"] != "ok":
            for chk in res.get("checks", []):
                if not chk["ok"]:
                    lines.append(f"    {chk['name']}: {chk['detail']}")
            hint = _hint(res)
            if hint:
                lines.append(f"    {hint}")
            lines.append(f"    reproduce: {' '.join(cmd)}")
    passed = sum(r["status"] == "ok" for _, r, _ in rows)
    lines.append(f"{passed} of {len(rows)} cases passed")
    return "\n".join(lines)


def _frameworks(requested: str) -> list:
    return ["paddle", "torch"] if requested == "auto" else [requested]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cute_kernels.selftest", description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("auto", "sm100", "sm90"), default="auto",
                    help="which kernel family to run (auto: the device's)")
    ap.add_argument("--framework", choices=("auto", "paddle", "torch"), default="auto")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per case, compile included")
    ap.add_argument("--case", action="append", default=None, help="only this case (repeatable)")
    ap.add_argument("--canary", action="store_true", help="add cases that must come out HUNG and MISMATCH")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        return _child_main(args.child, args.framework, args.mode)
    if args.list:
        for c in CASES:
            print(f"{c.name:<26} {c.kind:<16} {'(canary) ' if c.canary else ''}{c.params or ''}")
        return 0
    cc = _arch.device_arch(0)
    if cc is None:
        print("cute_kernels.selftest: no CUDA GPU found (the CUDA driver reports no device); nothing to run",
              file=sys.stderr)
        return 2
    reason = _arch.arch_reason(cc)
    if reason is not None:
        print(f"cute_kernels.selftest: {reason}", file=sys.stderr)
        return 2
    mode = {90: "sm90", 100: "sm100"}[_arch.family(cc)] if args.mode == "auto" else args.mode
    if {"sm90": 90, "sm100": 100}[mode] != _arch.family(cc):
        print(f"cute_kernels.selftest: --mode {mode} needs a GPU of that family; this one is CC "
              f"{cc // 10}.{cc % 10} ({_arch.arch_name(cc)})", file=sys.stderr)
        return 2
    env = None
    for fw in _frameworks(args.framework):
        env = run_child(_child_cmd("env", fw, mode), args.timeout)
        if env["status"] == "ok":
            break
    if env is None or env["status"] != "ok":
        print(f"cute_kernels.selftest: no framework with CUDA to allocate tensors ({env and env.get('message')})",
              file=sys.stderr)
        return 2
    fw = env["framework"]
    header = (f"cute_kernels.selftest: {env['device']} (CC {cc // 10}.{cc % 10}, target {_arch.arch_name(cc)}, "
              f"{_arch.device_sm_count(0)} SMs), mode {mode}, {fw} {env['framework_version']}, "
              f"nvidia-cutlass-dsl {env['dsl_version']}, timeout {args.timeout:g} s per case")
    print(header, flush=True)
    names = args.case or [c.name for c in CASES if args.canary or not c.canary]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        print(f"cute_kernels.selftest: unknown case(s) {unknown}; --list shows them", file=sys.stderr)
        return 2
    rows = []
    for name in names:
        cmd = _child_cmd(name, fw, mode)
        res = run_child(cmd, args.timeout)
        rows.append((name, res, cmd))
        print(f"  {name}: {res['status']} ({res['seconds']} s)", flush=True)
    print(format_report(header, rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(header=header, results={n: r for n, r, _ in rows}), f, indent=1)
    expected = {"canary_hang": "hung", "canary_mismatch": "mismatch"}
    failed = [n for n, r, _ in rows if r["status"] != expected.get(n, "ok")]
    if args.canary:
        print("canaries " + ("reported as expected" if not set(expected) & set(failed) else "NOT reported as expected"))
    return 1 if failed else 0


# ============================================================================ child: one case
def _phase(name: str) -> None:
    print(f"PHASE {name}", flush=True)


class _Torch:
    def __init__(self):
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch has no CUDA device")
        self.t = torch
        self.name, self.version, self.device = "torch", torch.__version__, torch.cuda.get_device_name()
        self._dt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                    "int32": torch.int32}

    def put(self, a, dtype):
        return self.t.from_numpy(np.ascontiguousarray(a)).cuda().to(self._dt[dtype])

    def full(self, shape, value, dtype):
        return self.t.full(tuple(shape), value, dtype=self._dt[dtype], device="cuda")

    def get(self, x):
        return None if x is None else (x.float() if x.is_floating_point() else x).cpu().numpy()

    def sync(self):
        self.t.cuda.synchronize()

    def pinned_words(self, n: int):
        """(address the GPU can write, reader) of ``n`` zeroed int32 words of mapped pinned host memory;
        ``reader()`` returns their current values as a numpy array (the caller keeps the reader alive)."""
        buf = self.t.zeros(n, dtype=self.t.int32, pin_memory=True)
        view = buf.numpy()  # shares the pinned memory
        return buf.data_ptr(), lambda: view

    def poll_sync(self, on_wait, period_s: float = 0.25):
        """Wait for the queued work without blocking the thread: ``on_wait()`` every ``period_s``."""
        ev = self.t.cuda.Event()
        ev.record()
        while not ev.query():
            on_wait()
            time.sleep(period_s)
        on_wait()


class _Paddle:
    def __init__(self):
        import paddle

        if not paddle.is_compiled_with_cuda() or paddle.device.cuda.device_count() == 0:
            raise RuntimeError("Paddle has no CUDA device (CPU build?)")
        self.p = paddle
        paddle.set_device("gpu:0")
        self.name, self.version = "paddle", paddle.__version__
        self.device = paddle.device.cuda.get_device_name()

    def put(self, a, dtype):
        return self.p.to_tensor(np.ascontiguousarray(a), place=self.p.CUDAPlace(0)).astype(dtype)

    def full(self, shape, value, dtype):
        return self.p.full(list(shape), value, dtype=dtype)

    def get(self, x):
        if x is None:
            return None
        return (x.astype("float32") if x.dtype in (self.p.bfloat16, self.p.float16) else x).numpy()

    def sync(self):
        self.p.device.synchronize()

    def pinned_words(self, n: int):
        buf = self.p.zeros([n], dtype="int32").pin_memory()
        return buf.data_ptr(), buf.numpy  # a copy per read

    def poll_sync(self, on_wait, period_s: float = 0.25):
        ev = self.p.device.cuda.Event()
        ev.record()
        while not ev.query():
            on_wait()
            time.sleep(period_s)
        on_wait()


def _round(x: np.ndarray, dtype: str) -> np.ndarray:
    """float values of ``dtype`` nearest to ``x`` (round to nearest even), as float32."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    if dtype == "float32":
        return x
    bits = x.view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def _check(name: str, got, ref, atol: float, rtol: float) -> dict:
    """max |got - ref| <= atol + rtol * max |ref| over finite entries; unwritten (NaN) entries and a
    different -inf pattern fail outright."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if got.shape != ref.shape:
        return dict(name=name, ok=False, detail=f"shape {got.shape} != {ref.shape}")
    if np.isnan(got).any():
        idx = tuple(int(i) for i in np.argwhere(np.isnan(got))[0])
        return dict(name=name, ok=False, detail=f"{int(np.isnan(got).sum())} entries NaN / never written, first {idx}")
    inf_g, inf_r = np.isneginf(got), np.isneginf(ref)
    if not np.array_equal(inf_g, inf_r):
        idx = tuple(int(i) for i in np.argwhere(inf_g != inf_r)[0])
        return dict(name=name, ok=False, detail=f"-inf pattern differs at {int((inf_g != inf_r).sum())} entries, "
                                                f"first {idx}: {got[idx]!r} vs {ref[idx]!r}")
    fin = ~inf_r
    with np.errstate(invalid="ignore"):
        err = np.where(fin, np.abs(got - ref), 0.0)
    tol = atol + rtol * float(np.abs(ref[fin]).max(initial=0.0))
    worst = tuple(int(i) for i in np.unravel_index(int(np.argmax(err)), err.shape)) if err.size else ()
    e = float(err.max(initial=0.0))
    detail = f"max err {e:.3e} (tol {tol:.3e}) at {worst}"
    if worst:
        detail += f": {got[worst]:.6g} vs {ref[worst]:.6g}"
    return dict(name=name, ok=bool(e <= tol), detail=detail)


def _visible(sq: int, sk: int, causal: bool, window) -> np.ndarray:
    """Row i sees key t iff i + Sk - Sq - wl <= t (wl >= 0) and t <= i + Sk - Sq + wr (wr >= 0; causal: wr 0)."""
    wl, wr = window
    if causal:
        wr = 0 if wr < 0 else min(wr, 0)
    i, t = np.arange(sq)[:, None], np.arange(sk)[None, :]
    ok = np.ones((sq, sk), bool)
    if wr >= 0:
        ok &= t <= i + sk - sq + wr
    if wl >= 0:
        ok &= t >= i + sk - sq - wl
    return ok


def _softmax_rows(s: np.ndarray):
    """(P, lse) of masked logits ``s`` (-inf = masked); rows without a key: P = 0, lse = -inf."""
    m = s.max(-1, keepdims=True, initial=-np.inf)
    m0 = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m0)
    den = e.sum(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.where(den[..., 0] > 0, np.log(den[..., 0]) + m0[..., 0], -np.inf)
        p = np.where(den > 0, e / np.where(den > 0, den, 1.0), 0.0)
    return p, lse


def _attn_fwd_ref(q, k, v, scale, causal, window, softcap, block_size, nb, dtype):
    """One sequence: q [Sq, Hq, D], k / v [Sk, Hkv, D] (float64) -> out [Sq, Hq, D], the same with P and
    out rounded to ``dtype`` (the eager result), lse [Hq, Sq], block_logit [Hq, Sq, nb] or None."""
    sq, hq, _ = q.shape
    sk, hkv, _ = k.shape
    kk, vv = np.repeat(k, hq // hkv, 1), np.repeat(v, hq // hkv, 1)
    s = np.einsum("qhd,khd->hqk", q, kk) * scale
    if softcap > 0:
        s = softcap * np.tanh(s / softcap)
    s = np.where(_visible(sq, sk, causal, window)[None], s, -np.inf)
    p, lse = _softmax_rows(s)
    out = np.einsum("hqk,khd->qhd", p, vv)
    eager = _round(np.einsum("hqk,khd->qhd", _round(p, dtype).astype(np.float64), vv), dtype)
    bl = None
    if block_size:
        pad = nb * block_size - sk
        sp = np.concatenate([s, np.full((hq, sq, pad), -np.inf)], -1) if pad > 0 else s[..., :nb * block_size]
        bl = sp.reshape(hq, sq, nb, block_size).max(-1)
    return out, eager, lse, bl


def _attn_bwd_ref(q, k, v, out, do, lse, scale, causal, window, softcap):
    """One sequence's dq, dk, dv (float64) for the given (rounded) out [Sq, Hq, D] and lse [Hq, Sq]: the
    math of bwd_config's docstring."""
    sq, hq, _ = q.shape
    sk, hkv, _ = k.shape
    g = hq // hkv
    kk, vv = np.repeat(k, g, 1), np.repeat(v, g, 1)
    raw = np.einsum("qhd,khd->hqk", q, kk) * scale
    s = softcap * np.tanh(raw / softcap) if softcap > 0 else raw
    vis = _visible(sq, sk, causal, window)[None]
    lse_t = lse[:, :, None]  # [Hq, Sq, 1]
    with np.errstate(invalid="ignore"):
        p = np.where(vis & np.isfinite(lse_t), np.exp(s - np.where(np.isfinite(lse_t), lse_t, 0.0)), 0.0)
    dpsum = np.einsum("qhd,qhd->hq", do, out)[..., None]
    dp = np.einsum("qhd,khd->hqk", do, vv)
    ds = p * (dp - dpsum)
    if softcap > 0:
        ds = ds * (1.0 - np.tanh(raw / softcap) ** 2)
    dq = np.einsum("hqk,khd->qhd", ds, kk) * scale
    dk = np.einsum("hqk,qhd->khd", ds, q).reshape(sk, hkv, g, -1).sum(2) * scale
    dv = np.einsum("hqk,qhd->khd", p, do).reshape(sk, hkv, g, -1).sum(2)
    return dq, dk, dv


def _sequences(p: dict):
    """Varlen: ([(q0, q1, k0, k1)] packed row ranges per sequence, cu_seqlens_q, cu_seqlens_k); else Nones."""
    if "seqs" in p:
        cq = np.cumsum([0] + [s for s, _ in p["seqs"]])
        ck = np.cumsum([0] + [s for _, s in p["seqs"]])
        return [(cq[i], cq[i + 1], ck[i], ck[i + 1]) for i in range(len(p["seqs"]))], cq, ck
    return None, None, None


def _make_qkv(rng, p: dict, dtype: str):
    d, hq, hkv = p["d"], p["hq"], p["hkv"]
    if "seqs" in p:
        tq, tk = sum(s for s, _ in p["seqs"]), sum(s for _, s in p["seqs"])
        shapes = ((tq, hq, d), (tk, hkv, d), (tk, hkv, d))
    else:
        shapes = ((p["b"], p["sq"], hq, d), (p["b"], p["sk"], hkv, d), (p["b"], p["sk"], hkv, d))
    return [_round(rng.standard_normal(s), dtype) for s in shapes]


def _per_sequence(p: dict, fn, *arrays):
    """``[fn(*slices) for each sequence]``; ``arrays`` are ("q" | "k", array) pairs, sliced by the
    sequence's query or key rows (varlen: packed rows; else the batch index)."""
    seqs, _, _ = _sequences(p)
    out = []
    if seqs is None:
        for b in range(arrays[0][1].shape[0]):
            out.append(fn(*[a[b] for _, a in arrays]))
    else:
        for q0, q1, k0, k1 in seqs:
            out.append(fn(*[a[q0:q1] if side == "q" else a[k0:k1] for side, a in arrays]))
    return out


class _EdgeWatch:
    """The edge trace of one traced launch (common/trace.py): the array's address for the kernel, and
    ``print()``, which writes an ``EDGES <json>`` line (the nonzero words) whenever they changed -- the
    parent keeps the last one a hung case printed and decodes it with the kernel's roles / edges."""

    def __init__(self, fw, roles, edges):
        from cute_kernels.common import trace

        self.fw, self.roles, self.edges = fw, list(roles), list(edges)
        self.addr, self.words = fw.pinned_words(trace.WORDS)
        self.last = None
        print("TRACE " + json.dumps(dict(roles=self.roles, edges=self.edges)), flush=True)

    def print(self):
        w = self.words()
        nz = {int(i): int(w[i]) & 0xFFFFFFFF for i in np.flatnonzero(w)}
        if nz != self.last:
            self.last = nz
            print("EDGES " + json.dumps(nz), flush=True)

    def sync(self):
        self.fw.poll_sync(self.print)


def _edge_watch(fw, cc: int, module: str):
    """An ``_EdgeWatch`` for the SM100 kernels (their traced builds), else None (SM90 builds have no trace)."""
    if _arch.family(cc) != 100:
        return None
    import importlib

    mod = importlib.import_module(f"cute_kernels.attention.{module}")
    return _EdgeWatch(fw, mod.TRACE_ROLES, mod.TRACE_EDGES)


def _case_fwd(fw, cc: int, p: dict, perturb: float = 1.0):
    from cute_kernels.attention import launch

    dtype = p.get("dtype", "bfloat16")
    causal, window, softcap = p.get("causal", False), p.get("window", (-1, -1)), p.get("softcap", 0.0)
    bs = p.get("block_size", 0)
    varlen = "seqs" in p
    rng = np.random.default_rng(0)
    q, k, v = _make_qkv(rng, p, dtype)
    scale = 1.0 / math.sqrt(p["d"])
    seqs, cq, ck = _sequences(p)
    max_sq = max(s for s, _ in p["seqs"]) if varlen else p["sq"]
    max_sk = max(s for _, s in p["seqs"]) if varlen else p["sk"]
    nb = -(-max_sk // bs) if bs else 0
    cfg = launch.fwd_config(cc, dtype, p["d"], p["d"], p["hq"] // p["hkv"], causal, tuple(window) != (-1, -1),
                            softcap > 0, bs, varlen)
    reason = launch.unsupported_reason(cfg)
    info = dict(kernel=launch._kernel_class(cfg.arch).__name__, config=repr(cfg))
    if reason is not None:
        return dict(status="error", message=f"unsupported: {reason}", **info)
    watch = _edge_watch(fw, cc, "fwd_sm100")
    _phase("compile")
    launch.compile_fwd(cfg, _arch.device_sm_count(0) if _arch.family(cc) == 100 else None, trace=watch is not None)
    _phase("launch")
    tq, tk, tv = fw.put(q, dtype), fw.put(k, dtype), fw.put(v, dtype)
    hq = p["hq"]
    out = fw.full(q.shape, float("nan"), dtype)
    lse = fw.full((hq, q.shape[0]) if varlen else (q.shape[0], hq, q.shape[1]), float("nan"), "float32")
    bl = fw.full(tuple(lse.shape) + (nb,), float("nan"), "float32") if bs else None
    tcq = fw.put(cq.astype(np.int32), "int32") if varlen else None
    tck = fw.put(ck.astype(np.int32), "int32") if varlen else None
    launch.run_fwd(cfg, tq, tk, tv, out, lse, bl, tcq, tck, softmax_scale=scale, softcap=softcap,
                   window_left=window[0], window_right=window[1], max_seqlen_q=max_sq,
                   trace_addr=None if watch is None else watch.addr)
    _phase("sync")
    watch.sync() if watch is not None else fw.sync()
    _phase("compare")
    got = [fw.get(out), fw.get(lse), fw.get(bl)]
    f64 = [a.astype(np.float64) for a in (q, k, v)]
    ref = _per_sequence(p, lambda a, b_, c: _attn_fwd_ref(a, b_, c, scale * perturb, causal, window, softcap, bs, nb,
                                                         dtype), ("q", f64[0]), ("k", f64[1]), ("k", f64[2]))
    join = (lambda xs, ax: np.concatenate(xs, ax)) if varlen else (lambda xs, ax: np.stack(xs))
    r_out, r_eager, r_lse = join([r[0] for r in ref], 0), join([r[1] for r in ref], 0), join([r[2] for r in ref], 1)
    eager_err = float(np.abs(r_eager - r_out).max(initial=0.0))
    checks = [_check("out", got[0], r_out, 2 * eager_err + 2e-3, 0.0), _check("lse", got[1], r_lse, 1e-3, 1e-3)]
    if bs:
        checks.append(_check("block_logit", got[2], join([r[3] for r in ref], 1), 2e-3, 1e-3))
    return dict(status="ok" if all(c["ok"] for c in checks) else "mismatch", checks=checks, **info)


def _case_bwd(fw, cc: int, p: dict):
    from cute_kernels.attention import bwd_launch

    dtype = p.get("dtype", "bfloat16")
    causal, window, softcap = p.get("causal", False), p.get("window", (-1, -1)), p.get("softcap", 0.0)
    det = p.get("deterministic", False)
    varlen = "seqs" in p
    rng = np.random.default_rng(1)
    q, k, v = _make_qkv(rng, p, dtype)
    do = _round(rng.standard_normal(q.shape), dtype)
    scale = 1.0 / math.sqrt(p["d"])
    seqs, cq, ck = _sequences(p)
    f64 = [a.astype(np.float64) for a in (q, k, v, do)]
    fwd = _per_sequence(p, lambda a, b_, c: _attn_fwd_ref(a, b_, c, scale, causal, window, softcap, 0, 0, dtype),
                        ("q", f64[0]), ("k", f64[1]), ("k", f64[2]))
    join = (lambda xs, ax: np.concatenate(xs, ax)) if varlen else (lambda xs, ax: np.stack(xs))
    out = _round(join([r[0] for r in fwd], 0), dtype)
    lse = join([r[2] for r in fwd], 1).astype(np.float32)
    cfg = bwd_launch.bwd_config(cc, dtype, p["d"], p["d"], p["hq"] // p["hkv"], causal, tuple(window) != (-1, -1),
                                softcap > 0, varlen, det)
    reason = bwd_launch.unsupported_reason(cfg)
    info = dict(kernel=bwd_launch._kernel_class(cfg.arch).__name__, config=repr(cfg))
    if reason is not None:
        return dict(status="error", message=f"unsupported: {reason}", **info)
    watch = _edge_watch(fw, cc, "bwd_sm100")
    _phase("compile")
    bwd_launch.compile_bwd(cfg)
    if watch is not None:
        bwd_launch.compile_bwd_main_traced(cfg)
    _phase("launch")
    t = {n: fw.put(a, dtype) for n, a in (("q", q), ("k", k), ("v", v), ("do", do), ("out", out))}
    tlse = fw.put(lse, "float32")
    grads = {n: fw.full(t[src].shape, float("nan"), dtype) for n, src in (("dq", "q"), ("dk", "k"), ("dv", "v"))}
    batch = len(seqs) if varlen else q.shape[0]
    max_sq = max(s for s, _ in p["seqs"]) if varlen else q.shape[1]
    max_sk = max(s for _, s in p["seqs"]) if varlen else k.shape[1]
    shapes = bwd_launch.workspace_shapes(cfg, batch=batch, seqlen_q=0 if varlen else q.shape[1],
                                         num_heads=p["hq"], total_q=q.shape[0] if varlen else 0, seqlen_k=max_sk,
                                         num_kv_heads=p["hkv"], total_k=k.shape[0] if varlen else 0)
    ws = {n: fw.full(s, float("nan") if dt == "float32" else 12345, dt) for n, (s, dt) in shapes.items()}
    bwd_launch.run_bwd(cfg, t["do"], t["q"], t["k"], t["v"], t["out"], tlse, None, grads["dq"], grads["dk"],
                       grads["dv"], fw.put(cq.astype(np.int32), "int32") if varlen else None,
                       fw.put(ck.astype(np.int32), "int32") if varlen else None, ws, softmax_scale=scale,
                       softcap=softcap, window_left=window[0], window_right=window[1], max_seqlen_q=max_sq,
                       max_seqlen_k=max_sk, trace_addr=None if watch is None else watch.addr)
    _phase("sync")
    watch.sync() if watch is not None else fw.sync()
    _phase("compare")
    ref = _per_sequence(p, lambda a, b_, c, o, d_, l_: _attn_bwd_ref(a, b_, c, o, d_, l_.T, scale, causal, window,
                                                                     softcap),
                        ("q", f64[0]), ("k", f64[1]), ("k", f64[2]), ("q", out.astype(np.float64)), ("q", f64[3]),
                        ("q", (lse.T if varlen else lse.transpose(0, 2, 1)).astype(np.float64)))
    rtol = 3e-2 if dtype == "bfloat16" else 1e-2
    checks = [_check(n, fw.get(grads[n]), join([r[i] for r in ref], 0), 1e-3, rtol)
              for i, n in enumerate(("dq", "dk", "dv"))]
    return dict(status="ok" if all(c["ok"] for c in checks) else "mismatch", checks=checks, **info)


def _case_indexed(fw, cc: int, p: dict):
    from cute_kernels.indexed import launch as il

    b, lq, lkv, hq, hkv, d, w = (p[n] for n in ("b", "lq", "lkv", "hq", "hkv", "d", "width"))
    rng = np.random.default_rng(2)
    q = _round(rng.standard_normal((b, lq, hq, d)), "bfloat16")
    k = _round(rng.standard_normal((b, lkv, hkv, d)), "bfloat16")
    v = _round(rng.standard_normal((b, lkv, hkv, d)), "bfloat16")
    do = _round(rng.standard_normal((b, lq, hq, d)), "bfloat16")
    idx = rng.integers(0, lkv, (b, lq, w)).astype(np.int32)
    idx[rng.random(idx.shape) < 0.2] = -1  # padding
    idx[:, :3] = -1  # rows without a valid index
    scale = d ** -0.5
    tq, tk, tv, tdo = (fw.put(a, "bfloat16") for a in (q, k, v, do))
    cfg = il.attn_config(tq, tk, False, arch=cc)
    info = dict(kernel="IndexedFwd / IndexedBwdDQ / dK-dV " + cfg.dkdv_impl, config=repr(cfg))
    _phase("compile")
    il.compile_plan(il.PlanConfig(arch=cc, window_queries=cfg.window_queries))
    for compile_fn in (il.compile_fwd, il.compile_bwd_dq, il.compile_bwd_dkdv):
        compile_fn(cfg)
    _phase("launch")
    shapes = il.plan_shapes(b, lq, w, lkv, cfg.window_queries)
    plan = {n: fw.full(s, 0, "int32") for n, s in shapes._asdict().items()}
    il.run_plan(fw.put(idx, "int32"), lkv, *(plan[n] for n in shapes._fields), window_queries=cfg.window_queries,
                arch=cc)
    out = fw.full(q.shape, float("nan"), "bfloat16")
    lse = fw.full((b, hq, lq), float("nan"), "float32")
    il.run_fwd(cfg, tq, tk, tv, plan["win_key"], plan["win_mask"], plan["win_count"], out, lse, scale)
    dq, dk, dv = (fw.full(a.shape, float("nan"), "bfloat16") for a in (q, k, v))
    delta = fw.full((b, hq, lq), float("nan"), "float32")
    il.run_bwd(cfg, tq, tk, tv, out, tdo, lse, plan["win_key"], plan["win_mask"], plan["win_count"],
               plan["tile_ptr"], plan["tile_win"], plan["tile_start"], dq, dk, dv, delta, scale)
    _phase("sync")
    fw.sync()
    _phase("compare")
    got_out = fw.get(out)
    refs = _indexed_ref(q, k, v, do, idx, scale, got_out)
    got = dict(out=got_out, lse=fw.get(lse), dq=fw.get(dq), dk=fw.get(dk), dv=fw.get(dv))
    checks = [_check(n, got[n], refs[n], 1e-3, 1e-3) if n == "lse" else _rel_l2(n, got[n], refs[n], 1e-2)
              for n in refs]
    return dict(status="ok" if all(c["ok"] for c in checks) else "mismatch", checks=checks, **info)


def _case_decode(fw, cc: int, p: dict):
    """Paged decode (cute_kernels/decode/launch.py) against the float64 oracle over the gathered cache
    (tests/oracles/decode_gpu.py); every slot no sequence uses is NaN, every output NaN-poisoned first."""
    try:
        from tests.oracles.decode_gpu import decode_reference
    except ImportError as err:
        return dict(status="error", message=f"needs the repository's tests/oracles (run from a checkout): {err}")
    from cute_kernels.decode import launch as dl

    lens, hkv, g, sq, d, page, splits, bs = (p[n] for n in ("lens", "hkv", "g", "sq", "d", "page", "splits",
                                                            "block_size"))
    rng = np.random.default_rng(7)
    bsz, hq = len(lens), hkv * g
    need = [-(-n // page) for n in lens]
    width = max(need) + 2
    total = sum(need) + 2
    perm = rng.permutation(total)
    table = np.where(np.arange(width) % 2 == 0, -1, 1 << 30)[None, None, :].repeat(bsz, 0).repeat(hkv, 1)
    k = np.full((total, hkv, page, d), np.nan, np.float32)
    v = np.full((total, hkv, page, d), np.nan, np.float32)
    at = 0
    for b, n in enumerate(lens):
        ids = perm[at:at + need[b]]
        at += need[b]
        table[b, :, :need[b]] = ids
        for j, pid in enumerate(ids):
            rows = min(page, n - j * page)
            k[pid, :, :rows] = _round(rng.standard_normal((hkv, rows, d)), "bfloat16")
            v[pid, :, :rows] = _round(rng.standard_normal((hkv, rows, d)), "bfloat16")
    q = _round(rng.standard_normal((bsz, sq, hq, d)), "bfloat16")
    seq = np.repeat(np.asarray(lens, np.int32)[:, None], hkv, 1)
    table = table.astype(np.int32)
    nb = -(-width * page // bs)
    scale = d ** -0.5
    tq, tk, tv = fw.put(q, "bfloat16"), fw.put(k, "bfloat16"), fw.put(v, "bfloat16")
    dense = bool(p.get("dense"))  # FA's [B] lengths / [B, n] table, read in place by every kv head
    tseq = fw.put(seq[:, 0].copy() if dense else seq, "int32")
    ttab = fw.put(table[:, 0].copy() if dense else table, "int32")
    cfg = dl.decode_config(tq, tk, layout="hnd", causal_or_right=True, has_left=False, softcap=False, block_size=bs,
                           split=True, arch=cc, dense_index=dense)
    info = dict(kernel="DecodeSplitStep (DecodeFwd + DecodeCombine)", config=repr(cfg))
    _phase("compile")
    dl.compile_decode_step(cfg)
    _phase("launch")
    out = fw.full(q.shape, float("nan"), "bfloat16")
    lse = fw.full((bsz, hq, sq), float("nan"), "float32")
    blk = fw.full((bsz, hq, sq, nb), float("nan"), "float32")
    o_shape, l_shape = dl.partial_shapes(tq, splits)
    o_part, l_part = fw.full(o_shape, float("nan"), "float32"), fw.full(l_shape, float("nan"), "float32")
    dl.run_decode(tq, tk, tv, tseq, ttab, out, lse, blk, o_part, l_part, layout="hnd", softmax_scale=scale,
                  window_left=-1, window_right=0, block_size=bs, arch=cc)
    _phase("sync")
    fw.sync()
    _phase("compare")
    r_out, r_lse, r_blk = decode_reference(q, k, v, seq, table, layout="hnd", scale=scale, window_right=0,
                                           block_size=bs, nb=nb)
    checks = [_check("out", fw.get(out), r_out, 2e-2, 0.0), _check("lse", fw.get(lse), r_lse, 2e-3, 2e-3),
              _check("block_logit", fw.get(blk), r_blk, 2e-3, 2e-3)]
    return dict(status="ok" if all(c["ok"] for c in checks) else "mismatch", checks=checks, **info)


def _case_block_sparse(fw, cc: int, p: dict):
    """block_sparse_attention's kernels (cute_kernels/block_sparse/launch.py): the plan from the numpy oracle, the
    forward, the dQ kernel (delta from out, or rowsum(P dP) with ``exact_delta``) and the dK/dV kernel, against the
    float64 oracle over the expanded token mask; every output NaN-poisoned first (dk / dv zero-filled, as the glue
    passes them: keys nobody selects stay 0)."""
    try:
        from tests.oracles import block_sparse as orc
    except ImportError as err:
        return dict(status="error", message=f"needs the repository's tests/oracles (run from a checkout): {err}")
    from cute_kernels.block_sparse import launch as bl
    from cute_kernels.block_sparse.config import BLOCK_SIZE, unsupported_reason

    b, s, hq, hkv, d, topk = (p[n] for n in ("b", "s", "hq", "hkv", "d", "topk"))
    cu = None if p.get("cu") is None else np.asarray(p["cu"], np.int64)
    exact = bool(p.get("exact_delta", False))
    rng = np.random.default_rng(5)
    q, do = (_round(rng.standard_normal((b, s, hq, d)), "bfloat16") for _ in range(2))
    k, v = (_round(rng.standard_normal((b, s, hkv, d)), "bfloat16") for _ in range(2))
    ids = orc.random_ids(rng, b, s, topk, BLOCK_SIZE, True, cu, pad=0.2, dup=0.2)
    scale = d ** -0.5
    tq, tk, tv, tdo = (fw.put(a, "bfloat16") for a in (q, k, v, do))
    cfg = bl.fwd_config(tq, tk, tv, per_kv_head=False, has_sink=False, arch=cc)
    bcfg = bl.bwd_config(tq, tk, tv, per_kv_head=False, arch=cc, exact_delta=exact)
    info = dict(kernel="block_sparse fwd / dQ" + (" (exact_delta)" if exact else "") + " / dK-dV", config=repr(bcfg))
    for c in (cfg, bcfg):
        reason = unsupported_reason(head_dim=d, head_dim_v=d, group=hq // hkv, dtype="bfloat16",
                                       block_size=BLOCK_SIZE, backward=c is bcfg)
        if reason is not None:
            return dict(status="error", message=f"unsupported: {reason}", **info)
    _phase("compile")
    bl.compile_fwd(cfg)
    bl.compile_bwd_dq(bcfg)
    bl.compile_bwd_dkdv(dataclasses.replace(bcfg, exact_delta=False))
    _phase("launch")
    plan = {n: fw.put(a, "int32") for n, a in orc.plan_arrays(ids, BLOCK_SIZE, hq // hkv, True, cu,
                                                                window=cfg.window_queries).items()}
    out = fw.full(q.shape, float("nan"), "bfloat16")
    lse = fw.full((b, hq, s), float("nan"), "float32")
    bl.run_fwd(cfg, tq, tk, tv, plan["tile_start"], plan["tile_mask"], plan["tile_count"], plan["q_limit"], None, out,
               lse, scale)
    dq = fw.full(q.shape, float("nan"), "bfloat16")
    delta = fw.full((b, hq, s), float("nan"), "float32")
    bl.run_bwd_dq(bcfg, tq, tk, tv, out, tdo, lse, delta, plan["tile_start"], plan["tile_mask"], plan["tile_count"],
                  plan["q_limit"], dq, scale)
    dk, dv = fw.full(k.shape, 0.0, "bfloat16"), fw.full(v.shape, 0.0, "bfloat16")
    ws = {n: fw.full(shape, 0 if zero else float("nan"), dt)
          for n, (shape, dt, zero) in bl.dkdv_workspace_shapes(tk, tv, plan["key_start"]).items()}
    bl.run_bwd_dkdv(bcfg, tq, tk, tv, tdo, lse, delta, plan["tile_mask"], plan["q_limit"], plan["key_start"],
                    plan["key_end"], plan["key_count"], plan["key_ptr"], plan["key_tile"], plan["key_slot"], dk, dv,
                    ws["dk_part"], ws["dv_part"], ws["seg_sem"], scale, key_order=plan["key_order"])
    _phase("sync")
    fw.sync()
    _phase("compare")
    mask = orc.token_mask(ids, BLOCK_SIZE, True, cu)
    f64 = [a.astype(np.float64) for a in (q, k, v, do)]
    ref_out, ref_lse, _ = orc.attention(*f64[:3], mask, scale)
    refs = dict(zip(("dq", "dk", "dv"), orc.gradients(*f64[:3], mask, f64[3], scale)[:3]))
    checks = [_rel_l2("out", fw.get(out), ref_out, 1e-2), _check("lse", fw.get(lse), ref_lse, 2e-3, 0.0)]
    checks += [_rel_l2(n, fw.get(t), refs[n], 2e-2) for n, t in (("dq", dq), ("dk", dk), ("dv", dv))]
    if exact:  # rowsum(P dP) = rowsum(dO * out) in exact arithmetic: the fp64 out's
        checks.append(_check("delta", fw.get(delta), np.einsum("bshd,bshd->bhs", f64[3], ref_out), 1e-3, 1e-4))
    return dict(status="ok" if all(c["ok"] for c in checks) else "mismatch", checks=checks, **info)


def _indexed_ref(q, k, v, do, idx, scale, out_used):
    """Indexed attention in float64: row i of batch b attends to the distinct valid keys of idx[b, i]
    (shared by the kv group); out, lse, and dq / dk / dv with D from ``out_used`` (the kernel's out,
    as its backward reads it). Rows without a key: out 0, lse -inf, no gradient."""
    b, lq, hq, d = q.shape
    lkv, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    refs = {n: [] for n in ("out", "lse", "dq", "dk", "dv")}
    for bi in range(b):
        mask = np.zeros((lq, lkv), bool)
        rows, cols = np.nonzero((idx[bi] >= 0) & (idx[bi] < lkv))
        mask[rows, idx[bi][rows, cols]] = True  # duplicates count once
        qq, kk, vv, dd = (a[bi].astype(np.float64) for a in (q, k, v, do))
        kx, vx = np.repeat(kk, g, 1), np.repeat(vv, g, 1)
        s = np.where(mask[None], np.einsum("qhd,khd->hqk", qq, kx) * scale, -np.inf)
        pr, lse = _softmax_rows(s)
        o_used = np.asarray(out_used[bi], np.float64)
        ds = pr * (np.einsum("qhd,khd->hqk", dd, vx) - np.einsum("qhd,qhd->hq", dd, o_used)[..., None])
        refs["out"].append(np.einsum("hqk,khd->qhd", pr, vx))
        refs["lse"].append(lse)
        refs["dq"].append(np.einsum("hqk,khd->qhd", ds, kx) * scale)
        refs["dk"].append(np.einsum("hqk,qhd->khd", ds, qq).reshape(lkv, hkv, g, d).sum(2) * scale)
        refs["dv"].append(np.einsum("hqk,qhd->khd", pr, dd).reshape(lkv, hkv, g, d).sum(2))
    return {n: np.stack(r) for n, r in refs.items()}


def _rel_l2(name, got, ref, tol):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if np.isnan(got).any():
        return dict(name=name, ok=False, detail=f"{int(np.isnan(got).sum())} entries NaN / never written")
    rel = float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))
    return dict(name=name, ok=rel <= tol, detail=f"rel L2 err {rel:.3e} (tol {tol:.0e})")


def _case_helpers(fw, cc: int):
    from cute_kernels import helper_probes as hp

    info = dict(kernel="math_sm100.exp2_poly / max_tree", config=f"{_arch.arch_name(cc)}"
                + (" (fmax3 = three-input max.f32)" if _arch.family(cc) == 100 else " (fmax3 = two max.f32)"))
    _phase("compile")
    exp2 = hp.compile_exp2(cc)
    trees = {k: hp.compile_max_tree(cc, k) for k in (5, 128)}
    _phase("launch")
    x = np.concatenate([np.linspace(-126.0, 127.0, 1 << 20), np.arange(-126.0, 128.0)]).astype(np.float32)
    tx = fw.put(x, "float32")
    poly, mufu = fw.full(x.shape, float("nan"), "float32"), fw.full(x.shape, float("nan"), "float32")
    exp2(tx, poly, mufu)
    rng = np.random.default_rng(3)
    vals = {k: rng.standard_normal((4096, k)).astype(np.float32) for k in trees}
    for a in vals.values():
        a[rng.random(a.shape) < 0.2] = -np.inf
        a[:64] = -np.inf
    outs = {}
    for k, fn in trees.items():
        outs[k] = fw.full((4096,), float("nan"), "float32")
        fn(fw.put(vals[k], "float32"), outs[k])
    _phase("sync")
    fw.sync()
    _phase("compare")
    checks = [_check("exp2_poly", fw.get(poly) / np.exp2(x.astype(np.float64)), np.ones(x.shape), 1e-4, 0.0)]
    for k in trees:
        ref = np.fmax.reduce(vals[k].astype(np.float64), axis=1)
        got = fw.get(outs[k]).astype(np.float64)
        same = bool(np.array_equal(got, ref))
        checks.append(dict(name=f"max_tree k={k}", ok=same, detail="exact" if same else
                           f"{int((got != ref).sum())} rows differ, first {int(np.argmax(got != ref))}"))
    return dict(status="ok" if all(c["ok"] for c in checks) else "mismatch", checks=checks, **info)


CANARY_ROLES, CANARY_EDGES = ("waiter",), ["canary.full", "canary.empty"]


def compile_canary_hang(cc: int):
    """An mbarrier nobody arrives at (what a kernel with a missing pipeline arrive does), edge-traced as the
    SM100 kernels' traced builds are: its waiter marks ``canary.full`` first. Takes the trace array address."""
    import cutlass
    import cutlass.cute as cute

    from cute_kernels.common.trace import EdgeTrace
    from cute_kernels.fake import arch_options

    @cute.kernel
    def deadlock(trace_addr):
        @cute.struct
        class S:
            bar: cute.struct.MemRange[cutlass.Int64, 1]

        bar = cutlass.utils.SmemAllocator().allocate(S).bar.data_ptr()
        tidx, _, _ = cute.arch.thread_idx()
        if tidx == 0:
            cute.arch.mbarrier_init(bar, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()
        EdgeTrace(trace_addr, CANARY_EDGES).mark(0, "canary.full", 0)
        cute.arch.mbarrier_wait(bar, 0)

    @cute.jit
    def launch(trace_addr):
        deadlock(trace_addr).launch(grid=[1, 1, 1], block=[32, 1, 1], smem=64)

    return cute.compile(launch, cutlass.Int64(0), options=arch_options(cc))


def _case_canary_hang(fw, cc: int):
    """The hang canary: must come out HUNG, with the edge trace naming canary.full."""
    watch = _EdgeWatch(fw, CANARY_ROLES, CANARY_EDGES)
    _phase("compile")
    fn = compile_canary_hang(cc)
    _phase("launch")
    fn(watch.addr)
    _phase("sync")
    watch.sync()
    return dict(status="ok", kernel="canary deadlock", config="mbarrier phase 0 never completes")


_RUNNERS = {
    "helpers": lambda fw, cc, case: _case_helpers(fw, cc),
    "fwd": lambda fw, cc, case: _case_fwd(fw, cc, case.params),
    "bwd": lambda fw, cc, case: _case_bwd(fw, cc, case.params),
    "indexed": lambda fw, cc, case: _case_indexed(fw, cc, case.params),
    "block_sparse": lambda fw, cc, case: _case_block_sparse(fw, cc, case.params),
    "decode": lambda fw, cc, case: _case_decode(fw, cc, case.params),
    "canary_hang": lambda fw, cc, case: _case_canary_hang(fw, cc),
    "canary_mismatch": lambda fw, cc, case: _case_fwd(fw, cc, case.params, perturb=1.05),
}


def _child_main(name: str, framework: str, mode: str) -> int:
    """Run one case (or ``env``) and print ``RESULT <json>``; exceptions become status ``error``."""
    import traceback

    try:
        fw = {"torch": _Torch, "paddle": _Paddle}[framework]()
        if name == "env":
            import importlib.metadata as md

            res = dict(status="ok", framework=fw.name, framework_version=fw.version, device=fw.device,
                       dsl_version=md.version("nvidia-cutlass-dsl"))
        else:
            cc = _arch.device_arch(0)
            if {"sm90": 90, "sm100": 100}.get(mode, _arch.family(cc)) != _arch.family(cc):
                raise RuntimeError(f"mode {mode} on CC {cc}")
            case = BY_NAME[name]
            res = _RUNNERS[case.kind](fw, cc, case)
    except Exception as exc:  # noqa: BLE001 - report, do not die silently
        first = (str(exc).strip().splitlines() or [""])[0]
        res = dict(status="error", message=f"{type(exc).__name__}: {first}", traceback=traceback.format_exc()[-4000:])
    print("RESULT " + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
