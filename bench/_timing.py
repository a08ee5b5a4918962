"""Kernel and host timing shared by the bench scripts (torch is imported only by the CUDA parts).

Method (issue 17), the same for our kernels and every anchor:

* **Kernel time.** Each variant is timed in its own steady-state window: a warm-up of at least
  ``warmup_s`` (its calls are discarded; it also sizes the window), then enough repetitions to fill
  ``window_s`` of GPU time.  One repetition is, on one stream::

      flush L2 (``zero_()`` of a 256 MiB buffer, >= 2x the H200's L2) ; pad ; start event ; fn() ; end event

  ``flush_mode="read"`` (``--flush-mode read``) flushes with a reduction that only reads the buffer
  instead: ``zero_()`` leaves the L2 full of dirty lines, which the timed kernel then writes back to
  DRAM as it evicts them (up to the L2's size of extra DRAM traffic, billed to whatever runs next).

  and only ``start -> end`` is kept, so the flush and the pad never count.  The pad is a GPU spin
  (``torch.cuda._sleep``) a little longer than the host cost of one ``fn()`` (measured once per
  variant), and a longer spin opens each window: the GPU then stays behind the host for the whole
  window, every ``fn()`` is already queued when its start event executes, and the Python before,
  inside and after the launch never lands in the timed span.  There is no host synchronisation
  inside a window, only one at its end (the events are read then).  With ``graph=True`` one call of
  ``fn`` is captured in a CUDA graph and each repetition replays it (same flush / pad / events);
  where capture fails the variant falls back to eager launches and its ``Stats.mode`` says so.
* **Prepare, then preheat.** ``run_windows`` first compiles and warms every variant of the shape, then
  runs ``preheat_s`` (the scripts' ``--preheat``, 3 s) of bf16 GEMMs, so no compile idles the GPU
  between windows and the first windows do not catch it on its way from idle to its power cap.
* **Rounds.** The windows run in alternating order, ``A B C, C B A, A B C, ...`` for ``rounds``
  rounds (>= 3 for published figures), so drift in clocks (the H200 here sits at its power cap,
  SM 1.5-1.7 GHz) hits every variant alike.  A variant's window value is the median of its
  repetitions; ``Stats.median_ms`` is the median of its window values and ``lo_ms`` / ``hi_ms``
  their min / max (the spread).  Ratios are taken **per round** (``WindowResult.ratio``), within
  one process, and summarised the same way.
* **Host cost.** ``host_us_per_call(fn, n)``: wall time of ``n`` back-to-back calls, divided by
  ``n``, while a GPU spin keeps the device busy (so the calls never wait for the GPU); call it on
  tiny inputs.  It is the Python / launcher overhead per call, reported as its own column.

The pure parts (window order, statistics, per-round ratios, repetition counts, pad sizes) take no
torch and are unit-tested on the CPU (``tests/cpu/test_bench_timing.py``); ``CudaTimer`` takes its
torch module as an argument so the same test can drive it with a recording fake.
"""

from __future__ import annotations

import datetime
import math
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field

FLUSH_BYTES = 256 << 20  # >= 2x the L2 of an H200 (50 MiB) or a B200 (126 MiB)


