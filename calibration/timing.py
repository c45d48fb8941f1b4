"""Wall-clock timing of device operations: warm-up, device synchronisation, a summary statistic."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

STATISTICS = ("median", "min")


def synchronize(device: torch.device) -> None:
    """Wait until every kernel queued on ``device`` has finished (a no-op on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu":
        module = getattr(torch, device.type, None)
        if module is not None and hasattr(module, "synchronize"):
            module.synchronize()


def timed_ms(run: Callable[[], object], device: torch.device, *, warmup: int = 0) -> float:
    """Latency (ms) of one synchronised call of ``run``, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        run()
    synchronize(device)
    start = time.perf_counter()
    run()
    synchronize(device)
    return (time.perf_counter() - start) * 1e3


def summarize(samples: Sequence[float], statistic: str = "median") -> float:
    """The median (default) or minimum of repeated timings of one shape."""
    if not samples:
        raise ValueError("no timings to summarize")
    if statistic == "median":
        return statistics.median(samples)
    if statistic == "min":
        return min(samples)
    raise ValueError(f"unknown statistic {statistic!r}; expected one of {STATISTICS}")
