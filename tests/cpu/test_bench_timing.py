"""bench/_timing.py without a GPU: window order, statistics, per-round ratios, and the CUDA timer's
schedule driven by a simulated stream (host and GPU clocks, launch gaps) in place of torch."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "_timing.py")
_spec = importlib.util.spec_from_file_location("bench_timing_under_test", _PATH)
T = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = T
_spec.loader.exec_module(T)


# ----------------------------------------------------------------------------- pure parts
def test_window_order_alternates():
    assert T.window_order(["A", "B", "C"], 4) == [["A", "B", "C"], ["C", "B", "A"], ["A", "B", "C"],
                                                   ["C", "B", "A"]]
    assert T.window_order(["x"], 3) == [["x"], ["x"], ["x"]]
    with pytest.raises(ValueError):
        T.window_order(["A"], 0)
    with pytest.raises(ValueError):
        T.window_order(["A", "A"], 3)


def test_median_and_summary():
    assert T.median([3.0, 1.0, 2.0]) == 2.0
    assert T.median([4.0, 1.0, 3.0, 2.0]) == 2.5
    with pytest.raises(ValueError):
        T.median([])
    st = T.summarize([1.2, 0.9, 1.0], reps=(10, 11, 12), mode="graph")
    assert (st.median_ms, st.lo_ms, st.hi_ms) == (1.0, 0.9, 1.2)
    assert st.samples == (1.2, 0.9, 1.0) and st.reps == (10, 11, 12) and st.mode == "graph"
    assert st.as_dict()["windows_ms"] == [1.2, 0.9, 1.0]


class ScriptedTimer:
    """Returns per-repetition samples from a table keyed by (name, how many windows of it ran)."""

    def __init__(self, table):
        self.table = table
        self.calls = []
        self.count = {}

    def window(self, name, fn):
        i = self.count.get(name, 0)
        self.count[name] = i + 1
        self.calls.append(name)
        fn()
        return self.table[name][i]


def test_run_windows_order_stats_and_ratio_per_round():
    ran = []
    fns = {n: (lambda n=n: ran.append(n)) for n in ("A", "B", "C")}
    # round r's windows: A is 2x B in rounds 0 and 2 but 4x in round 1; medians of the reps are used
    table = {"A": [[2.0, 2.0, 9.0], [4.0, 4.0, 4.0], [2.2, 2.2, 2.2]],
             "B": [[1.0, 1.0], [1.0, 1.0, 0.0], [1.1]],
             "C": [[5.0], [6.0], [7.0]]}
    timer = ScriptedTimer(table)
    res = T.run_windows(fns, 3, timer)
    assert timer.calls == ["A", "B", "C", "C", "B", "A", "A", "B", "C"]
    assert ran == timer.calls
    assert res["A"].samples == (2.0, 4.0, 2.2)
    assert (res["A"].median_ms, res["A"].lo_ms, res["A"].hi_ms) == (2.2, 2.0, 4.0)
    assert res["A"].reps == (3, 3, 3) and res["B"].reps == (2, 3, 1)
    assert res["B"].samples == (1.0, 1.0, 1.1)
    r = res.ratio("A", "B")
    assert r.samples == pytest.approx((2.0, 4.0, 2.0))
    assert (r.median, r.lo, r.hi) == pytest.approx((2.0, 2.0, 4.0))
    # per-round, not a ratio of medians: 2.2 / 1.0 would be 2.2
    assert r.median != pytest.approx(res["A"].median_ms / res["B"].median_ms)
    assert res.as_dict()["rounds"][1] == {"A": 4.0, "B": 1.0, "C": 6.0}


def test_run_windows_rejects_empty_window():
    class Empty:
        def window(self, name, fn):
            return []

    with pytest.raises(RuntimeError):
        T.run_windows({"A": lambda: None}, 3, Empty())


def test_reps_and_pad():
    assert T.reps_for_window(0.001, 0.5) == 500
    assert T.reps_for_window(0.3, 0.5) == 3  # min_reps
    assert T.reps_for_window(1e-7, 0.5, max_reps=20000) == 20000
    assert T.reps_for_window(0.0, 0.5) == 20000
    assert T.pad_us(100.0) == pytest.approx(145.0)
    assert T.pad_us(-5.0) == pytest.approx(20.0)


def test_host_us_per_call_fake_clock():
    now = [0.0]

    def clock():
        return now[0]

    def fn():
        now[0] += 37e-6

    assert T.host_us_per_call(fn, n=50, repeats=3, busy=False, clock=clock) == pytest.approx(37.0)


# ----------------------------------------------------------------------------- simulated CUDA stream
class Sim:
    """One in-order stream: every launch costs the host ``launch_us``; the GPU starts an item when it
    is free and the item has been launched. Events take the GPU time at which the stream reaches
    them. Clocks in microseconds."""

    def __init__(self, launch_us=4.0, flush_us=70.0, mhz=1500.0):
        self.host = 0.0
        self.gpu = 0.0
        self.launch_us, self.flush_us, self.mhz = launch_us, flush_us, mhz
        self.log = []
        self.capturing = None
        self.syncs = 0

    def launch(self, dur, tag):
        if self.capturing is not None:
            self.capturing.append((dur, tag))
            return
        self.host += self.launch_us
        self.gpu = max(self.gpu, self.host) + dur
        self.log.append(tag)

    def clock(self):
        return self.host * 1e-6


class FakeEvent:
    def __init__(self, sim, enable_timing=True):
        self.sim, self.t = sim, None

    def record(self):
        s = self.sim
        s.host += 1.0
        s.gpu = max(s.gpu, s.host)
        self.t = s.gpu
        s.log.append("record")

    def synchronize(self):
        self.sim.host = max(self.sim.host, self.t)

    def elapsed_time(self, other):
        return (other.t - self.t) / 1e3  # ms


class FakeGraph:
    def __init__(self, sim):
        self.sim, self.items = sim, []

    def replay(self):  # one launch running the captured items back to back
        self.sim.launch(sum(d for d, _ in self.items), "replay")


class FakeCuda:
    def __init__(self, sim):
        self.sim = sim

    def Event(self, enable_timing=True):  # noqa: N802 - torch's name
        return FakeEvent(self.sim)

    def synchronize(self):
        self.sim.host = max(self.sim.host, self.sim.gpu)
        self.sim.syncs += 1
        self.sim.log.append("sync")

    def _sleep(self, cycles):
        self.sim.launch(cycles / self.sim.mhz, "sleep")

    def Stream(self):  # noqa: N802
        return self

    def current_stream(self):
        return self

    def wait_stream(self, other):
        pass

    def stream(self, s):
        import contextlib

        return contextlib.nullcontext()

    def CUDAGraph(self):  # noqa: N802
        return FakeGraph(self.sim)

    def graph(self, g):
        import contextlib

        sim = self.sim

        @contextlib.contextmanager
        def cm():
            sim.capturing = g.items
            try:
                yield
            finally:
                sim.capturing = None

        return cm()


class FakeBuf:
    def __init__(self, sim):
        self.sim = sim

    def zero_(self):
        self.sim.launch(self.sim.flush_us, "flush")

    def view(self, *shape):
        return self


class FakeTorch:
    uint8 = "uint8"
    bfloat16 = "bfloat16"
    GEMM_US = 1500.0  # one 8192^3 bf16 GEMM

    def __init__(self, sim):
        self.sim = sim
        self.cuda = FakeCuda(sim)

    def empty(self, n, dtype=None, device=None):
        return FakeBuf(self.sim)

    def randn(self, *shape, dtype=None, device=None):
        return ("randn", shape)

    def matmul(self, a, b):
        self.sim.launch(self.GEMM_US, "gemm")

    def amax(self, x, dim=None, out=None):
        self.sim.launch(self.sim.flush_us, "read_flush")


def kernel_fn(sim, host_us, kernel_us, tag="kernel"):
    """A variant that spends ``host_us`` of Python around one launch of ``kernel_us``, like a Python
    interface with work before and after the launch."""

    def fn():
        sim.host += host_us / 2
        sim.launch(kernel_us, tag)
        sim.host += host_us / 2

    return fn


def make_timer(sim, **kw):
    kw.setdefault("window_s", 0.02)
    kw.setdefault("warmup_s", 0.005)
    return T.CudaTimer(torch_mod=FakeTorch(sim), clock=sim.clock, **kw)


@pytest.mark.parametrize("host_us,kernel_us", [(150.0, 10.0), (10.0, 300.0), (150.0, 150.0)])
def test_cuda_timer_excludes_flush_pad_and_host(host_us, kernel_us):
    sim = Sim()
    timer = make_timer(sim)
    assert timer.cycles_per_us == pytest.approx(sim.mhz)
    fn = kernel_fn(sim, host_us, kernel_us)
    ms = timer.window("k", fn)
    # the window spans >= window_s and is measured as the kernel alone (flush, pad, host excluded)
    assert len(ms) >= 3
    assert all(m == pytest.approx(kernel_us / 1e3) for m in ms)
    # the window lasts about window_s of GPU time (sized from the warm-up's wall time per repetition)
    t0 = sim.gpu
    timer.window("k", fn)
    assert 0.8 * timer.window_s <= (sim.gpu - t0) * 1e-6 <= 3.0 * timer.window_s


def test_cuda_timer_window_has_one_sync_after_the_reps():
    sim = Sim()
    timer = make_timer(sim)
    fn = kernel_fn(sim, 50.0, 20.0)
    timer.window("k", fn)  # prepares (first call, warm-up)
    del sim.log[:]
    timer.window("k", fn)
    log = sim.log
    # warm-up batches sync; the timed stretch starts at the lead spin after the last warm-up sync
    lead = max(i for i, x in enumerate(log[:-1]) if x == "sync") + 1
    timed = log[lead:]
    assert timed[-1] == "sync" and "sync" not in timed[:-1]
    reps = timed[1:-1]
    assert len(reps) % 5 == 0 and len(reps) >= 15
    assert reps == ["flush", "sleep", "record", "kernel", "record"] * (len(reps) // 5)


def test_cuda_timer_without_pad_would_see_host_time():
    # the control: with the pad and the lead spin off, a host-bound variant's Python leaks in
    sim = Sim()
    timer = make_timer(sim, pad=False, flush=False)
    ms = timer.window("k", kernel_fn(sim, 150.0, 10.0))
    assert T.median(ms) > 0.1  # ms: mostly the 150 us of host time, not the 10 us kernel


def test_cuda_timer_graph_replay_and_fallback():
    sim = Sim()
    timer = make_timer(sim, graph=True)

    def bad():
        if sim.capturing is not None:
            raise RuntimeError("not capturable")
        sim.launch(30.0, "kernel")

    res = T.run_windows({"g": kernel_fn(sim, 150.0, 10.0), "bad": bad}, 3, timer)
    assert res["g"].mode == "graph" and res["bad"].mode == "eager"
    assert "not capturable" in timer.capture_errors["bad"]
    assert res["g"].median_ms == pytest.approx(0.010)
    assert res["bad"].median_ms == pytest.approx(0.030)
    assert res.ratio("bad", "g").median == pytest.approx(3.0)


def test_cuda_timer_forgets_between_calls():
    # one timer serves many configs: a second run_windows with the same names times the new callables
    sim = Sim()
    timer = make_timer(sim, graph=True)
    a = T.run_windows({"ours": kernel_fn(sim, 20.0, 40.0)}, 3, timer)
    b = T.run_windows({"ours": kernel_fn(sim, 20.0, 80.0)}, 3, timer)
    assert a["ours"].median_ms == pytest.approx(0.040)
    assert b["ours"].median_ms == pytest.approx(0.080)


def test_host_us_per_call_busy_spins_first():
    sim = Sim()
    fake = FakeTorch(sim)
    fn = kernel_fn(sim, 20.0, 500.0)
    us = T.host_us_per_call(fn, n=10, repeats=3, busy=True, torch_mod=fake, clock=sim.clock)
    assert us == pytest.approx(20.0 + sim.launch_us)
    assert sim.log.count("sleep") == 3  # one spin before each counted repeat (not the sizing one)


def test_run_info_markdown_has_fields():
    info = T.RunInfo(gpu="FakeGPU", method={"window_s": 0.5})
    info.finish()
    md = info.markdown()
    for part in ("date ", "commit `", "GPU FakeGPU", "command `", "clocks.sm", "window_s 0.5"):
        assert part in md
    assert info.date.endswith("UTC")


# ----------------------------------------------------------------------------- the scripts' CPU parts
def _bench_module(name):
    bench_dir = os.path.join(os.path.dirname(__file__), "..", "..", "bench")
    sys.path.insert(0, os.path.abspath(bench_dir))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}_under_test", os.path.join(bench_dir, f"{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.pop(0)
    return mod


def _scripted(names, per_round):
    table = {n: [[v] for v in per_round[n]] for n in names}
    return T.run_windows({n: (lambda: None) for n in names}, len(per_round[names[0]]), ScriptedTimer(table))


def test_bench_fwd_args_ratios_and_markdown():
    m = _bench_module("bench_fwd")
    args = m.parse_args(["--hdims", "128", "--heads", "32", "--heads-kv", "8", "--variants", "ours,ours_bl,fa4"])
    assert args.heads_kv == 8 and args.variants == ["ours", "ours_bl", "fa4"] and args.rounds == 3
    with pytest.raises(SystemExit):
        m.parse_args(["--variants", "ours,nope"])
    with pytest.raises(SystemExit):
        m.parse_args(["--heads", "32", "--heads-kv", "6"])
    res = _scripted(["ours", "ours_bl", "fa4"], {"ours": [1.0, 1.0, 1.0], "ours_bl": [1.02, 1.05, 1.01],
                                                 "fa4": [1.10, 1.05, 0.99]})
    ratios = m.row_ratios(res, ["ours", "ours_bl", "fa4"])
    assert set(ratios) == {"bl_over_fa4", "bl_over_ours", "ours_over_fa4"}
    assert ratios["bl_over_fa4"]["rounds"] == pytest.approx([1.10 / 1.02, 1.0, 0.99 / 1.01])
    row = {"head_dim": 128, "seqlen": 8192, "batch": 4, "heads": 32, "heads_kv": 8, "causal": True,
           "ratios": ratios, "host_us": {"ours": 12.0, "fa4": 140.0},
           "tflops": {n: {"median": 600.0, "lo": 590.0, "hi": 610.0} for n in ("ours", "ours_bl", "fa4")}}
    md = m.markdown(T.RunInfo(gpu="G"), [row], ["ours", "ours_bl", "fa4"])
    assert "| 128 | 8192 | 4 | 32/8 | causal | 600 (590-610) |" in md
    assert "1.000 (0.980-1.078)" in md  # ours+bl / FA4 per round: 1.078, 1.000, 0.980
    assert "| 12.0 | - | 140.0 |" in md


def test_bench_other_scripts_parse_and_render():
    ix = _bench_module("bench_indexed")
    a = ix.parse_args(["--shapes", "16Kx131K", "--stages", "default,mma"])
    assert a.shapes == [("16Kx131K", 16384, 131 * 1024)] and a.stage_list == [None, "mma"]
    stats = {p: {"median_ms": 1.0, "lo_ms": 0.9, "hi_ms": 1.1} for p in ix.PARTS}
    md = ix.markdown(T.RunInfo(gpu="G"), [{"shape": "16Kx131K", "rho": 0.9, "union_ratio": 2.49, "stats": stats,
                                           "published_windowed_ms": 65,
                                           "ratio_vs_published_windowed": {"median": 0.97, "lo": 0.96, "hi": 0.99}}],
                     {"fwd": 15.0})
    assert "| 16Kx131K | 0.9 | 2.49 | 1.00 (0.90-1.10) |" in md and "0.970 (0.960-0.990)" in md and "fwd 15.0" in md
    sel = _bench_module("bench_select")
    a = sel.parse_args(["--seqlens", "8192,16384", "--forward-seqlens", "8192"])
    assert a.seqlens == [8192, 16384] and a.forward_seqlens == {8192}
    h2o = _bench_module("bench_h2o")
    assert len(h2o.plan(False)) == 19 and len(h2o.plan(True)) == 7
    assert h2o.parse_args(["--graph"]).graph


@pytest.mark.parametrize("preheat_s", [0.0, 0.05])
def test_run_windows_prepares_every_variant_then_preheats(preheat_s):
    """run_windows warms every variant first, then runs preheat_s of GEMMs (none at 0), then the
    windows: no GEMM after the first window's kernels, none inside a window."""
    sim = Sim()
    timer = make_timer(sim, preheat_s=preheat_s)
    res = T.run_windows({"a": kernel_fn(sim, 10.0, 100.0, "a"), "b": kernel_fn(sim, 10.0, 50.0, "b")}, 3, timer)
    log = sim.log
    gemm_at = [i for i, tag in enumerate(log) if tag == "gemm"]
    assert len(gemm_at) * FakeTorch.GEMM_US >= preheat_s * 1e6 and bool(gemm_at) == (preheat_s > 0)
    if gemm_at:
        assert "a" in log[:gemm_at[0]] and "b" in log[:gemm_at[0]]  # both prepared before the preheat
        assert set(log[gemm_at[0]:gemm_at[-1] + 1]) == {"gemm", "sync"}  # one block, before every window
    assert res.ratio("a", "b").median == pytest.approx(2.0)


