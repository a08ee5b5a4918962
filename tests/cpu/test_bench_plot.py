"""bench/plot.py on the CPU: bench JSON rows become plot entries, the picture is written, and the committed
docs/img/figures.json quotes docs/benchmarks.md exactly (each entry's ratio on a table row of its run and commit)."""

from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import plot  # noqa: E402

RUN = {"date": "2026-12-05 10:00:00 UTC", "commit": "abc1234", "gpu": "NVIDIA H200",
       "command": "python bench/bench_fwd.py --hdims 128"}


def spread(m, lo, hi):
    return {"median": m, "lo": lo, "hi": hi, "rounds": [m, lo, hi]}


def fwd_doc():
    row = {"head_dim": 128, "seqlen": 8192, "batch": 4, "heads": 32, "heads_kv": 8, "causal": True, "block_size": 64,
           "ratios": {"bl_over_fa4": spread(0.91, 0.9, 0.92), "ours_over_fa4": spread(0.95, 0.94, 0.96),
                      "bl_over_ours": spread(0.97, 0.96, 0.98)}}
    return {"run": RUN, "rows": [row]}


def bwd_doc():
    row = {"head_dim": 64, "seqlen": 2048, "batch": 16, "heads": 16, "heads_kv": 16, "causal": False,
           "ratios": {"ours_over_fa4": spread(0.93, 0.92, 0.95), "det_over_fa4_det": spread(0.9, 0.88, 0.91)}}
    return {"run": dict(RUN, command="python bench/bench_bwd.py"), "rows": [row]}


def bs_doc():
    rows = [{"shape": "gqa", "S": 16384, "selection": "local", "speedup_vs_idx_fwd_bwd": spread(2.09, 2.08, 2.13),
             "speedup_vs_idx_b2i_plan_fwd": spread(2.49, 2.48, 2.52)},
            {"shape": "mla64", "S": 16384, "selection": "local", "bs_fwd_ms": 4.1}]
    return {"run": dict(RUN, command="python bench/bench_block_sparse.py"), "rows": rows}


def decode_doc():
    """bench_decode.py's rows: dense rows carry vs_fa4 (and vs_sdpa on the contiguous cache); blk / sparse rows
    are not ratios against an anchor and give no entries."""
    dense = {"kind": "dense", "Hq": 32, "Hkv": 8, "layout": "contiguous", "P": 0, "B": 1, "Sk": 131072, "splits": 32,
             "us": 198.5, "vs_fa4": spread(6.69, 6.66, 6.72), "vs_sdpa": spread(0.98, 0.97, 0.98)}
    paged = dict(dense, layout="hnd", P=16, B=8, Sk=32768, vs_fa4=spread(1.32, 1.31, 1.32))
    del paged["vs_sdpa"]
    blk = dict(paged, kind="blk", vs_nobl=spread(0.96, 0.95, 0.96))
    del blk["vs_fa4"]
    return {"run": dict(RUN, gpu="NVIDIA H100 80GB HBM3", command="python bench/bench_decode.py --ab"),
            "rows": [dense, paged, blk]}


