"""The calibrated fit's residual on the profile's grid: exact at measured points, between too."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from sglang_bastion.budget import LatencyModel, ModelShape, load_profile
from sglang_bastion.budget.residual import residual_table

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "calibration" / "profiles" / "tiny-pair-cpu.json"
PAIR_TARGET = ROOT / "training" / "pair" / "target" / "config.json"


def flat_fit(batch, tokens, context):
    """A fit that predicts 10 ms everywhere, so residuals are measurement - 10."""
    return torch.full(torch.broadcast_shapes(batch.shape, tokens.shape, context.shape), 10.0)


def product(batches, tokens, contexts, latency):
    """Points of a full grid with latency(b, t, c)."""
    return [(b, t, c, latency(b, t, c)) for b, t, c in itertools.product(batches, tokens, contexts)]


def grid_latency(b, t, c):
    return 10.0 + 0.5 * b + 0.25 * t * t + 0.001 * c


POINTS = product([1, 4], [1, 8, 16], [64, 512], grid_latency)
TABLE = residual_table(POINTS, flat_fit)


def test_the_residual_at_a_measured_point_is_measurement_minus_fit():
    for b, t, c, latency in POINTS:
        assert float(TABLE(b, t, c)) == pytest.approx(latency - 10.0)


def test_between_measured_tokens_the_residual_is_linear():
    # Halfway between 8 and 16 tokens: the mean of the two residuals (not the quadratic).
    expected = (grid_latency(4, 8, 64) + grid_latency(4, 16, 64)) / 2 - 10.0
    assert float(TABLE(4, 12, 64)) == pytest.approx(expected)


def test_between_batch_sizes_and_contexts_the_residual_is_trilinear():
    corners = [grid_latency(b, t, c) - 10.0 for b in (1, 4) for t in (1, 8) for c in (64, 512)]
    assert float(TABLE(2.5, 4.5, 288)) == pytest.approx(sum(corners) / 8)


def test_beyond_the_grid_the_residual_is_held_at_its_edge():
    assert float(TABLE(16, 64, 4096)) == pytest.approx(grid_latency(4, 16, 512) - 10.0)
    assert float(TABLE(0.5, 1, 0)) == pytest.approx(grid_latency(1, 1, 64) - 10.0)


def test_arguments_broadcast_like_the_roofline():
    tokens = torch.arange(1, 17, dtype=torch.float64)  # [16]
    contexts = torch.tensor([[64.0], [512.0]])  # [2, 1]
    values = TABLE(4, tokens, contexts)
    assert values.shape == (2, 16)
    assert float(values[1, 7]) == pytest.approx(grid_latency(4, 8, 512) - 10.0)


def test_repeated_points_are_averaged():
    table = residual_table([(1, 1, 0, 11.0), (1, 1, 0, 13.0)], flat_fit)
    assert float(table(1, 1, 0)) == pytest.approx(2.0)


def test_a_grid_that_is_not_a_full_product_has_no_table():
    assert residual_table(POINTS[:-1], flat_fit) is None
    assert residual_table([], flat_fit) is None


def test_on_the_shipped_profile_held_out_widths_are_predicted_better_than_by_the_fit():
    profile = load_profile(SHIPPED)
    shape = ModelShape.from_hf_config(json.loads(PAIR_TARGET.read_text()))
    fit = LatencyModel.from_profile(profile, shape, grid_residual=False)
    points = [
        (p.batch_size, p.tokens_per_request, p.context_len, p.latency_ms) for p in profile.grid
    ]
    widths = sorted({p[1] for p in points})
    errors_fit, errors_residual = [], []
    for held in widths[1:-1]:  # interior widths: the others interpolate across them
        kept = [p for p in points if p[1] != held]
        table = residual_table(kept, fit.fit_ms)
        for b, t, c, latency in (p for p in points if p[1] == held):
            predicted_fit = float(fit.fit_ms(b, t, c))
            errors_fit.append(predicted_fit - latency)
            errors_residual.append(predicted_fit + float(table(b, t, c)) - latency)
    rmse = lambda errors: (sum(e * e for e in errors) / len(errors)) ** 0.5  # noqa: E731
    assert rmse(errors_residual) < 0.5 * rmse(errors_fit)
