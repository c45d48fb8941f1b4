"""Cycle-latency predictions for the budget controller (paper Sections 3.4 and 5.2).

One speculative cycle with N tokens per request costs C(N) = T_aux + T_verify(N). T_aux
(drafting and tree building) is taken as constant in N and interpolated in batch size from the
profile; T_verify builds on the roofline R(N) of the verify pass (roofline.py):

    static     C = T_aux + V(N)              offline calibration (default)
    ema        C = T_aux + gamma * R(N)      online bias on the bare roofline
    ema_calib  C = T_aux + gamma * V(N)      online residual on calibration

with V(N) = slope * R(N) + intercept + E(N): the calibrated roofline plus, from a profile, the
fit's error at the measured grid points interpolated between them (residual.py), so that V
is the measurement wherever the grid measured.

gamma tracks observed / predicted verify time by ``ema_update`` (one per batch size: live.py).
L_AR, the latency of one plain autoregressive step, turns accepted length into speedup:
S(N) = A(N) L_AR / C(N).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import torch

from sglang_bastion.budget.profile import Calibration, LatencyProfile
from sglang_bastion.budget.residual import ResidualTable, residual_table
from sglang_bastion.budget.roofline import Hardware, ModelShape, Scalar, roofline_ms

CostMode = Literal["static", "ema", "ema_calib"]
COST_MODES: tuple[str, ...] = ("static", "ema", "ema_calib")


@functools.lru_cache(maxsize=4096)  # every decode step asks again at its batch size
def _interpolate(table: tuple[tuple[int, float], ...], batch: float) -> float:
    """Piecewise-linear in batch size through the table, constant beyond its ends."""
    sizes, values = zip(*table, strict=True)
    return float(np.interp(batch, sizes, values))


@dataclass(frozen=True)
class LatencyModel:
    """Predicts verify and cycle latency (ms) for a target on one GPU."""

    shape: ModelShape
    hardware: Hardware
    calibration: Calibration
    t_aux_table: tuple[tuple[int, float], ...]  # (batch size, ms), batch sizes increasing
    l_ar_table: tuple[tuple[int, float], ...]  # (batch size, ms), batch sizes increasing
    residual: ResidualTable | None = None  # the fit's error on the profile's grid

    def __post_init__(self) -> None:
        """Reject empty tables."""
        if not self.t_aux_table or not self.l_ar_table:
            raise ValueError("LatencyModel needs non-empty t_aux and l_ar tables")

    @classmethod
    def from_profile(
        cls, profile: LatencyProfile, shape: ModelShape, grid_residual: bool = True
    ) -> LatencyModel:
        """The model of a loaded profile for the target whose shape is ``shape``.

        With ``grid_residual`` the verify prediction passes through the profile's measured
        points (see residual.py); without it, it is the calibrated roofline alone.
        """
        model = cls(
            shape=shape,
            hardware=profile.hardware,
            calibration=profile.calibration,
            t_aux_table=profile.t_aux_ms,
            l_ar_table=profile.l_ar_ms,
        )
        if not grid_residual:
            return model
        points = [
            (p.batch_size, p.tokens_per_request, p.context_len, p.latency_ms) for p in profile.grid
        ]
        return replace(model, residual=residual_table(points, model.fit_ms))

    @classmethod
    def uncalibrated(
        cls,
        shape: ModelShape,
        hardware: Hardware,
        bytes_per_elem: float = 2,
        t_aux_ms: float = 0.0,
    ) -> LatencyModel:
        """A model with no profile: identity calibration, L_AR from the roofline (for 'ema')."""
        sizes = [2**i for i in range(11)]  # 1 .. 1024
        l_ar = roofline_ms(shape, hardware, torch.tensor(sizes, dtype=torch.float64), 1, 0)
        return cls(
            shape=shape,
            hardware=hardware,
            calibration=Calibration(slope=1.0, intercept_ms=0.0, bytes_per_elem=bytes_per_elem),
            t_aux_table=((1, t_aux_ms),),
            l_ar_table=tuple(zip(sizes, l_ar.tolist(), strict=True)),
        )

    def roofline_ms(self, batch: Scalar, tokens: Scalar, context: Scalar) -> torch.Tensor:
        """Bare roofline verify latency (ms); arguments broadcast."""
        return roofline_ms(
            self.shape, self.hardware, batch, tokens, context, self.calibration.bytes_per_elem
        )

    def fit_ms(self, batch: Scalar, tokens: Scalar, context: Scalar) -> torch.Tensor:
        """The calibrated roofline slope * R + intercept (ms); arguments broadcast."""
        return self.calibration.apply(self.roofline_ms(batch, tokens, context))

    def verify_ms(self, batch: Scalar, tokens: Scalar, context: Scalar) -> torch.Tensor:
        """Predicted verify latency (ms): the fit plus the grid's residual; arguments broadcast."""
        fit = self.fit_ms(batch, tokens, context)
        if self.residual is None:
            return fit
        return fit + self.residual(batch, tokens, context).to(fit.dtype)

    def aux_ms(self, batch: float) -> float:
        """T_aux (ms): drafting and tree building for ``batch`` requests."""
        return _interpolate(self.t_aux_table, batch)

    def ar_ms(self, batch: float) -> float:
        """L_AR (ms): one autoregressive target step for ``batch`` requests."""
        return _interpolate(self.l_ar_table, batch)

    def verify_price_ms(
        self,
        batch: float,
        tokens: Scalar,
        context: Scalar,
        mode: CostMode = "static",
        gamma: float = 1.0,
    ) -> torch.Tensor:
        """T_verify (ms) as ``mode`` prices it; tokens and context broadcast.

        ``static``: the calibrated prediction; ``ema``: gamma times the bare roofline;
        ``ema_calib``: gamma times the calibrated prediction.
        """
        if mode not in COST_MODES:
            raise ValueError(f"unknown cost mode {mode!r}; expected one of {COST_MODES}")
        if mode == "static":
            return self.verify_ms(batch, tokens, context)
        if not gamma > 0:
            raise ValueError(f"gamma must be > 0, got {gamma}")
        price = self.roofline_ms if mode == "ema" else self.verify_ms
        return gamma * price(batch, tokens, context)

    def cycle_ms(
        self,
        batch: float,
        tokens: Scalar,
        context: Scalar,
        mode: CostMode = "static",
        gamma: float = 1.0,
    ) -> torch.Tensor:
        """Cycle latency (ms) = T_aux + T_verify under ``mode``; tokens and context broadcast."""
        return self.aux_ms(batch) + self.verify_price_ms(batch, tokens, context, mode, gamma)


def ema_update(gamma: float, observed_ms: float, predicted_ms: float, alpha: float) -> float:
    """gamma <- (1 - alpha) gamma + alpha observed / predicted (Section 5.2)."""
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    if not predicted_ms > 0 or not math.isfinite(predicted_ms):
        raise ValueError(f"predicted_ms must be a positive finite number, got {predicted_ms}")
    if not observed_ms >= 0 or not math.isfinite(observed_ms):
        raise ValueError(f"observed_ms must be a finite number >= 0, got {observed_ms}")
    return (1 - alpha) * gamma + alpha * observed_ms / predicted_ms


def cost_vector_ms(
    model: LatencyModel,
    batch: float,
    max_tokens: int,
    context: float,
    mode: CostMode = "static",
    gamma: float = 1.0,
) -> torch.Tensor:
    """[max_tokens] float64 CPU: predicted cycle latency for 1..max_tokens tokens per request."""
    # context is the mean prefix length over the batch: exact, since costs are linear in it.
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    tokens = torch.arange(1, max_tokens + 1, dtype=torch.float64)  # [max_tokens]
    return model.cycle_ms(batch, tokens, context, mode, gamma)
