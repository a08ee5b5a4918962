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
