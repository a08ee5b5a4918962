"""A rule of the kernels' pipeline code that no compile check sees: a function that advances a pipeline
state it was handed must return it (the caller rebinds), or leave the advance to the caller. A
``@cute.jit`` helper works on a copy of its arguments' values, so an advance inside it does not reach
the caller's loop: the SM100 forward once advanced its stats state inside ``publish_row_stats`` and the
stats barrier's wait parity became a constant (found by diffing the PTX, 2026-12-03; it would hang on a
CTA's second work tile). This test reads every kernel source for the pattern."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def advanced_not_returned(source: str) -> list[str]:
    """``name(param)`` for each function that calls ``param.advance(...)`` on one of its parameters and
    returns no expression naming it."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        params = {a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs}
        advanced, returned = set(), set()
        for node in ast.walk(fn):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "advance"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in params):
                advanced.add(node.func.value.id)
            if isinstance(node, ast.Return) and node.value is not None:
                returned |= {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}
        found += [f"{fn.name}({name})" for name in sorted(advanced - returned)]
    return found


def test_rule_flags_the_pattern():
    bad = '''
def publish(self, pipe, state, x):
    pipe.producer_acquire(state)
    pipe.producer_commit(state)
    state.advance(2)
'''
    good = '''
def step(self, pipe, state):
    v = state.clone()
    state.advance()
    return state, v

def caller(self, pipe, state):
    publish(pipe, state)
    local = state.clone()
    local.advance()
'''
    assert advanced_not_returned(bad) == ["publish(state)"]
    assert advanced_not_returned(good) == []


def test_no_kernel_advances_a_state_it_does_not_return():
    files = sorted((ROOT / "cute_kernels").rglob("*.py"))
    assert len(files) > 20
    found = [f"{p.relative_to(ROOT)}: {hit}" for p in files for hit in advanced_not_returned(p.read_text())]
    assert not found, found
