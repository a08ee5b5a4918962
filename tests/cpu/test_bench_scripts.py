"""The bench scripts' main() end to end on the CPU (tests/cpu/_bench_dry.py: stand-in torch, FA4,
launchers and timer, in a subprocess): every variant is timed in alternating windows, rows carry
per-round ratios and the run metadata, and the JSON / markdown files are written."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("cutlass")  # the scripts import the launch modules (no GPU needed)

HERE = os.path.dirname(os.path.abspath(__file__))


def dry(tmp_path, script, *args):
    js, md = tmp_path / f"{script}.json", tmp_path / f"{script}.md"
    res = subprocess.run([sys.executable, os.path.join(HERE, "_bench_dry.py"), script, *args,
                          "--json", str(js), "--markdown", str(md)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    windows = [w.split(":") for w in res.stdout.split("WINDOWS ")[-1].strip().split(",")]
    return json.loads(js.read_text()), md.read_text(), windows


def test_bench_fwd_dry(tmp_path):
    out, md, windows = dry(tmp_path, "bench_fwd", "--hdims", "128", "--seqlens", "2048,4096", "--heads", "32",
                           "--heads-kv", "8", "--variants", "ours,ours_bl,fa4,unfused")
    rows = out["rows"]
    assert [(r["seqlen"], r["causal"]) for r in rows] == [(2048, False), (2048, True), (4096, False), (4096, True)]
    assert out["run"]["gpu"] == "FakeGPU" and out["run"]["commit"] and "bench_fwd" in out["run"]["command"]
    # one config's windows: 3 rounds in alternating order
    first = [n for n, _ in windows[:12]]
    assert first == ["ours", "ours_bl", "fa4", "unfused", "unfused", "fa4", "ours_bl", "ours",
                     "ours", "ours_bl", "fa4", "unfused"]
    r = rows[0]
    assert set(r["ratios"]) == {"bl_over_fa4", "bl_over_ours", "ours_over_fa4", "bl_over_unfused"}
    for key, x in r["ratios"].items():
        assert len(x["rounds"]) == 3 and x["lo"] <= x["median"] <= x["hi"], key
    assert r["host_us"] == {"ours": 12.5, "ours_bl": 12.5, "fa4": 12.5}
    assert r["heads"] == 32 and r["heads_kv"] == 8 and r["batch"] == 16
    assert "| 128 | 2048 | 16 | 32/8 | full |" in md and "clocks.sm" in md


def test_bench_flashmask_dry(tmp_path):
    out, md, windows = dry(tmp_path, "bench_flashmask", "--seqlens", "8192", "--heads", "32/8")
    rows = out["rows"]
    names = ["causal", "fm_causal", "fm_docs", "varlen_docs", "fm_share_question", "fm_sliding_window",
             "fm_prefix_lm"]
    assert [r["variant"] for r in rows] == names * 2 and [r["direction"] for r in rows] == ["fwd"] * 7 + ["bwd"] * 7
    assert [n for n, _ in windows[:7]] == names and [n for n, _ in windows[7:14]] == names[::-1]
    by = {r["variant"]: r for r in rows if r["direction"] == "fwd"}
    bwd = {r["variant"]: r for r in rows if r["direction"] == "bwd"}
    assert bwd["fm_docs"]["pairs"] == by["fm_docs"]["pairs"] and "over_varlen" in bwd["fm_docs"]
    ratio = bwd["fm_docs"]["tflops_visible"] * bwd["fm_docs"]["stats"]["median_ms"]
    assert ratio == pytest.approx(2.5 * by["fm_docs"]["tflops_visible"] * by["fm_docs"]["stats"]["median_ms"])
    assert by["fm_causal"]["pairs"] == by["causal"]["pairs"] == 4 * 8192 * 8193 // 2
    assert by["fm_docs"]["pairs"] == by["varlen_docs"]["pairs"] < by["causal"]["pairs"]
    assert by["fm_sliding_window"]["pairs"] == 4 * (1025 * 8192 - 1024 * 1025 // 2)
    assert len(by["fm_docs"]["over_varlen"]["rounds"]) == 3 and "over_varlen" not in by["fm_prefix_lm"]
    assert set(by["fm_prefix_lm"]["rate_over_causal"]) == {"median", "lo", "hi", "rounds"}
    assert "| fwd | 8192 | 4 | 32/8 | fm_docs |" in md and "| bwd | 8192 | 4 | 32/8 | fm_docs |" in md
    assert "clocks.sm" in md


def test_bench_indexed_dry(tmp_path):
    out, md, _ = dry(tmp_path, "bench_indexed", "--shapes", "16Kx16K,64Kx64K", "--rhos", "0.9")
    rows = out["rows"]
    assert [r["shape"] for r in rows] == ["16Kx16K", "64Kx64K"]
    assert set(rows[0]["stats"]) == {"plan", "fwd", "dq", "dkdv", "total"}
    assert "baseline_gather_dense_ms" in rows[0] and "baseline_gather_dense_ms" not in rows[1]
    assert len(rows[0]["ratio_vs_published_windowed"]["rounds"]) == 3
    assert set(out["host_us_per_call"]) == {"plan", "fwd", "dq", "dkdv", "total"}
    assert "| 16Kx16K | 0.9 |" in md


def test_bench_select_dry(tmp_path):
    out, md, _ = dry(tmp_path, "bench_select", "--seqlens", "8192,16384", "--forward-seqlens", "8192")
    rows = out["rows"]
    assert [r["S"] for r in rows] == [8192, 16384] and all("error" not in r for r in rows)
    assert set(rows[0]["forward_stats"]) == {"fa4_fwd", "ours_fwd", "ours_fwd_blk"}
    assert "forward_stats" not in rows[1]
    assert len(rows[0]["speedup_vs_composite"]["rounds"]) == 3
    assert "| 8192 | 0.125 |" in md


def test_bench_h2o_dry(tmp_path):
    out, md, windows = dry(tmp_path, "bench_h2o")
    assert [r["op"] for r in out["rows"]] == ["page_scores", "select_pages"]
    assert out["copy_GBps"] > 0 and len(out["rows"][0]["speedup"]["rounds"]) == 3
    assert ["copy", "0"] in windows and "| page_scores | 1 | 4096 |" in md


def test_bench_layer_dry(tmp_path):
    """The full-layer step bench: one row per (heads, S, mode), per-round ratio, host-cost table."""
    out, md, windows = dry(tmp_path, "bench_layer", "--hdims", "128", "--seqlens", "4096", "--heads", "16,32/8",
                           "--host-n", "5")
    rows = out["rows"]
    assert [(r["heads"], r["heads_kv"], r["causal"]) for r in rows] == [(16, 16, False), (16, 16, True),
                                                                      (32, 8, False), (32, 8, True)]
    assert [n for n, _ in windows[:6]] == ["ours_layer", "ours_plain", "fa4_layer", "fa4_layer", "ours_plain",
                                           "ours_layer"]
    r = rows[0]
    assert set(r["tflops"]) == {"ours_layer", "ours_plain", "fa4_layer"}
    assert 0 < r["ratio"]["lo"] <= r["ratio"]["median"] <= r["ratio"]["hi"]
    assert set(out["host_us"]["128/full"]) == {"ours_step", "fa4_step", "ours_bwd", "fa4_bwd"}
    assert "ours / FA4 (step)" in md and "Host cost per call" in md


def test_bench_bwd_dry(tmp_path):
    """The backward bench: one row per (d, heads, S, mode) with both ratios, and the host-cost table of every
    variant (ours through the launcher, FA4 through its interface)."""
    out, md, windows = dry(tmp_path, "bench_bwd", "--hdims", "128", "--seqlens", "4096", "--heads", "32/8",
                           "--host-n", "5")
    rows = out["rows"]
    assert [(r["heads"], r["heads_kv"], r["causal"]) for r in rows] == [(32, 8, False), (32, 8, True)]
    assert [n for n, _ in windows[:4]] == ["ours", "fa4", "ours_det", "fa4_det"]
    r = rows[1]
    assert set(r["tflops"]) == {"ours", "fa4", "ours_det", "fa4_det"}
    assert set(r["ratios"]) == {"ours_over_fa4", "det_over_fa4_det"}
    assert set(out["host_us"]["128/causal"]) == {"ours", "fa4", "ours_det", "fa4_det"}
    assert "ours det / FA4 det" in md and "Host cost per call" in md


def test_bench_block_sparse_dry(tmp_path):
    out, md, windows = dry(tmp_path, "bench_block_sparse", "--seqlens", "16K", "--selections", "local",
                           "--shapes", "gqa,mqa64,mla64", "--dkdv-min-seg", "64,256")
    rows = out["rows"]
    assert [(r["shape"], r["S"]) for r in rows] == [("gqa", 16384), ("mqa64", 16384), ("mla64", 16384)]
    assert "bs_fwd_ms" in rows[2] and "bs_fwd_bwd_ms" in rows[2]  # the latent: forward and backward
    assert "idx_fwd_bwd_ms" not in rows[2]  # no token path at the latent's head dims
    names = {n for n, _ in windows}
    assert {"bs_fwd", "bs_fwd_bwd", "bs_dq", "bs_dkdv", "bs_dkdv_L64", "bs_dkdv_L256"} <= names
    assert "idx_fwd_bwd_ms" in rows[0] and "idx_fwd_bwd_ms" not in rows[1]  # the token path: GQA only
    assert "bs_dkdv_L256_ms" in rows[1] and len(rows[0]["speedup_vs_idx_fwd_bwd"]) == 3
    assert "dkdv ms by shortest segment" in md and "64: " in md and "256: " in md


def test_bench_json_feeds_plot(tmp_path):
    """What bench_fwd / bench_bwd / bench_block_sparse write with --json is what bench/plot.py reads."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "bench"))
    import plot

    fwd, _, _ = dry(tmp_path, "bench_fwd", "--hdims", "128", "--seqlens", "2048", "--modes", "causal", "--host-n", "0")
    bwd, _, _ = dry(tmp_path, "bench_bwd", "--hdims", "64", "--seqlens", "4096", "--heads", "16", "--modes", "full",
                    "--host-n", "0")
    bs, _, _ = dry(tmp_path, "bench_block_sparse", "--seqlens", "16K", "--selections", "local", "--shapes", "gqa")
    got = [(e["family"], e["shape"], e["series"]) for doc, name in ((fwd, "f"), (bwd, "b"), (bs, "s"))
           for e in plot.entries_from_bench(doc, name)]
    assert got == [("forward", "d128 2K 16/16 causal", "ours+bl / FA4"),
                   ("forward", "d128 2K 16/16 causal", "ours / FA4"),
                   ("backward", "d64 4K 16/16 full", "ours / FA4"),
                   ("backward", "d64 4K 16/16 full", "det / FA4 det"),
                   ("block_sparse", "gqa 16K", "fwd+bwd vs token path"),
                   ("block_sparse", "gqa 16K", "fwd vs token path")]
    e = plot.entries_from_bench(fwd, "f")[0]
    assert e["ratio"] == fwd["rows"][0]["ratios"]["bl_over_fa4"]["median"] and e["gpu"] == "FakeGPU"


