"""What the calibrated roofline misses at the profile's measured points, between them too.

The fit slope * R + intercept has two parameters for the whole grid. Where the device's
latency curve has another shape than the roofline's (on a CPU the roofline is flat in the
tokens per request up to its kink, while the measured pass grows smoothly with them), the fit
is wrong by the same amount at every step of a server, and the controller picks widths by
exactly those differences. The profile keeps every measured point, so the model adds the
fit's residual there, interpolated piecewise-linearly in batch size, tokens per request and
context length, and held constant beyond the grid's ends (where the calibrated roofline alone
extrapolates). At a measured point the prediction is the measurement.

A grid that is not a full product of its batch sizes, tokens and context lengths (a
calibration stopped early with Ctrl-C) has no residual table: the fit alone prices it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from sglang_bastion.budget.roofline import Scalar

Predictor = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ResidualTable:
    """Measured minus fitted latency (ms) on a rectilinear grid: batch x tokens x context."""

    batch_sizes: tuple[float, ...]
    tokens: tuple[float, ...]
    contexts: tuple[float, ...]
    values_ms: tuple[float, ...]  # row-major over (batch, tokens, context)

    def __call__(self, batch: Scalar, tokens: Scalar, context: Scalar) -> torch.Tensor:
        """Interpolated residual (ms), float64; arguments broadcast."""
        b, t, c = (torch.as_tensor(x, dtype=torch.float64) for x in (batch, tokens, context))
        b, t, c = torch.broadcast_tensors(b, t, c)
        shape = b.shape
        axes = (self.batch_sizes, self.tokens, self.contexts)
        sizes = tuple(len(a) for a in axes)
        table = torch.tensor(self.values_ms, dtype=torch.float64).view(sizes)
        brackets = [_bracket(torch.tensor(a, dtype=torch.float64), q.reshape(-1).contiguous())
                    for a, q in zip(axes, (b, t, c), strict=True)]  # fmt: skip
        total = torch.zeros(b.numel(), dtype=torch.float64)  # [Q]
        for corner in range(8):  # the 2 x 2 x 2 corners around each query
            weight = torch.ones_like(total)
            index = []
            for axis, (lo, hi, frac) in enumerate(brackets):
                upper = (corner >> axis) & 1
                index.append(hi if upper else lo)
                weight = weight * (frac if upper else 1 - frac)
            total += weight * table[index[0], index[1], index[2]]
        return total.view(shape)


def _bracket(axis: torch.Tensor, query: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """[Q] lower and upper indices into ``axis`` around each query, and the upper's weight."""
    if axis.numel() == 1:
        zero = torch.zeros_like(query, dtype=torch.long)
        return zero, zero, torch.zeros_like(query)
    hi = torch.searchsorted(axis, query).clamp(1, axis.numel() - 1)
    lo = hi - 1
    frac = ((query - axis[lo]) / (axis[hi] - axis[lo])).clamp(0.0, 1.0)  # constant beyond ends
    return lo, hi, frac


def residual_table(
    points: Sequence[tuple[int, int, int, float]], fit: Predictor
) -> ResidualTable | None:
    """The table of measured minus ``fit`` at (batch, tokens, context, ms) points, or None.

    None when the points are not a full product grid (repeated points are averaged).
    """
    if not points:
        return None
    cells: dict[tuple[int, int, int], list[float]] = {}
    for batch, tokens, context, latency in points:
        cells.setdefault((batch, tokens, context), []).append(latency)
    axes = [sorted({key[i] for key in cells}) for i in range(3)]
    if len(cells) != len(axes[0]) * len(axes[1]) * len(axes[2]):
        return None
    keys = [(b, t, c) for b in axes[0] for t in axes[1] for c in axes[2]]  # row-major
    b, t, c = (torch.tensor(col, dtype=torch.float64) for col in zip(*keys, strict=True))
    measured = torch.tensor([sum(cells[k]) / len(cells[k]) for k in keys], dtype=torch.float64)
    residual = measured - fit(b, t, c).to(torch.float64)  # [P]
    return ResidualTable(
        batch_sizes=tuple(float(x) for x in axes[0]),
        tokens=tuple(float(x) for x in axes[1]),
        contexts=tuple(float(x) for x in axes[2]),
        values_ms=tuple(residual.tolist()),
    )
