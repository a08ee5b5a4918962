"""Argument checks shared by the public ops.

Every check raises before any work is done, with a message that starts with the op's name and
names the offending argument, e.g. ``indexed_attention: softmax_scale must be finite, got nan``.
``TypeError`` is for wrong types and dtypes, ``ValueError`` for wrong shapes and values;
``NotImplementedError`` (raised by the ops themselves) is for valid but unsupported cases.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterable, Sequence

from cute_kernels.dtypes import dtype_name as _dtype_name  # light: no cutlass import

#: Floating dtypes the CuTe kernels take.
KERNEL_FLOAT_DTYPES = ("bfloat16", "float16")
#: Floating dtypes the reference backend additionally takes.
REFERENCE_FLOAT_DTYPES = ("bfloat16", "float16", "float32")
#: Bounds of the int32 the kernels index with (index arguments arrive as int32 or int64).
INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1


def is_empty(t) -> bool:
    """Whether ``t`` has no elements, from its host-side shape. (``Tensor.numel()`` is a device op in
    Paddle: testing its result synchronises with the GPU on every call.)"""
    return 0 in t.shape


def dtype_name(t) -> str:
    """Canonical dtype name of a tensor (``"bfloat16"``, ``"int32"``, ...)."""
    return _dtype_name(t.dtype)


def check_tensor(op: str, name: str, t) -> None:
    """Raise ``TypeError`` unless ``t`` is a ``paddle.Tensor``."""
    import paddle

    if not isinstance(t, paddle.Tensor):
        raise TypeError(f"{op}: {name} must be a paddle.Tensor, got {type(t).__name__}")


def check_dtype(op: str, name: str, t, allowed: Sequence[str]) -> str:
    """Raise ``TypeError`` unless ``t``'s dtype is one of ``allowed``; return the dtype name."""
    got = dtype_name(t)
    if got not in allowed:
        wanted = " or ".join(allowed)
        raise TypeError(f"{op}: {name} must be {wanted}, got {got}")
    return got


def check_rank(op: str, name: str, t, ranks: Iterable[int], layout: str) -> None:
    """Raise ``ValueError`` unless ``t.ndim`` is in ``ranks``; ``layout`` is shown in the message."""
    if t.ndim not in tuple(ranks):
        raise ValueError(f"{op}: {name} must be {layout}, got shape {list(t.shape)}")


def check_shape(op: str, name: str, t, expected: Sequence[int], layout: str) -> None:
    """Raise ``ValueError`` unless ``list(t.shape) == list(expected)``."""
    if list(t.shape) != list(expected):
        raise ValueError(f"{op}: {name} must have shape {list(expected)} ({layout}), got {list(t.shape)}")


def check_same_place(op: str, tensors: dict) -> None:
    """Raise ``ValueError`` unless every non-None tensor in ``{name: tensor}`` shares one place."""
    items = [(n, t) for n, t in tensors.items() if t is not None]
    if not items:
        return
    first_name, first = items[0]
    place = first.place  # once: each Tensor.place builds a new Place object
    for n, t in items[1:]:
        if t.place != place:
            raise ValueError(f"{op}: {n} must be on the same place as {first_name} "
                             f"({t.place} vs {place})")


def check_int(op: str, name: str, value, low: int | None = None, high: int | None = None) -> int:
    """Raise unless ``value`` is an int (not bool) in ``[low, high]``; return it as ``int``."""
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            import numpy as np

            if isinstance(value, np.integer):
                value = int(value)
            else:
                raise TypeError
        except TypeError:
            raise TypeError(f"{op}: {name} must be an int, got {type(value).__name__}") from None
    if low is not None and value < low:
        raise ValueError(f"{op}: {name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{op}: {name} must be <= {high}, got {value}")
    return value


def check_float(op: str, name: str, value, low: float | None = None) -> float:
    """Raise unless ``value`` is a finite real number (>= ``low`` when given); return a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            import numpy as np

            if isinstance(value, (np.integer, np.floating)):
                value = float(value)
            else:
                raise TypeError
        except TypeError:
            raise TypeError(f"{op}: {name} must be a float, got {type(value).__name__}") from None
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{op}: {name} must be finite, got {value}")
    if low is not None and value < low:
        raise ValueError(f"{op}: {name} must be >= {low}, got {value}")
    return value


def check_bool(op: str, name: str, value) -> bool:
    """Raise ``TypeError`` unless ``value`` is a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{op}: {name} must be a bool, got {type(value).__name__}")
    return value


def check_choice(op: str, name: str, value, choices: Sequence) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``choices``."""
    if value not in tuple(choices):
        raise ValueError(f"{op}: {name} must be one of {tuple(choices)}, got {value!r}")


def index_tensor(op: str, name: str, t, *, padding: bool):
    """An index argument (``indices``, ``cu_seqlens*``, ``block_ids``, ``block_tables``, ``seq_lens``, ...)
    as int32: an int32 tensor is returned as it is, an int64 one (what ``paddle.to_tensor`` of Python
    ints and ``paddle.randint`` give) is converted once, other dtypes raise ``TypeError``.

    int64 values outside int32: ``padding=True`` is for arguments where every out-of-range value means
    padding / nothing (``indices``, ``block_idx``, ``slot_mapping``): they saturate to the int32 bounds,
    which keeps them out of range. ``padding=False`` (lengths, offsets, block ids, page ids): a host
    tensor holding one raises ``ValueError``; a GPU tensor is saturated unread (reading it back would
    sync with the device), like every other value check these arguments have only on the host.
    """
    check_tensor(op, name, t)
    got = dtype_name(t)
    if got == "int32":
        return t
    if got != "int64":
        raise TypeError(f"{op}: {name} must be int32 (int64 is accepted and converted to int32), got {got}; "
                        f"convert with {name}.astype('int32')")
    if not padding:
        values = host_values(t)
        if values is not None and values.size:
            low, high = int(values.min()), int(values.max())
            if low < INT32_MIN or high > INT32_MAX:
                bad = low if low < INT32_MIN else high
                raise ValueError(f"{op}: {name} is int64 with the value {bad} outside int32 (the kernels index "
                                 f"with int32; every valid {name} fits)")
    import paddle

    with paddle.no_grad():
        return paddle.clip(t, INT32_MIN, INT32_MAX).astype("int32")


@contextlib.contextmanager
def sized_by(op: str, what: str, arguments: str):
    """Re-raise a ``MemoryError`` inside the block (Paddle's ``ResourceExhausted`` is one) naming ``what``
    could not be allocated and the ``arguments`` that size it, e.g. ``sized_by(op, "the output [1, 2, 4,
    1073741824] int32", "topk=1073741824")``."""
    try:
        yield
    except MemoryError as err:
        raise MemoryError(f"{op}: not enough memory for {what}, sized by {arguments} ({err})") from err


def host_values(t):
    """``t`` as a numpy array when it lives on the CPU, else None (reading GPU values would sync).

    Checks that need tensor values (monotone ``cu_seqlens``, ...) run only when this is not None.
    """
    place = t.place
    if bool(getattr(place, "is_cpu_place", lambda: False)()):
        return t.numpy()
    return None
