"""bastion-calibrate's pieces that need no model: grid, arguments, timing, hardware, identity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sglang_bastion.budget import Hardware, config_fingerprint, identity
from sglang_bastion.budget.identity import model_ref, serving_identity
from sglang_bastion.calibration import cli, hardware, timing
from sglang_bastion.calibration.grid import DEFAULT, QUICK, Grid
from sglang_bastion.calibration.measure import Measurements
from sglang_bastion.calibration.report import can_fit

DATA = Path(__file__).parent / "data"
QWEN3_8B_CONFIG = json.loads((DATA / "qwen3-8b-config.json").read_text())


# --- grid ------------------------------------------------------------------------------------


def test_grid_drops_widths_above_the_servers_tree_budget():
    grid = Grid(batch_sizes=(1,), tokens=(4, 16, 64), context_lens=(128,))
    assert grid.fitted_to(max_tokens=16, max_context=4096).tokens == (4, 16)


def test_grid_replaces_contexts_that_do_not_fit_with_the_longest_that_does():
    grid = Grid(batch_sizes=(1,), tokens=(4,), context_lens=(256, 2048, 8192))
    assert grid.fitted_to(max_tokens=64, max_context=2000).context_lens == (256, 2000)


def test_grid_keeps_a_width_when_every_width_is_too_wide():
    grid = Grid(batch_sizes=(1,), tokens=(32, 64), context_lens=(128,))
    assert grid.fitted_to(max_tokens=8, max_context=4096).tokens == (8,)


def test_grid_times_small_batches_first():
    grid = Grid(batch_sizes=(8, 1, 4), tokens=(4,), context_lens=(512, 64))
    batches = [batch for batch, _ in grid.fitted_to(64, 4096).points()]
    assert batches == sorted(batches)


def test_grid_counts_a_step_per_width_plus_a_decode_per_setup():
    grid = Grid(batch_sizes=(1, 2), tokens=(4, 8, 16), context_lens=(64, 128, 256))
    assert grid.num_timings == 2 * 3 * (3 + 1)


@pytest.mark.parametrize("field", ["batch_sizes", "tokens", "context_lens"])
def test_grid_rejects_an_empty_axis(field):
    axes = {"batch_sizes": (1,), "tokens": (4,), "context_lens": (64,), field: ()}
    with pytest.raises(ValueError, match=field):
        Grid(**axes)


def test_quick_grid_is_smaller_than_the_default():
    assert QUICK.num_timings * QUICK.repeats < DEFAULT.num_timings * DEFAULT.repeats


# --- command line ----------------------------------------------------------------------------


def test_command_line_axes_override_the_chosen_grid():
    args, _ = cli.parse_args(["--quick", "--tokens", "3", "5", "--repeats", "7"])
    grid = cli.choose_grid(args)
    assert (grid.tokens, grid.repeats, grid.batch_sizes) == ((3, 5), 7, QUICK.batch_sizes)


def test_server_flags_pass_through_to_sglang():
    _, rest = cli.parse_args(["--model-path", "T", "--quick", "--dtype", "float16", "--tp-size=1"])
    assert rest == ["--model-path", "T", "--dtype", "float16", "--tp-size=1"]


def test_server_arguments_select_bastion_with_a_window_for_the_widest_pass():
    argv = cli.server_argv(["--model-path", "T"], QUICK)
    assert cli._flag_value(argv, "--speculative-algorithm") == "BASTION"
    assert cli._flag_value(argv, "--speculative-num-draft-tokens") == str(max(QUICK.tokens))


def test_server_arguments_keep_what_the_user_chose():
    user = ["--device", "cpu", "--attention-backend=triton", "--max-total-tokens", "999"]
    argv = cli.server_argv(user, QUICK)
    assert cli._flag_value(argv, "--attention-backend") == "triton"
    assert cli._flag_value(argv, "--max-total-tokens") == "999"
    assert argv.count("--max-total-tokens") == 1


def test_cpu_server_arguments_use_the_tree_mask_backend_and_fit_the_largest_batch():
    argv = cli.server_argv(["--device", "cpu"], QUICK)
    assert cli._flag_value(argv, "--attention-backend") == "bastion_cpu"
    needed = max(QUICK.batch_sizes) * (max(QUICK.context_lens) + max(QUICK.tokens))
    assert int(cli._flag_value(argv, "--max-total-tokens")) >= needed


def test_serve_command_carries_the_defaults_the_profile_identity_depends_on():
    user = ["--model-path", "T", "--device", "cpu"]
    command = cli.serve_command(user, cli.server_argv(user, QUICK))
    assert cli._flag_value(command, "--attention-backend") == "bastion_cpu"
    assert cli._flag_value(command, "--speculative-algorithm") == "BASTION"
    assert "--max-total-tokens" not in command


def test_serve_environment_repeats_the_thread_count_the_profile_was_timed_with(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("SGLANG_BASTION_TOPK", raising=False)
    assert cli.serve_env(Path("/p.json")).split() == [
        "SGLANG_BASTION_PROFILE=/p.json",
        "OMP_NUM_THREADS=1",
    ]


# --- timing ----------------------------------------------------------------------------------


def test_timed_ms_runs_the_warmup_calls_before_the_timed_one():
    calls = []
    timing.timed_ms(lambda: calls.append(1), torch.device("cpu"), warmup=2)
    assert len(calls) == 3


def test_timed_ms_reports_milliseconds_between_start_and_end(monkeypatch):
    clock = iter([1.0, 1.004])
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    assert timing.timed_ms(lambda: None, torch.device("cpu")) == pytest.approx(4.0)


@pytest.mark.parametrize(("statistic", "expected"), [("median", 3.0), ("min", 1.0)])
def test_repeated_timings_are_summarised_by_the_chosen_statistic(statistic, expected):
    assert timing.summarize([3.0, 1.0, 100.0], statistic) == expected


def test_an_unknown_statistic_is_refused():
    with pytest.raises(ValueError, match="mean"):
        timing.summarize([1.0], "mean")


# --- hardware --------------------------------------------------------------------------------


def test_cpu_roofline_is_measured_with_positive_rates():
    found = hardware.measure_hardware(
        torch.device("cpu"), torch.float32, name="probe", matmul_size=128, copy_bytes=1 << 20
    )
    assert found.peak_flops > 0 and found.bandwidth > 0


def test_cpu_device_is_named_after_its_model():
    assert identity.device_name(torch.device("cpu")) == f"CPU {identity.cpu_model()}"


def test_listed_gpus_use_their_datasheet_preset(monkeypatch):
    monkeypatch.setattr(hardware, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
    found = hardware.device_hardware(torch.device("cuda"), torch.bfloat16)
    assert found == Hardware.lookup("H100-SXM")


# --- identity --------------------------------------------------------------------------------


def _identity(**changes):
    values = dict(
        target_name="Qwen/Qwen3-8B",
        target_config=QWEN3_8B_CONFIG,
        drafter_name="drafter",
        drafter_config=QWEN3_8B_CONFIG,
        dtype=torch.bfloat16,
        attention_backend="triton",
        block_size=16,
        tp_size=1,
    )
    values.update(changes)
    return serving_identity(**values)


def test_identity_names_the_dtype_without_the_torch_prefix():
    assert _identity().dtype == "bfloat16"


def test_identity_fingerprints_the_target_by_its_cost_relevant_shape():
    assert _identity().target.config_sha256 == config_fingerprint(QWEN3_8B_CONFIG)


def test_identity_changes_with_the_drafters_config():
    other = {**QWEN3_8B_CONFIG, "num_hidden_layers": 1}
    assert _identity(drafter_config=other).drafter != _identity().drafter


def test_a_config_the_roofline_cannot_read_is_still_fingerprinted():
    odd = {"architectures": ["DFlashDraftModel"], "block_size": 16}
    assert (
        model_ref("d", odd).config_sha256 != model_ref("d", {**odd, "block_size": 8}).config_sha256
    )


# --- fit -------------------------------------------------------------------------------------


def _measured(*verify_shapes: tuple[int, int, int]) -> Measurements:
    measured = Measurements()
    for shape in verify_shapes:
        measured.verify[shape] += [1.0, 1.2, 5.0]
    measured.aux[1, 64].append(0.5)
    measured.ar[1, 64].append(0.5)
    return measured


def test_one_verify_shape_is_not_enough_to_fit():
    assert not can_fit(_measured((1, 4, 64), (1, 4, 128)))


def test_two_verify_shapes_with_aux_and_decode_times_can_be_fitted():
    assert can_fit(_measured((1, 4, 64), (1, 8, 64)))


def test_each_grid_point_summarises_its_rounds():
    assert [p.latency_ms for p in _measured((1, 4, 64)).grid()] == [1.2]


def test_aux_and_decode_tables_average_over_contexts_per_batch_size():
    measured = _measured()
    measured.aux[1, 512].append(1.5)
    measured.aux[4, 64].append(2.0)
    assert measured.t_aux_table() == [(1, 1.0), (4, 2.0)]


def test_cpu_bf16_flags_name_the_bfloat16_instructions_the_cpu_has():
    flags = "processor : 0\nflags : fpu sse2 avx512f avx512_bf16 amx_tile amx_bf16\n"
    assert identity.cpu_bf16_flags(flags) == "amx_bf16, avx512_bf16"


def test_cpu_bf16_flags_say_none_for_a_cpu_without_them():
    assert identity.cpu_bf16_flags("flags : fpu sse2 avx2 avx512f\n") == "none"
