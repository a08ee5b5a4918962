"""``python -m paddle_fa4 decode-demo``: the paged decode loop runs on the reference backend, keeps
the stale (NaN) pages out of every output and reports sane numbers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("paddle")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_decode_demo_reports_sparse_numbers():
    from paddle_fa4.decode_demo import DecodeDemoConfig, run

    r = run(DecodeDemoConfig(batch=2, prompt=900, steps=2, heads=4, kv_heads=2, head_dim=32, page_size=8,
                             topk_blocks=4, window=32, h2o_topk=8, backend="reference"))
    assert r["outputs_finite"] and r["backend"] == "reference"
    assert 0.1 < r["hysparse_kv_read_fraction"] < 0.5 and 0.02 < r["h2o_kv_read_fraction"] < 0.3
    assert 0 < r["hysparse_rel_err_mean"] < 0.5 and 0 < r["h2o_rel_err_mean"] < 0.5


def test_decode_demo_budget_covering_everything_is_exact():
    """Every block / page selected: sparse decode is dense decode (to rounding), 100% read."""
    from paddle_fa4.decode_demo import DecodeDemoConfig, run

    r = run(DecodeDemoConfig(batch=1, prompt=150, steps=2, heads=2, kv_heads=1, head_dim=16, page_size=16,
                             topk_blocks=4, window=0, h2o_topk=16, backend="reference"))
    assert r["hysparse_kv_read_fraction"] == 1.0 and r["h2o_kv_read_fraction"] == 1.0
    assert r["hysparse_rel_err_mean"] < 1e-6 and r["h2o_rel_err_mean"] < 1e-6


def test_decode_demo_cli():
    proc = subprocess.run([sys.executable, "-m", "paddle_fa4", "decode-demo", "--prompt", "200", "--steps", "1",
                           "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--backend", "reference"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "decode demo:" in proc.stdout and "H2O token flow" in proc.stdout and "KV read" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "paddle_fa4", "decode-demo", "--page-size", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--page-size must be >= 1" in bad.stderr and "Traceback" not in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "paddle_fa4", "decode-demo", "--heads", "3"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "multiple of --kv-heads" in bad.stderr
