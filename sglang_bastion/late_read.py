"""Read small device values and span timings late, without making the host wait for the device."""

from __future__ import annotations

import time

import torch


class LateRead:
    """A device tensor copied to the host in the background; read it once it has landed.

    On a CUDA device the copy goes to pinned memory behind an event; `value` and `values`
    answer None until the event has completed, so the step that asks never synchronises. On
    a CPU the values are there at once (a snapshot: later in-place changes do not show).
    """

    def __init__(self, value: torch.Tensor) -> None:
        """Start copying ``value`` (a few elements) to the host."""
        if value.device.type == "cuda":
            self._host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            self._host.copy_(value, non_blocking=True)
            self._event: torch.cuda.Event | None = torch.cuda.Event()
            self._event.record()
        else:
            self._host, self._event = value.detach().clone(), None

    def landed(self) -> bool:
        """Whether the copy has completed."""
        return self._event is None or self._event.query()

    def value(self) -> float | None:
        """The one-element value, or None while its copy is still in flight."""
        return float(self._host.reshape(())) if self.landed() else None

    def values(self) -> list[float] | None:
        """Every element, flattened, or None while the copy is still in flight."""
        return [float(v) for v in self._host.reshape(-1).tolist()] if self.landed() else None


class SpanTimer:
    """Device time of a span of queued work, read once the work has finished.

    On a CUDA device two timing events bracket the span and `elapsed_ms` answers None until
    the end event has completed: the EMA modes learn a step's verify time a step late instead
    of synchronising. On a CPU the work is done when the host returns: wall time at once.
    """

    def __init__(self, device: torch.device) -> None:
        """Start timing at this point of the device's queue."""
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._start, self._end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            self._start.record()
        else:
            self._t0, self._t1 = time.perf_counter(), None

    def stop(self) -> SpanTimer:
        """End the span at this point of the queue."""
        if self._cuda:
            self._end.record()
        else:
            self._t1 = time.perf_counter()
        return self

    def elapsed_ms(self) -> float | None:
        """The span's milliseconds, or None while its work is still running."""
        if self._cuda:
            return float(self._start.elapsed_time(self._end)) if self._end.query() else None
        return None if self._t1 is None else (self._t1 - self._t0) * 1e3


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on ``device``, copied without a host sync (pinned first on CUDA)."""
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
