"""``python -m cute_kernels.selftest`` on a machine without a GPU.

The tool itself: it exits non-zero with a clear message when there is no GPU, lists its cases, its
watchdog reports a process that never finishes as HUNG with the last phase reached (and one that dies
as CRASH), and the report names the case and how to reproduce it. Its cases are driven end to end
with numpy "device" tensors and the launchers replaced by the float64 oracles of tests/oracles: a
correct kernel must come out ok (the references, layouts and tolerances agree with the oracles) and a
wrong one MISMATCH. The real launches run on the H200 (``--mode sm90``) and on Blackwell.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from cute_kernels import selftest as st
from tests.conftest import ROOT
from tests.oracles import attention as attn_oracle
from tests.oracles import attention_bwd as bwd_oracle
from tests.oracles import indexed as indexed_oracle


def _run(*args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "cute_kernels.selftest", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_no_gpu_exits_non_zero_with_the_reason():
    proc = _run()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no CUDA GPU found" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_list_needs_no_gpu():
    proc = _run("--list")
    assert proc.returncode == 0, proc.stderr
    assert all(c.name in proc.stdout for c in st.CASES)


def test_watchdog_reports_a_hang_with_its_last_phase():
    code = "import time; print('PHASE compile', flush=True); print('PHASE sync', flush=True); time.sleep(60)"
    res = st.run_child([sys.executable, "-c", code], timeout=3)
    assert res["status"] == "hung" and res["phase"] == "sync" and res["seconds"] < 60
    assert "pipeline handshake" in st._hint(res)


def test_watchdog_results_and_crashes():
    ok = st.run_child([sys.executable, "-c", "print('PHASE sync'); print('RESULT ' + '{\"status\": \"ok\"}')"], 30)
    assert ok["status"] == "ok"
    dead = st.run_child([sys.executable, "-c", "import sys; print('PHASE launch'); sys.exit(3)"], 30)
    assert dead["status"] == "crash" and dead["phase"] == "launch" and "exit status 3" in dead["message"]


def test_report_names_the_failure_and_the_reproducer():
    rows = [("fwd", dict(status="ok", seconds=1.0, kernel="FlashFwdSm100", config="FwdConfig(arch=100)"), ["x"]),
            ("bwd", dict(status="hung", phase="sync", seconds=300.0, message="no result after 300 s",
                         kernel="FlashBwdSm100", config="BwdConfig(arch=103)"),
             ["python", "-m", "cute_kernels.selftest"]),
            ("indexed", dict(status="mismatch", seconds=2.0, kernel="k", config="c",
                             checks=[dict(name="dq", ok=False, detail="max err 1")]), ["y"])]
    text = st.format_report("header", rows)
    assert "1 of 3 cases passed" in text
    assert "HUNG" in text and "BwdConfig(arch=103)" in text and "reproduce: python -m cute_kernels.selftest" in text
    assert "dq: max err 1" in text and "MISMATCH" in text


# --------------------------------------------------------------------------- cases, oracle-backed
class _NumpyFramework:
    """``put`` / ``full`` / ``get`` / ``sync`` on host arrays (values already rounded to their dtype)."""

    def put(self, a, dtype):
        return np.array(a, dtype=np.int32 if dtype == "int32" else np.float32)

    def full(self, shape, value, dtype):
        return np.full(tuple(shape), value, dtype=np.int32 if dtype == "int32" else np.float32)

    def get(self, x):
        return None if x is None else np.asarray(x)

    def sync(self):
        pass

    def pinned_words(self, n):  # the edge trace's array: host memory only here
        self.words = np.zeros(n, dtype=np.int32)
        return 0, lambda: self.words

    def poll_sync(self, on_wait, period_s=0.25):
        on_wait()


def _window(wl, wr):
    return (None if wl < 0 else wl, None if wr < 0 else wr)


@pytest.fixture
def oracle_launchers(monkeypatch):
    """The attention and indexed launchers replaced by the oracles; ``state['wrong']`` corrupts one output."""
    from cute_kernels.attention import bwd_launch, launch
    from cute_kernels.indexed import launch as il

    state = dict(wrong=False, traced=[])

    def run_fwd(cfg, q, k, v, out, lse, bl, cu_q, cu_k, *, softmax_scale, softcap, window_left, window_right,
                max_seqlen_q, trace_addr=None):
        state["traced"].append(trace_addr is not None)
        max_sk = int(np.diff(cu_k).max()) if cu_k is not None else None
        o, l_, b_ = attn_oracle.attention(q, k, v, softmax_scale, cfg.causal, _window(window_left, window_right),
                                          softcap, cfg.block_size, cu_q, cu_k, max_sk)
        out[...], lse[...] = o, l_
        if bl is not None:
            bl[...] = b_
        if state["wrong"]:
            out[..., 0, 0] += 0.5

    def run_bwd(cfg, dout, q, k, v, out, lse, dlse, dq, dk, dv, cu_q, cu_k, ws, *, softmax_scale, softcap,
                window_left, window_right, max_seqlen_q, max_seqlen_k, trace_addr=None):
        state["traced"].append(trace_addr is not None)
        g = bwd_oracle.attention_bwd(q, k, v, dout, None, softmax_scale, cfg.causal,
                                     _window(window_left, window_right), softcap, cu_q, cu_k)
        dq[...], dk[...], dv[...] = g
        if state["wrong"]:
            dk[-1] = 0.0  # the last key rows never written

    plan = {}
    monkeypatch.setattr(launch, "compile_fwd", lambda *a, **kw: None)
    monkeypatch.setattr(launch, "run_fwd", run_fwd)
    monkeypatch.setattr(bwd_launch, "compile_bwd", lambda cfg: None)
    monkeypatch.setattr(bwd_launch, "compile_bwd_main_traced", lambda cfg: None)
    monkeypatch.setattr(bwd_launch, "run_bwd", run_bwd)
    for name in ("compile_plan", "compile_fwd", "compile_bwd_dq", "compile_bwd_dkdv"):
        monkeypatch.setattr(il, name, lambda cfg: None)
    monkeypatch.setattr(il, "run_plan", lambda idx, *a, **kw: plan.update(idx=idx))

    def il_fwd(cfg, q, k, v, wk, wm, wc, out, lse, scale):
        out[...], lse[...] = indexed_oracle.forward(q, k, v, plan["idx"], scale)

    def il_bwd(cfg, q, k, v, out, dout, lse, wk, wm, wc, tp, tw, ts, dq, dk, dv, delta, scale):
        dq[...], dk[...], dv[...] = indexed_oracle.backward(q, k, v, plan["idx"], dout, scale)
        if state["wrong"]:
            dq[0, 5] *= 3.0

    monkeypatch.setattr(il, "run_fwd", il_fwd)
    monkeypatch.setattr(il, "run_bwd", il_bwd)
    return state


KERNEL_CASES = [c for c in st.CASES if c.kind in ("fwd", "bwd", "indexed")]


@pytest.mark.parametrize("cc", [90, 100, 103])
@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: c.name)
def test_case_passes_a_correct_kernel(oracle_launchers, case, cc, capsys):
    res = st._RUNNERS[case.kind](_NumpyFramework(), cc, case)
    assert res["status"] == "ok", json.dumps(res, indent=1)
    assert f"arch={cc}" in res["config"]
    # the SM100 cases launch the edge-trace builds (and print the trace schema), the SM90 ones do not
    if case.kind in ("fwd", "bwd"):
        assert oracle_launchers["traced"] == [cc != 90]
        assert ("TRACE " in capsys.readouterr().out) == (cc != 90)


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: c.name)
def test_case_flags_a_wrong_kernel(oracle_launchers, case):
    oracle_launchers["wrong"] = True
    res = st._RUNNERS[case.kind](_NumpyFramework(), 100, case)
    assert res["status"] == "mismatch", json.dumps(res, indent=1)
    assert any(not c["ok"] for c in res["checks"])


def test_canary_mismatch_is_flagged(oracle_launchers):
    case = st.BY_NAME["canary_mismatch"]
    assert st._RUNNERS[case.kind](_NumpyFramework(), 90, case)["status"] == "mismatch"


def test_unwritten_outputs_are_reported():
    chk = st._check("out", np.array([1.0, np.nan]), np.array([1.0, 2.0]), 1e-3, 0.0)
    assert not chk["ok"] and "never written" in chk["detail"]
    chk = st._check("lse", np.array([-np.inf, 1.0]), np.array([-np.inf, 1.0005]), 1e-3, 0.0)
    assert chk["ok"], chk
