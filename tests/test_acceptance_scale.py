"""Online acceptance calibration: the controller learns what the target really accepts."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch
from test_controller_state import model, trees

from sglang_bastion.acceptance_scale import (
    GREEDY,
    MAX_SCALE,
    SAMPLED,
    accepting_kinds,
    calibrated_surrogate,
    host_request_kinds,
    new_acceptance_scale,
    observe,
    pool_index,
    scales,
    start_requests,
    step_evidence,
)
from sglang_bastion.controller import Controller
from sglang_bastion.tree import TreeBatch


def slots(*indices: int) -> torch.Tensor:
    """Request slots as SGLang's req_pool_indices carry them."""
    return torch.tensor(indices, dtype=torch.long)


def lengths(*values: int) -> torch.Tensor:
    """Requests' sequence lengths as SGLang's seq_lens carry them."""
    return torch.tensor(values, dtype=torch.long)


def test_a_fresh_calibration_trusts_the_drafter():
    state = new_acceptance_scale(8, "cpu")
    assert scales(state, slots(0, 3, 7), lengths(0, 5, 90)).tolist() == [1.0, 1.0, 1.0]


def test_the_scale_is_realised_over_predicted_drafts_up_to_its_cap():
    state = new_acceptance_scale(4, "cpu", decay=0.5, prior=1e-3)
    for _ in range(12):  # a quarter of the predicted drafts, twice as many, ten times as many
        observe(
            state, slots(1, 2, 3), lengths(40, 40, 40), torch.tensor([4.0, 2.0, 0.5]),
            torch.tensor([1.0, 4.0, 5.0]),
        )  # fmt: skip
    got = scales(state, slots(1, 2, 3), lengths(40, 40, 40)).tolist()
    assert got == pytest.approx([0.25, 2.0, MAX_SCALE], rel=0.02)


def test_a_step_that_passes_its_pools_along_calibrates_as_one_that_recomputes_them():
    reused, recomputed = new_acceptance_scale(8, "cpu"), new_acceptance_scale(8, "cpu")
    ids, at = slots(0, 3, 5, 6), lengths(10, 12, 40, 41)
    for state in (reused, recomputed):
        start_requests(
            state, ids, torch.tensor([GREEDY, SAMPLED, GREEDY, GREEDY]), lengths(9, 9, 9, 30)
        )
    for step in range(6):  # ages cross pool edges as the requests grow
        predicted = torch.tensor([3.0, 2.0, 4.0, 1.0])
        realised = torch.tensor([1.0, 0.0, 4.0, float(step % 2)])
        pool = pool_index(reused, ids, at + 3 * step)
        assert (
            scales(reused, ids, at + 3 * step, pool).tolist()
            == scales(recomputed, ids, at + 3 * step).tolist()
        )
        observe(reused, ids, at + 3 * step, predicted, realised, pool)
        observe(recomputed, ids, at + 3 * step, predicted, realised)
    assert torch.equal(reused.pools, recomputed.pools) and torch.equal(reused.slot, recomputed.slot)
    assert scales(reused, ids, at + 18).tolist() != [1.0, 1.0, 1.0, 1.0]  # it learned


def test_observing_a_batch_leaves_the_requests_of_other_kinds_alone():
    state = new_acceptance_scale(4, "cpu")
    start_requests(state, slots(2), torch.tensor([SAMPLED]), lengths(0))
    observe(state, slots(2), lengths(0), torch.tensor([3.0]), torch.tensor([0.0]))
    assert scales(state, slots(0, 1, 3), lengths(0, 0, 0)).tolist() == [1.0, 1.0, 1.0]
    assert float(scales(state, slots(2), lengths(0))[0]) < 1.0


def test_the_calibrated_surrogate_is_the_root_alone_at_scale_zero():
    batch = trees(2)
    flat = calibrated_surrogate(batch, torch.tensor([0.0, 1.0]))
    assert torch.equal(flat[0], torch.ones_like(flat[0]))
    assert torch.allclose(flat[1], batch.surrogate()[1])


def test_the_calibrated_surrogate_stays_concave_and_non_decreasing():
    batch = trees(4)
    cal = calibrated_surrogate(batch, torch.tensor([0.1, 0.7, 1.5, MAX_SCALE]))
    gains = cal.diff(dim=1)  # [B, N-1]
    assert bool((gains >= -1e-6).all()) and bool((gains.diff(dim=1) <= 1e-6).all())


def test_the_calibrated_surrogate_never_exceeds_what_the_tree_could_accept():
    batch = trees(2, nodes=16)
    cal = calibrated_surrogate(batch, torch.tensor([MAX_SCALE, MAX_SCALE]))
    deepest = batch.depths.max(dim=1).values + 1  # [B]
    assert bool((cal <= deepest.unsqueeze(1)).all())


def test_a_drafted_step_is_judged_by_its_accepted_drafts_against_a_hat():
    batch = trees(2, nodes=16)
    sizes, accept_lens = torch.tensor([8, 16]), torch.tensor([3, 1])
    predicted, realised = step_evidence(batch, sizes, accept_lens, torch.tensor([-1, -1]))
    want = batch.surrogate()[torch.arange(2), sizes - 1] - 1
    assert torch.allclose(predicted, want.float()) and realised.tolist() == [2.0, 0.0]


