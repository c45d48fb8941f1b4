"""Which requests' drafter context dormant plain steps keep whole, and who drafts after."""

import pytest
import torch

from sglang_bastion.draft_context import (
    DraftContext,
    drafting_rows,
    full_step_mean,
    joiners_kept_whole,
    kept_rows,
    probe_rows,
    whole_count,
)


def batch(*ids: int) -> tuple[str, ...]:
    """Request ids r<i> in batch order."""
    return tuple(f"r{i}" for i in ids)


def test_a_dormant_step_keeps_a_samples_worth_of_requests_and_the_others_fall_behind():
    state = DraftContext()
    assert kept_rows(state, batch(*range(8)), 3) == (0, 1, 2)
    assert state.behind == set(batch(3, 4, 5, 6, 7))


def test_kept_requests_stay_kept_while_the_rows_around_them_change():
    state = DraftContext()
    kept_rows(state, batch(*range(8)), 3)
    # r0 left; r1 and r2 moved up a row; r8 joined (whole: its prefill wrote its context)
    assert kept_rows(state, batch(1, 2, 3, 4, 5, 6, 7, 8), 3) == (0, 1, 7)
    assert state.kept == frozenset(batch(1, 2, 8))


def test_a_request_that_fell_behind_is_never_kept_again():
    state = DraftContext()
    kept_rows(state, batch(*range(6)), 2)
    assert kept_rows(state, batch(2, 3, 4, 5), 2) == ()  # r0 and r1 left; the rest are behind
    assert state.kept == frozenset()


def test_requests_that_left_are_forgotten():
    state = DraftContext()
    kept_rows(state, batch(*range(6)), 2)
    kept_rows(state, batch(0, 1, 5, 9), 2)
    assert state.behind == set(batch(5, 9))


def test_a_dormant_prefill_writes_only_the_joiners_that_refill_the_sample():
    state = DraftContext()
    kept_rows(state, batch(*range(8)), 4)  # r0..r3 kept, r4..r7 behind
    # r0 finished: 3 running requests are kept, so one of the joiners refills the sample
    assert joiners_kept_whole(state, batch(8, 9, 10), 3, 4) == (0,)
    assert "r8" in state.kept and {"r9", "r10"} <= state.behind
    assert drafting_rows(state, batch(1, 2, 3, 4, 5, 6, 7, 8, 9, 10), 4) == [0, 1, 2, 7]


def test_a_dormant_prefill_beside_a_whole_sample_writes_no_joiner():
    state = DraftContext()
    kept_rows(state, batch(*range(8)), 4)
    assert joiners_kept_whole(state, batch(8, 9), 4, 4) == ()
    assert state.behind >= set(batch(8, 9))


def test_a_prompt_prefilled_again_keeps_what_it_was():
    state = DraftContext()
    kept_rows(state, batch(*range(8)), 2)  # r0, r1 kept; r2..r7 behind
    # r1's and r5's prompts come again (chunks, retraction); the sample is full
    assert joiners_kept_whole(state, batch(1, 5, 8), 2, 2) == (0,)
    assert "r1" in state.kept and {"r5", "r8"} <= state.behind


def test_with_nobody_behind_a_full_step_drafts_everyone_and_samples_take_turns():
    state = DraftContext()
    requests = batch(*range(10))
    assert drafting_rows(state, requests, 10) is None
    assert drafting_rows(state, requests, 4) == [0, 1, 2, 3]
    assert drafting_rows(state, requests, 4) == [4, 5, 6, 7]
    assert drafting_rows(state, requests, 4) == [1, 2, 3, 4]  # 8 would run past the batch


def test_requests_behind_never_draft_while_whole_ones_can():
    state = DraftContext()
    kept_rows(state, batch(*range(8)), 2)  # r2..r7 fell behind
    requests = batch(*range(10))  # r8 and r9 joined
    assert drafting_rows(state, requests, 10) == [0, 1, 8, 9]  # the full probe: the whole ones
    assert drafting_rows(state, requests, 3) == [0, 1, 8]
    assert drafting_rows(state, requests, 3) == [1, 8, 9]


def test_with_every_request_behind_a_sample_is_drawn_from_them_all():
    state = DraftContext()
    kept_rows(state, batch(*range(4)), 1)
    assert drafting_rows(state, batch(1, 2, 3), 2) == [0, 1]
    assert drafting_rows(state, batch(1, 2, 3), 3) is None


def test_a_full_probe_of_a_batch_with_requests_behind_is_no_sampled_probe():
    state = DraftContext()
    kept_rows(state, batch(*range(16)), 4)
    assert probe_rows(state, batch(*range(16)), 16) == ([0, 1, 2, 3], False)
    rows, sampled = probe_rows(state, batch(*range(16)), 2)
    assert sampled and len(rows) == 2 and set(rows) <= {0, 1, 2, 3}
    assert probe_rows(DraftContext(), batch(*range(16)), 16) == (None, False)


def test_a_full_probe_drafts_only_the_requests_whose_context_is_whole():
    state = DraftContext()
    kept_rows(state, batch(*range(16)), 4)  # 12 fell behind
    assert whole_count(state, batch(*range(16))) == 4
    assert whole_count(state, batch(0, 1, 20, 21)) == 4  # r20 and r21 joined whole
    assert whole_count(DraftContext(), batch(*range(16))) == 16


def test_a_sample_promises_its_full_probe_only_what_the_whole_requests_can_emit():
    walked = torch.tensor([10, 11, 9, 10])  # a sample of 4 walked 10 tokens each on average
    assert float(full_step_mean(walked, 16, 16)) == pytest.approx(10.0)  # everyone drafts
    # 4 of 16 can draft: they walk as the sample did, the other 12 emit their roots
    assert float(full_step_mean(walked, 4, 16)) == pytest.approx((4 * 10 + 12) / 16)
    assert float(full_step_mean(walked, 0, 16)) == pytest.approx(1.0)
