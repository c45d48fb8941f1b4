"""--max-running-requests defaults to DFLASH's 48, lowered where W-wide step buffers do not fit;
the verify graphs capture the narrowest widths whose attention state fits."""

from __future__ import annotations

import pytest
from resolution import resolved_bastion_args

from sglang_bastion.controller import width_ladder
from sglang_bastion.memory import (
    default_max_running_requests,
    graph_widths_that_fit,
    step_buffer_bytes,
    verify_graph_bytes,
)

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


QWEN3_8B_GRAPH = {"context": 40_960, "heads": 32, "head_dim": 128, "kv_splits": 8}


def ladder_state(n_max: int) -> dict[int, int]:
    """Triton's graph state per ladder width for Qwen3-8B at 48 requests and N_max."""
    return {
        w: verify_graph_bytes(max_bs=48, width=w, window=n_max, **QWEN3_8B_GRAPH)
        for w in width_ladder(n_max)
    }


@pytest.mark.parametrize(
    ("n_max", "captured", "state_gib"),
    [(16, (1, 2, 4, 8, 12, 16), 1.06), (32, (1, 2, 4, 8, 12, 16, 24, 32), 2.50),
     (64, (1, 2, 4, 8, 12, 16, 24, 32), 2.97)],
)  # fmt: skip
def test_an_8b_qwen3_on_an_80gb_gpu_captures_the_narrowest_widths_within_five_percent(
    n_max, captured, state_gib
):
    state = ladder_state(n_max)
    fitted = graph_widths_that_fit(tuple(state), state, 80 * 1024)
    used = sum(state[w] for w in fitted)
    assert fitted == captured and used / GIB == pytest.approx(state_gib, abs=0.01)
    assert used <= 0.05 * 80 * GIB


def test_the_graph_state_of_a_width_is_dominated_by_its_kv_slots_per_context_position():
    one = verify_graph_bytes(max_bs=48, width=32, window=32, **QWEN3_8B_GRAPH)
    assert 48 * 32 * 40_960 * 8 < one < 1.6 * 48 * 32 * 40_960 * 8


def test_an_unknown_device_memory_captures_every_width():
    state = ladder_state(64)
    assert graph_widths_that_fit(tuple(state), state, None) == width_ladder(64)


def test_the_startup_sampling_rehearsal_runs_at_the_verify_width(monkeypatch):
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from sglang_bastion.worker import BastionWorker

    rehearsed = []
    monkeypatch.setattr(
        DFlashWorkerV2, "prewarm_sampling", lambda self: rehearsed.append(self.block_size) or 7
    )
    worker = BastionWorker.__new__(BastionWorker)  # the glue only: no model
    worker.block_size, worker.window = 8, 32
    assert worker.prewarm_sampling() == 7
    assert rehearsed == [32] and worker.block_size == 8