def test_a_root_only_step_is_judged_at_depth_one():
    batch = trees(2, nodes=16)
    children = (batch.depths == 1) & batch.real_mask()  # [B, N]
    hit = int(batch.token_ids[0][children[0]][0])  # a child of the first root
    miss = 63 if 63 not in batch.token_ids[1][children[1]].tolist() else 62
    predicted, realised = step_evidence(
        batch, torch.tensor([1, 1]), torch.tensor([1, 1]), torch.tensor([hit, miss])
    )
    mass = (batch.log_scores.exp() * children).sum(dim=1)
    assert torch.allclose(predicted, mass.float()) and realised.tolist() == [1.0, 0.0]


def test_one_step_that_accepts_nothing_leaves_a_request_most_of_its_calibration():
    # a greedy step accepts anything from none to the tree's depth: one poor step is luck
    state, ids, at = new_acceptance_scale(8, "cpu"), torch.arange(8), torch.full((8,), 40)
    for _ in range(20):
        observe(state, ids, at, torch.full((8,), 4.0), torch.full((8,), 4.0))
    observe(state, ids[:1], at[:1], torch.tensor([4.0]), torch.tensor([0.0]))
    assert float(scales(state, ids[:1], at[:1])[0]) >= 0.85


def test_a_new_request_starts_from_what_its_kind_was_accepted():
    state = new_acceptance_scale(8, "cpu")
    start_requests(
        state, slots(0, 1, 2), torch.tensor([SAMPLED, SAMPLED, GREEDY]), lengths(9, 9, 9)
    )
    for _ in range(20):  # sampled requests accept a tenth of their drafts, greedy all
        observe(state, slots(0, 1, 2), lengths(9, 9, 9), torch.full((3,), 4.0),
                torch.tensor([0.4, 0.4, 4.0]))  # fmt: skip
    start_requests(state, slots(5, 6), torch.tensor([SAMPLED, GREEDY]), lengths(30, 30))
    sampled, greedy = scales(state, slots(5, 6), lengths(30, 30)).tolist()
    assert sampled == pytest.approx(0.1, abs=0.02) and greedy == pytest.approx(1.0)


def serve_ages(state, ids: torch.Tensor, steps: int, young: float, old: float) -> None:
    """``steps`` steps of requests in ``ids`` started together, one token a step, whose
    drafts are accepted at ``young`` of A_hat's prediction in their first three tokens and at
    ``old`` from the seventh on (and halfway between)."""
    start_requests(state, ids, torch.full_like(ids, GREEDY), torch.full_like(ids, 100))
    for age in range(steps):
        ratio = young if age < 3 else old if age >= 7 else (young + old) / 2
        predicted = torch.full(ids.shape, 4.0)
        observe(state, ids, torch.full_like(ids, 100 + age), predicted, predicted * ratio)


def test_a_new_request_starts_from_what_requests_accepted_at_its_age():
    state, older = new_acceptance_scale(16, "cpu"), torch.arange(8)
    serve_ages(state, older, 40, young=0.05, old=1.25)  # a wave that has aged
    start_requests(state, slots(12), torch.tensor([GREEDY]), lengths(300))
    assert float(scales(state, slots(12), lengths(300))[0]) == pytest.approx(0.05, abs=0.03)
    # the same request ten tokens later, though it has not drafted since
    assert float(scales(state, slots(12), lengths(310))[0]) == pytest.approx(1.25, abs=0.01)


def test_a_request_s_poor_first_steps_do_not_hold_back_its_trees_once_it_is_older():
    state = new_acceptance_scale(16, "cpu")
    serve_ages(state, torch.arange(8), 40, young=0.05, old=1.25)
    serve_ages(state, torch.arange(8, 16), 8, young=0.05, old=1.25)  # the next wave
    assert scales(state, torch.arange(8, 16), torch.full((8,), 108)).tolist() == pytest.approx(
        [1.25] * 8, abs=0.02
    )


def test_one_request_at_a_time_prices_a_new_request_by_many_requests_first_steps():
    # requests served one after another reach the youngest age once each: its pool holds the
    # first steps of many requests, not of the last one alone (which accepted nothing here)
    state = new_acceptance_scale(4, "cpu")
    for first in [1.0, 0.0] * 6:  # the first step accepts all or nothing, every later one all
        start_requests(state, slots(0), torch.tensor([GREEDY]), lengths(100))
        for age in range(20):
            predicted = torch.tensor([2.0])
            ratio = first if age == 0 else 1.0
            observe(state, slots(0), lengths(100 + age), predicted, predicted * ratio)
    start_requests(state, slots(1), torch.tensor([GREEDY]), lengths(500))
    assert float(scales(state, slots(1), lengths(500))[0]) == pytest.approx(0.5, abs=0.1)


def test_where_acceptance_does_not_depend_on_age_a_request_s_own_ratio_prices_it():
    state, ids = new_acceptance_scale(16, "cpu"), torch.arange(16)
    serve_ages(state, ids, 12, young=0.6, old=0.6)
    assert scales(state, ids, torch.full((16,), 112)).tolist() == pytest.approx(
        [0.6] * 16, abs=0.01
    )


