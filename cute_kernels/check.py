"""Compile every kernel config for an arch without a GPU and report its resources.

    python -m cute_kernels.check --arch sm_90a|sm_100a|sm_103a [--kernel NAME] [--full] [--match TEXT ...]
                                 [--limit N] [--shard K/N] [--json FILE]

For each config prints: kernel, config, compile seconds, registers per thread, spill store/load
bytes and the dynamic shared memory the launcher requests (vs the arch limit). Exits non-zero when
any config fails to compile, spills, asks for more shared memory than the arch has, or has its SM90
wgmma instructions serialized by ptxas (its "Potential Performance Loss" info, C75xx: the async
tensor-core pipeline then waits after every wgmma, a silent slowdown no spill count shows).
Registers, spills and those notes come from ptxas remarks (``remarks{ptx}``) captured from stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
import time
import traceback

from cute_kernels.arch import dsl_cuda  # noqa: F401  (the summary line names the build; tests read it here)

_REMARK = re.compile(
    # Plain ptxas -v output quotes the name on one line; when ptxas spills, the DSL re-wraps the same
    # text in a remark (name unquoted or quoted on the next line), so accept both.
    r"Compiling entry function\s+'?(?P<fn>[^'\s]+)'?.*?"
    r"(?P<stack>\d+) bytes stack frame, (?P<st>\d+) bytes spill stores, (?P<ld>\d+) bytes spill loads.*?"
    r"Used (?P<regs>\d+) registers",
    re.S,
)


@contextlib.contextmanager
def _capture_fd2():
    """Capture everything written to file descriptor 2 (ptxas remarks come from native code)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        box = {"text": ""}
        try:
            yield box
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            box["text"] = tmp.read().decode("utf-8", "replace")


_SERIALIZED = re.compile(r"wgmma\.mma_async instructions are serialized (?:due to )?(?P<why>.*?)"
                         r"(?: (?:for|in) the function\b.*)?$", re.M)


def serialized_wgmma(text: str) -> list[str]:
    """The reasons of every ptxas note that it serialized wgmma.mma_async instructions (deduplicated)."""
    return sorted({m["why"].strip() or "no reason given" for m in _SERIALIZED.finditer(text)})


def parse_remarks(text: str) -> list[dict]:
    """Per kernel entry function: registers, stack and spill bytes from ptxas remarks."""
    out = []
    for m in _REMARK.finditer(text):
        out.append({"function": m["fn"], "registers": int(m["regs"]), "stack_bytes": int(m["stack"]),
                    "spill_store_bytes": int(m["st"]), "spill_load_bytes": int(m["ld"])})
    return out


def check(arch_text: str, kernel: str | None = None, full: bool = False, limit: int | None = None,
          match: list[str] | tuple[str, ...] = (), shard: tuple[int, int] = (0, 1)) -> list[dict]:
    """Compile each kernel's config matrix for ``arch_text`` (``match``: only the configs whose repr contains
    every one of these strings; ``shard`` (k, n): only the configs at positions k, k + n, k + 2n, ... of that
    list, so n processes or sessions split a long ``--full`` matrix; ``limit``: at most that many configs per
    kernel, the first of its selection) and return one result row per config."""
    from cute_kernels import arch as _arch

    arch = _arch.parse_arch(arch_text)
    if arch not in _arch.TARGETS:
        raise SystemExit(f"--arch {arch_text}: {_arch.arch_reason(arch)}")
    # The DSL reads the target at first use; set it before cutlass is imported (compile-only mode).
    os.environ["CUTE_DSL_ARCH"] = _arch.arch_name(arch)
    os.environ["CUTE_KERNELS_EXTRA_OPTS"] = (os.environ.get("CUTE_KERNELS_EXTRA_OPTS", "") + " remarks{ptx}").strip()
    from cute_kernels.registry import all_checks

    checks = all_checks()
    if kernel is not None and kernel not in checks:
        raise SystemExit(f"unknown kernel {kernel!r}; known: {', '.join(sorted(checks))}")
    smem_max = _arch.SMEM_BYTES_MAX[_arch.family(arch)]
    results = []
    for name, (matrix, compile_fn, smem_fn) in checks.items():
        if kernel is not None and name != kernel:
            continue
        cfgs = [c for c in matrix(arch, full) if all(m in repr(c) for m in match)][shard[0]::shard[1]]
        for cfg in cfgs[:limit]:
            row = {"kernel": name, "config": repr(cfg), "ok": False}
            start = time.perf_counter()
            try:
                with _capture_fd2() as box:
                    compile_fn(cfg)
                row["compile_seconds"] = round(time.perf_counter() - start, 2)
                fns = parse_remarks(box["text"])
                row["functions"] = fns
                row["registers"] = max((f["registers"] for f in fns), default=None)
                row["spill_bytes"] = sum(f["spill_store_bytes"] + f["spill_load_bytes"] for f in fns)
                row["smem_bytes"] = smem_fn(cfg)
                problems = []
                if not fns:
                    problems.append("no ptxas remark captured")
                if row["spill_bytes"]:
                    problems.append(f"{row['spill_bytes']} spill bytes")
                for why in serialized_wgmma(box["text"]):
                    problems.append(f"ptxas serialized wgmma ({why})")
                if row["smem_bytes"] is not None and row["smem_bytes"] > smem_max:
                    problems.append(f"smem {row['smem_bytes']} > {smem_max}")
                row["problems"] = problems
                row["ok"] = not problems
            except Exception as exc:  # report and go on: one failure must not hide the others
                row["compile_seconds"] = round(time.perf_counter() - start, 2)
                row["problems"] = [f"{type(exc).__name__}: {exc}"]
                row["traceback"] = traceback.format_exc()
            results.append(row)
            _print_row(row)
    return results


