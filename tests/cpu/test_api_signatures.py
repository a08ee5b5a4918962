"""docs/api.md and the code agree on every signature it prints: the ``paddle_fa4.<op>(...)`` lines of its
code blocks and the ``### <h2o op>(...)`` headings give each op's parameters in order, which of them are
keyword-only, and their defaults; one vocabulary (``return_lse``, ``softmax_scale``, ...) follows."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

import paddle_fa4
from paddle_fa4 import h2o

API_MD = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def _calls(text: str):
    """``(qualified name, parameter text)`` of every ``paddle_fa4.name(`` / ``### name(`` signature."""
    out = []
    code = "\n".join(m.group(1) for m in re.finditer(r"```python\n(.*?)```", text, re.S))
    for m in re.finditer(r"^paddle_fa4\.(\w+)\(", code, re.M):
        out.append((m.group(1), _balanced(code, m.end())))
    h2o_part = text[text.index("## H2O"):]
    h2o_part = h2o_part[:h2o_part.index("\n## ", 3)]
    for m in re.finditer(r"^### (\w+)\(", h2o_part, re.M):
        out.append(("h2o." + m.group(1), _balanced(h2o_part, m.end())))
    return out


def _balanced(text: str, start: int) -> str:
    depth, i = 1, start
    while depth:
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
    return text[start:i - 1]


def _documented(params: str):
    """``[(name, kind, default)]``; a ``<...>`` placeholder ends the list (None: the rest unchecked)."""
    complete = "<" not in params
    params = params.split("<")[0].rstrip().rstrip(",")
    fn = ast.parse(f"def f({params}): pass").body[0].args
    out = []
    positional = fn.posonlyargs + fn.args
    defaults = [None] * (len(positional) - len(fn.defaults)) + list(fn.defaults)
    for a, d in zip(positional, defaults):
        out.append((a.arg, "positional", _value(d)))
    for a, d in zip(fn.kwonlyargs, fn.kw_defaults):
        out.append((a.arg, "keyword", _value(d)))
    if fn.kwarg is not None:
        out.append(("**" + fn.kwarg.arg, "var", None))
    return out, complete


def _value(node):
    return inspect.Parameter.empty if node is None else ast.literal_eval(node)


def _actual(fn):
    kinds = {inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional", inspect.Parameter.POSITIONAL_ONLY: "positional",
             inspect.Parameter.KEYWORD_ONLY: "keyword"}
    out = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind == inspect.Parameter.VAR_KEYWORD:
            out.append(("**" + p.name, "var", None))
        else:
            out.append((p.name, kinds[p.kind], p.default))
    return out


SIGNATURES = _calls(API_MD.read_text())


def test_signatures_found():
    names = {n for n, _ in SIGNATURES}
    assert {"flash_attn_fwd", "flash_attn_bwd", "indexed_attention", "block_sparse_attention",
            "h2o.select_pages"} <= names, sorted(names)


@pytest.mark.parametrize("name,params", SIGNATURES, ids=[n for n, _ in SIGNATURES])
def test_documented_signature_matches_code(name, params):
    fn = getattr(h2o, name[4:]) if name.startswith("h2o.") else getattr(paddle_fa4, name)
    documented, complete = _documented(params)
    actual = _actual(fn)
    if complete:
        assert documented == actual, f"docs/api.md {name}: {documented}\n  code: {actual}"
    else:
        assert documented == actual[:len(documented)], f"docs/api.md {name}: {documented}\n  code: {actual}"


def test_return_lse_in_every_attention_op():
    """The shared vocabulary's ``return_lse`` is a keyword of every op that computes an lse."""
    for fn in (paddle_fa4.flash_attn_func, paddle_fa4.flash_attn_varlen_func, paddle_fa4.flash_attn_fwd,
               paddle_fa4.indexed_attention, paddle_fa4.block_sparse_attention):
        p = inspect.signature(fn).parameters.get("return_lse")
        assert p is not None and p.kind == inspect.Parameter.KEYWORD_ONLY and p.default is False, fn.__name__