def test_a_request_s_own_ratio_counts_half_against_its_pool_however_long_it_runs():
    # a request's decayed evidence holds about ten steps' drafts (40 here), as much as the
    # prior: its own ratio, 1.2 or 0.8 of its pool's, moves its scale halfway, after 200
    # steps as after 20
    state, ids = new_acceptance_scale(16, "cpu"), torch.arange(16)
    start_requests(state, ids, torch.full_like(ids, GREEDY), torch.full_like(ids, 100))
    ratio = torch.tensor([1.2] * 8 + [0.8] * 8)
    at = torch.full_like(ids, 200)  # every request in the oldest age's pool
    for step in range(200):
        observe(state, ids, at, torch.full((16,), 4.0), 4.0 * ratio)
        if step in (19, 199):
            got = scales(state, ids, at).tolist()
            assert got == pytest.approx([1.1] * 8 + [0.9] * 8, abs=0.02), step


def test_a_kind_accepts_where_its_pools_with_evidence_realised_half_their_predicted_drafts():
    state = new_acceptance_scale(4, "cpu")
    assert accepting_kinds(state) == frozenset()  # nothing observed: no evidence either way
    greedy, sampled = slots(0, 1), slots(2, 3)
    start_requests(state, greedy, torch.full((2,), GREEDY), lengths(100, 100))
    start_requests(state, sampled, torch.full((2,), SAMPLED), lengths(100, 100))
    predicted = torch.tensor([3.0, 3.0])
    observe(state, greedy, lengths(120, 120), predicted, torch.tensor([2.0, 1.0]))  # age 20
    observe(state, sampled, lengths(120, 120), predicted, torch.tensor([0.5, 0.0]))
    assert accepting_kinds(state) == frozenset({GREEDY})
    observe(state, sampled, lengths(102, 102), predicted, torch.tensor([3.0, 3.0]))  # age 2
    assert accepting_kinds(state) == frozenset({GREEDY, SAMPLED})


def test_a_kind_accepted_at_one_age_alone_does_not_accept():
    # sampled requests whose first drafts are accepted and whose later ones are not: a wave
    # of them is not a wave of accepting requests
    state, sampled = new_acceptance_scale(4, "cpu"), slots(0, 1)
    start_requests(state, sampled, torch.full((2,), SAMPLED), lengths(100, 100))
    observe(state, sampled, lengths(101, 101), torch.full((2,), 1.0), torch.full((2,), 1.0))
    for age in range(10, 20):
        observe(state, sampled, lengths(100 + age, 100 + age), torch.full((2,), 3.0),
                torch.full((2,), 0.3))  # fmt: skip
    assert accepting_kinds(state) == frozenset()


def test_request_kinds_are_read_from_the_host_sampling_parameters():
    def req(top_k: int) -> SimpleNamespace:
        return SimpleNamespace(sampling_params=SimpleNamespace(top_k=top_k))

    assert host_request_kinds([req(1), req(1)]) == {GREEDY}  # SGLang's greedy: top-k 1
    assert host_request_kinds([req(1), req(1 << 30)]) == {GREEDY, SAMPLED}


def confident_trees(batch: int) -> TreeBatch:
    """Trees of 64 nodes whose drafter is sure of every depth (A_hat far above one)."""
    return trees(batch, nodes=64)


def run_step(controller: Controller, state, batch: int, accept: float) -> bool:
    """One served step against a target that accepts ``accept`` of each tree's drafts.

    Returns whether the step speculated (drafted and verified more than the root).
    """
    ids = torch.arange(batch)
    if not controller.drafts_this_step(4):
        controller.plain_decision(batch, torch.full((batch,), 256), torch.device("cpu"))
        return False
    whole = confident_trees(batch)
    contexts = torch.full((batch,), 256)
    decision = controller.decide(whole, contexts, scales(state, ids, contexts))
    predicted = step_evidence(whole, decision.sizes, decision.sizes, torch.full((batch,), -1))[0]
    observe(state, ids, contexts, predicted, predicted * accept)
    return not decision.plain


@pytest.mark.parametrize("layout", ["uniform", "ragged", "global"])
def test_a_miscalibrated_drafter_falls_back_to_plain_steps_and_recovers(layout):
    controller = Controller(
        "static", 64, layout, model(), learn_acceptance=True, max_backoff=8, packs_ragged=True
    )
    state = new_acceptance_scale(4, "cpu")
    assert run_step(controller, state, 4, accept=1.0)  # trusted at first: it speculates
    overconfident = [run_step(controller, state, 4, accept=0.0) for _ in range(60)]
    first_plain = overconfident.index(False)
    assert first_plain <= 6, overconfident  # within a few steps ...
    # ... and then speculates only in probes, one step after each plain wait
    tail = overconfident[first_plain:]
    assert not any(a and b for a, b in itertools.pairwise(tail)), overconfident
    assert sum(tail[-27:]) <= 3, overconfident
    assert controller.backoff == controller.max_backoff  # probing rarely by then
    recovered = [run_step(controller, state, 4, accept=1.0) for _ in range(60)]
    # a few drafted probes, one per max_backoff plain steps, bring the calibration back
    settled = max(i for i, spec in enumerate(recovered) if not spec) + 1
    assert settled <= 4 * (controller.max_backoff + 1) and all(recovered[settled:]), recovered


