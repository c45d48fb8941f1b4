"""The controller as the server runs it: modes, layouts, EMA correction."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch
from helpers import random_marginals

from sglang_bastion import controller
from sglang_bastion.budget import Calibration, Hardware, LatencyModel, ModelShape
from sglang_bastion.budget.global_budget import packed_totals
from sglang_bastion.controller import Controller, width_ladder
from sglang_bastion.tree import TreeBatch, build_trees

SHAPE = ModelShape.from_hf_config(
    {"hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
     "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288,
     "vocab_size": 151936}
)  # fmt: skip


def model(t_aux_ms: float = 1.0) -> LatencyModel:
    """A Qwen3-8B-shaped model on an H100 roofline, calibrated as the identity."""
    return LatencyModel(
        shape=SHAPE,
        hardware=Hardware.lookup("H100-SXM"),
        calibration=Calibration(slope=1.0, intercept_ms=0.5),
        t_aux_table=((1, t_aux_ms), (64, 4 * t_aux_ms)),
        l_ar_table=((1, 8.0), (64, 20.0)),
    )


def trees(batch: int, nodes: int = 64, seed: int = 0):
    """Best-first trees of smooth random marginals, the same 4 requests over and over."""
    probs = random_marginals(4, 7, 64, "smooth", torch.Generator().manual_seed(seed))
    probs = probs.repeat((batch + 3) // 4, 1, 1)[:batch]
    return build_trees(probs, torch.zeros(batch, dtype=torch.long), top_k=8, max_nodes=nodes)


def test_fixed_mode_verifies_n_nodes_per_request():
    decision = Controller("fixed", 16).decide(trees(4), torch.full((4,), 100))
    assert decision.sizes.tolist() == [16] * 4 and decision.width == 16
    assert decision.predicted_cycle_ms is None


def same_trees(one: TreeBatch, other: TreeBatch) -> bool:
    """Whether two tree batches hold the same tensors, field by field."""
    names = [f.name for f in fields(TreeBatch)]
    return all(torch.equal(getattr(one, name), getattr(other, name)) for name in names)


@pytest.mark.parametrize(
    ("budget", "batch"),
    [
        (Controller("fixed", 16), 4),  # trees built to N
        (Controller("fixed", 8), 4),  # larger trees, cut to N
        (Controller("static", 32, "uniform", model()), 4),
        (Controller("static", 32, "global", model(), packs_ragged=True), 1),
    ],
    ids=["fixed-whole", "fixed-cut", "uniform", "global-lone-request"],
)
def test_a_decision_that_narrows_only_cuts_the_trees_as_truncating_them_does(budget, batch):
    built = trees(batch, nodes=16 if budget.mode == "fixed" else 32)
    decision = budget.decide(built, torch.full((batch,), 256))
    assert decision.narrows_only  # the worker then narrows the trees alone
    cut = built.truncate(decision.sizes).narrow(decision.width)
    assert same_trees(built.narrow(decision.width), cut)
    assert same_trees(decision.cut(built), cut)  # what the worker verifies


def test_a_packed_decision_does_not_narrow_only():
    budget = Controller("static", 32, "global", model(), packs_ragged=True)
    assert not budget.decide(trees(4, nodes=32), torch.full((4,), 256)).narrows_only


def test_a_packed_decision_cuts_each_tree_to_its_size_within_the_width():
    built = trees(4, nodes=32)
    scale = torch.tensor([0.0, 0.5, 1.0, 4.0])  # [B]: from no speculation to confident
    decision = Controller("static", 32, "global", model(), packs_ragged=True).decide(
        built, torch.full((4,), 256), scale
    )
    assert len(set(decision.sizes.tolist())) > 1  # sizes differ: the cut is not a narrowing
    assert same_trees(decision.cut(built), built.truncate(decision.sizes).narrow(decision.width))


def test_cut_trees_price_their_own_nodes_after_the_whole_trees_were_priced():
    built = trees(4, nodes=32)
    whole = built.surrogate()  # [B, N]: computed once, on the whole trees
    cut = built.truncate(torch.tensor([1, 3, 8, 32]))
    assert built.surrogate() is whole
    assert torch.equal(cut.surrogate(), torch.cumsum(torch.exp(cut.log_scores), dim=1))
    assert cut.surrogate()[:, -1].tolist() != whole[:, -1].tolist()


def test_adaptive_modes_need_a_latency_model():
    with pytest.raises(ValueError, match="needs a latency model"):
        Controller("static", 16)


@pytest.mark.parametrize("layout", ["uniform", "ragged"])
def test_adaptive_width_shrinks_as_the_batch_grows(layout):
    budget = Controller("static", 64, layout, model())
    widths = [budget.decide(trees(b), torch.full((b,), 512)).width for b in (1, 16, 64, 256)]
    assert widths == sorted(widths, reverse=True) and widths[0] > widths[-1]


def test_uniform_layout_gives_every_request_the_width():
    decision = Controller("static", 64, "uniform", model()).decide(trees(8), torch.full((8,), 64))
    assert decision.sizes.tolist() == [decision.width] * 8


def test_ragged_width_is_the_smallest_ladder_width_holding_every_request():
    decision = Controller("static", 64, "ragged", model()).decide(trees(8), torch.full((8,), 64))
    largest = int(decision.sizes.max())
    assert decision.width == min(w for w in width_ladder(64) if w >= largest)


def test_prediction_is_the_latency_model_at_the_chosen_width():
    lm = model()
    decision = Controller("static", 64, "uniform", lm).decide(trees(4), torch.full((4,), 320))
    expected = float(lm.cycle_ms(4, decision.width, 320.0))
    assert decision.predicted_cycle_ms == pytest.approx(expected)
    assert decision.predicted_verify_ms == pytest.approx(expected - lm.aux_ms(4))


def test_ema_gamma_tracks_observed_over_predicted_verify_time():
    budget = Controller("ema", 64, "uniform", model(), ema_alpha=0.5)
    batch = trees(2)
    for _ in range(30):  # the hardware is twice as slow as the roofline says
        decision = budget.decide(batch, torch.full((2,), 128))
        budget.observe(decision, 2 * decision.predicted_verify_ms / budget.gamma_at(2))
    assert budget.gamma_at(2) == pytest.approx(2.0, rel=1e-3)


def test_ema_gamma_is_kept_per_batch_size():
    budget = Controller("ema_calib", 64, "uniform", model(), ema_alpha=1.0)
    for batch, slowdown in ((1, 1.0), (4, 1.5)):
        decision = budget.decide(trees(batch), torch.full((batch,), 128))
        budget.observe(decision, decision.predicted_verify_ms)  # the shape's first pass
        budget.observe(decision, slowdown * decision.predicted_verify_ms)
    assert budget.gamma == {1: pytest.approx(1.0), 4: pytest.approx(1.5)}


def test_an_unobserved_batch_size_takes_the_nearest_gamma():
    budget = Controller("ema_calib", 64, "uniform", model(), gamma={1: 1.1, 8: 1.4})
    assert (budget.gamma_at(3), budget.gamma_at(6), budget.gamma_at(32)) == (1.1, 1.4, 1.4)
    assert Controller("ema", 64, "uniform", model()).gamma_at(4) == 1.0


def test_ema_calib_prices_a_batch_size_by_its_own_gamma():
    budget = Controller("ema_calib", 64, "uniform", model(), gamma={1: 1.0, 4: 2.0})
    static = Controller("static", 64, "uniform", model())
    for batch, gamma in ((1, 1.0), (4, 2.0)):
        aux = budget.model.aux_ms(batch)
        verify = budget.cost_vector_ms(batch, 128) - aux
        assert torch.allclose(verify, gamma * (static.cost_vector_ms(batch, 128) - aux))


def test_static_mode_ignores_observed_times():
    budget = Controller("static", 64, "uniform", model())
    decision = budget.decide(trees(2), torch.full((2,), 128))
    budget.observe(decision, 100.0)
    assert budget.gamma == {} and budget.observed_steps == 1


def test_a_slower_observed_verify_makes_ema_choose_smaller_trees():
    budget = Controller("ema", 64, "uniform", model(t_aux_ms=20.0), ema_alpha=1.0)
    batch, contexts = trees(64), torch.full((64,), 256)  # compute-bound: W matters
    before = budget.decide(batch, contexts)
    budget.observe(before, before.predicted_verify_ms)  # the shape's first pass
    budget.observe(before, 3 * before.predicted_verify_ms)
    assert budget.decide(batch, contexts).width < before.width


def test_the_first_pass_at_a_shape_is_not_learned_from():
    budget = Controller("ema", 64, "uniform", model(), ema_alpha=1.0)
    decision = budget.decide(trees(2), torch.full((2,), 128))
    budget.observe(decision, 10 * decision.predicted_verify_ms)  # e.g. a kernel compiling
    assert budget.gamma == {}
    budget.observe(decision, 2 * decision.predicted_verify_ms)
    assert budget.gamma == {2: pytest.approx(2.0)}


def test_a_stall_is_not_learned_from_once_the_batch_size_has_a_gamma():
    budget = Controller("ema", 64, "uniform", model(), ema_alpha=1.0)
    decision = budget.decide(trees(2), torch.full((2,), 128))
    for observed in (1.0, 1.5):
        budget.observe(decision, observed * decision.predicted_verify_ms)
    stalled = budget.decide(trees(2), torch.full((2,), 128))
    budget.observe(stalled, 5 * stalled.predicted_verify_ms)  # 5x the prediction: a stall
    assert budget.gamma == {2: pytest.approx(1.5)}


def test_prices_are_those_of_the_nearest_context_bucket():
    budget = Controller("static", 64, "uniform", model())
    assert torch.equal(budget.cost_vector_ms(4, 1001.0), budget.cost_vector_ms(4, 1007.0))
    assert not torch.equal(budget.cost_vector_ms(4, 1000.0), budget.cost_vector_ms(4, 1100.0))
    expected = model().cycle_ms(4, torch.arange(1, 65, dtype=torch.float64), 1008.0)
    assert torch.allclose(budget.cost_vector_ms(4, 1007.0), expected)


def test_the_width_ladder_is_short_and_ends_at_n():
    assert width_ladder(64) == (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
    assert width_ladder(10) == (1, 2, 4, 8, 10) and width_ladder(1) == (1,)


@pytest.mark.parametrize("layout", ["uniform", "ragged"])
def test_adaptive_widths_come_from_the_ladder(layout):
    budget = Controller("static", 64, layout, model())
    for batch in (1, 3, 16, 64, 200):
        decision = budget.decide(trees(batch), torch.full((batch,), 700))
        assert decision.width in width_ladder(64)
        assert int(decision.sizes.max()) <= decision.width


@pytest.mark.parametrize("layout", ["uniform", "ragged"])
def test_after_use_widths_every_decision_takes_one_of_them(layout):
    budget = Controller("static", 64, layout, model())
    budget.decide(trees(4), torch.full((4,), 700))  # caches the ladder on the device
    budget.use_widths((1, 2, 4, 8))  # e.g. the widths whose verify graphs fit
    for batch in (1, 3, 16, 64):
        decision = budget.decide(trees(batch), torch.full((batch,), 700))
        assert decision.width in (1, 2, 4, 8) and int(decision.sizes.max()) <= decision.width
    assert budget.verify_widths() == (1, 2, 4, 8)


def test_widths_outside_the_tree_budget_are_refused():
    with pytest.raises(ValueError, match="widths must lie in"):
        Controller("static", 16, model=model(), widths=(4, 32))


def test_a_measured_period_becomes_the_batch_sizes_overhead_then_an_ema():
    budget = Controller("static", 64, "uniform", model(), ema_alpha=0.5, measure_overhead=True)
    decision = budget.decide(trees(4), torch.full((4,), 128))
    cycle = decision.predicted_cycle_ms
    budget.observe_period(decision, 4, cycle + 6.0)
    assert budget.overhead_ms == {4: pytest.approx(6.0)}
    budget.observe_period(decision, 4, cycle + 2.0)
    assert budget.overhead_ms[4] == pytest.approx(4.0)


def test_the_overhead_is_added_to_the_priced_cycle():
    budget = Controller("static", 64, "uniform", model(), measure_overhead=True)
    bare = budget.decide(trees(4), torch.full((4,), 128))
    budget.overhead_ms[4] = 7.0
    priced = budget.decide(trees(4), torch.full((4,), 128))
    assert priced.overhead_ms == 7.0
    assert priced.predicted_verify_ms == pytest.approx(
        float(model().cycle_ms(4, priced.width, 128.0)) - model().aux_ms(4)
    )
    if priced.width == bare.width:
        assert priced.predicted_cycle_ms == pytest.approx(bare.predicted_cycle_ms + 7.0)


def test_a_larger_step_overhead_makes_the_controller_choose_larger_trees():
    budget = Controller("static", 64, "uniform", model(), measure_overhead=True)
    widths = []
    for overhead in (0.0, 20.0, 200.0):
        budget.overhead_ms[16] = overhead
        widths.append(budget.decide(trees(16), torch.full((16,), 512)).width)
    assert widths == sorted(widths) and widths[0] < widths[-1]


def test_the_overhead_is_not_measured_unless_asked():
    budget = Controller("static", 64, "uniform", model())
    decision = budget.decide(trees(4), torch.full((4,), 128))
    budget.observe_period(decision, 4, decision.predicted_cycle_ms + 6.0)
    assert budget.overhead_ms == {}


def test_a_stalled_period_is_not_taken_as_overhead_once_the_batch_size_has_one():
    budget = Controller("static", 64, "uniform", model(), measure_overhead=True)
    decision = budget.decide(trees(4), torch.full((4,), 128))
    budget.observe_period(decision, 4, decision.predicted_cycle_ms + 5.0)
    priced = budget.decide(trees(4), torch.full((4,), 128))
    budget.observe_period(priced, 4, 10 * priced.predicted_cycle_ms)
    assert budget.overhead_ms == {4: pytest.approx(5.0)}


def test_the_first_period_of_a_batch_size_is_taken_even_when_far_above_the_model():
    # A server whose steps take many times the profile's cycle still learns its overhead.
    budget = Controller("static", 64, "uniform", model(), measure_overhead=True)
    decision = budget.decide(trees(4), torch.full((4,), 128))
    budget.observe_period(decision, 4, 10 * decision.predicted_cycle_ms)
    assert budget.overhead_ms[4] == pytest.approx(9 * decision.predicted_cycle_ms)


def test_an_unseen_batch_size_borrows_the_nearest_measured_overhead():
    budget = Controller("static", 64, "uniform", model(), measure_overhead=True)
    budget.overhead_ms.update({2: 1.0, 8: 5.0})
    assert [budget.step_overhead_ms(b) for b in (1, 2, 4, 6, 64)] == [1.0, 1.0, 1.0, 5.0, 5.0]
    assert Controller("static", 64, "uniform", model()).step_overhead_ms(4) == 0.0


@pytest.mark.parametrize("layout", ["uniform", "global"])
def test_a_width_measured_cheaper_than_priced_is_explored_then_chosen(layout):
    # Widths above 2 are priced dear (as a profile that overprices width would); every 4th
    # step starts a stretch of 2 steps at the next wider ladder width, and once the period
    # of its second (warm) step shows what it costs, the controller takes it.
    budget = Controller(
        "static", 16, layout, model(), packs_ragged=True, ema_alpha=1.0, measure_overhead=True,
        width_overheads=True, explore_every=4, explore_run=2, explore_cold=1,
    )  # fmt: skip
    budget.width_offset_ms[1] = {w: 1000.0 for w in budget.widths if w > 2}
    tree, context = trees(1, 16), torch.full((1,), 128)
    assert [budget.decide(tree, context).width for _ in range(3)] == [2, 2, 2]
    for _ in range(2):
        explored = budget.decide(tree, context)
        assert explored.width == 4 and explored.overhead_ms == 1000.0
        assert explored.overhead_width == 4
        budget.observe_period(explored, 1, explored.predicted_cycle_ms - 1000.0)  # the model's
    assert budget.width_offset_ms[1][4] == pytest.approx(0.0)
    assert budget.decide(tree, context).width == 4


@pytest.mark.parametrize("layout", ["uniform", "global"])
def test_an_explorations_first_steps_and_the_step_back_price_no_width(layout):
    # A pass shape met once in a while runs cold: a width's first step, the stretch's first
    # explore_cold steps and the step back to the chosen width are left out; the steps
    # between price the widths.
    budget = width_priced(layout, ema_alpha=1.0, explore_every=3, explore_run=3, explore_cold=2)
    budget.overhead_ms[1] = 2.0
    budget.width_offset_ms[1] = {w: 0.5 if w == 8 else 1000.0 for w in budget.widths}
    tree, context = trees(1, 16), torch.full((1,), 128)
    steps = [budget.decide(tree, context) for _ in range(6)]
    assert [d.width for d in steps] == [8, 8, 12, 12, 12, 8]
    assert [d.warming for d in steps] == [True, False, True, True, False, True]  # 8's first
    moved = []
    for step in steps:  # every period 3 ms over the model's cycle: an offset of 0 once folded
        before = dict(budget.width_offset_ms[1])
        budget.observe_period(step, 1, step.predicted_cycle_ms - step.overhead_ms + 3.0)
        moved.append(budget.width_offset_ms[1] != before)
    assert moved == [not step.warming for step in steps]


def test_a_widths_offset_prices_it_over_the_batch_sizes_overhead_as_that_drifts():
    # the batch size's overhead, measured every step, follows the host for every width alike
    budget = width_priced(explore_every=0)
    budget.width_offset_ms[1] = {w: 2.0 if w == 8 else 0.0 for w in budget.widths}
    tree, context = trees(1, 16), torch.full((1,), 128)
    priced = []
    for overhead in (1.0, 5.0):
        budget.overhead_ms[1] = overhead
        decision = budget.decide(tree, context)
        offset = budget.width_offset_ms[1][decision.width]
        assert decision.overhead_ms == pytest.approx(overhead + offset)
        priced.append(decision.overhead_ms)
    assert priced[1] - priced[0] == pytest.approx(4.0)


def test_a_widths_offset_is_measured_against_the_batch_sizes_overhead_before_it():
    budget = width_priced(explore_every=0)
    tree, context = trees(1, 16), torch.full((1,), 128)
    for overhead in (3.0, 3.0, 5.0):  # the first pass is cold: the next two measure the width
        decision = budget.decide(tree, context)
        model_cycle = decision.predicted_cycle_ms - decision.overhead_ms
        budget.observe_period(decision, 1, model_cycle + overhead)
    assert budget.overhead_ms == {1: pytest.approx(3.0 + 0.1 * 2.0)}
    # 0 ms over 3 ms, then 2 over 3
    assert budget.width_offset_ms == {1: {decision.width: pytest.approx(0.1 * 2.0)}}


def test_a_widths_first_pass_prices_nothing_at_its_width():
    budget = width_priced()
    budget.overhead_ms[1] = 1.0
    first = budget.decide(trees(1, 16), torch.full((1,), 128))
    assert first.warming
    budget.observe_period(first, 1, first.predicted_cycle_ms + 3.0)
    assert budget.width_offset_ms.get(1, {}) == {}
    assert not budget.decide(trees(1, 16), torch.full((1,), 128)).warming


def width_priced(layout: str = "uniform", **kwargs: float) -> Controller:
    """A controller that keeps per-width overheads at batch 1, over a ladder up to 16."""
    return Controller(
        "static", 16, layout, model(), packs_ragged=True, measure_overhead=True,
        width_overheads=True, **kwargs,
    )  # fmt: skip


def test_a_widths_offset_starts_from_none_and_moves_by_ema_alpha():
    # a width seldom chosen is priced by few samples: one slow pass must not price it out
    budget = width_priced(explore_every=0)  # ema_alpha 0.1
    budget.overhead_ms[1] = 2.0
    budget.width_offset_ms[1] = {w: 1000.0 for w in budget.widths if w != 16}  # 16 stays
    tree, context = trees(1, 16), torch.full((1,), 128)
    expected = 0.0
    for offset in (0.0, 3.0, -1.0, 2.0):  # the first pass is not folded
        decision = budget.decide(tree, context)
        model_cycle = decision.predicted_cycle_ms - decision.overhead_ms
        budget.observe_period(decision, 1, model_cycle + budget.overhead_ms[1] + offset)
        if offset:
            expected += 0.1 * (offset - expected)
            assert budget.width_offset_ms[1][16] == pytest.approx(expected)
    assert decision.width == 16


def test_a_stalled_period_counts_at_most_half_again_its_widths_priced_cycle():
    budget = width_priced(ema_alpha=1.0, explore_every=0)
    budget.overhead_ms[1] = 2.0
    budget.width_offset_ms[1] = {w: 0.0 for w in budget.widths}
    tree, context = trees(1, 16), torch.full((1,), 128)
    cold = budget.decide(tree, context)
    budget.observe_period(cold, 1, cold.predicted_cycle_ms)  # its first pass: 2 ms over
    decision = budget.decide(tree, context)
    priced = decision.predicted_cycle_ms
    budget.observe_period(decision, 1, 3.0 * priced)  # under the batch size's 4x stall bound
    assert budget.overhead_ms[1] == pytest.approx(3.0 * priced - (priced - 2.0))
    capped = 1.5 * priced - (priced - 2.0)
    assert budget.width_offset_ms[1][decision.width] == pytest.approx(capped - 2.0)  # alpha 1


@pytest.mark.parametrize("layout", ["uniform", "global"])
def test_explorations_verify_the_wider_and_the_narrower_width_in_turn(layout):
    budget = width_priced(layout, explore_every=2, explore_run=2)
    budget.width_offset_ms[1] = {w: 0.0 if w == 8 else 1000.0 for w in budget.widths}
    tree, context = trees(1, 16), torch.full((1,), 128)
    widths = [budget.decide(tree, context).width for _ in range(9)]
    assert widths == [8, 12, 12, 8, 4, 4, 8, 12, 12]


def test_at_the_widest_width_every_exploration_verifies_the_narrower():
    budget = width_priced(explore_every=2, explore_run=1)
    budget.width_offset_ms[1] = {w: 0.0 if w == 16 else 1000.0 for w in budget.widths}
    tree, context = trees(1, 16), torch.full((1,), 128)
    assert [budget.decide(tree, context).width for _ in range(4)] == [16, 12, 16, 12]


@pytest.mark.parametrize(("batch", "on"), [(8, True), (1, False)])
def test_no_width_is_explored_at_a_batch_above_the_sample_or_with_width_overheads_off(batch, on):
    budget = Controller(
        "static", 16, "uniform", model(), measure_overhead=True, width_overheads=on,
        explore_every=2,
    )  # fmt: skip
    tree, context = trees(batch, 16), torch.full((batch,), 128)
    widths = {budget.decide(tree, context).width for _ in range(6)}
    assert len(widths) == 1


def on_meta(batch: TreeBatch) -> TreeBatch:
    """The same trees on the meta device, where any host read of a value raises."""
    return TreeBatch(**{f.name: getattr(batch, f.name).to("meta") for f in fields(batch)})


@pytest.mark.parametrize(("mode", "layout"), [("static", "uniform"), ("ema_calib", "ragged")])
def test_an_adaptive_decision_reads_the_device_once_for_its_width(monkeypatch, mode, layout):
    reads = []
    monkeypatch.setattr(controller, "read_width", lambda width: reads.append(width.device) or 8)
    budget = Controller(mode, 64, layout, model(), measure_overhead=True)
    for _ in range(3):  # fresh and cached prices alike
        decision = budget.decide(on_meta(trees(4)), torch.full((4,), 300))  # contexts: host
        budget.observe(decision, 1.0)
    assert reads == [torch.device("meta")] * 3 and decision.width == 8


def test_a_fixed_decision_reads_nothing_from_the_device():
    decision = Controller("fixed", 16).decide(on_meta(trees(4)), torch.full((4,), 300))
    assert decision.width == 16 and decision.sizes.device == torch.device("meta")


def doubtful_and_confident(batch: int = 4):
    """Trees where even requests are sure of every draft and odd ones doubt them all."""
    probs = torch.full((batch, 7, 64), 1e-4)
    probs[0::2, :, 5] = 1.0  # [B, D, V]: one sure token per depth
    probs[1::2] = 1.0 / 64  # uniform marginals: every path is a long shot
    probs = probs / probs.sum(-1, keepdim=True)
    return build_trees(probs, torch.zeros(batch, dtype=torch.long), top_k=8, max_nodes=16)


def test_the_global_budget_gives_confident_requests_deep_trees_and_doubtful_ones_roots():
    # 64 requests: the H100 pass is compute-bound there, so a verify token has a price.
    budget = Controller("static", 16, "global", model(), packs_ragged=True)
    decision = budget.decide(doubtful_and_confident(64), torch.full((64,), 256))
    sizes = decision.sizes.tolist()
    assert decision.ragged == tuple(sizes)
    assert set(sizes[0::2]) == {8} and set(sizes[1::2]) == {1}  # the whole sure chain; roots
    assert decision.width in budget.widths and decision.width >= max(sizes)


def test_the_global_budget_prices_the_batch_s_total_tokens():
    budget = Controller("static", 16, "global", model(), packs_ragged=True)
    decision = budget.decide(doubtful_and_confident(), torch.full((4,), 256))
    tokens = torch.tensor(sum(decision.ragged) / 4, dtype=torch.float64)
    verify = float(budget.model.verify_price_ms(4, tokens, 256, "static"))
    assert decision.predicted_verify_ms == pytest.approx(verify)


def test_a_lone_request_s_tree_fills_its_ladder_width_instead_of_packing():
    budget = Controller("static", 32, "global", model(), packs_ragged=True)
    built = trees(1, nodes=32)
    decision = budget.decide(built, torch.full((1,), 256))
    assert decision.ragged is None and decision.width in budget.widths
    assert decision.sizes.tolist() == [min(int(built.num_nodes[0]), decision.width)]
    # two requests still pack
    assert budget.decide(trees(2, nodes=32), torch.full((2,), 256)).ragged is not None


@pytest.mark.parametrize("seed", range(4))
def test_a_lone_request_is_priced_as_the_padded_pass_it_runs(seed):
    # its width is the uniform rule's: each ladder width's goodput at that width's price
    packed = Controller("static", 32, "global", model(), packs_ragged=True)
    uniform = Controller("static", 32, "uniform", model())
    built, context = trees(1, 32, seed), torch.full((1,), 256)
    chosen, priced = packed.decide(built, context), uniform.decide(built, context)
    assert (chosen.width, chosen.sizes.tolist()) == (priced.width, priced.sizes.tolist())
    assert chosen.predicted_cycle_ms == pytest.approx(priced.predicted_cycle_ms)


def test_where_the_verify_pads_the_global_layout_decides_as_uniform():
    tree, context = doubtful_and_confident(), torch.full((4,), 256)
    padded = Controller("static", 16, "global", model()).decide(tree, context)
    uniform = Controller("static", 16, "uniform", model()).decide(tree, context)
    assert padded.ragged is None
    assert (padded.width, padded.sizes.tolist()) == (uniform.width, uniform.sizes.tolist())


@pytest.mark.parametrize("explore_every", [0, 1])
@pytest.mark.parametrize("batch", [3, 5, 11, 24])
def test_a_packed_pass_takes_its_token_count_from_the_totals_ladder(batch, explore_every):
    # every distinct pass shape compiles once on a CPU; an exploration off the ladder pads
    budget = Controller(
        "static", 32, "global", model(), packs_ragged=True, measure_overhead=True,
        width_overheads=True, explore_every=explore_every,
    )  # fmt: skip
    budget.width_offset_ms[batch] = {w: 0.0 for w in budget.widths}
    ladder = packed_totals(batch * 32)
    for seed in range(8):
        decision = budget.decide(trees(batch, 32, seed), torch.full((batch,), 256))
        if decision.ragged is None:
            assert explore_every and decision.width in budget.widths
        else:
            assert sum(decision.ragged) == batch or sum(decision.ragged) in ladder


def sloped(batch: int = 64) -> Controller:
    """A packed global controller whose every width at ``batch`` has an overhead of 2 ms (its
    offset, over no batch-size overhead)."""
    budget = width_priced("global", explore_every=0)
    budget.width_offset_ms[batch] = {w: 2.0 for w in budget.widths}
    return budget


def priced(budget: Controller, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([B*N] priced cycle, [B*N] the model's part) of packed passes at contexts of 256."""
    widened = budget._width_overheads(batch, 0.0)
    return budget._total_cost(batch, 256.0, 0.0, budget.max_nodes, torch.device("cpu"), widened)