def test_cuda_timer_read_flush_mode():
    """--flush-mode read: each repetition flushes with a read-only reduction (one zero_ at set-up), never zero_()."""
    sim = Sim()
    timer = make_timer(sim, flush_mode="read")
    sim.log.clear()
    res = T.run_windows({"a": kernel_fn(sim, 10.0, 50.0)}, rounds=1, timer=timer)
    kinds = [k for k in sim.log if k in ("flush", "read_flush", "kernel")]
    # every repetition flushes first; the one kernel call without a flush is the prepare step's first call
    assert "flush" not in kinds and kinds.count("read_flush") == kinds.count("kernel") - 1 > 0
    assert abs(res["a"].median_ms * 1e3 - 50.0) < 1.0
    with pytest.raises(ValueError, match="flush_mode"):
        make_timer(Sim(), flush_mode="dirty")


def test_gpu_lock_serialises_processes_and_run_windows_releases_it(tmp_path, monkeypatch):
    """BENCH_GPU_LOCK: a second holder waits until the first releases; run_windows always releases."""
    import threading

    path = str(tmp_path / "gpu.lock")
    a, b = T.GpuLock(path), T.GpuLock(path)
    a.acquire()
    got = threading.Event()
    th = threading.Thread(target=lambda: (b.acquire(), got.set()))
    th.start()
    assert not got.wait(0.3)  # b waits while a holds the lock
    a.release()
    assert got.wait(5)
    b.release()
    th.join()
    monkeypatch.setenv("BENCH_GPU_LOCK", path)
    sim = Sim()
    timer = make_timer(sim)
    kinds = []
    orig = timer.gpu_lock.acquire
    timer.gpu_lock.acquire = lambda: (kinds.append(list(sim.log)), orig())
    T.run_windows({"a": kernel_fn(sim, 10.0, 50.0), "b": kernel_fn(sim, 10.0, 20.0)}, rounds=1, timer=timer)
    # both variants were compiled (one call each) before the lock was first taken, and it was released
    assert kinds and kinds[0].count("kernel") == 2
    assert timer.gpu_lock.fd is None