def test_where_trees_keep_losing_probes_draft_in_under_three_percent_of_the_steps():
    controller = Controller("static", 64, "uniform", model(), learn_acceptance=True)
    state = new_acceptance_scale(4, "cpu")
    drafted = []
    for _ in range(1000):
        plain_before = controller.plain_left
        run_step(controller, state, 4, accept=0.0)
        drafted.append(plain_before == 0)  # a step with no plain wait left drafts
    assert sum(drafted[-500:]) <= 15, sum(drafted[-500:])  # a probe and its judge per wait


def test_without_learning_the_controller_never_steps_plainly():
    controller = Controller("static", 64, "uniform", model())
    state = new_acceptance_scale(4, "cpu")
    assert all(run_step(controller, state, 4, accept=0.0) for _ in range(20))


def plain_waiting(kinds: frozenset[int]) -> Controller:
    """A controller whose batch of ``kinds`` was judged not to pay, waiting in plain steps."""
    controller = Controller("static", 64, "uniform", model(), learn_acceptance=True)
    controller.requests_joined(kinds)
    state = new_acceptance_scale(4, "cpu")
    while run_step(controller, state, 4, accept=0.0):
        pass
    assert controller.plain_left > 0
    return controller


@pytest.mark.parametrize("joined", [frozenset({GREEDY}), None])
def test_a_joining_request_of_another_or_unknown_kind_ends_the_plain_wait(joined):
    controller = plain_waiting(frozenset({SAMPLED}))
    controller.requests_joined(joined)
    assert controller.drafts_this_step(4)


def test_a_joining_request_of_a_kind_already_judged_keeps_the_plain_wait():
    controller = plain_waiting(frozenset({SAMPLED, GREEDY}))
    controller.requests_joined(frozenset({SAMPLED}))
    assert not controller.drafts_this_step(4)


def test_a_plain_step_is_priced_without_the_draft_pass():
    lm = model(t_aux_ms=3.0)
    controller = Controller("static", 64, "uniform", lm, learn_acceptance=True)
    plain = controller.plain_decision(4, torch.full((4,), 320), torch.device("cpu"))
    assert plain.plain and plain.width == 1 and plain.sizes.tolist() == [1] * 4
    assert plain.predicted_cycle_ms == pytest.approx(float(lm.cycle_ms(4, 1, 320.0)) - lm.aux_ms(4))


def serve_varying(
    controller: Controller, acceptance: list[float], spec_ms: float = 30.0, plain_ms: float = 10.0
) -> list[bool]:
    """A step per entry: a speculative step takes ``spec_ms`` and emits the entry's tokens per
    request (what the batch's drafts are worth at that step), a plain step (drafted or not)
    ``plain_ms`` and one. Returns whether each step speculated."""
    state, out = new_acceptance_scale(4, "cpu"), []
    ids, contexts = torch.arange(4), torch.full((4,), 256)
    for emitted in acceptance:
        if controller.drafts_this_step(4):
            decision = controller.decide(confident_trees(4), contexts, scales(state, ids, contexts))
        else:
            decision = controller.plain_decision(4, contexts, torch.device("cpu"))
        plain = decision.plain
        controller.observe_period(decision, 4, plain_ms if plain else spec_ms,
                                  1.0 if plain else emitted)  # fmt: skip
        out.append(not plain)
    return out


def serve(controller: Controller, steps: int, spec_ms: float, plain_ms: float, emitted: float):
    """`serve_varying` for ``steps`` steps whose speculative steps emit ``emitted`` each."""
    return serve_varying(controller, [emitted] * steps, spec_ms, plain_ms)


def test_speculation_that_measures_slower_than_plain_steps_stops():
    # the model is sure trees pay; the served steps say otherwise: 2 tokens in 3x the time
    controller = Controller(
        "static", 64, "uniform", model(), learn_acceptance=True, measure_overhead=True
    )
    spec = serve(controller, 80, spec_ms=30.0, plain_ms=10.0, emitted=2.0)
    assert spec[0] and sum(spec[-40:]) <= 6, spec


def test_a_step_the_measured_rates_judge_plain_spends_no_draft_pass():
    # the drafter is sure (A_hat high, never corrected here) but served trees lose: 1.5 tokens
    # in 5/3 of a plain step's time. Probes speculate; the step that judges a probe (or the
    # rates) plain is then a plain step, not a draft pass thrown away.
    controller = Controller(
        "static", 64, "uniform", model(), learn_acceptance=True, measure_overhead=True
    )
    state, contexts, ids = new_acceptance_scale(4, "cpu"), torch.full((4,), 256), torch.arange(4)
    wasted = speculated = 0
    for i in range(400):
        if drafted := controller.drafts_this_step(4):
            decision = controller.decide(confident_trees(4), contexts, scales(state, ids, contexts))
        else:
            decision = controller.plain_decision(4, contexts, torch.device("cpu"))
        controller.observe_period(decision, 4, 18.0 if decision.plain else 30.0,
                                  1.0 if decision.plain else 1.5)  # fmt: skip
        if i >= 200:
            wasted += drafted and decision.plain
            speculated += not decision.plain
    # waits reach 64 plain steps: at most 4 probes, each of at most `probe_steps` steps
    assert wasted == 0 and 0 < speculated <= 4 * controller.probe_steps, (wasted, speculated)


