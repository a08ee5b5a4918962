"""CUDA-event timing shared by the bench scripts (torch is imported on first use)."""

from __future__ import annotations


def samples_ms(fn, iters: int, warmup: int = 2) -> list:
    """Milliseconds of ``iters`` runs of ``fn()`` after ``warmup`` runs (CUDA events, one run each)."""
    return interleaved_samples_ms({"fn": fn}, iters, warmup)["fn"]


def interleaved_samples_ms(fns: dict, iters: int, warmup: int = 2) -> dict:
    """Per callable, the milliseconds of ``iters`` rounds in which each runs once, round-robin, so clock
    and thermal drift hit every variant alike."""
    import torch

    for _ in range(warmup):
        for fn in fns.values():
            fn()
    torch.cuda.synchronize()
    times = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    return times


def _median(samples: list) -> float:
    return sorted(samples)[len(samples) // 2]


def median_ms(fn, iters: int, warmup: int = 2) -> float:
    """Median (upper middle for even counts) of ``samples_ms``."""
    return _median(samples_ms(fn, iters, warmup))


def interleaved_median_ms(fns: dict, iters: int, warmup: int = 2) -> dict:
    """Median ms of each callable, timed round-robin (``interleaved_samples_ms``)."""
    return {name: _median(t) for name, t in interleaved_samples_ms(fns, iters, warmup).items()}
