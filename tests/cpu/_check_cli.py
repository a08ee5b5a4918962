"""``python -m cute_kernels.check`` in a subprocess, for the compile tests (the DSL target is fixed per
process, so each arch gets its own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT


def run_check(tmp_path, arch: str, kernel: str, *extra: str, timeout: int = 7200) -> list[dict]:
    """The JSON rows of ``cute_kernels.check --arch <arch> --kernel <kernel> [extra]``; asserts the run
    succeeded and every config compiled without spills (per-kernel limits are the caller's)."""
    out = tmp_path / f"{arch}-{kernel}.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("CUTE_DSL_ARCH", None)  # check sets it from --arch
    proc = subprocess.run([sys.executable, "-m", "cute_kernels.check", "--arch", arch, "--kernel", kernel,
                           "--json", str(out), *extra], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = json.loads(out.read_text())
    assert rows and all(r["ok"] for r in rows), [r for r in rows if not r["ok"]][:3]
    assert all(r["spill_bytes"] == 0 for r in rows)
    return rows