def measuring() -> Controller:
    """An adaptive controller that learns acceptance and measures its steps."""
    return Controller(
        "static", 64, "uniform", model(), learn_acceptance=True, measure_overhead=True
    )


def plain_period(controller: Controller, batch: int, period_ms: float) -> None:
    """One plain step of ``batch`` requests that took ``period_ms``."""
    decision = controller.plain_decision(batch, torch.full((batch,), 256), torch.device("cpu"))
    controller.observe_period(decision, batch, period_ms, 1.0)


def test_a_batch_sizes_first_plain_period_is_not_folded():
    controller = measuring()
    plain_period(controller, 16, 30.0)  # the first decode forward at this shape: cold
    assert 16 not in controller.plain_rate and 16 not in controller.plain_overhead_ms
    plain_period(controller, 16, 10.0)
    assert controller.plain_rate[16] == pytest.approx(1 / 10.0)
    plain_period(controller, 8, 30.0)  # another batch size runs its own first pass cold
    assert 8 not in controller.plain_rate


def test_plain_periods_are_averaged_until_the_ema_takes_over():
    controller = measuring()
    periods = [0.0, 10.0, 20.0, 40.0]  # the first (cold) is dropped
    for period in periods:
        plain_period(controller, 16, period if period else 50.0)
    mean = sum(1 / p for p in periods[1:]) / 3
    assert controller.plain_rate[16] == pytest.approx(mean)
    for _ in range(3 * round(1 / controller.rate_alpha)):
        plain_period(controller, 16, 10.0)
    before = controller.plain_rate[16]
    plain_period(controller, 16, 20.0)  # an EMA now: a new sample weighs rate_alpha
    moved = (before - controller.plain_rate[16]) / (before - 1 / 20.0)
    assert moved == pytest.approx(controller.rate_alpha)


def test_a_cold_first_plain_step_does_not_keep_speculation_that_loses():
    # speculative steps emit 2.5 tokens in 30 ms, plain steps one in 10 ms (trees lose), but
    # the first plain step at the batch size runs cold, in 40 ms: judged by it, trees win
    controller = measuring()
    state, contexts, ids = new_acceptance_scale(4, "cpu"), torch.full((4,), 256), torch.arange(4)
    spec, plain_steps = [], 0
    for _ in range(80):
        if controller.drafts_this_step(4):
            decision = controller.decide(confident_trees(4), contexts, scales(state, ids, contexts))
        else:
            decision = controller.plain_decision(4, contexts, torch.device("cpu"))
        if decision.plain:
            plain_steps += 1
        period = (40.0 if plain_steps == 1 else 10.0) if decision.plain else 30.0
        controller.observe_period(decision, 4, period, 1.0 if decision.plain else 2.5)
        spec.append(not decision.plain)
    assert sum(spec[-40:]) <= 6, spec


def test_speculation_that_measures_faster_goes_on():
    controller = Controller(
        "static", 64, "uniform", model(), learn_acceptance=True, measure_overhead=True
    )
    spec = serve(controller, 80, spec_ms=30.0, plain_ms=10.0, emitted=5.0)
    assert sum(spec[-40:]) >= 39, spec  # one plain step in 64 keeps the plain rate measured


def test_speculation_that_pays_twice_over_survives_three_poor_steps_in_a_row():
    # greedy steps emit anything from one token to the tree's depth: a short run of poor
    # steps is luck, not a change in what speculation yields
    controller = Controller(
        "static", 64, "uniform", model(), learn_acceptance=True, measure_overhead=True
    )
    assert sum(serve(controller, 200, spec_ms=30.0, plain_ms=10.0, emitted=6.0)[-40:]) >= 39
    serve_varying(controller, [1.0, 1.0, 1.0, 6.0, 6.0], spec_ms=30.0, plain_ms=10.0)
    assert controller.backoff == 0  # no plain wait began


def test_a_probe_that_passes_by_luck_does_not_start_the_plain_waits_over():
    # one step in three would emit 5 tokens in 3 plain steps' time, the others 1: speculation
    # loses, but a third of the probes pass
    controller = Controller(
        "static", 64, "uniform", model(), learn_acceptance=True, measure_overhead=True
    )
    serve_varying(controller, [5.0 if i % 3 == 0 else 1.0 for i in range(2000)])
    waits = []
    for i in range(2000):
        serve_varying(controller, [5.0 if i % 3 == 0 else 1.0])
        waits.append(controller.backoff)
    # the speculation a lucky probe resumes loses at once, and the waits go on doubling
    assert min(w for w in waits if w > 0) >= controller.max_backoff, sorted(set(waits))


def test_speculation_a_probe_resumes_that_pays_starts_the_plain_waits_over():
    controller = Controller(
        "static", 64, "uniform", model(), learn_acceptance=True, measure_overhead=True
    )
    serve_varying(controller, [1.0] * 1000)  # trees lose: long plain waits
    assert controller.backoff >= controller.max_backoff
    # acceptance returns for a while (5 tokens: speculation pays), then fails again
    assert sum(serve_varying(controller, [5.0] * 600)[-40:]) >= 39  # speculating again
    for _ in range(100):  # trees lose again, until the rates judge a plain step
        if not all(serve_varying(controller, [1.0])):
            break
    assert controller.backoff == 1  # the first wait after speculation that paid


