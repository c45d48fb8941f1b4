"""BASTION's environment knobs: defaults, and one-line refusals naming the variable."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from sglang_bastion.controller import measures_overhead, unmeasured_widths
from sglang_bastion.options import (
    ENV_PUBLISHED,
    BastionOptions,
    publish_options,
    published_options,
)
from sglang_bastion.spec_algo import validate_server_args


def options(monkeypatch, **env: str) -> BastionOptions:
    """Options read from exactly ``env``."""
    names = ("TOPK", "MODE", "PROFILE", "LAYOUT", "WIDTHS", "EMA_ALPHA", "TRACE", "TRACE_STEPS")
    for name in (*names, "MEASURE_OVERHEAD"):
        monkeypatch.delenv(f"SGLANG_BASTION_{name}", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(f"SGLANG_BASTION_{name}", value)
    return BastionOptions.from_env()


def test_without_a_profile_the_tree_size_is_fixed(monkeypatch):
    assert options(monkeypatch).resolved_mode == "fixed"


def test_a_profile_turns_the_adaptive_controller_on(monkeypatch):
    assert options(monkeypatch, PROFILE="/p.json").resolved_mode == "static"


def test_an_adaptive_mode_without_a_profile_is_refused_naming_bastion_calibrate(monkeypatch):
    with pytest.raises(ValueError, match=r"bastion-calibrate.*SGLANG_BASTION_PROFILE"):
        options(monkeypatch, MODE="ema").validate()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"MODE": "turbo"}, "SGLANG_BASTION_MODE=turbo must be one of"),
        ({"LAYOUT": "diagonal"}, "SGLANG_BASTION_LAYOUT=diagonal must be one of"),
        ({"EMA_ALPHA": "0"}, r"SGLANG_BASTION_EMA_ALPHA=0.0 must be in \(0, 1\]"),
        ({"TOPK": "0"}, "SGLANG_BASTION_TOPK=0 must be between 1 and 64"),
        ({"WIDTHS": "0,8"}, "SGLANG_BASTION_WIDTHS=0,8 must list widths of at least 1"),
    ],
)
def test_out_of_range_knobs_are_refused_by_name(monkeypatch, env, message):
    with pytest.raises(ValueError, match=message):
        options(monkeypatch, **env).validate()


def test_a_non_number_is_refused_by_name(monkeypatch):
    with pytest.raises(ValueError, match="SGLANG_BASTION_TRACE_STEPS='many' must be an integer"):
        options(monkeypatch, TRACE_STEPS="many")


def test_the_adaptive_widths_default_to_the_ladder_and_can_be_listed(monkeypatch):
    assert options(monkeypatch).widths == ()
    assert options(monkeypatch, WIDTHS="8, 12,16").widths == (8, 12, 16)


def test_a_width_list_that_is_not_integers_is_refused_by_name(monkeypatch):
    with pytest.raises(ValueError, match="SGLANG_BASTION_WIDTHS='8;16' must be comma-separated"):
        options(monkeypatch, WIDTHS="8;16")


def test_the_step_overhead_is_measured_unless_switched_off(monkeypatch):
    assert options(monkeypatch).measure_overhead is True
    assert options(monkeypatch, MEASURE_OVERHEAD="0").measure_overhead is False
    assert options(monkeypatch, MEASURE_OVERHEAD="1").measure_overhead is True


def test_a_non_boolean_overhead_switch_is_refused_by_name(monkeypatch):
    with pytest.raises(ValueError, match="SGLANG_BASTION_MEASURE_OVERHEAD='maybe' must be 0 or 1"):
        options(monkeypatch, MEASURE_OVERHEAD="maybe")


def test_the_step_overhead_is_never_measured_under_tensor_parallelism(monkeypatch):
    assert measures_overhead(options(monkeypatch), tp_size=1) is True
    assert measures_overhead(options(monkeypatch), tp_size=2) is False
    assert measures_overhead(options(monkeypatch, MEASURE_OVERHEAD="0"), tp_size=1) is False


def test_widths_beyond_the_profiles_largest_measured_width_are_named():
    assert unmeasured_widths((1, 2, 4, 8, 12, 16, 24, 32, 48, 64), 32) == [48, 64]
    assert unmeasured_widths((1, 2, 4, 8, 16), 32) == []


def test_the_published_snapshot_carries_every_option(monkeypatch):
    read = options(monkeypatch, TOPK="4", WIDTHS="2,8", PROFILE="/p.json", EMA_ALPHA="0.5")
    read = replace(read, max_nodes=12)
    monkeypatch.setenv(ENV_PUBLISHED, "")
    publish_options(read)
    assert published_options() == read


def test_the_server_check_publishes_the_tree_budget_it_resolved(monkeypatch, pair):
    target, drafter = pair
    monkeypatch.setenv(ENV_PUBLISHED, "")
    for flag, resolved in ((12, 12), (None, BastionOptions.default_max_nodes)):
        options(monkeypatch)
        validate_server_args(server_args(target, drafter, speculative_num_draft_tokens=flag))
        assert published_options().max_nodes == resolved


def test_a_worker_started_without_the_launcher_is_told_how_to_start_it(monkeypatch):
    monkeypatch.delenv(ENV_PUBLISHED, raising=False)
    with pytest.raises(RuntimeError, match=r"sglang\.launch_server --speculative-algorithm"):
        published_options()


def server_args(target, drafter, **fields) -> SimpleNamespace:
    """The server arguments validate_server_args reads, for ``target`` and ``drafter``."""
    defaults = {"model_path": str(target), "speculative_draft_model_path": str(drafter),
                "attention_backend": "bastion_cpu", "page_size": None, "tp_size": 1}  # fmt: skip
    return SimpleNamespace(**{**defaults, **fields})
