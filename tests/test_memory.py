"""--max-running-requests defaults to DFLASH's 48, lowered where W-wide step buffers do not fit."""

from __future__ import annotations

import pytest
from resolution import resolved_bastion_args

from sglang_bastion.memory import default_max_running_requests, step_buffer_bytes

QWEN3_8B_VOCAB, DFLASH_B16_DEPTH = 151_936, 15
GIB = 1 << 30


@pytest.mark.parametrize(("n_max", "buffers_gib"), [(16, 1.28), (32, 2.14), (64, 3.89)])
def test_an_8b_qwen3_on_an_80gb_gpu_runs_48_requests_within_five_percent(n_max, buffers_gib):
    batch = default_max_running_requests(n_max, DFLASH_B16_DEPTH, QWEN3_8B_VOCAB, 80 * 1024)
    used = step_buffer_bytes(batch, n_max, DFLASH_B16_DEPTH, QWEN3_8B_VOCAB)
    assert batch == 48 and used / GIB == pytest.approx(buffers_gib, abs=0.01)
    assert used <= 0.05 * 80 * GIB


def test_wide_trees_on_a_small_gpu_lower_the_default():
    assert default_max_running_requests(64, DFLASH_B16_DEPTH, QWEN3_8B_VOCAB, 24 * 1024) == 14
    assert default_max_running_requests(64, DFLASH_B16_DEPTH, QWEN3_8B_VOCAB, 1024) == 1


def test_an_unknown_device_memory_keeps_dflashs_default():
    assert default_max_running_requests(64, DFLASH_B16_DEPTH, QWEN3_8B_VOCAB, None) == 48


def resolved_max_running(*extra: str) -> int:
    """The --max-running-requests SGLang resolves for a CPU BASTION server with ``extra``."""
    return int(
        resolved_bastion_args(["--attention-backend", "bastion_cpu", *extra]).max_running_requests
    )


def test_the_launcher_fills_the_default_and_keeps_a_given_value():
    assert resolved_max_running() == 48  # the tiny pair's buffers fit many times over
    assert resolved_max_running("--max-running-requests", "5") == 5