def packed_step(budget: Controller, batch: int, per_request: int) -> controller.Decision:
    """A packed pass of ``per_request`` tokens for every request, priced as `decide` prices it."""
    total, modelled = priced(budget, batch)
    at = batch * per_request - 1
    cycle, model_cycle = float(total[at]), float(modelled[at])
    ragged = (per_request,) * batch
    return controller.Decision(
        torch.full((batch,), per_request), per_request, model_cycle - 1.0, cycle,
        cycle - model_cycle, ragged=ragged,
        overhead_width=budget._overhead_width(per_request, ragged, batch),
    )  # fmt: skip


def served(budget: Controller, batch: int, period_ms) -> None:
    """Two hundred packed passes of 5 to 8 tokens per request, each served in
    ``period_ms(model cycle)``."""
    for step in range(200):
        decision = packed_step(budget, batch, 5 + step % 4)
        model_cycle = decision.predicted_cycle_ms - decision.overhead_ms
        budget.observe_period(decision, batch, period_ms(model_cycle))


def priced_rise(budget: Controller, batch: int) -> tuple[float, float]:
    """(priced, modelled) rise of the cycle from 5 to 8 tokens per request."""
    total, modelled = priced(budget, batch)
    five, eight = 5 * batch - 1, 8 * batch - 1
    return float(total[eight] - total[five]), float(modelled[eight] - modelled[five])


