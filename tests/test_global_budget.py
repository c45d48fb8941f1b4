"""The batch-global budget: one best-first expansion over every request, priced by total tokens."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import random_marginals

from sglang_bastion.budget.global_budget import (
    allowed_totals,
    global_sizes,
    packed_totals,
    total_tokens,
)
from sglang_bastion.tree import build_trees


def concave_acceptance(batch: int, nodes: int, gen: torch.Generator) -> torch.Tensor:
    """[B, N] A(n) = 1 + cumulative non-increasing node gains in [0, 1]."""
    gains = torch.rand(batch, nodes - 1, generator=gen, dtype=torch.float64)
    gains = gains.sort(dim=1, descending=True).values * torch.rand(batch, 1, generator=gen)
    return torch.cat([torch.ones(batch, 1, dtype=torch.float64), 1 + gains.cumsum(1)], dim=1)


def convex_cost(batch: int, nodes: int, gen: torch.Generator) -> torch.Tensor:
    """[B*N] an increasing convex C(T) = a + b T + c T^2 with random positive a, b, c."""
    a, b, c = torch.rand(3, generator=gen, dtype=torch.float64) * torch.tensor([8, 1, 0.05])
    tokens = torch.arange(1, batch * nodes + 1, dtype=torch.float64)
    return a + 0.1 + b * tokens + c * tokens**2


def brute_force(accepted, num_nodes, cost):
    """The best goodput over every split: sizes n_r in 1..num_nodes_r."""
    best = float("-inf")
    for sizes in itertools.product(*(range(1, int(n) + 1) for n in num_nodes)):
        emitted = sum(float(accepted[r, n - 1]) for r, n in enumerate(sizes))
        best = max(best, emitted / float(cost[sum(sizes) - 1]))
    return best


def goodput_of(accepted, sizes, cost):
    """G / C of one split."""
    emitted = accepted.gather(1, (sizes - 1).unsqueeze(1)).sum()
    return float(emitted / cost[int(sizes.sum()) - 1])


@pytest.mark.parametrize("batch", [1, 3])  # one request takes its own order, unsorted
@pytest.mark.parametrize("seed", range(40))
def test_the_greedy_split_is_the_brute_force_optimum(seed, batch):
    gen = torch.Generator().manual_seed(seed)
    nodes = 5
    accepted = concave_acceptance(batch, nodes, gen)
    num_nodes = torch.randint(1, nodes + 1, (batch,), generator=gen)
    cost = convex_cost(batch, nodes, gen)
    sizes, goodput = global_sizes(accepted, num_nodes, cost)
    best = brute_force(accepted, num_nodes, cost)
    assert float(goodput) == pytest.approx(best, rel=1e-12)
    assert goodput_of(accepted, sizes, cost) == pytest.approx(best, rel=1e-12)
    assert bool((sizes >= 1).all() and (sizes <= num_nodes).all())


def test_best_first_trees_get_the_brute_force_optimum():
    probs = random_marginals(3, 4, 32, "smooth", torch.Generator().manual_seed(3))
    trees = build_trees(probs, torch.zeros(3, dtype=torch.long), top_k=4, max_nodes=6)
    accepted = trees.surrogate().double()
    cost = 4.0 + 0.6 * torch.arange(1, 19, dtype=torch.float64)  # [B*N]
    sizes, goodput = global_sizes(accepted, trees.num_nodes, cost)
    assert float(goodput) == pytest.approx(brute_force(accepted, trees.num_nodes, cost))
    assert goodput_of(accepted, sizes, cost) == pytest.approx(float(goodput))


def test_a_confident_request_gets_a_deep_tree_and_a_doubtful_one_its_root():
    accepted = torch.tensor(
        [[1.0, 1.9, 2.7, 3.4, 4.0, 4.5], [1.0, 1.02, 1.03, 1.035, 1.04, 1.042]],
        dtype=torch.float64,
    )
    cost = 10.0 + torch.arange(1, 13, dtype=torch.float64)  # each token costs a tenth of a pass
    sizes, _ = global_sizes(accepted, torch.tensor([6, 6]), cost)
    assert sizes.tolist() == [6, 1]


def test_when_no_tree_pays_every_request_verifies_its_root_alone():
    accepted = 1 + 0.05 * torch.arange(4, dtype=torch.float64).expand(3, 4)  # [B, N]
    cost = 1.0 + 2.0 * torch.arange(1, 13, dtype=torch.float64)  # a token costs two passes
    sizes, goodput = global_sizes(accepted, torch.tensor([4, 4, 4]), cost)
    assert sizes.tolist() == [1, 1, 1]
    assert float(goodput) == pytest.approx(3 / float(cost[2]))


def test_slots_past_a_tree_are_never_chosen():
    accepted = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]], dtype=torch.float64)
    cost = torch.ones(8, dtype=torch.float64)  # free tokens: take every real node
    sizes, _ = global_sizes(accepted, torch.tensor([4, 2]), cost)
    assert sizes.tolist() == [4, 2]


def test_one_node_trees_verify_their_roots():
    sizes, _ = global_sizes(torch.ones(2, 1), torch.ones(2, dtype=torch.long), torch.ones(2))
    assert sizes.tolist() == [1, 1]


def test_the_cost_must_price_every_total():
    with pytest.raises(ValueError, match=r"C\(T\) for T = 1\.\.B\*N = 8"):
        global_sizes(torch.ones(2, 4), torch.full((2,), 4), torch.ones(4))


def test_total_tokens_are_spread_over_the_batch():
    assert total_tokens(2, 3).tolist() == [0.5, 1.0, 1.5, 2.0, 2.5, 3.0]


def brute_force_over(accepted, num_nodes, cost, allowed):
    """The best goodput over every split whose total is allowed."""
    best = float("-inf")
    for sizes in itertools.product(*(range(1, int(n) + 1) for n in num_nodes)):
        if allowed[sum(sizes) - 1]:
            emitted = sum(float(accepted[r, n - 1]) for r, n in enumerate(sizes))
            best = max(best, emitted / float(cost[sum(sizes) - 1]))
    return best


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("seed", range(12))
def test_on_the_totals_ladder_the_split_is_the_best_over_allowed_totals(seed, batch):
    gen = torch.Generator().manual_seed(seed)
    nodes = 8  # B*N = 32: totals 17, 19, 21, 23, 25-27, 29-31 are off the ladder at B = 4
    accepted = concave_acceptance(batch, nodes, gen)
    num_nodes = torch.randint(1, nodes + 1, (batch,), generator=gen)
    cost = convex_cost(batch, nodes, gen)
    allowed = allowed_totals(batch, nodes)
    sizes, goodput = global_sizes(accepted, num_nodes, cost, allowed)
    assert bool(allowed[int(sizes.sum()) - 1])
    best = brute_force_over(accepted, num_nodes, cost, allowed)
    assert float(goodput) == pytest.approx(best, rel=1e-12)
    assert goodput_of(accepted, sizes, cost) == pytest.approx(best, rel=1e-12)


def test_the_totals_ladder_steps_by_at_most_an_eighth_and_stays_short():
    ladder = sorted(packed_totals(4096))
    assert ladder[:16] == list(range(1, 17))
    above = ladder[15:]  # from 16 on
    assert all(b / a <= 1.125 for a, b in itertools.pairwise(above))
    assert len(ladder) <= 16 + 8 * 8  # a few dozen pass shapes up to 4096 tokens


def test_a_batch_of_roots_alone_is_always_an_allowed_total():
    assert bool(allowed_totals(17, 32)[17 - 1])  # 17 is off the ladder
    assert not bool(allowed_totals(16, 32)[17 - 1])
