"""Plot ours / anchor per shape, one panel per op family, from recorded figures and bench JSON files.

    python bench/plot.py [RUN.json ...] [--figures docs/img/figures.json | --no-figures]
                         [--out docs/img/benchmarks.png]

Inputs:
  --figures   the figures docs/benchmarks.md quotes, transcribed from its tables (``{"figures": [entry, ...]}``;
              an entry names family, shape, series, ratio (lo / hi: the rounds' spread), run, date, gpu, commit)
  RUN.json    what ``bench_fwd.py`` / ``bench_bwd.py`` / ``bench_block_sparse.py`` / ``bench_decode.py`` wrote with
              ``--json RUN.json``; its rows become entries of the same form (run = the file's name, date / GPU /
              commit from its ``run`` record; decode: the dense rows' ratios against FA4 b36 and SDPA)

Panels: forward (ours / FA4 b36), backward (ours / FA4 b36's backward, deterministic against deterministic),
block-sparse (against the token path, and the latent forward against FlashMLA's published figure), decode (ours /
FA4 b36 and ours / SDPA per shape). A panel whose ratios span more than 4x gets a log axis. A ratio > 1 means ours
is faster; entries whose ratio is a cost (``higher_is_better: false``: time ratios such as the exact-delta cost) are
not drawn. Each panel's caption names the runs it draws (run, date, commit, GPU). Needs matplotlib
(``pip install ".[demo]"``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIGURES = os.path.join(ROOT, "docs", "img", "figures.json")
OUT = os.path.join(ROOT, "docs", "img", "benchmarks.png")

# (family, panel title); the order of the panels
PANELS = (("forward", "forward: ours / FA4 b36 forward (ours+bl: with the fused block_logit)"),
          ("backward", "backward (pre + main + post): ours / FA4 b36 backward"),
          ("block_sparse", "block-sparse attention: ours / token path (blocks_to_indices + indexed_attention)"),
          ("decode", "decode (issue 41): ours / FA4 b36 and ours / torch SDPA (contiguous cache only), "
                     "per Hq/Hkv, cache, B, Sk"))
SHORT_S = {2048: "2K", 4096: "4K", 8192: "8K", 16384: "16K", 32768: "32K", 65536: "64K", 131072: "128K"}


def _s(n: int) -> str:
    return SHORT_S.get(int(n), str(n))


def _entry(family, shape, series, r, run, **kw) -> dict:
    """An entry from a bench row's ratio dict (``{"median", "lo", "hi", ...}``)."""
    return {"family": family, "shape": shape, "series": series, "ratio": float(r["median"]),
            "lo": float(r["lo"]), "hi": float(r["hi"]), **run, **kw}


def script_of(doc: dict) -> str:
    """Which bench script wrote ``doc``: from its command line, else from the keys of its first row."""
    cmd = str(doc.get("run", {}).get("command", ""))
    for name in ("bench_block_sparse", "bench_bwd", "bench_fwd", "bench_decode"):
        if name in cmd:
            return name
    row = (doc.get("rows") or [{}])[0]
    if "Hkv" in row and "kind" in row:
        return "bench_decode"
    if "shape" in row and "S" in row:
        return "bench_block_sparse"
    if "det_over_fa4_det" in row.get("ratios", {}) or ("ratios" in row and "block_size" not in row):
        return "bench_bwd"
    if "block_size" in row:
        return "bench_fwd"
    raise ValueError("not a bench_fwd / bench_bwd / bench_block_sparse / bench_decode JSON (no recognisable command "
                     "or rows)")


def entries_from_bench(doc: dict, source: str) -> list:
    """Entries of one bench JSON file (``source`` names it in the legend and captions)."""
    info = doc.get("run", {})
    run = {"run": source, "date": str(info.get("date", ""))[:10], "gpu": info.get("gpu", ""),
           "commit": info.get("commit", "")}
    script, out = script_of(doc), []
    for row in doc.get("rows", []):
        if script == "bench_decode":
            if row.get("kind") == "dense":
                cache = "contig" if row["layout"] == "contiguous" else f"P{row['P']}"
                shape = f"{row['Hq']}/{row['Hkv']} {cache} B{row['B']} {_s(row['Sk'])}"
                for key, series in (("vs_fa4", "ours / FA4 b36"), ("vs_sdpa", "ours / SDPA")):
                    if key in row:
                        gpu = run["gpu"] or row.get("gpu", "")
                        out.append(_entry("decode", shape, series, row[key], dict(run, gpu=gpu)))
            continue
        if script == "bench_block_sparse":
            shape = f"{row['shape']} {_s(row['S'])}" + ("" if row.get("selection", "local") == "local"
                                                        else f" {row['selection']}")
            for key, series in (("speedup_vs_idx_fwd_bwd", "fwd+bwd vs token path"),
                                ("speedup_vs_idx_b2i_plan_fwd", "fwd vs token path")):
                if key in row:
                    out.append(_entry("block_sparse", shape, series, row[key], run))
            continue
        shape = f"d{row['head_dim']} {_s(row['seqlen'])} {row['heads']}/{row['heads_kv']} " + (
            "causal" if row["causal"] else "full")
        keys = ((("bl_over_fa4", "ours+bl / FA4"), ("ours_over_fa4", "ours / FA4")) if script == "bench_fwd"
                else (("ours_over_fa4", "ours / FA4"), ("det_over_fa4_det", "det / FA4 det")))
        family = "forward" if script == "bench_fwd" else "backward"
        for key, series in keys:
            if key in row.get("ratios", {}):
                out.append(_entry(family, shape, series, row["ratios"][key], run))
    return out


