"""The edge trace of the SM100 kernels' traced builds (cute_kernels/common/trace.py) and how the selftest
reports it: word encoding, the per-role summary, the hung-case report, and (compile marker) that the
traced forward / backward compile for sm_100a with 0 spills while the production build is unchanged."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cute_kernels import selftest as st
from cute_kernels.common import trace as tr
from tests.conftest import ROOT


def test_words_encode_edges_and_counts():
    edges = tr.edge_names(["q", "kv", "s"])
    assert edges == ["q.full", "q.empty", "kv.full", "kv.empty", "s.full", "s.empty"]
    assert tr.decode(0, edges) is None
    assert tr.decode(tr.DONE, edges) == "done"
    assert tr.decode(tr.encode(5, 7), edges) == "s.empty @7"
    assert tr.decode(tr.encode(2, (1 << tr.COUNT_BITS) + 3), edges) == "kv.full @3"  # the count wraps
    assert all(tr.encode(e, c) != tr.DONE and tr.encode(e, c) != 0 for e in range(8) for c in (0, 5))


def test_summary_names_where_each_role_waits():
    roles, edges = ["mma", "load", "idle"], tr.edge_names(["q", "s"])
    words = {}
    for cta in range(5):  # mma: 3 CTAs wait on s.empty, 2 finished; load waits on q.empty in all
        words[cta * tr.SLOTS_PER_CTA + 0] = tr.encode(3, cta) if cta < 3 else tr.DONE
        words[cta * tr.SLOTS_PER_CTA + 1] = tr.encode(1, 9)
    lines = tr.summarize(words, roles, edges)
    assert lines[0] == "mma: waiting on s.empty in 3 CTAs (@0: 1, @1: 1, @2: 1); finished in 2 CTAs"
    assert lines[1] == "load: waiting on q.empty in 5 CTAs (@9: 5)"
    assert lines[2] == "idle: no trace written"


def test_hung_report_carries_the_edge_trace():
    """A child that prints a trace schema and words, then hangs: the report names the edge."""
    schema = json.dumps(dict(roles=["waiter"], edges=["canary.full", "canary.empty"]))
    words = json.dumps({"0": tr.encode(0, 0)})
    code = (f"import time; print('TRACE ' + {schema!r}, flush=True); print('PHASE sync', flush=True); "
            f"print('EDGES ' + {words!r}, flush=True); time.sleep(60)")
    res = st.run_child([sys.executable, "-c", code], timeout=3)
    assert res["status"] == "hung" and res["edges"] == ["waiter: waiting on canary.full in 1 CTAs (@0: 1)"]
    assert "waiting on canary.full" in st._hint(res)
    # without a trace the report is the phase alone
    res = st.run_child([sys.executable, "-c", "import time; print('PHASE sync', flush=True); time.sleep(60)"], 3)
    assert "edges" not in res and "edge trace" not in st._hint(res)


_COMPILE = r'''
import json, os, sys
os.environ["CUTE_DSL_ARCH"] = sys.argv[1]
os.environ["CUTE_KERNELS_EXTRA_OPTS"] = "remarks{ptx}"
from cute_kernels import check as C
from cute_kernels.attention import bwd_launch as B, launch as F
out = {}
cc = int(sys.argv[1][3:6])
fcfg = F.fwd_config(cc, "bfloat16", 128, 128, 2, True, False, False, 64, False)
bcfg = B.bwd_config(cc, "bfloat16", 128, 128, 2, True, False, False, False, True)
for name, fn in (("fwd", lambda: F.compile_fwd(fcfg, trace=True)), ("bwd", lambda: B.compile_bwd_main_traced(bcfg))):
    with C._capture_fd2() as box:
        fn()
    out[name] = [(f["registers"], f["spill_store_bytes"] + f["spill_load_bytes"]) for f in C.parse_remarks(box["text"])]
print("JSON " + json.dumps(out))
'''


@pytest.mark.compile
@pytest.mark.parametrize("arch", ["sm_100a", "sm_103a"])
def test_traced_builds_compile_for_sm100_without_spills(arch):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("CUTE_DSL_ARCH", None)
    proc = subprocess.run([sys.executable, "-c", _COMPILE, arch], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("JSON ")][-1][5:])
    for name in ("fwd", "bwd"):
        assert res[name] and all(spill == 0 for _, spill in res[name]), res


def test_production_launchers_pass_no_trace():
    """The untraced build is the default everywhere but the selftest: compile keys differ by the flag."""
    import inspect

    from cute_kernels.attention import bwd_launch, launch

    assert inspect.signature(launch.run_fwd).parameters["trace_addr"].default is None
    assert inspect.signature(bwd_launch.run_bwd).parameters["trace_addr"].default is None
    assert inspect.signature(launch.compile_fwd).parameters["trace"].default is False
    with pytest.raises(NotImplementedError, match="SM100 kernel only"):
        launch.compile_fwd(launch.fwd_config(90, "bfloat16", 128, 128, 1, False, False, False, 0, False), trace=True)


@pytest.mark.compile
def test_hang_canary_compiles_for_sm90():
    """The selftest's traced hang canary (run on the H200 by ``selftest --canary``) builds without a GPU."""
    code = ("import os; os.environ['CUTE_DSL_ARCH'] = 'sm_90a'\n"
            "from cute_kernels import selftest as st\nst.compile_canary_hang(90)\nprint('OK')")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("CUTE_DSL_ARCH", None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