@pytest.mark.parametrize("poor_first", [True, False])
def test_a_probe_is_judged_by_its_steps_together_not_by_one_poor_step(poor_first):
    # trees pay twice over on average (4 tokens in 2 plain steps' time), yet every other
    # step emits one token: a probe judged by one step alone fails when it lands on one
    controller = Controller(
        "static", 64, "uniform", model(), learn_acceptance=True, measure_overhead=True
    )
    serve_varying(controller, [1.0] * 400, spec_ms=20.0)  # trees lose: long plain waits
    assert controller.backoff >= controller.max_backoff
    steps = [1.0, 7.0] if poor_first else [7.0, 1.0]
    spec = serve_varying(controller, steps * 400, spec_ms=20.0)
    probe = spec.index(True)  # the first probe after the switch passes: speculation goes on
    assert sum(spec[probe : probe + 200]) >= 190, spec


def test_a_probe_speculates_where_the_model_prices_trees_out():
    # the model prices every tree above a plain step; after a stretch where trees lost,
    # only a probe's speculative steps can show that they pay again
    controller = Controller(
        "static", 64, "uniform", model(t_aux_ms=1000.0), learn_acceptance=True,
        measure_overhead=True,
    )  # fmt: skip
    serve(controller, 400, spec_ms=30.0, plain_ms=10.0, emitted=1.0)
    assert controller.backoff >= controller.max_backoff
    spec = serve(controller, 400, spec_ms=30.0, plain_ms=10.0, emitted=5.0)
    assert sum(spec[-200:]) >= 190, sum(spec[-200:])


def test_a_model_that_overprices_trees_is_overruled_by_the_measured_rates():
    # drafting priced at 1 s a step: the model alone would never speculate again
    controller = Controller(
        "static", 64, "uniform", model(t_aux_ms=1000.0), learn_acceptance=True,
        measure_overhead=True,
    )  # fmt: skip
    spec = serve(controller, 80, spec_ms=30.0, plain_ms=10.0, emitted=5.0)
    assert not spec[0] and sum(spec[-40:]) >= 39, spec


def serve_timed(controller: Controller, steps: int, draft_ms: float) -> tuple[float, float]:
    """Served steps where trees lose: a plain step takes 10 ms, a draft pass ``draft_ms`` more,
    a speculative step 60 ms for 2 tokens. Returns (time served, time of the tokens at the
    plain rate) over the second half of the steps."""
    state, served, plain_time = new_acceptance_scale(4, "cpu"), 0.0, 0.0
    ids, contexts = torch.arange(4), torch.full((4,), 256)
    for i in range(steps):
        if controller.drafts_this_step(4):
            decision = controller.decide(confident_trees(4), contexts, scales(state, ids, contexts))
            period, emitted = (10.0 + draft_ms, 1.0) if decision.plain else (60.0, 2.0)
        else:
            decision = controller.plain_decision(4, contexts, torch.device("cpu"))
            period, emitted = 10.0, 1.0
        controller.observe_period(decision, 4, period, emitted)
        if i >= steps // 2:
            served, plain_time = served + period, plain_time + 10.0 * emitted
    return served, plain_time


def test_costly_probes_wait_longer_so_they_lose_at_most_their_share_of_the_time():
    controller = Controller(
        "static", 64, "uniform", model(), learn_acceptance=True, measure_overhead=True,
        probe_share=0.02,
    )  # fmt: skip
    served, plain_time = serve_timed(controller, 8000, draft_ms=30.0)
    # each wait ends in a probe of two speculative steps (12 plain steps' time, past the
    # probe's 8): 4 tokens in 12 plain steps' time, 8 lost
    assert controller.probe_loss[4] == pytest.approx(8.0)
    assert controller.backoff == math.ceil(8.0 / controller.probe_share) > controller.max_backoff
    assert served / plain_time <= 1 + controller.probe_share, served / plain_time


def test_probes_within_their_share_keep_the_doubling_waits():
    controller = Controller(
        "static", 64, "uniform", model(), learn_acceptance=True, measure_overhead=True,
        probe_share=0.5,
    )  # fmt: skip
    served, plain_time = serve_timed(controller, 2000, draft_ms=30.0)
    # 8 plain steps lost per wait are within half the time after 16: the doubling's 64 rule
    assert controller.backoff == controller.max_backoff
    assert served / plain_time <= 1 + 8.5 / controller.max_backoff  # one probe per wait


