"""Read a small device value one step late, without making the host wait for the device."""

from __future__ import annotations

import torch


class LateRead:
    """A device scalar copied to the host in the background; read it once it has landed.

    On a CUDA device the copy goes to pinned memory behind an event; `value` answers None
    until the event has completed, so the step that asks never synchronises. On a CPU the
    value is there at once.
    """

    def __init__(self, value: torch.Tensor) -> None:
        """Start copying the 0-dim (or one-element) ``value`` to the host."""
        if value.device.type == "cuda":
            self._host = torch.empty((), dtype=value.dtype, pin_memory=True)
            self._host.copy_(value.reshape(()), non_blocking=True)
            self._event: torch.cuda.Event | None = torch.cuda.Event()
            self._event.record()
        else:
            self._host, self._event = value.detach().reshape(()).clone(), None

    def value(self) -> float | None:
        """The value, or None while its copy is still in flight."""
        if self._event is not None and not self._event.query():
            return None
        return float(self._host)
