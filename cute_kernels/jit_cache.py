"""In-memory compile cache: the compile function's arguments are the key.

``@jit_cache`` wraps ``compile_x(cfg)`` where ``cfg`` is a frozen (hashable) config dataclass that
holds everything that changes generated code (arch, dtypes, static dims, flags). Dynamic extents
(batch, sequence lengths) are ``cute.sym_int()`` in the fake tensors, so one compile serves every
length and there is no second hand-kept key that could drift from the compile arguments.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)

_ALL_CACHES: list["_JitCache"] = []


class _JitCache:
    def __init__(self, fn: Callable):
        self.fn = fn
        self.signature = inspect.signature(fn)
        self.entries: dict = {}  # canonical key (all arguments bound, defaults applied) -> result
        self.aliases: dict = {}  # key as called -> result (so a hit stays one dict lookup)
        self.compile_seconds: dict = {}
        self.lock = threading.Lock()
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        key = (args, tuple(sorted(kwargs.items()))) if kwargs else (args, ())
        hit = self.aliases.get(key)
        if hit is not None:
            return hit
        # f(cfg), f(cfg, "x") with "x" the default and f(cfg, mode="x") are one compile.
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        canon = tuple(bound.arguments.items())
        with self.lock:
            hit = self.entries.get(canon)
            if hit is None:
                start = time.perf_counter()
                hit = self.fn(*args, **kwargs)
                self.compile_seconds[canon] = time.perf_counter() - start
                self.entries[canon] = hit
            self.aliases[key] = hit
        return hit

    def cache_info(self) -> dict:
        return {"entries": len(self.entries), "compile_seconds": sum(self.compile_seconds.values())}

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()
            self.aliases.clear()
            self.compile_seconds.clear()


def jit_cache(fn: F) -> F:
    """Memoise a compile function on its (hashable) arguments."""
    cache = _JitCache(fn)
    _ALL_CACHES.append(cache)
    return cache  # type: ignore[return-value]


def clear_all() -> None:
    for cache in _ALL_CACHES:
        cache.clear()


_FAST: dict = {}


def fast_memo(key, build):
    """A launch path's memo: ``build()`` once per hashable ``key`` (the tensors' dtypes / static dims and
    the options that pick a config), so a hit is one dict lookup, cheaper than building the config again
    to reach :func:`jit_cache`. Keys are tuples led by the launcher's name, so launchers never collide."""
    hit = _FAST.get(key)
    if hit is None:
        hit = _FAST[key] = build()
    return hit


#: ``fast_lookup(key)``: the ``fast_memo`` entry of ``key`` or None. The dict's own bound ``get`` (no Python
#: frame), for launchers whose per-call cost is the point; on None they call ``fast_memo(key, build)``.
fast_lookup = _FAST.get


def direct_call(fn):
    """The C entry of a function compiled with ``--enable-tvm-ffi``, when the DSL's Python ``__call__`` around
    it would only pass the arguments through; else ``fn`` itself.

    cutlass-dsl 4.8.1 wraps the ``tvm_ffi.Function`` in a Python ``__call__`` (a handle check, a pointer
    argument conversion when the signature has pointer-address arguments, and for the ``WithKwargs`` class a
    generated wrapper function), about 0.7 us of Python per launch on a 2-core EPYC VM. The C entry is taken
    only when that wrapper is a plain positional pass-through: no pointer-address arguments, and a generated
    wrapper that names nothing but its target (no defaults, keyword-only or dataclass unpacking). Callers then
    pass every argument positionally, as the wrapper would. Any other case, or another DSL's classes, keeps
    ``fn``."""
    try:
        import tvm_ffi
    except ImportError:
        return fn
    if getattr(getattr(fn, "execution_args", None), "has_pointer_address_arg_specs", True):
        return fn
    inner = getattr(fn, "_tvm_ffi_function", None)
    wrapper = getattr(fn, "_kwargs_wrapper", None)
    if isinstance(inner, tvm_ffi.Function) and wrapper is not None:
        code = getattr(wrapper, "__code__", None)
        if (code is not None and code.co_names == ("__i_target_func",) and not wrapper.__defaults__
                and not wrapper.__kwdefaults__ and wrapper.__globals__.get("__i_target_func") is inner):
            return inner
        return fn
    if isinstance(fn, tvm_ffi.Function) and fn.__chandle__() != 0:  # the positional-only class: its C call
        return tvm_ffi.Function.__call__.__get__(fn)
    return fn
