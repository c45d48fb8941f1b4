"""bastion-calibrate end to end on the tiny pair on CPU: real SGLang passes, timed and fitted."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from server_utils import STANDINS

from sglang_bastion.budget import load_profile
from sglang_bastion.budget.identity import device_name, serving_identity
from sglang_bastion.calibration.cli import EXIT_INTERRUPTED
from sglang_bastion.calibration.grid import QUICK
from sglang_bastion.spec_algo import drafter_block_size

pytestmark = pytest.mark.slow

# One OpenMP thread: on a CPU shared with other jobs, a second thread waiting at every
# parallel-region barrier for a descheduled sibling makes single passes 100x slower at
# random, which no median survives (the server would be slowed the same way).
CALIBRATE_ENV = {"OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
PROGRESS = re.compile(r"(\d+)/(\d+) \[")


def calibrate_command(pair: tuple[Path, Path], output: Path, *extra: str) -> list[str]:
    """The bastion-calibrate command line for the tiny pair on CPU."""
    target, drafter = pair
    return [
        sys.executable, "-m", "sglang_bastion.calibration.cli",
        "--model-path", str(target), "--speculative-draft-model-path", str(drafter),
        "--device", "cpu", "--dtype", "bfloat16", "--output", str(output), *extra,
    ]  # fmt: skip


def calibrate_env() -> dict[str, str]:
    """This environment with the CPU stand-ins on PYTHONPATH (vLLM's rotary import)."""
    env = dict(os.environ, **CALIBRATE_ENV)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(STANDINS), env.get("PYTHONPATH")) if p)
    return env


@pytest.fixture(scope="module")
def quick_run(pair, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """One quick calibration of the tiny pair: the finished process and its profile path."""
    output = tmp_path_factory.mktemp("calibration") / "tiny.json"
    done = subprocess.run(
        calibrate_command(pair, output, "--quick", "--no-progress"),
        env=calibrate_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done, output


def test_quick_calibration_writes_a_profile_the_server_can_load(quick_run, pair):
    target, drafter = pair
    expect = serving_identity(
        target_name=str(target),
        target_config=json.loads((target / "config.json").read_text()),
        drafter_name=str(drafter),
        drafter_config=json.loads((drafter / "config.json").read_text()),
        dtype="bfloat16",
        attention_backend="bastion_cpu",
        block_size=drafter_block_size(drafter),
        tp_size=1,
    )
    cpu = device_name(torch.device("cpu"))
    assert load_profile(quick_run[1], expect, expect_device_name=cpu).identity == expect


def test_quick_calibration_times_every_shape_of_the_quick_grid(quick_run):
    profile = load_profile(quick_run[1])
    shapes = {(p.batch_size, p.tokens_per_request, p.context_len) for p in profile.grid}
    expected = {
        (b, t, c) for b in QUICK.batch_sizes for t in QUICK.tokens for c in QUICK.context_lens
    }
    assert shapes == expected
    assert [b for b, _ in profile.t_aux_ms] == list(QUICK.batch_sizes)
    assert [b for b, _ in profile.l_ar_ms] == list(QUICK.batch_sizes)


def test_calibrated_fit_beats_the_bare_roofline(quick_run):
    profile = load_profile(quick_run[1])
    assert profile.rmse_calibrated_ms < profile.rmse_roofline_ms


def test_calibration_draws_the_measured_vs_predicted_figure(quick_run):
    figure = quick_run[1].with_suffix(".png")
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_calibration_says_where_the_profile_is_and_how_to_serve_with_it(quick_run):
    done, output = quick_run
    assert f"SGLANG_BASTION_PROFILE={output}" in done.stdout
    assert "--speculative-algorithm BASTION" in done.stdout


def test_ctrl_c_keeps_and_fits_what_was_measured(pair, tmp_path):
    output = tmp_path / "interrupted.json"
    log = tmp_path / "progress.log"
    # Many rounds: the grid takes minutes, far longer than the wait for its first passes. The
    # widths differ 16-fold at batch 16, so one noisy sample per shape still fits a rising line.
    extra = ["--batch-sizes", "16", "32", "--tokens", "2", "32"]
    extra += ["--context-lens", "64", "512", "--repeats", "1000", "--warmup", "1"]
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            calibrate_command(pair, output, *extra),
            env=calibrate_env(),
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    try:
        done, deadline = 0, time.monotonic() + 240
        while done < 6 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
            counts = PROGRESS.findall(log.read_text(errors="ignore"))
            done = int(counts[-1][0]) if counts else 0
        assert proc.poll() is None, "the grid finished before it could be interrupted"
        proc.send_signal(signal.SIGINT)
        stdout, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_INTERRUPTED, log.read_text()[-3000:]
    assert "interrupted by Ctrl-C" in stdout
    assert len(load_profile(output).grid) >= 2
    assert output.with_suffix(".png").exists()