def _print_row(row: dict) -> None:
    status = "ok  " if row["ok"] else "FAIL"
    regs = row.get("registers")
    print(f"{status} {row['kernel']:<28} {row.get('compile_seconds', 0):6.2f}s regs={regs} "
          f"spill={row.get('spill_bytes')} smem={row.get('smem_bytes')}  {row['config']}", flush=True)
    for p in row.get("problems", []):
        print(f"     problem: {p}", flush=True)
    if not row["ok"] and "traceback" in row and os.environ.get("CUTE_KERNELS_CHECK_VERBOSE"):
        print(row["traceback"], flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cute_kernels.check", description=__doc__.splitlines()[0])
    ap.add_argument("--arch", required=True, help="sm_90a, sm_100a or sm_103a (the CC's target, arch.TARGETS)")
    ap.add_argument("--kernel", default=None, help="only this kernel (default: all)")
    ap.add_argument("--full", action="store_true", help="the full config matrix (slow)")
    ap.add_argument("--match", action="append", default=[], metavar="TEXT",
                    help="only configs whose repr contains TEXT (repeat: all of them), e.g. --match varlen=True")
    ap.add_argument("--limit", type=int, default=None, help="at most N configs per kernel (CI smoke)")
    ap.add_argument("--shard", default="0/1", metavar="K/N",
                    help="only every N-th config of each kernel's selection, starting at the K-th (0-based): N runs "
                         "with K = 0 .. N-1 cover the matrix once")
    ap.add_argument("--json", default=None, help="write the results to this file")
    args = ap.parse_args(argv)
    try:
        k, n = (int(x) for x in args.shard.split("/"))
        if not (n >= 1 and 0 <= k < n):
            raise ValueError
    except ValueError:
        ap.error(f"--shard {args.shard!r}: expected K/N with N >= 1 and 0 <= K < N")
    results = check(args.arch, args.kernel, args.full, args.limit, args.match, (k, n))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    failed = [r for r in results if not r["ok"]]
    cuda = dsl_cuda()
    print(f"{len(results) - len(failed)} of {len(results)} configs compiled cleanly for {os.environ['CUTE_DSL_ARCH']}"
          f" (the DSL's CUDA {cuda if cuda is not None else '?'} build)")
    want = os.environ.get("CUTE_KERNELS_CHECK_DSL_CUDA")
    if want and str(cuda) != want:  # e.g. a CUDA 12 driver makes the DSL take its CUDA 12 build
        print(f"expected the DSL's CUDA {want} build (CUTE_KERNELS_CHECK_DSL_CUDA), compiled with CUDA {cuda}")
        return 1
    return 1 if failed or not results else 0


if __name__ == "__main__":
    sys.exit(main())
