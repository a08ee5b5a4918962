"""Trace-time arrival checks for the mbarrier pipelines and named barriers of warp-specialised kernels.

An mbarrier completes a phase after the number of arrivals it was initialised with: a count above
the threads that really arrive hangs the kernel, one below lets the waiter run early (a race). Both
show up only on the GPU, usually for one config. So each kernel states its facts once and the trace
compares them, failing the compile instead:

* ``role_threads``: role name -> the arrivals one signal of that role makes: 32 per warp for roles
  whose every thread arrives (``PipelineAsync`` sides, named barriers), 1 for a role that signals
  through one elected thread (the MMA warp's ``tcgen05.commit``, the TMA warp's
  ``arrive.expect_tx``), where the hardware delivers a single arrival;
* ``pipes``: pipeline name -> (producer role(s), consumer role(s)): who arrives on its full
  barrier and who on its empty barrier;
* ``barriers``: named-barrier id -> the roles that meet at it.

``check_arrivals(counts, named, ...)`` then takes the counts the barriers were actually initialised
with (``pipeline_counts`` reads them from a pipeline object) and raises ``ArrivalCountError`` (a
ValueError) naming the first barrier whose count differs from the sum over its roles.
"""

from __future__ import annotations

from cutlass.pipeline import PipelineOp


class ArrivalCountError(ValueError):
    """A barrier's arrival count contradicts the threads of the roles that arrive on it."""


# Sides signalled by hardware on behalf of one elected thread: one arrival per signal.
_ELECTED_OPS = (PipelineOp.TmaLoad, PipelineOp.TCGen05Mma)


def _roles(spec) -> tuple:
    return (spec,) if isinstance(spec, str) else tuple(spec)


def _threads(spec, role_threads: dict) -> int:
    return sum(role_threads[r] for r in _roles(spec))


def pipeline_counts(name: str, pipe) -> tuple:
    """(full, empty) arrival counts the pipeline's mbarriers were initialised with. A side signalled
    by TMA or tcgen05.commit must count 1 (one elected arrive), else ArrivalCountError."""
    counts = []
    for side, sync in (("full", pipe.sync_object_full), ("empty", pipe.sync_object_empty)):
        n = sync.arrive_count
        if sync.op_type in _ELECTED_OPS and n != 1:
            raise ArrivalCountError(f"pipeline {name}: {side} barrier is signalled by {sync.op_type.name} "
                                    f"(one elected arrive) but counts {n} arrivals")
        counts.append(n)
    return tuple(counts)


def check_arrivals(counts: dict, named: dict, *, pipes: dict, barriers: dict, role_threads: dict) -> None:
    """``counts``: pipeline name -> (full, empty) initialised counts; ``named``: barrier id -> its
    thread count. Raises ArrivalCountError on the first one that differs from its roles' threads,
    or when a declared pipeline / barrier is missing (an unchecked edge is a bug too)."""
    for name, (prod, cons) in pipes.items():
        if name not in counts:
            raise ArrivalCountError(f"pipeline {name}: declared but its counts were not checked")
        p, c = counts[name]
        want_p, want_c = _threads(prod, role_threads), _threads(cons, role_threads)
        if (p, c) != (want_p, want_c):
            raise ArrivalCountError(
                f"pipeline {name}: arrival counts ({p}, {c}) != role threads ({want_p} "
                f"{'+'.join(_roles(prod))}, {want_c} {'+'.join(_roles(cons))})")
    for bid, roles in barriers.items():
        if bid not in named:
            raise ArrivalCountError(f"named barrier {bid.name}: declared but its count was not checked")
        want = _threads(roles, role_threads)
        if named[bid] != want:
            raise ArrivalCountError(
                f"named barrier {bid.name}: {named[bid]} threads != {want} ({'+'.join(_roles(roles))})")