def test_flashmask_tiles_counts():
    """bench/flashmask_tiles.py's counts on masks small enough to count by hand: causal over two 128-key tiles visits
    3 tiles (2 diagonal, partial) holding 256 * 257 / 2 visible pairs; two causal 128-token documents visit only the
    2 diagonal tiles, as the varlen count over the same documents does; a bidirectional (n = 2) mask with every row
    masked visits none."""
    import importlib.util

    import numpy as np

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench",
                        "flashmask_tiles.py")
    spec = importlib.util.spec_from_file_location("flashmask_tiles", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    causal = np.full((256, 1), 256, np.int32)
    st = mod.tile_stats(causal, True)
    assert (st["visited"], st["partial"], st["pairs"]) == (3, 2, 256 * 257 // 2)
    docs = np.array([[128]] * 128 + [[256]] * 128, np.int32)  # LTS = each key's document end
    st = mod.tile_stats(docs, True)
    assert (st["visited"], st["partial"], st["pairs"]) == (2, 2, 2 * 128 * 129 // 2)
    vl = mod.varlen_stats([128, 128])
    assert (vl["visited"], vl["partial"], vl["pairs"]) == (2, 2, 2 * 128 * 129 // 2)
    none = np.zeros((256, 2), np.int32)  # non-causal [LTS, UTE]: rows >= 0 masked
    assert mod.tile_stats(none, False)["visited"] == 0
