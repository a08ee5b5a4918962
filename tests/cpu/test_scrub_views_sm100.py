"""The SM100 scrubs (Note [scrubbed value tiles, SM100] in fwd_sm100.py, Note [scrubbed K / V, SM100] in
bwd_sm100.py) scan a shared-memory K / V buffer through a (keys, head dims) view they build from the MMA
operand layout. The scan zeroes and flags by that view, so it must name the same bytes as the MMA: for every
head dim, each sampled element of the operand layout (its (key, dim) coordinate from the MMA's own partition
of an identity tensor) sits at the offset the view gives that coordinate. A view with keys and dims swapped
is checked to differ (the test can fail). Trace-time layout algebra only (no compile, no GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT

_SCRIPT = r"""
import json, os, sys
os.environ["CUTE_DSL_ARCH"] = "sm_100a"
import cutlass, cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass.cute.nvgpu import tcgen05
from cute_kernels.attention.config import FwdConfig
from cute_kernels.attention import fwd_sm100 as F, bwd_sm100 as B

STEP = 7  # samples every 7th element (coprime to every power-of-two extent)


def count(view, stage, crd, order, n, swapped):
    bad = 0
    for i in range(0, n, STEP):  # plain Python (count is not a jit function): static ints
        c = crd[i]
        key, dim = (c[1], c[0]) if order == "dk" else (c[0], c[1])
        want = stage(i)
        bad = bad + int(cute.crd2idx((key, dim), view) != want)
        swapped = swapped + int(cute.crd2idx((dim % cute.size(view, mode=[0]), key), view) != want)
    return bad, swapped


results = []
for d, dv in [(64, 64), (128, 128), (192, 192), (256, 256), (192, 128)]:
    cfg = FwdConfig(arch=100, dtype="bfloat16", head_dim=d, head_dim_v=dv, qhead_per_kvhead=1, causal=True,
                    has_window=False, has_softcap=False, block_size=0, varlen=False, startend="", block_bos=False)
    k = F.FlashFwdSm100(cfg)
    k.dtype = cutlass.BFloat16

    @cute.jit
    def fwd():
        _tq, tp, _sq, _sk, sV, _tP = k.mmas_and_layouts()
        stage = cute.slice_(sV.outer, (None, None, None, 0))
        crd = tp.get_slice(0).partition_B(cute.make_identity_tensor((dv, F.TILE_N)))
        bad, swapped = count(k.v_key_major(sV), stage, crd, "dk", cute.size(stage), 0)
        results.append(["fwd V", d, dv, cute.size(stage), bad, swapped])

    cute.compile(fwd)
for d, tm in [(64, 128), (96, 128), (128, 128), (192, 64), (256, 64)]:
    @cute.jit
    def bwd():
        dt = cutlass.BFloat16
        K_ = cute.nvgpu.OperandMajorMode.K
        mma = sm100_utils.make_trivial_tiled_mma(dt, dt, K_, K_, cutlass.Float32, tcgen05.CtaGroup.ONE, (128, tm))
        L = sm100_utils.make_smem_layout_a(mma, (128, tm, d), dt, 1)
        stage = cute.slice_(L.outer, (None, None, None, 0))
        crd = mma.get_slice(0).partition_A(cute.make_identity_tensor((128, d)))
        bad, swapped = count(B.FlashBwdSm100.key_major(L), stage, crd, "kd", cute.size(stage), 0)
        results.append(["bwd K / V", d, d, cute.size(stage), bad, swapped])

    cute.compile(bwd)
print("RESULT " + json.dumps(results))
"""


def test_scrub_views_name_the_mma_operand_bytes(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    script = tmp_path / "scrub_views.py"  # the DSL reads a jit function's source from its file
    script.write_text(_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    rows = json.loads(line[len("RESULT "):])
    assert len(rows) == 10
    for what, d, dv, n, bad, swapped in rows:
        assert n == 128 * (dv if what == "fwd V" else d), (what, d, n)
        assert bad == 0, f"{what} d {d}/{dv}: {bad} sampled elements at another offset than the MMA's"
        assert swapped > 0, f"{what} d {d}/{dv}: the swapped view was not told apart"
