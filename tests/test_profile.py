"""Latency profile file: round trip, strict validation with field paths, identity, calibration."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from sglang_bastion.budget import (
    HARDWARE,
    SCHEMA_VERSION,
    GridPoint,
    ModelRef,
    ModelShape,
    ProfileError,
    ProfileIdentity,
    build_profile,
    config_fingerprint,
    fit_calibration,
    load_profile,
    profile_to_dict,
    roofline_ms,
    save_profile,
)

DATA = Path(__file__).parent / "data"
QWEN3_8B_CONFIG = json.loads((DATA / "qwen3-8b-config.json").read_text())
SHAPE = ModelShape.from_hf_config(QWEN3_8B_CONFIG)
A6000 = HARDWARE["A6000"]
SLOPE, INTERCEPT_MS = 1.4, 3.0  # the "true" calibration behind the synthetic measurements

IDENTITY = ProfileIdentity(
    target=ModelRef.from_hf_config("Qwen/Qwen3-8B", QWEN3_8B_CONFIG),
    drafter=ModelRef("z-lab/Qwen3-8B-DFlash-b16", "ab" * 32),
    dtype="bfloat16",
    attention_backend="triton",
    block_size=16,
    tp_size=1,
)


def synthetic_grid(noise_ms: float = 0.3, seed: int = 0) -> list[GridPoint]:
    """Latencies = SLOPE * roofline + INTERCEPT_MS + Gaussian noise, on a 3 x 4 x 2 grid."""
    generator = torch.Generator().manual_seed(seed)
    grid = []
    for batch in (1, 4, 16):
        for tokens in (1, 8, 32, 128):
            for context in (64, 1024):
                roof = float(roofline_ms(SHAPE, A6000, batch, tokens, context))
                noise = noise_ms * float(torch.randn((), generator=generator, dtype=torch.float64))
                grid.append(GridPoint(batch, tokens, context, SLOPE * roof + INTERCEPT_MS + noise))
    return grid


def make_profile():
    return build_profile(
        identity=IDENTITY,
        hardware=A6000,
        device_name="NVIDIA RTX A6000",
        shape=SHAPE,
        grid=synthetic_grid(),
        t_aux_ms=[(1, 1.5), (8, 2.0), (32, 4.0)],
        l_ar_ms=[(1, 30.0), (32, 40.0)],
        tool="sglang-bastion test",
    )


@pytest.fixture
def saved(tmp_path):
    """A valid profile written to disk, with its JSON dict."""
    path = tmp_path / "profile.json"
    save_profile(make_profile(), path)
    return path, json.loads(path.read_text())


def test_round_trip_save_load_is_identity(tmp_path):
    profile = make_profile()
    path = tmp_path / "profile.json"
    save_profile(profile, path)
    assert load_profile(path) == profile
    assert load_profile(path, expect=IDENTITY) == profile


def test_saved_file_carries_schema_version_and_flat_tables(saved):
    _, data = saved
    assert data["schema_version"] == SCHEMA_VERSION == 1
    assert data["t_aux_ms"] == [[1, 1.5], [8, 2.0], [32, 4.0]]
    assert set(data["grid"][0]) == {"batch_size", "tokens_per_request", "context_len", "latency_ms"}


def _set(data, path, value):
    """Set (or delete, for value=...) data[path] where path is a list of keys/indices."""
    *parents, last = path
    for key in parents:
        data = data[key]
    if value is ...:
        del data[last]
    else:
        data[last] = value


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (["identity", "attention_backend"], ..., r"identity\.attention_backend: missing"),
        (["grid", 3, "batch_size"], "4", r"grid\[3\]\.batch_size: expected an integer"),
        (["grid", 3, "latency_ms"], -1.0, r"grid\[3\]\.latency_ms: expected a positive number"),
        (["grid"], [], r"grid: expected a non-empty list"),
        (["schema_version"], 2, r"schema_version: unsupported version 2"),
        (["identity", "tp_size"], True, r"identity\.tp_size: expected an integer"),
        (["hardware", "peak_flops"], "fast", r"hardware\.peak_flops: expected a number"),
        (["calibration", "slope"], 0.0, r"calibration\.slope: expected a positive number"),
        (["rmse_ms", "calibrated"], None, r"rmse_ms\.calibrated: expected a number"),
        (["t_aux_ms", 1, 0], 1, r"t_aux_ms\[1\]\[0\]: batch sizes must increase"),
        (["l_ar_ms", 0], [1], r"l_ar_ms\[0\]: expected a \[batch_size, ms\] pair"),
        (["identity", "target", "config_sha256"], "xyz", r"identity\.target\.config_sha256"),
        (["created_at"], "yesterday", r"created_at: expected an ISO 8601 time"),
        (["grid", 0, "flops"], 1.0, r"grid\[0\]\.flops: unknown key"),
    ],
)
def test_malformed_field_is_rejected_naming_file_and_field(saved, path, value, field):
    file, data = saved
    data = copy.deepcopy(data)
    _set(data, path, value)
    file.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=field) as info:
        load_profile(file)
    message = str(info.value)
    assert message.startswith(f"{file}: ") and "\n" not in message
    assert "bastion-calibrate" in message or "remove it" in message


def test_non_finite_latency_is_rejected(saved):
    file, _ = saved
    file.write_text(file.read_text().replace('"latency_ms": ', '"latency_ms": NaN, "x": ', 1))
    with pytest.raises(ProfileError, match=r"not valid JSON.*NaN"):
        load_profile(file)


def test_missing_file_says_to_calibrate(tmp_path):
    with pytest.raises(ProfileError, match=r"cannot read latency profile.*bastion-calibrate"):
        load_profile(tmp_path / "absent.json")


def test_identity_mismatch_names_field_and_both_values(saved):
    file, _ = saved
    server = replace(IDENTITY, attention_backend="flashinfer")
    with pytest.raises(ProfileError) as info:
        load_profile(file, expect=server)
    assert str(info.value) == (
        f"{file}: identity.attention_backend: profile was measured for "
        "attention_backend='triton', this server uses 'flashinfer': run bastion-calibrate for "
        "this configuration"
    )


def test_other_target_config_is_a_mismatch_even_under_the_same_name(saved):
    file, _ = saved
    deeper = dict(QWEN3_8B_CONFIG, num_hidden_layers=40)
    server = replace(IDENTITY, target=ModelRef.from_hf_config("Qwen/Qwen3-8B", deeper))
    with pytest.raises(ProfileError, match=r"identity\.target\.config_sha256: .*'Qwen/Qwen3-8B'"):
        load_profile(file, expect=server)


def test_missing_drafter_is_a_mismatch(saved):
    file, _ = saved
    with pytest.raises(ProfileError, match=r"identity\.drafter: .*this server uses None"):
        load_profile(file, expect=replace(IDENTITY, drafter=None))


def test_other_gpu_is_a_mismatch(saved):
    file, _ = saved
    with pytest.raises(ProfileError, match=r"hardware\.device_name: .*'NVIDIA H100 80GB HBM3'"):
        load_profile(file, expect_device_name="NVIDIA H100 80GB HBM3")


def test_save_refuses_an_invalid_profile(tmp_path):
    profile = make_profile()
    bad = replace(profile, grid=(*profile.grid[:2], GridPoint(1, 1, 0, -2.0)))
    with pytest.raises(ProfileError, match=r"grid\[2\]\.latency_ms"):
        save_profile(bad, tmp_path / "bad.json")
    assert not (tmp_path / "bad.json").exists()


def test_fit_recovers_known_slope_and_intercept():
    calibration, _, _ = fit_calibration(SHAPE, A6000, synthetic_grid(), bytes_per_elem=2)
    assert calibration.slope == pytest.approx(SLOPE, rel=0.01)
    assert calibration.intercept_ms == pytest.approx(INTERCEPT_MS, abs=0.3)


def test_fit_is_exact_without_noise():
    calibration, _, rmse_after = fit_calibration(SHAPE, A6000, synthetic_grid(noise_ms=0.0))
    assert calibration.slope == pytest.approx(SLOPE, rel=1e-9)
    assert calibration.intercept_ms == pytest.approx(INTERCEPT_MS, rel=1e-9)
    assert rmse_after == pytest.approx(0.0, abs=1e-9)


def test_calibration_reduces_rmse_to_the_noise_level():
    noise_ms = 0.3
    _, rmse_before, rmse_after = fit_calibration(SHAPE, A6000, synthetic_grid(noise_ms))
    assert rmse_after < rmse_before
    assert rmse_after < 1.5 * noise_ms
    profile = make_profile()
    assert profile.rmse_calibrated_ms < profile.rmse_roofline_ms


def test_fit_needs_more_than_one_roofline_value():
    point = GridPoint(1, 8, 64, 30.0)
    with pytest.raises(ValueError, match="vary batch size and tokens"):
        fit_calibration(SHAPE, A6000, [point, replace(point, latency_ms=31.0)])


def test_fingerprint_ignores_fields_that_do_not_change_cost():
    reordered = dict(reversed(list(QWEN3_8B_CONFIG.items())))
    renamed = dict(QWEN3_8B_CONFIG, rope_theta=1.0, architectures=["Other"])
    implicit = {k: v for k, v in QWEN3_8B_CONFIG.items() if k != "head_dim"}  # 4096/32 = 128
    fingerprint = config_fingerprint(QWEN3_8B_CONFIG)
    assert len(fingerprint) == 64
    assert {config_fingerprint(c) for c in (reordered, renamed, implicit)} == {fingerprint}


def test_fingerprint_changes_with_cost_fields():
    wider = dict(QWEN3_8B_CONFIG, intermediate_size=14336)
    assert config_fingerprint(wider) != config_fingerprint(QWEN3_8B_CONFIG)


def test_profile_dict_is_json_serialisable():
    json.dumps(profile_to_dict(make_profile()), allow_nan=False)
