"""Edge trace: which pipeline edge each role of each CTA is waiting on, readable while the kernel hangs.

A traced build of a kernel (``trace`` on, the first-contact selftest's builds; production builds
generate none of this) is given the address of a word array in *mapped pinned host memory*. Before
every pipeline wait a role writes one word, ``encode(edge, count)``, to its slot
``cta * SLOTS_PER_CTA + role`` with ``st.relaxed.sys`` (the write crosses to host memory while the
kernel runs), and ``DONE`` when it has left its loop. A deadlocked kernel never completes, but the host
can read the array at any time: the word of a hung role names the edge it waits on (``"<pipe>.full"``
for a consumer wait, ``"<pipe>.empty"`` for a producer acquire) and the pipeline state's count there.

``traced_pipes`` wraps a kernel's ``{name: pipeline}`` dict for one role, so the role's code is the same
with and without the trace. ``decode`` / ``summarize`` are plain Python (CPU-tested).
"""

from __future__ import annotations

from collections import Counter

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

SLOTS_PER_CTA = 8  # roles traced per CTA
MAX_CTAS = 1024  # CTAs with a slot (linear block index); the host array holds MAX_CTAS * SLOTS_PER_CTA words
WORDS = MAX_CTAS * SLOTS_PER_CTA
COUNT_BITS = 20
DONE = 0x7FF << COUNT_BITS  # the role left its loop


def encode(edge: int, count: int) -> int:
    """Word of a role about to wait on edge ``edge`` (its index in the kernel's edge list) at count."""
    return ((edge + 1) << COUNT_BITS) | (count & ((1 << COUNT_BITS) - 1))


def edge_names(pipes) -> list:
    """The edge list of a kernel with pipelines ``pipes`` (names, in order): full then empty of each."""
    return [f"{p}.{side}" for p in pipes for side in ("full", "empty")]


def decode(word: int, edges: list) -> str | None:
    """None (never written), "done", or "<edge> @<count>"."""
    word &= 0xFFFFFFFF
    if word == 0:
        return None
    if word == DONE:
        return "done"
    edge = (word >> COUNT_BITS) - 1
    name = edges[edge] if 0 <= edge < len(edges) else f"edge#{edge}"
    return f"{name} @{word & ((1 << COUNT_BITS) - 1)}"


def summarize(words, roles: list, edges: list, grid: int = MAX_CTAS) -> list:
    """One line per role: where its CTAs stand, most common state first, e.g.
    ``mma: waiting on s.empty in 148 CTAs (@3: 100, @4: 48)``; CTAs that never wrote are omitted.
    ``words``: the array, or a {word index: word} dict of its nonzero words."""
    lines = []
    grid = min(int(grid), MAX_CTAS)
    get = words.get if isinstance(words, dict) else (lambda i, _d=0: words[i])
    for r, role in enumerate(roles):
        states = [decode(int(get(c * SLOTS_PER_CTA + r, 0)), edges) for c in range(grid)]
        states = [s for s in states if s is not None]
        if not states:
            lines.append(f"{role}: no trace written")
            continue
        by_edge = Counter(s.split(" @")[0] for s in states)
        parts = []
        for edge, n in by_edge.most_common():
            if edge == "done":
                parts.append(f"finished in {n} CTAs")
            else:
                counts = Counter(s.split(" @")[1] for s in states if s.split(" @")[0] == edge)
                detail = ", ".join(f"@{k}: {v}" for k, v in sorted(counts.items(), key=lambda kv: int(kv[0]))[:4])
                parts.append(f"waiting on {edge} in {n} CTAs ({detail})")
        lines.append(f"{role}: " + "; ".join(parts))
    return lines


@dsl_user_op
def _store_sys(addr, val, *, loc=None, ip=None) -> None:
    llvm.inline_asm(
        None, [Int64(addr).ir_value(loc=loc, ip=ip), Int32(val).ir_value(loc=loc, ip=ip)],
        "st.relaxed.sys.global.b32 [$0], $1;", "l,r", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT)


class EdgeTrace:
    """The device side: ``mark(slot, edge, count)`` / ``done(slot)`` by one thread per warp (lane 0). The
    CTA's slot row is its linear block index, read again at each mark (nothing held across the roles)."""

    def __init__(self, addr: Int64, edges: list):
        self.addr, self.edges = Int64(addr), list(edges)

    # Role branches carry it (a runtime value to the DSL): the array's address.
    def __extract_mlir_values__(self):
        return cutlass.extract_mlir_values((self.addr,))

    def __new_from_mlir_values__(self, values):
        (addr,) = cutlass.new_from_mlir_values((self.addr,), values)
        return EdgeTrace(addr, self.edges)

    @cute.jit
    def _write(self, slot, word: Int32):
        bx, by, bz = cute.arch.block_idx()
        gx, gy, _ = cute.arch.grid_dim()
        cta = bx + gx * (by + gy * bz)
        if cta < MAX_CTAS:
            if cute.arch.lane_idx() == 0:
                _store_sys(self.addr + Int64((cta * SLOTS_PER_CTA + slot) * 4), word)

    def mark(self, slot, edge: str, count):
        e = self.edges.index(edge)
        self._write(slot, Int32((e + 1) << COUNT_BITS) | (Int32(count) & Int32((1 << COUNT_BITS) - 1)))

    def done(self, slot):
        self._write(slot, Int32(DONE))


class _TracedPipeline:
    """A pipeline whose waits first mark the edge (then do exactly what the pipeline does)."""

    def __init__(self, pipe, name: str, trace: EdgeTrace, slot):
        self._pipe, self._name, self._trace, self._slot = pipe, name, trace, Int32(slot)

    def __extract_mlir_values__(self):
        return cutlass.extract_mlir_values((self._pipe, self._trace, self._slot))

    def __new_from_mlir_values__(self, values):
        pipe, trace, slot = cutlass.new_from_mlir_values((self._pipe, self._trace, self._slot), values)
        return _TracedPipeline(pipe, self._name, trace, slot)

    def consumer_wait(self, state, *args, **kwargs):
        self._trace.mark(self._slot, f"{self._name}.full", state.count)
        return self._pipe.consumer_wait(state, *args, **kwargs)

    def producer_acquire(self, state, *args, **kwargs):
        self._trace.mark(self._slot, f"{self._name}.empty", state.count)
        return self._pipe.producer_acquire(state, *args, **kwargs)

    def __getattr__(self, attr):
        return getattr(self._pipe, attr)


def traced_pipes(pipes: dict, trace: EdgeTrace | None, slot: int) -> dict:
    """``pipes`` for role ``slot``: unchanged without a trace, else every wait marks its edge first."""
    if const_expr(trace is None):
        return pipes
    return {name: _TracedPipeline(p, name, trace, slot) for name, p in pipes.items()}


__all__ = ["SLOTS_PER_CTA", "MAX_CTAS", "WORDS", "DONE", "encode", "edge_names", "decode", "summarize",
           "EdgeTrace", "traced_pipes"]