def load(paths, figures: str | None) -> list:
    entries = []
    if figures:
        with open(figures) as fh:
            entries += json.load(fh)["figures"]
    for p in paths:
        with open(p) as fh:
            entries += entries_from_bench(json.load(fh), os.path.basename(p))
    return entries


def caption(entries) -> str:
    runs = []
    for e in entries:
        key = (e.get("run", ""), e.get("date", ""), e.get("commit", ""), e.get("gpu", ""))
        if key not in runs:
            runs.append(key)
    return "; ".join(f"{r} {d} {c}" for r, d, c, _ in runs) + "  |  " + ", ".join(
        sorted({g.replace("NVIDIA ", "") for _, _, _, g in runs if g}))


def plot(entries, out: str, dpi: int = 80) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    drawn = [e for e in entries if e.get("higher_is_better", True)]
    fams = {f: [e for e in drawn if e["family"] == f] for f, _ in PANELS}
    fig, axes = plt.subplots(len(PANELS), 1, figsize=(15, 17),
                             gridspec_kw={"height_ratios": [3 if fams[f] else 1 for f, _ in PANELS]})
    markers = "os^Dv<>p"
    for ax, (fam, title) in zip(axes, PANELS):
        ents = fams[fam]
        ax.set_title(title, fontsize=10, loc="left")
        if not ents:
            ax.text(0.5, 0.5, "no figures yet", ha="center", va="center", fontsize=10,
                    color="0.4", transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        shapes = list(dict.fromkeys(e["shape"] for e in ents))
        xs = {s: i for i, s in enumerate(shapes)}
        series = list(dict.fromkeys((e["series"], e["run"] if e["run"].endswith(".json") else "") for e in ents))
        n = len(series)
        for k, (name, src) in enumerate(series):
            sel = [e for e in ents if e["series"] == name and (e["run"] if e["run"].endswith(".json") else "") == src]
            off = (k - (n - 1) / 2) * (0.5 / max(1, n))
            x = [xs[e["shape"]] + off for e in sel]
            y = [e["ratio"] for e in sel]
            lo = [e["ratio"] - e.get("lo", e["ratio"]) for e in sel]
            hi = [e.get("hi", e["ratio"]) - e["ratio"] for e in sel]
            ax.errorbar(x, y, yerr=[lo, hi], fmt=markers[k % len(markers)], ms=4, lw=0.8, capsize=1.5,
                        label=name + (f" ({src})" if src else ""))
        ax.axhline(1.0, color="0.3", lw=0.8, ls="--")
        ratios = [e["ratio"] for e in ents]
        if max(ratios) > 4 * min(ratios):  # decode: 0.9x next to 8x; parity stays readable on a log axis
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(matplotlib.ticker.FixedLocator([0.8, 0.9, 1, 1.1, 1.25, 1.5, 2, 3, 4, 6, 8, 12]))
            ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
            ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        y0, y1 = ax.get_ylim()
        ax.set_ylim(min(y0, 0.95), max(y1, 1.05))  # the parity line stays in view
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels(shapes, rotation=90, fontsize=7)
        ax.set_xlim(-0.6, len(shapes) - 0.4)
        ax.tick_params(axis="y", labelsize=7)
        ax.set_ylabel("ours / anchor", fontsize=8)
        ax.grid(axis="y", lw=0.3, color="0.8")
        ax.legend(fontsize=7, loc="best", framealpha=0.8)
        ax.annotate(caption(ents), xy=(1.0, 1.0), xycoords="axes fraction", ha="right", va="bottom", fontsize=7,
                    color="0.35")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi, format="png")
    plt.close(fig)
    from PIL import Image  # matplotlib's own dependency

    buf.seek(0)  # a 64-colour palette keeps the committed picture small (< 150 KB)
    Image.open(buf).convert("RGB").quantize(colors=64).save(out, optimize=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="*",
                    help="JSON files written by bench_fwd / bench_bwd / bench_block_sparse / bench_decode --json")
    ap.add_argument("--figures", default=FIGURES, help="recorded figures (default: docs/img/figures.json)")
    ap.add_argument("--no-figures", action="store_true", help="plot only the given bench JSON files")
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--dpi", type=int, default=80)
    args = ap.parse_args(argv)
    entries = load(args.runs, None if args.no_figures else args.figures)
    if not entries:
        ap.error("nothing to plot (no figures and no bench JSON files)")
    print(plot(entries, args.out, args.dpi))
    return 0


if __name__ == "__main__":
    sys.exit(main())
