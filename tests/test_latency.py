"""Cycle-cost predictions for the controller: modes, EMA, batch interpolation, cost vector."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sglang_bastion.budget import (
    HARDWARE,
    Calibration,
    GridPoint,
    LatencyModel,
    LatencyProfile,
    ModelRef,
    ModelShape,
    ProfileIdentity,
    cost_vector_ms,
    ema_update,
    roofline_ms,
)

SHAPE = ModelShape.from_config_file(Path(__file__).parent / "data" / "qwen3-8b-config.json")
A100 = HARDWARE["A100-80GB"]
MODEL = LatencyModel(
    shape=SHAPE,
    hardware=A100,
    calibration=Calibration(slope=2.0, intercept_ms=1.0, bytes_per_elem=2),
    t_aux_table=((1, 1.0), (9, 5.0)),  # T_aux: 1 ms alone, +0.5 ms per extra request up to 9
    l_ar_table=((1, 10.0), (5, 30.0)),
)


def bare(batch, tokens, context):
    return roofline_ms(SHAPE, A100, batch, tokens, context)


def test_static_mode_is_aux_plus_calibrated_roofline():
    predicted = MODEL.cycle_ms(1, 16, 512, mode="static")
    assert float(predicted) == pytest.approx(1.0 + 2.0 * float(bare(1, 16, 512)) + 1.0)


def test_static_mode_ignores_gamma():
    assert float(MODEL.cycle_ms(1, 16, 512, "static", gamma=3.0)) == float(
        MODEL.cycle_ms(1, 16, 512, "static")
    )


def test_ema_mode_scales_the_bare_roofline():
    predicted = MODEL.cycle_ms(1, 16, 512, mode="ema", gamma=1.5)
    assert float(predicted) == pytest.approx(1.0 + 1.5 * float(bare(1, 16, 512)))


def test_ema_calib_mode_scales_the_calibrated_roofline():
    predicted = MODEL.cycle_ms(1, 16, 512, mode="ema_calib", gamma=1.5)
    assert float(predicted) == pytest.approx(1.0 + 1.5 * (2.0 * float(bare(1, 16, 512)) + 1.0))


def test_unknown_mode_is_rejected():
    with pytest.raises(ValueError, match="unknown cost mode 'ewma'"):
        MODEL.cycle_ms(1, 16, 512, mode="ewma")  # type: ignore[arg-type]


def test_verify_ms_broadcasts_tokens_against_contexts():
    grid = MODEL.verify_ms(2, torch.tensor([1.0, 8.0, 64.0]), torch.tensor([[64.0], [4096.0]]))
    assert grid.shape == (2, 3)
    assert float(grid[1, 2]) == pytest.approx(2.0 * float(bare(2, 64, 4096)) + 1.0)


def test_aux_interpolates_linearly_in_batch_size():
    assert MODEL.aux_ms(1) == 1.0
    assert MODEL.aux_ms(5) == pytest.approx(3.0)  # halfway between (1, 1 ms) and (9, 5 ms)
    assert MODEL.aux_ms(9) == 5.0


def test_aux_and_ar_are_clamped_outside_the_measured_batch_sizes():
    assert MODEL.aux_ms(0.5) == 1.0 and MODEL.aux_ms(64) == 5.0
    assert MODEL.ar_ms(0.5) == 10.0 and MODEL.ar_ms(64) == 30.0


def test_ar_interpolates_linearly_in_batch_size():
    assert MODEL.ar_ms(2) == pytest.approx(15.0)


def test_cycle_cost_uses_aux_at_its_batch_size():
    static = float(MODEL.cycle_ms(5, 4, 0))
    assert static == pytest.approx(3.0 + 2.0 * float(bare(5, 4, 0)) + 1.0)


def test_from_profile_takes_hardware_calibration_and_tables():
    profile = LatencyProfile(
        identity=ProfileIdentity(ModelRef("t", "0" * 64), None, "bfloat16", "triton", 16, 1),
        hardware=A100,
        device_name="NVIDIA A100-SXM4-80GB",
        grid=(GridPoint(1, 1, 0, 12.0),),
        calibration=MODEL.calibration,
        rmse_roofline_ms=1.0,
        rmse_calibrated_ms=0.1,
        t_aux_ms=MODEL.t_aux_table,
        l_ar_ms=MODEL.l_ar_table,
        created_at="2026-01-01T00:00:00+00:00",
        tool="test",
    )
    assert LatencyModel.from_profile(profile, SHAPE, grid_residual=False) == MODEL
    # With the grid's residual (the default), the one measured point is predicted exactly.
    measured = LatencyModel.from_profile(profile, SHAPE).verify_ms(1, 1, 0)
    assert float(measured) == pytest.approx(12.0)


def test_uncalibrated_model_in_ema_mode_is_gamma_times_roofline():
    model = LatencyModel.uncalibrated(SHAPE, A100)
    assert float(model.cycle_ms(4, 32, 256, "ema", gamma=1.2)) == pytest.approx(
        1.2 * float(bare(4, 32, 256))
    )
    assert model.ar_ms(1) == pytest.approx(float(bare(1, 1, 0)))


def test_ema_update_moves_gamma_towards_observed_over_predicted():
    # gamma <- 0.75 * 1.0 + 0.25 * (12 / 10)
    assert ema_update(1.0, observed_ms=12.0, predicted_ms=10.0, alpha=0.25) == pytest.approx(1.05)


def test_ema_update_converges_to_a_constant_ratio():
    gamma = 1.0
    for _ in range(200):
        gamma = ema_update(gamma, observed_ms=13.0, predicted_ms=10.0, alpha=0.1)
    assert gamma == pytest.approx(1.3)


@pytest.mark.parametrize(
    ("observed", "predicted", "alpha", "message"),
    [(12.0, 10.0, 0.0, "alpha"), (12.0, 10.0, 1.5, "alpha"), (12.0, 0.0, 0.5, "predicted_ms")],
)
def test_ema_update_rejects_bad_arguments(observed, predicted, alpha, message):
    with pytest.raises(ValueError, match=message):
        ema_update(1.0, observed, predicted, alpha)


def test_cost_vector_lists_cycle_cost_for_one_to_max_tokens():
    costs = cost_vector_ms(MODEL, batch=4, max_tokens=64, context=1024)
    assert costs.shape == (64,) and costs.dtype == torch.float64 and costs.device.type == "cpu"
    for n in (1, 17, 64):
        assert float(costs[n - 1]) == pytest.approx(float(MODEL.cycle_ms(4, n, 1024)))


@pytest.mark.parametrize("mode", ["static", "ema", "ema_calib"])
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_cost_vector_is_positive_non_decreasing_and_convex(mode, batch):
    costs = cost_vector_ms(MODEL, batch, 512, 2048, mode=mode, gamma=0.8)
    tolerance = 1e-9 * float(costs.max())
    assert float(costs.min()) > 0
    assert float(costs.diff().min()) >= -tolerance
    assert float(costs.diff(n=2).min()) >= -tolerance


def test_cost_vector_needs_at_least_one_token():
    with pytest.raises(ValueError, match="max_tokens"):
        cost_vector_ms(MODEL, 1, 0, 0)