def test_a_packed_width_served_at_one_cost_learns_that_its_tokens_cost_nothing_more():
    # 64 requests: the H100 pass is compute-bound, so the profile prices 8 tokens a request
    # above 5; served, the passes of that width all take the same time
    budget = sloped()
    flat = packed_step(budget, 64, 8).predicted_cycle_ms
    served(budget, 64, lambda model_cycle: flat)
    rise, modelled = priced_rise(budget, 64)
    assert modelled > 0.5 and rise < 0.3 * modelled
    assert budget.width_slope(64) < -0.7


def test_a_packed_width_served_as_the_profile_prices_it_keeps_the_profiles_rise():
    budget = sloped()
    served(budget, 64, lambda model_cycle: model_cycle + 2.0)
    rise, modelled = priced_rise(budget, 64)
    assert rise == pytest.approx(modelled, rel=0.05)


def test_a_packed_price_never_falls_as_tokens_are_added_whatever_the_periods():
    budget = sloped()
    flat = packed_step(budget, 64, 8).predicted_cycle_ms
    served(budget, 64, lambda model_cycle: 2 * flat - model_cycle)  # cheaper as tokens are added
    assert budget.width_slope(64) == -1.0
    total, _ = priced(budget, 64)
    inside = total[4 * 64 : 8 * 64]  # T = 4B+1 .. 8B: the width of 8
    assert bool((inside.diff() >= -1e-9).all())


def test_a_width_served_at_one_cost_gets_more_tokens_from_the_global_budget():
    tree, context = trees(64, 16), torch.full((64,), 256)
    fresh, learned = sloped(), sloped()
    flat = packed_step(learned, 64, 5).predicted_cycle_ms  # what 5 tokens a request are priced
    served(learned, 64, lambda model_cycle: flat)
    before, after = fresh.decide(tree, context), learned.decide(tree, context)
    assert sum(after.ragged) > sum(before.ragged)
    tokens = torch.tensor(sum(after.ragged) / 64, dtype=torch.float64)
    verify = float(learned.model.verify_price_ms(64, tokens, 256, "static"))
    # the slope's part of the price is overhead: a period is measured against the model alone
    assert after.predicted_cycle_ms - after.overhead_ms == pytest.approx(
        verify + learned.model.aux_ms(64)
    )
