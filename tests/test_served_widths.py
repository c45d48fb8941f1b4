"""The served-width tool reads a worker trace as the controller's prices are meant."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from served_widths import step_summary  # noqa: E402


def step(started_s: float, batch: int, verify_ms: float, emitted: int) -> dict:
    """A traced decode step of ``batch`` requests that emitted ``emitted`` tokens each."""
    return {
        "started_s": started_s, "sizes": [8] * batch, "verify_ms": verify_ms,
        "cycle_ms": verify_ms + 5.0, "emitted": [[1] * emitted] * batch,
        "context_lens": [100] * batch,
    }  # fmt: skip


def test_only_steps_that_held_the_whole_batch_are_summarised():
    records = [step(0.00, 2, 10.0, 3), step(0.02, 1, 99.0, 1), step(0.04, 2, 12.0, 5)]
    summary = step_summary(records, 2)
    assert summary["steps"] == 2
    assert summary["verify_ms"] == pytest.approx(11.0)
    assert summary["cycle_ms"] == pytest.approx(16.0)
    assert summary["tokens_per_step"] == pytest.approx(8.0)


def test_a_step_s_period_runs_to_the_next_step_and_idle_gaps_are_not_periods():
    records = [step(0.00, 2, 10.0, 4), step(0.02, 2, 10.0, 4), step(5.00, 2, 10.0, 4)]
    summary = step_summary(records, 2)
    assert summary["period_ms"] == pytest.approx(20.0)  # the 4.98 s gap is an idle server
    assert summary["tokens_per_s"] == pytest.approx(1e3 * 8 / 20.0)


def test_a_batch_never_traced_has_no_summary():
    assert step_summary([step(0.0, 1, 10.0, 2)], 4) is None
