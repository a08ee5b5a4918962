"""bench/bench_decode.py end to end on the CPU (tests/cpu/_bench_decode_dry.py: stand-in torch, FA4, timer and
decode launchers): rows, per-round ratios against FA4 / SDPA / no-block_logit, JSON and markdown."""

from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_bench_decode_dry(tmp_path):
    js, md = tmp_path / "d.json", tmp_path / "d.md"
    res = subprocess.run([sys.executable, os.path.join(HERE, "_bench_decode_dry.py"), "--heads", "32/8", "--layouts",
                          "contiguous", "--json", str(js), "--markdown", str(md)], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads(js.read_text())
    rows = out["rows"]
    assert [r["kind"] for r in rows] == ["dense", "dense", "dense", "blk"]
    assert all(r["splits"] == 4 for r in rows)
    assert rows[0]["layout"] == "contiguous" and {"vs_fa4", "vs_sdpa"} <= set(rows[0])
    assert "vs_nobl" in rows[3] and len(rows[0]["vs_fa4"]["rounds"]) == 3
    assert out["host_us"] == 9.5 and out["read_GBps"] > 0 and out["copy_GBps"] > 0
    assert "| dense | 32/8 | contiguous |" in md.read_text()
    assert int(res.stdout.split("RUN_DECODE_CALLS ")[-1].split()[0]) > 0
