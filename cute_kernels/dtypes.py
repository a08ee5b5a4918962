"""Dtype names shared by every framework <-> cutlass numeric types.

Frameworks are identified by name only (``"bfloat16"``, ``"float32"``, ...) so this module needs
neither paddle nor torch. ``dtype_name`` accepts ``paddle.bfloat16``, ``torch.bfloat16``, numpy
dtypes or plain strings.
"""

from __future__ import annotations

import functools

_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
            "float": "float32", "int": "int32"}


def _parse(dtype) -> str:
    text = str(dtype).lower()
    for prefix in ("paddle.", "torch.", "<dtype: '", "dtype('"):
        text = text.removeprefix(prefix)
    text = text.strip("')>\" ")
    return _ALIASES.get(text, text)


_parse_cached = functools.lru_cache(maxsize=256)(_parse)  # every op validates dtypes on each call
# dtype objects by identity: a framework's dtypes are a few long-lived singletons, and hashing one can cost
# more than the whole lookup (Paddle's ~0.5 us). Each entry keeps its object, so its id stays that object's.
_BY_ID: dict = {}


def dtype_name(dtype) -> str:
    """Canonical dtype name of a paddle/torch/numpy dtype or string (``"bfloat16"`` etc.)."""
    hit = _BY_ID.get(id(dtype))
    if hit is not None and hit[0] is dtype:
        return hit[1]
    try:
        name = _parse_cached(dtype)
    except TypeError:  # unhashable
        return _parse(dtype)
    if not isinstance(dtype, str) and len(_BY_ID) < 256:
        _BY_ID[id(dtype)] = (dtype, name)
    return name


def cutlass_dtype(dtype):
    """cutlass numeric type for a dtype (name or framework dtype)."""
    import cutlass

    table = {
        "bfloat16": cutlass.BFloat16,
        "float16": cutlass.Float16,
        "float32": cutlass.Float32,
        "int32": cutlass.Int32,
        "int64": cutlass.Int64,
        "uint8": cutlass.Uint8,
    }
    name = dtype_name(dtype)
    if name not in table:
        raise TypeError(f"no cutlass type for dtype {name!r}")
    return table[name]
