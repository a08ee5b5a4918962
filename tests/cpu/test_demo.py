"""``python -m paddle_fa4 demo``: the HySparse walk-through runs on the reference backend, reports
sane numbers and writes a small PNG heatmap."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("paddle")
pytest.importorskip("matplotlib")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_demo_run_reports_and_writes_png(tmp_path):
    from paddle_fa4.demo import DemoConfig, run

    out = tmp_path / "sel.png"
    r = run(DemoConfig(seq=320, heads=4, kv_heads=2, head_dim=32, block_size=16, topk=4, sink_blocks=1,
                       local_blocks=1, backend="reference", out=str(out)))
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) < 150_000
    assert r["chunked_ids_identical"]
    assert r["key_blocks"] == 20 and 0 < r["blocks_per_row_mean"] <= 4
    assert 0.5 < r["mass_captured_mean"] <= 1.0 + 1e-6
    assert 0.5 < r["recall_vs_exact_topk_mean"] <= 1.0 + 1e-6
    assert 0 < r["sparse_vs_dense_rel_err_next_layer"] < 1
    assert set(r["times_s"]) >= {"full forward + block_logit", "select_topk_blocks", "blocks_to_indices"}


def test_demo_budget_covering_everything_is_exact(tmp_path):
    """topk * block_size >= seq: every visible key is selected, so sparse == dense."""
    from paddle_fa4.demo import DemoConfig, run

    import warnings

    with warnings.catch_warnings():  # no row is longer than the budget: no "Mean of empty slice"
        warnings.simplefilter("error", RuntimeWarning)
        r = run(DemoConfig(seq=96, heads=2, kv_heads=1, head_dim=16, block_size=16, topk=6, sink_blocks=0,
                           local_blocks=0, backend="reference", out=str(tmp_path / "all.png")))
    assert r["mass_captured_long_rows_mean"] != r["mass_captured_long_rows_mean"]  # NaN, printed as n/a
    assert r["sparse_vs_dense_rel_err_next_layer"] < 1e-5 and r["sparse_vs_dense_rel_err_same_layer"] < 1e-5
    assert abs(r["mass_captured_mean"] - 1.0) < 1e-5


def test_cli(tmp_path):
    out = tmp_path / "cli.png"
    proc = subprocess.run([sys.executable, "-m", "paddle_fa4", "demo", "--seq", "128", "--heads", "2", "--kv-heads",
                           "1", "--head-dim", "16", "--block-size", "16", "--topk", "2", "--sink-blocks", "0", "--seed", "3",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "recall vs the exact top-2 blocks" in proc.stdout and out.read_bytes()[:8] == PNG_MAGIC
    assert f"heatmap of the selected blocks: {out.resolve()}" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "paddle_fa4", "nope"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and "unknown command" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "paddle_fa4", "demo", "--topk", "2"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and "--sink-blocks + --local-blocks" in bad.stderr


@pytest.mark.parametrize("args,message", [(["--seq", "0"], "--seq must be >= 1"),
                                          (["--kv-heads", "0"], "--kv-heads must be >= 1"),
                                          (["--heads", "-2"], "--heads must be >= 1"),
                                          (["--block-size", "48"], "--block-size must be one of")])
def test_cli_bad_arguments_are_usage_errors(args, message):
    proc = subprocess.run([sys.executable, "-m", "paddle_fa4", "demo", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