# ----------------------------------------------------------------------------- pure statistics
def median(xs) -> float:
    """The median (mean of the two middle values for even counts)."""
    s = sorted(xs)
    if not s:
        raise ValueError("median of no samples")
    n = len(s)
    return float(s[n // 2]) if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2.0


@dataclass(frozen=True)
class Stats:
    """One variant: ``median_ms`` of its window values, ``lo_ms`` / ``hi_ms`` their min / max,
    ``samples`` the window values in round order, ``reps`` the repetitions per window, ``mode``
    "eager" or "graph" (what actually ran)."""

    median_ms: float
    lo_ms: float
    hi_ms: float
    samples: tuple
    reps: tuple = ()
    mode: str = "eager"

    def as_dict(self) -> dict:
        return {"median_ms": self.median_ms, "lo_ms": self.lo_ms, "hi_ms": self.hi_ms,
                "windows_ms": list(self.samples), "reps": list(self.reps), "mode": self.mode}


@dataclass(frozen=True)
class Ratio:
    """A ratio taken per round: ``median`` / ``lo`` / ``hi`` over the rounds' values ``samples``."""

    median: float
    lo: float
    hi: float
    samples: tuple

    def as_dict(self) -> dict:
        return {"median": self.median, "lo": self.lo, "hi": self.hi, "rounds": list(self.samples)}

    def fmt(self, digits: int = 3) -> str:
        return fmt_spread(self.as_dict(), digits)


def fmt_spread(x, digits: int = 3) -> str:
    """``median (lo-hi)`` of a ``{"median", "lo", "hi"}`` dict (a row's JSON form), ``-`` for None."""
    if x is None:
        return "-"
    return f"{x['median']:.{digits}f} ({x['lo']:.{digits}f}-{x['hi']:.{digits}f})"


def summarize(window_values, reps=(), mode: str = "eager") -> Stats:
    vals = tuple(float(v) for v in window_values)
    return Stats(median(vals), min(vals), max(vals), vals, tuple(reps), mode)


def window_order(names, rounds: int) -> list:
    """Per round the list of names to time: as given in even rounds, reversed in odd ones."""
    names = list(names)
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate variant names: {names}")
    return [names if r % 2 == 0 else names[::-1] for r in range(rounds)]


class WindowResult(dict):
    """``{name: Stats}`` plus ``rounds`` (one ``{name: window ms}`` per round) for per-round ratios."""

    def __init__(self, stats: dict, rounds: list):
        super().__init__(stats)
        self.rounds = rounds

    def ratio(self, num: str, den: str) -> Ratio:
        """``time[num] / time[den]`` in each round, summarised (e.g. ``ratio("fa4", "ours")`` > 1 when
        ours is faster)."""
        vals = tuple(r[num] / r[den] for r in self.rounds)
        return Ratio(median(vals), min(vals), max(vals), vals)

    def as_dict(self) -> dict:
        return {"stats": {k: v.as_dict() for k, v in self.items()}, "rounds": self.rounds}


def run_windows(fns: dict, rounds: int, timer) -> WindowResult:
    """Time every callable of ``fns`` in its own window, rounds in alternating order.

    ``timer.window(name, fn)`` returns the per-repetition milliseconds of one window (warm-up
    included, not returned); ``timer.mode(name)`` (optional) what ran; ``timer.begin()`` (optional)
    forgets what an earlier call prepared under the same names.
    """
    if hasattr(timer, "begin"):
        timer.begin()
    try:
        return _run_windows(fns, rounds, timer)
    finally:
        if hasattr(timer, "release"):  # the GPU lock (BENCH_GPU_LOCK), if this process took it
            timer.release()


def _run_windows(fns: dict, rounds: int, timer) -> WindowResult:
    if hasattr(timer, "compile"):  # compile every variant before the GPU lock is taken (GpuLock)
        for name in fns:
            timer.compile(name, fns[name])
    if hasattr(timer, "prepare"):  # compile / load every variant first: no compile between windows
        for name in fns:
            timer.prepare(name, fns[name])
    if hasattr(timer, "settle"):  # then bring the GPU back to its loaded state (compiles idle it)
        timer.settle()
    per_round = []
    samples = {name: [] for name in fns}
    reps = {name: [] for name in fns}
    for order in window_order(fns, rounds):
        row = {}
        for name in order:
            ms = timer.window(name, fns[name])
            if not ms:
                raise RuntimeError(f"window of {name!r} returned no samples")
            row[name] = median(ms)
            samples[name].append(row[name])
            reps[name].append(len(ms))
        per_round.append({name: row[name] for name in fns})
    mode = getattr(timer, "mode", lambda name: "eager")
    return WindowResult({name: summarize(samples[name], reps[name], mode(name)) for name in fns}, per_round)


def reps_for_window(rep_s: float, window_s: float, min_reps: int = 3, max_reps: int = 20000) -> int:
    """Repetitions that fill ``window_s`` at ``rep_s`` per repetition, clamped to [min, max]."""
    if rep_s <= 0:
        return max_reps
    return int(min(max_reps, max(min_reps, math.ceil(window_s / rep_s))))


def pad_us(host_us: float, margin: float = 1.25, floor_us: float = 20.0) -> float:
    """GPU spin before each start event: longer than the host's work for one repetition, so the GPU
    never catches up with the host inside a window."""
    return margin * max(0.0, host_us) + floor_us


# ----------------------------------------------------------------------------- CUDA side
class GpuLock:
    """Exclusive use of the GPU among bench processes that share ``BENCH_GPU_LOCK=<file>`` (an flock).

    Several bench processes can then compile at once (compiles are single-threaded) while only one
    at a time warms up and times: ``run_windows`` compiles every variant of a shape first, takes the
    lock at the first warm-up and holds it to its last window. Without the variable it does nothing."""

    def __init__(self, path=None):
        self.path, self.fd = path, None

    def acquire(self) -> None:
        if self.path and self.fd is None:
            import fcntl

            self.fd = open(self.path, "a")
            fcntl.flock(self.fd, fcntl.LOCK_EX)

    def release(self) -> None:
        if self.fd is not None:
            import fcntl

            fcntl.flock(self.fd, fcntl.LOCK_UN)
            self.fd.close()
            self.fd = None


class CudaTimer:
    """The CUDA implementation of ``timer`` for ``run_windows`` (see the module docstring)."""

    def __init__(self, window_s: float = 0.5, warmup_s: float = 0.1, flush: bool = True, graph: bool = False,
                 flush_bytes: int = FLUSH_BYTES, lead_ms: float = 5.0, min_reps: int = 3, max_reps: int = 20000,
                 pad: bool = True, torch_mod=None, clock=time.perf_counter, preheat_s: float = 0.0,
                 flush_mode: str = "zero"):
        if torch_mod is None:
            import torch as torch_mod
        self.torch = torch_mod
        self.clock = clock
        self.window_s, self.warmup_s = float(window_s), float(warmup_s)
        self.graph, self.lead_ms, self.pad = bool(graph), float(lead_ms), bool(pad)
        self.min_reps, self.max_reps = int(min_reps), int(max_reps)
        cuda = torch_mod.cuda
        if flush_mode not in ("zero", "read"):
            raise ValueError(f"flush_mode {flush_mode!r}: 'zero' or 'read'")
        self.flush_mode = flush_mode
        self.flush_buf = torch_mod.empty(int(flush_bytes), dtype=torch_mod.uint8, device="cuda") if flush else None
        if flush and flush_mode == "read":  # written once; each flush only reads it (the L2 keeps clean lines)
            self.flush_buf.zero_()
            self._flush_rows = self.flush_buf.view(-1, 4096)
            self._flush_out = torch_mod.empty(4096, dtype=torch_mod.uint8, device="cuda")
        self.cycles_per_us = self._calibrate_sleep()
        self._runners: dict = {}  # name -> {"run", "mode", "host_us", "reps"}
        self._graphs: list = []  # keep captured graphs alive
        self.capture_errors: dict = {}
        cuda.synchronize()
        self.preheat_s = float(preheat_s)
        self._preheat_ab = None
        self.gpu_lock = GpuLock(os.environ.get("BENCH_GPU_LOCK"))

    def prepare(self, name: str, fn) -> None:
        """Compile / capture and warm ``fn`` now (``run_windows`` prepares every variant before the first
        window); its first window then warms up again like every later one."""
        self._prepare(name, fn).pop("fresh", None)

    def settle(self) -> None:
        self.preheat(self.preheat_s)

    def preheat(self, seconds: float) -> None:
        """Back-to-back bf16 GEMMs for ``seconds`` (``settle``: after the variants of a shape are compiled,
        before its first window): the H200 leaves the clock it idled at during the compiles and settles at
        its power cap first (otherwise a shape's first windows run at a higher clock than the rest and
        its per-round ratios scatter by up to 10 %)."""
        if seconds <= 0:
            return
        torch = self.torch
        if self._preheat_ab is None:  # made once, kept for the next shapes' preheats
            self._preheat_ab = [torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        a, b = self._preheat_ab
        t0 = self.clock()
        while self.clock() - t0 < seconds:
            for _ in range(16):
                torch.matmul(a, b)
            torch.cuda.synchronize()

    # -- helpers
    def _calibrate_sleep(self) -> float:
        cuda = self.torch.cuda
        cycles = 2_000_000
        cuda._sleep(cycles)  # first launch loads the module
        cuda.synchronize()
        best = math.inf
        for _ in range(3):
            s, e = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
            cuda._sleep(cycles // 4)  # busy GPU: the start event waits for it, not for the next launch
            s.record()
            cuda._sleep(cycles)
            e.record()
            e.synchronize()
            best = min(best, s.elapsed_time(e))
        # the fastest run has the highest clock: sizing pads with it errs on the long side later
        return cycles / (best * 1e3) if best > 0 else 1e3

    def _pad_us(self, state: dict) -> float:
        return pad_us(state["host_us"]) if self.pad else 0.0

    def _spin(self, us: float) -> None:
        if us > 0:
            self.torch.cuda._sleep(max(1, int(us * self.cycles_per_us)))

    def _capture(self, name: str, fn):
        torch = self.torch
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            torch.cuda.synchronize()
            g.replay()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - fall back to eager launches, recorded in Stats.mode
            self.capture_errors[name] = f"{type(exc).__name__}: {exc}"[:300]
            try:
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001
                pass
            return None
        self._graphs.append(g)
        return g.replay

    def _prepare(self, name: str, fn, warm: bool = True):
        state = self._runners.get(name)
        if state is None:
            run, mode = fn, "eager"
            if self.graph:
                replay = self._capture(name, fn)
                if replay is not None:
                    run, mode = replay, "graph"
            t0 = self.clock()
            run()  # first call (compiles, loads modules): its host time is an upper bound for the pad
            first_us = (self.clock() - t0) * 1e6
            self.torch.cuda.synchronize()
            state = {"run": run, "mode": mode, "host_us": min(first_us, 1e5), "reps": self.min_reps, "fresh": False,
                     "warm": False}
            self._runners[name] = state
        if warm and not state["warm"]:
            self.gpu_lock.acquire()  # from the first warm-up on, this process times: no other may run then
            self._warmup(state, self.warmup_s)
            state["warm"] = state["fresh"] = True
        return state

    def compile(self, name: str, fn) -> None:
        """The first call of ``fn`` only (compile, module load), before the GPU lock is taken."""
        self._prepare(name, fn, warm=False)

    def release(self) -> None:
        self.gpu_lock.release()

    def _rep(self, run, pad_us_, start, end) -> None:
        if self.flush_buf is None:
            pass
        elif self.flush_mode == "read":
            self.torch.amax(self._flush_rows, dim=0, out=self._flush_out)
        else:
            self.flush_buf.zero_()
        self._spin(pad_us_)
        start.record()
        run()
        end.record()

    def _warmup(self, state: dict, seconds: float) -> None:
        """Repetitions for >= ``seconds`` of wall time, in doubling batches with one sync each.
        Updates ``state``: ``host_us`` (the host's time per repetition, the least over the batches of
        <= 64 repetitions: a batch that fills the launch queue waits for the GPU, which only adds)
        and ``reps`` (what a window of ``window_s`` needs at the measured wall time per repetition)."""
        cuda = self.torch.cuda
        done, batch, t0 = 0, 1, self.clock()
        ev = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
        host = []
        while True:
            pad = self._pad_us(state)
            tb = self.clock()
            for _ in range(batch):
                self._rep(state["run"], pad, *ev)
            if batch <= 64:
                host.append((self.clock() - tb) / batch * 1e6)
                state["host_us"] = min(host)
            cuda.synchronize()
            done += batch
            elapsed = self.clock() - t0
            if elapsed >= seconds:
                break
            batch = min(batch * 2, 1024)
        state["reps"] = reps_for_window(elapsed / done, self.window_s, self.min_reps, self.max_reps)

    # -- the timer interface
    def begin(self) -> None:
        self._runners.clear()
        self._graphs.clear()

    def mode(self, name: str) -> str:
        return self._runners[name]["mode"] if name in self._runners else "eager"

    def window(self, name: str, fn) -> list:
        cuda = self.torch.cuda
        state = self._prepare(name, fn)
        if not state.pop("fresh", False):  # (a fresh variant has just warmed up in _prepare)
            self._warmup(state, self.warmup_s)  # steady state again after the other variants' windows
        run, pad, reps = state["run"], self._pad_us(state), state["reps"]
        starts = [cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [cuda.Event(enable_timing=True) for _ in range(reps)]
        self._spin(self.lead_ms * 1e3 if self.pad else 0.0)  # the host gets ahead of the GPU before the first start event
        for s, e in zip(starts, ends):
            self._rep(run, pad, s, e)
        cuda.synchronize()  # the only sync of the window
        return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def bench_windows(fns: dict, window_s: float = 0.5, rounds: int = 3, flush: bool = True, graph: bool = False,
                  warmup_s: float = 0.1, timer=None) -> WindowResult:
    """``{name: Stats}`` of every callable, each timed in its own window, rounds alternating
    (module docstring).  ``timer`` defaults to a fresh ``CudaTimer(window_s, warmup_s, flush, graph)``;
    ``result.ratio(a, b)`` gives ``time[a] / time[b]`` per round."""
    if timer is None:
        timer = CudaTimer(window_s=window_s, warmup_s=warmup_s, flush=flush, graph=graph)
    return run_windows(fns, rounds, timer)


def host_us_per_call(fn, n: int = 100, repeats: int = 5, busy: bool = True, torch_mod=None,
                     clock=time.perf_counter, summarize=median):
    """Microseconds of host time per call: wall time of ``n`` back-to-back calls / ``n``, ``summarize``
    (default the median) of ``repeats``.  With ``busy`` a GPU spin covering the calls is queued first, so
    no call waits for the GPU (keep ``n`` x launches per call well under the launch queue, ~1000); use
    tiny inputs. ``busy=False`` without ``torch_mod`` needs no torch (CPU-only callers)."""
    if torch_mod is None and busy:
        import torch as torch_mod
    sync = torch_mod.cuda.synchronize if torch_mod is not None else (lambda: None)
    fn()
    sync()
    est_us = None  # with ``busy``, one extra uncounted repeat (no spin) sizes the spins
    out = []
    while len(out) < repeats:
        if busy and est_us is not None:
            cycles_per_us = 2000.0  # above any SM clock in MHz: the spin lasts at least the intended time
            torch_mod.cuda._sleep(max(1, int((2.0 * est_us * n + 100.0) * cycles_per_us)))
        t0 = clock()
        for _ in range(n):
            fn()
        per = (clock() - t0) / n * 1e6
        sync()
        if busy and est_us is None:
            est_us = min(per, 1e4)
            continue
        out.append(per)
    return summarize(out)


# ----------------------------------------------------------------------------- run metadata
def git_commit(cwd: str | None = None) -> str:
    cwd = cwd or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha or "unknown") + ("+dirty" if dirty else "")


def gpu_clocks() -> str:
    """``nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw --format=csv`` (values only)."""
    try:
        res = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unavailable ({type(exc).__name__})"
    return res.stdout.strip().replace("\n", "; ") or f"unavailable (rc {res.returncode})"


@dataclass
class RunInfo:
    """Date, commit, command line, GPU and clocks of one bench run (clocks at start and end)."""

    date: str = field(default_factory=lambda: datetime.datetime.now(datetime.timezone.utc)
                      .strftime("%Y-%m-%d %H:%M:%S UTC"))
    commit: str = field(default_factory=git_commit)
    command: str = field(default_factory=lambda: " ".join(shlex.quote(a) for a in ["python"] + sys.argv))
    gpu: str = ""
    clocks_start: str = field(default_factory=gpu_clocks)
    clocks_end: str = ""
    method: dict = field(default_factory=dict)

    def finish(self) -> "RunInfo":
        self.clocks_end = gpu_clocks()
        return self

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    def markdown(self) -> str:
        m = ", ".join(f"{k} {v}" for k, v in self.method.items())
        return (f"- date {self.date}, commit `{self.commit}`, GPU {self.gpu}\n"
                f"- command `{self.command}`\n"
                f"- clocks.sm, clocks.mem, power.draw: start {self.clocks_start}; end {self.clocks_end}\n"
                + (f"- method: {m}" if m else "")).rstrip("\n")


def add_method_args(ap, window_s: float = 0.5, rounds: int = 3) -> None:
    """The timing options every bench script shares."""
    ap.add_argument("--window", type=float, default=window_s, help="seconds of one variant's window (>= 0.5)")
    ap.add_argument("--rounds", type=int, default=rounds, help="rounds of windows, alternating order (>= 3)")
    ap.add_argument("--warmup", type=float, default=0.1, help="warm-up seconds before each window")
    ap.add_argument("--preheat", type=float, default=3.0,
                    help="seconds of GEMMs before the first window (the GPU settles at its power cap)")
    ap.add_argument("--no-flush", action="store_true", help="do not flush L2 between repetitions")
    ap.add_argument("--flush-mode", choices=("zero", "read"), default="zero",
                    help="zero: zero_() of the flush buffer (leaves the L2 full of dirty lines the next kernel "
                         "writes back); read: a reduction that only reads it (leaves clean lines)")
    ap.add_argument("--graph", action="store_true",
                    help="replay a CUDA graph of one call per repetition (eager where capture fails)")
    ap.add_argument("--markdown", nargs="?", const="-", default=None, metavar="FILE",
                    help="write a markdown table to FILE (or stdout without FILE)")
    ap.add_argument("--json", default=None, metavar="FILE")


def add_shape_args(ap, hdims: str, seqlens: str) -> None:
    """The attention shape options of bench_bwd / bench_layer: head dims, sequence lengths, tokens per
    batch, heads ("Hq" or "Hq/Hkv"), modes; ``parse_shape_args`` turns them into lists."""
    ap.add_argument("--hdims", default=hdims)
    ap.add_argument("--seqlens", default=seqlens)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--heads", default="16,32/8")
    ap.add_argument("--modes", default="full,causal")


def parse_shape_args(args):
    args.hdims = [int(x) for x in args.hdims.split(",")]
    args.seqlens = [int(x) for x in args.seqlens.split(",")]
    args.heads = [tuple(int(y) for y in (x.split("/") * 2)[:2]) for x in args.heads.split(",")]
    args.modes = args.modes.split(",")
    return args


def timer_from_args(args, torch_mod=None) -> CudaTimer:
    return CudaTimer(window_s=args.window, warmup_s=args.warmup, flush=not args.no_flush, graph=args.graph,
                     torch_mod=torch_mod, preheat_s=getattr(args, "preheat", 0.0),
                     flush_mode=getattr(args, "flush_mode", "zero"))


def method_from_args(args) -> dict:
    return {"window_s": args.window, "rounds": args.rounds, "warmup_s": args.warmup,
            "preheat_s": getattr(args, "preheat", 0.0),
            "l2_flush": not args.no_flush, "flush_mode": getattr(args, "flush_mode", "zero"),
            "graph": bool(args.graph)}


def write_markdown(path, text: str) -> None:
    if path is None:
        return
    if path == "-":
        print(text)
    else:
        with open(path, "w") as fh:
            fh.write(text)


def cpu_us_per_call(fn, n: int, repeats: int) -> dict:
    """``{"median", "min"}`` microseconds per call over ``repeats`` timings of ``n`` calls with no GPU involved
    (the CPU host-path benches; on a shared or virtualised CPU the minimum is the steadier figure)."""
    import statistics

    return host_us_per_call(fn, n=n, repeats=repeats, busy=False,
                            summarize=lambda v: {"median": statistics.median(v), "min": min(v)})


def write_host_rows(path, rows: dict, argv, n: int, repeats: int, **extra) -> None:
    """The CPU host-path benches' JSON: ``{"run": {date, cpu, n, repeats, command, **extra}, "us_per_call": rows}``."""
    import json
    import platform

    if not path:
        return
    info = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "cpu": platform.processor() or platform.machine(), "n": n, "repeats": repeats, **extra,
            "command": " ".join([os.path.basename(sys.argv[0])] + list(argv if argv is not None else sys.argv[1:]))}
    with open(path, "w") as fh:
        json.dump({"run": info, "us_per_call": rows}, fh, indent=1)

