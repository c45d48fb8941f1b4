"""Which batches are waves: requests bound to end together while they decode plainly."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sglang.srt.sampling.sampling_params import SamplingParams

from sglang_bastion.worker import wave_budget


def req(emitted: int = 10, grammar: object = None, **params: object) -> SimpleNamespace:
    """A request of SGLang's sampling parameters (64 new tokens, EOS ignored unless given)."""
    sampling = SamplingParams(**{"max_new_tokens": 64, "ignore_eos": True, **params})
    return SimpleNamespace(sampling_params=sampling, output_ids=[0] * emitted, grammar=grammar)


def test_requests_that_must_run_to_one_budget_end_together_with_its_tokens_left():
    assert wave_budget([req(), req(), req()]) == (54, 1)


def test_requests_that_must_run_to_their_budgets_end_at_as_many_steps_as_budgets():
    batch = [req(emitted=10), req(emitted=12), req(emitted=10), req(max_new_tokens=80)]
    assert wave_budget(batch) == (52, 3)  # the first ends 52 tokens on


@pytest.mark.parametrize("odd", [
    req(ignore_eos=False), req(stop=["\n"]), req(stop_token_ids=[7]), req(stop_regex=["x+"]),
    req(grammar=object()), req(max_new_tokens=None),
])  # fmt: skip
def test_a_request_that_may_end_before_its_budget_makes_no_waves(odd):
    assert wave_budget([req(), odd, req()]) == (0, 0)


def test_an_empty_batch_makes_no_waves():
    assert wave_budget([]) == (0, 0)