def serve_sampled(
    controller: Controller, steps: int, accept: float, batch: int = 16, cut: bool = False
) -> tuple[list[str], float, float]:
    """Served steps of ``batch`` requests where a request that drafts emits ``accept`` tokens:
    a plain step takes 10 ms, a whole batch's draft pass 50 ms more and its speculative step
    30 ms; a sampled probe takes 12 ms (``cut``: a prefill follows it, which cuts its period
    short). Returns each step's kind ("plain", "sampled", "full" for a whole-batch draft
    pass), the time served and the time of its tokens at the plain rate."""
    state, kinds, served, plain_time = new_acceptance_scale(batch, "cpu"), [], 0.0, 0.0
    ids, contexts = torch.arange(batch), torch.full((batch,), 256)
    for _ in range(steps):
        sample = None
        if not controller.drafts_this_step(batch):
            decision = controller.plain_decision(batch, contexts, torch.device("cpu"))
            period, emitted, kind = 10.0, 1.0, "plain"
        else:
            rows = controller.draft_rows(batch)
            sampled = rows < batch
            decision = controller.decide(
                confident_trees(batch), contexts, scales(state, ids, contexts),
                slice(0, rows) if sampled else None,
            )  # fmt: skip
            if sampled:
                period, emitted, kind = 12.0, (rows * accept + batch - rows) / batch, "sampled"
                sample = accept
            elif decision.plain:
                period, emitted, kind = 60.0, 1.0, "full"
            else:
                period, emitted, kind = 30.0, accept, "full"
        if cut and kind == "sampled":
            controller.observe_cut(decision, batch, sample)
        else:
            controller.observe_period(decision, batch, period, emitted, sample)
        kinds.append(kind)
        served, plain_time = served + period, plain_time + 10.0 * emitted
    return kinds, served, plain_time


def sampling_controller() -> Controller:
    """A learning, measuring controller whose probes at batches above 4 draft 4 requests."""
    return Controller(
        "static", 64, "uniform", model(), learn_acceptance=True, measure_overhead=True,
        max_backoff=8,
    )  # fmt: skip


def test_where_trees_lose_probes_at_a_larger_batch_draft_only_a_sample():
    controller = sampling_controller()
    kinds, _, _ = serve_sampled(controller, 400, accept=1.5)  # 1.5 tokens in 3x the time
    tail = kinds[200:]
    assert tail.count("sampled") >= 10, kinds
    assert tail.count("full") == 0, kinds  # the samples show the full probe is not worth it


def test_a_sampled_probe_cut_short_by_a_prefill_is_still_judged_by_its_sample():
    controller = sampling_controller()
    kinds, _, _ = serve_sampled(controller, 400, accept=1.5, cut=True)
    tail = kinds[200:]
    # one sample per wait of 8 plain steps, as when no prefill follows it (unjudged, every
    # step after the first wait would probe again)
    assert 10 <= tail.count("sampled") <= 200 // controller.max_backoff + 1, kinds
    assert tail.count("full") == 0, kinds


def test_sampled_probes_lose_little_of_the_plain_rate():
    controller = sampling_controller()
    serve_sampled(controller, 400, accept=1.5)
    _, served, plain_time = serve_sampled(controller, 400, accept=1.5)
    # one sampled probe per wait of 8 plain steps, each 1.2 plain steps for 1.125 tokens
    assert served / plain_time <= 1.02, served / plain_time


def test_a_sample_that_accepts_enough_lets_the_full_probe_resume_speculation():
    controller = sampling_controller()
    serve_sampled(controller, 200, accept=1.5)
    assert controller.plain_left > 0 or controller.backoff > 0  # waiting in plain steps
    kinds, _, _ = serve_sampled(controller, 60, accept=5.0)  # 5 tokens in 3x the time: pays
    first = kinds.index("sampled")
    assert "full" in kinds[first : first + 3], kinds  # the full probe follows its sample
    assert kinds[-30:].count("full") >= 29, kinds


def test_plain_steps_go_dormant_only_after_four_plain_judgements_in_a_row():
    controller = sampling_controller()
    waits = []
    for _ in range(200):
        serve_sampled(controller, 1, accept=1.5)
        waits.append((controller.backoff, controller.dormant(16)))
    assert all(dormant == (backoff >= 8) for backoff, dormant in waits), waits
    assert waits[-1] == (8, True)
    assert not controller.dormant(controller.probe_rows)  # its probes draft every request


def dormant_controller() -> Controller:
    """A sampling controller of a batch of 16 whose plain steps went dormant."""
    controller = sampling_controller()
    controller.requests_joined(frozenset({GREEDY}), 16, frozenset({GREEDY}))
    serve_sampled(controller, 200, accept=1.5)
    assert controller.dormant(16)
    return controller


def test_a_new_wave_of_accepting_requests_starts_the_plain_waits_over():
    # The batch's old requests went dormant; half a batch of new ones of a kind whose drafts
    # are accepted at some age gets every drafter context, and its first poor steps wait
    # from one plain step.
    controller = dormant_controller()
    controller.requests_joined(frozenset({GREEDY}), 5, frozenset({GREEDY}))
    controller.requests_joined(frozenset({GREEDY}), 3, frozenset({GREEDY}))  # 8 of 16
    assert not controller.dormant(16)  # their prefill writes every joiner's drafter context
    controller.drafts_this_step(16)
    assert controller.backoff <= 1 and not controller.dormant(16)
    kinds, _, _ = serve_sampled(controller, 3, accept=1.5)
    assert controller.backoff <= 2, kinds


def test_a_wave_after_one_where_no_probe_passed_keeps_the_wait():
    # The first wave's waits started over and no probe passed since: the next wave's probes
    # stay as rare as the wait has grown, and its prefill still writes every joiner's
    # drafter context.
    controller = dormant_controller()
    controller.requests_joined(frozenset({GREEDY}), 8, frozenset({GREEDY}))
    controller.drafts_this_step(16)
    assert controller.backoff <= 1  # this wave starts over: the one before it speculated
    while not controller.dormant(16):
        serve_sampled(controller, 1, accept=1.5)
    backoff = controller.backoff
    controller.requests_joined(frozenset({GREEDY}), 8, frozenset({GREEDY}))
    assert not controller.dormant(16)
    controller.drafts_this_step(16)
    assert controller.backoff == backoff and controller.dormant(16)


