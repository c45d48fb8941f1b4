"""Budget controller: first-drop sizes, uniform width and ragged allocation are optimal."""

from __future__ import annotations

import pytest
import torch
from helpers import random_marginals

from sglang_bastion.controller import fixed_sizes, per_request_sizes, uniform_width
from sglang_bastion.tree import TreeBatch, build_trees


def trees_with_rho(rhos: list[list[float]]) -> TreeBatch:
    """Chains whose rho per slot are given (root rho 1 first); enough for the controller."""
    batch, nodes = len(rhos), len(rhos[0])
    slots = torch.arange(nodes)
    return TreeBatch(
        token_ids=torch.zeros(batch, nodes, dtype=torch.long),
        parents=(slots - 1).expand(batch, nodes).clone(),
        depths=slots.expand(batch, nodes).clone(),
        log_scores=torch.tensor(rhos, dtype=torch.float64).log(),
        num_nodes=torch.full((batch,), nodes),
    )


def convex_cost(length: int, base: float, slope: float, curve: float) -> torch.Tensor:
    """[length] a convex, increasing cost for 1..length tokens."""
    n = torch.arange(1, length + 1, dtype=torch.float64)
    return base + slope * n + curve * n**2


def random_trees(seed: int, batch: int, nodes: int) -> TreeBatch:
    probs = random_marginals(batch, 6, 8, "smooth", torch.Generator().manual_seed(seed))
    return build_trees(
        2 * probs.clamp(max=0.5), torch.zeros(batch, dtype=torch.long), top_k=3, max_nodes=nodes
    )


def test_per_request_stops_at_the_first_drop_of_estimated_speedup():
    trees = trees_with_rho([[1.0, 0.5, 0.2, 0.05]])  # A_hat = 1, 1.5, 1.7, 1.75
    cost = torch.tensor([1.0, 1.1, 1.3, 1.6])  # S_hat = 1, 1.36, 1.31, 1.09
    assert per_request_sizes(trees, cost).tolist() == [2]


@pytest.mark.parametrize("seed", range(10))
def test_per_request_size_is_a_global_maximiser_of_estimated_speedup(seed):
    trees = random_trees(seed, batch=8, nodes=32)
    gen = torch.Generator().manual_seed(seed)
    base, slope, curve = (torch.rand(3, generator=gen) * torch.tensor([5.0, 0.3, 0.01])).tolist()
    cost = convex_cost(32, base + 0.1, slope, curve)
    sizes = per_request_sizes(trees, cost, ar_ms=2.0)
    speedup = trees.surrogate().double() * 2.0 / cost
    for b in range(8):
        assert speedup[b, sizes[b] - 1] == pytest.approx(speedup[b].max().item(), rel=1e-12)


def test_flat_cost_verifies_the_whole_tree_and_steep_cost_only_the_root():
    trees = random_trees(0, batch=4, nodes=16)
    assert per_request_sizes(trees, torch.ones(16)).tolist() == [16] * 4
    assert per_request_sizes(trees, convex_cost(16, 0.01, 100.0, 0.0)).tolist() == [1] * 4


def test_per_request_size_never_exceeds_the_trees_real_nodes():
    trees = random_trees(1, batch=3, nodes=16).truncate(torch.tensor([3, 16, 1]))
    sizes = per_request_sizes(trees, torch.ones(16))
    assert sizes.tolist() == [3, 16, 1]


@pytest.mark.parametrize("seed", range(6))
def test_uniform_width_maximises_batch_goodput_over_the_allowed_widths(seed):
    trees = random_trees(seed, batch=6, nodes=32)
    cost = convex_cost(32, 1.0, 0.05, 0.002 * (seed + 1))
    widths = [1, 2, 4, 8, 16, 32]
    chosen = int(uniform_width(trees, cost, widths))
    a_hat = trees.surrogate().double()
    goodput = {w: float(a_hat[:, w - 1].sum() / cost[w - 1]) for w in widths}
    assert chosen in widths
    assert goodput[chosen] == pytest.approx(max(goodput.values()), rel=1e-12)


def test_uniform_width_refuses_widths_outside_the_tree():
    trees = random_trees(0, batch=2, nodes=8)
    with pytest.raises(ValueError, match="widths"):
        uniform_width(trees, torch.ones(8), [4, 16])


def test_fixed_budget_caps_at_the_real_nodes():
    trees = random_trees(0, batch=3, nodes=8).truncate(torch.tensor([2, 8, 5]))
    assert fixed_sizes(trees, 4).tolist() == [2, 4, 4]
    with pytest.raises(ValueError, match="budget"):
        fixed_sizes(trees, 0)


def test_cost_vectors_of_the_wrong_length_are_refused():
    trees = random_trees(0, batch=2, nodes=8)
    with pytest.raises(ValueError, match="cost_ms"):
        per_request_sizes(trees, torch.ones(7))
