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


def dtype_name(dtype) -> str:
    """Canonical dtype name of a paddle/torch/numpy dtype or string (``"bfloat16"`` etc.)."""
    try:
        return _parse_cached(dtype)
    except TypeError:  # unhashable
        return _parse(dtype)


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