def test_short_requests_joining_in_waves_do_not_multiply_the_probes():
    # Half the batch ends and joins every 32 steps and trees never pay: after the first
    # waves, probes come once per wait of the doubling's cap, not five times per wave.
    controller = Controller(
        "static", 64, "uniform", model(), learn_acceptance=True, measure_overhead=True
    )  # fmt: skip
    kinds = []
    for _ in range(40):
        controller.requests_joined(frozenset({GREEDY}), 8, frozenset({GREEDY}))
        kinds += serve_sampled(controller, 32, accept=1.5)[0]
    tail = kinds[-640:]
    assert tail.count("sampled") <= len(tail) // controller.max_backoff + 1, kinds
    assert tail.count("full") == 0, kinds


def test_a_probe_that_passes_lets_the_next_wave_start_the_waits_over():
    controller = dormant_controller()
    controller.requests_joined(frozenset({GREEDY}), 8, frozenset({GREEDY}))
    serve_sampled(controller, 200, accept=1.5)  # this wave's probes all lose
    for _ in range(1000):  # then a sample passes, and its full probe
        if controller.backoff == 0:
            break
        serve_sampled(controller, 1, accept=5.0)
    serve_sampled(controller, 200, accept=1.5)  # and speculation loses again
    assert controller.backoff > 1
    controller.requests_joined(frozenset({GREEDY}), 8, frozenset({GREEDY}))
    controller.drafts_this_step(16)
    assert controller.backoff <= 1


def test_a_new_wave_does_not_judge_the_old_requests_resumed_speculation():
    # A probe passed after a long wait; the speculation it resumed is judged against that
    # wait (lost: the next wait doubles it). A new wave's first poor steps are not that.
    controller = sampling_controller()
    serve_sampled(controller, 200, accept=1.5)
    while controller.backoff > 0:  # a sample passes, then its full probe: speculation resumes
        serve_sampled(controller, 1, accept=5.0)
    assert controller._resumed is not None
    controller.requests_joined(frozenset({GREEDY}), 16, frozenset({GREEDY}))
    steps = 0
    while controller.backoff == 0 and steps < 100:  # the wave's first steps accept nothing
        serve_sampled(controller, 1, accept=1.0)
        steps += 1
    assert controller.backoff == 1 and not controller.dormant(16), steps  # a first wait


@pytest.mark.parametrize(
    ("count", "accepting"),
    [(7, frozenset({GREEDY})), (16, frozenset()), (16, frozenset({SAMPLED}))],
)
def test_a_few_new_requests_or_a_wave_of_a_kind_never_accepted_keep_the_wait(count, accepting):
    controller = dormant_controller()
    backoff = controller.backoff
    controller.requests_joined(frozenset({GREEDY}), count, accepting)
    controller.drafts_this_step(16)
    assert controller.backoff == backoff and controller.dormant(16)


def test_a_sample_that_accepts_enough_ends_dormancy():
    controller = sampling_controller()
    serve_sampled(controller, 200, accept=1.5)
    kinds = []
    while "sampled" not in kinds:
        kinds += serve_sampled(controller, 1, accept=5.0)[0]
    assert not controller.dormant(16)


def test_probes_at_a_batch_no_larger_than_the_sample_draft_every_request():
    controller = sampling_controller()
    kinds, _, _ = serve_sampled(controller, 200, accept=1.5, batch=controller.probe_rows)
    assert "sampled" not in kinds and kinds.count("full") > 2, kinds


def alike_trees(batch: int) -> TreeBatch:
    """``batch`` copies of one confident request's tree of up to 64 nodes."""
    whole = confident_trees(4)
    fields = ("token_ids", "parents", "depths", "log_scores", "num_nodes")
    firsts = (getattr(whole, name)[:1] for name in fields)
    return TreeBatch(*(first.expand(batch, *first.shape[1:]) for first in firsts))


@pytest.mark.parametrize("layout", ["uniform", "ragged", "global"])
@pytest.mark.parametrize("rows", [slice(4, 8), torch.tensor([1, 6, 7, 12])])
def test_a_sampled_probe_sizes_its_sample_as_the_full_step_would_and_the_rest_as_roots(
    layout, rows
):
    controller = Controller("static", 64, layout, model(), packs_ragged=True)
    contexts = torch.full((16,), 256)
    full = controller.decide(alike_trees(16), contexts)
    merged = TreeBatch.roots(torch.zeros(16, dtype=torch.long)).with_rows(rows, alike_trees(4))
    sampled = controller.decide(merged, contexts, sample=rows)
    assert sampled.sampled and not full.sampled
    assert sampled.width == full.width > 1
    assert sampled.sizes[rows].tolist() == full.sizes[rows].tolist()
    others = torch.ones(16, dtype=torch.bool)
    others[rows] = False
    assert sampled.sizes[others].tolist() == [1] * 12
