"""Impossible BASTION launches fail fast with one line naming the problem and the fix.

Two tests run ``python -m sglang.launch_server`` and wait for it to exit without a traceback.
The others resolve the same arguments in this process, as the launcher does before it starts
anything (SGLang's ``prepare_server_args`` and ``resolve_once``), and read the refusal: the
same check at a fraction of a launch's cost.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from server_utils import CPU_ARGS, run_to_exit
from tiny_models import write_drafter

from sglang_bastion.options import ENV_PUBLISHED

pytestmark = pytest.mark.slow

BACKEND = ["--attention-backend", "bastion_cpu", "--max-total-tokens", "8192"]


def refusal(
    pair: tuple[Path, Path],
    drafter: Path | str | None,
    *extra: str,
    env: dict[str, str] | None = None,
) -> str:
    """Start a BASTION server expected to refuse; its output (asserting a quick failure)."""
    args = [*BACKEND, "--speculative-algorithm", "BASTION", *extra]
    if drafter is not None:
        args += ["--speculative-draft-model-path", str(drafter)]
    code, output = run_to_exit(pair[0], args, env=env)
    assert code != 0
    assert "Traceback" not in output, output[-2000:]
    return output


def resolution_refusal(
    monkeypatch: pytest.MonkeyPatch,
    pair: tuple[Path, Path],
    drafter: Path | str | None,
    *extra: str,
    env: dict[str, str] | None = None,
) -> str:
    """Resolve a BASTION server's arguments in this process, expecting a refusal; its line."""
    from sglang.srt.server_args import prepare_server_args

    from sglang_bastion.plugin import register

    register()
    monkeypatch.setenv(ENV_PUBLISHED, "")  # restored afterwards: the check publishes options
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    argv = ["--model-path", str(pair[0]), *CPU_ARGS, *BACKEND, "--speculative-algorithm",
            "BASTION", *extra]  # fmt: skip
    if drafter is not None:
        argv += ["--speculative-draft-model-path", str(drafter)]
    with pytest.raises(SystemExit) as refused:
        prepare_server_args(argv).resolve_once()
    return str(refused.value)


def test_missing_drafter_path_is_refused(pair):
    assert "--speculative-draft-model-path" in refusal(pair, None)


def test_drafter_with_another_hidden_size_is_refused(monkeypatch, pair, tmp_path):
    drafter = write_drafter(tmp_path / "wide", pair[0], hidden=96)
    assert "hidden_size=96" in resolution_refusal(monkeypatch, pair, drafter)


def test_drafter_with_another_vocabulary_is_refused(monkeypatch, pair, tmp_path):
    drafter = write_drafter(tmp_path / "vocab", pair[0], vocab=1000)
    assert "vocab_size=1000" in resolution_refusal(monkeypatch, pair, drafter)


def test_attention_backend_without_tree_masks_is_refused(monkeypatch, pair):
    output = resolution_refusal(monkeypatch, pair, pair[1], "--attention-backend", "torch_native")
    assert "cannot verify trees" in output


def test_page_size_above_one_is_refused(monkeypatch, pair):
    assert "--page-size 1" in resolution_refusal(monkeypatch, pair, pair[1], "--page-size", "16")


def test_drafter_tapping_layers_the_target_lacks_is_refused(monkeypatch, pair, tmp_path):
    drafter = write_drafter(tmp_path / "taps", pair[0], target_layer_ids=(0, 3))
    config = json.loads((drafter / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == [0, 3]
    assert "target_layer_ids" in resolution_refusal(monkeypatch, pair, drafter)


SHIPPED_PROFILE = Path(__file__).resolve().parent.parent / "calibration/profiles/tiny-pair-cpu.json"


def test_a_profile_measured_for_another_target_is_refused(monkeypatch, pair):
    output = resolution_refusal(
        monkeypatch, pair, pair[1], env={"SGLANG_BASTION_PROFILE": str(SHIPPED_PROFILE)}
    )
    assert "identity.target.config_sha256" in output and "bastion-calibrate" in output


def test_a_malformed_profile_is_refused(pair, tmp_path):
    broken = tmp_path / "profile.json"
    broken.write_text('{"schema_version": 1, "identity": ')
    output = refusal(pair, pair[1], env={"SGLANG_BASTION_PROFILE": str(broken)})
    assert "not valid JSON" in output and str(broken) in output


def test_an_adaptive_mode_without_a_profile_is_refused(monkeypatch, pair):
    output = resolution_refusal(monkeypatch, pair, pair[1], env={"SGLANG_BASTION_MODE": "static"})
    assert "SGLANG_BASTION_MODE=static needs a latency profile" in output


def test_adaptive_widths_above_the_tree_budget_are_refused(monkeypatch, pair):
    env = {"SGLANG_BASTION_PROFILE": str(SHIPPED_PROFILE), "SGLANG_BASTION_WIDTHS": "8,32"}
    output = resolution_refusal(
        monkeypatch, pair, pair[1], "--speculative-num-draft-tokens", "16", env=env
    )
    assert "SGLANG_BASTION_WIDTHS=8,32 lists widths above the tree budget N=16" in output


def test_a_timing_driven_mode_under_tensor_parallelism_is_refused(monkeypatch, pair):
    env = {"SGLANG_BASTION_MODE": "ema", "SGLANG_BASTION_PROFILE": str(SHIPPED_PROFILE)}
    output = resolution_refusal(monkeypatch, pair, pair[1], "--tp-size", "2", env=env)
    assert "not supported with --tp-size 2" in output and "SGLANG_BASTION_MODE=static" in output


def test_a_malformed_group_price_for_bastion_cpu_is_refused(monkeypatch, pair):
    env = {"SGLANG_BASTION_CPU_GROUP_ELEMENTS": "16k"}
    output = resolution_refusal(monkeypatch, pair, pair[1], env=env)
    assert "SGLANG_BASTION_CPU_GROUP_ELEMENTS=16k must be a whole number" in output