def test_entries_from_bench_json():
    fwd = plot.entries_from_bench(fwd_doc(), "fwd.json")
    assert [(e["family"], e["shape"], e["series"], e["ratio"]) for e in fwd] == [
        ("forward", "d128 8K 32/8 causal", "ours+bl / FA4", 0.91),
        ("forward", "d128 8K 32/8 causal", "ours / FA4", 0.95)]
    assert fwd[0]["lo"] == 0.9 and fwd[0]["hi"] == 0.92
    assert fwd[0]["run"] == "fwd.json" and fwd[0]["commit"] == "abc1234" and fwd[0]["date"] == "2026-12-05"
    bwd = plot.entries_from_bench(bwd_doc(), "bwd.json")
    assert [(e["family"], e["series"], e["ratio"]) for e in bwd] == [("backward", "ours / FA4", 0.93),
                                                                     ("backward", "det / FA4 det", 0.9)]
    bs = plot.entries_from_bench(bs_doc(), "bs.json")
    assert [(e["family"], e["shape"], e["series"]) for e in bs] == [
        ("block_sparse", "gqa 16K", "fwd+bwd vs token path"), ("block_sparse", "gqa 16K", "fwd vs token path")]
    dec = plot.entries_from_bench(decode_doc(), "dec.json")
    assert [(e["family"], e["shape"], e["series"], e["ratio"]) for e in dec] == [
        ("decode", "32/8 contig B1 128K", "ours / FA4 b36", 6.69),
        ("decode", "32/8 contig B1 128K", "ours / SDPA", 0.98),
        ("decode", "32/8 P16 B8 32K", "ours / FA4 b36", 1.32)]
    assert dec[0]["gpu"] == "NVIDIA H100 80GB HBM3" and dec[0]["lo"] == 6.66
    # without a command line the script is told apart by its rows
    for doc, fam in ((fwd_doc(), "forward"), (bwd_doc(), "backward"), (bs_doc(), "block_sparse"),
                     (decode_doc(), "decode")):
        doc["run"] = {}
        assert plot.entries_from_bench(doc, "x.json")[0]["family"] == fam
    with pytest.raises(ValueError, match="not a bench"):
        plot.entries_from_bench({"rows": [{"op": "page_scores"}]}, "h2o.json")


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    figures = {"figures": [
        {"family": "forward", "shape": "d128 2K 16/16 full", "series": "ours+bl / FA4", "ratio": 0.897, "lo": 0.887,
         "hi": 0.898, "run": "AH2", "date": "2026-12-03", "gpu": "NVIDIA H200", "commit": "085a57d"},
        {"family": "indexed", "shape": "16K", "series": "time", "ratio": 0.79, "higher_is_better": False,
         "run": "R", "date": "2026-12-01", "gpu": "NVIDIA H200", "commit": "5c19bf2"}]}
    paths = []
    for name, doc in (("figures.json", figures), ("fwd.json", fwd_doc()), ("bwd.json", bwd_doc()),
                      ("bs.json", bs_doc()), ("dec.json", decode_doc())):
        (tmp_path / name).write_text(json.dumps(doc))
        paths.append(str(tmp_path / name))
    out = tmp_path / "img" / "b.png"
    assert plot.main(paths[1:] + ["--figures", paths[0], "--out", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and 1000 < len(data) < 150_000
    out2 = tmp_path / "only_runs.png"
    assert plot.main([paths[1], "--no-figures", "--out", str(out2)]) == 0 and out2.exists()
    with pytest.raises(SystemExit):  # nothing to plot
        plot.main(["--no-figures", "--out", str(tmp_path / "none.png")])


def test_figures_json_quotes_benchmarks_md():
    """Every committed figure is a ratio docs/benchmarks.md records, on a table row of the same run and commit (and,
    where the entry names it, the row's leading cells: the decode rows give Hq/Hkv, cache, B and Sk)."""
    with open(os.path.join(ROOT, "docs", "img", "figures.json")) as fh:
        figures = json.load(fh)["figures"]
    with open(os.path.join(ROOT, "docs", "benchmarks.md")) as fh:
        rows = [line for line in fh if line.startswith("| ")]
    assert len(figures) >= 100
    fams = {e["family"] for e in figures}
    assert {"forward", "backward", "block_sparse", "decode"} <= fams
    for e in figures:
        assert {"run", "date", "gpu", "commit", "ratio", "ratio_text"} <= set(e), e
        tag = f"{e['run']} · {e['date']} · `{e['commit']}`"
        hits = [r for r in rows
                if tag in r and e["ratio_text"] in r.replace("*", "") and r.startswith(e.get("row", ""))]
        assert hits, f"{e['family']} {e['shape']} {e['series']} {e['ratio_text']} ({tag}) not in docs/benchmarks.md"
        assert float(e["ratio_text"].replace("x", " ").replace("×", " ").split()[0]) == e["ratio"]


def test_committed_png_is_small():
    size = os.path.getsize(os.path.join(ROOT, "docs", "img", "benchmarks.png"))
    assert size < 150_000, size


def test_readme_figures_are_in_benchmarks_md():
    """README's "where it stands" table quotes docs/benchmarks.md: every number in it is one the tables hold."""
    import re

    with open(os.path.join(ROOT, "README.md")) as fh:
        readme = fh.read()
    with open(os.path.join(ROOT, "docs", "benchmarks.md")) as fh:
        bench = fh.read()
    start = readme.index("Where it stands")
    table = [line for line in readme[start:readme.index("docs/img/benchmarks.png", start)].splitlines()
             if line.startswith("| ") and not line.startswith("| op |")]
    assert len(table) >= 10
    numbers = {n for line in table for n in re.findall(r"\d+\.\d+", line.split("|")[4])}
    assert len(numbers) >= 30
    missing = sorted(n for n in numbers if not re.search(r"(?<![\d.])" + re.escape(n) + r"(?![\d])", bench))
    assert not missing, missing
