"""build_trees: best-first trees equal a heap builder's in A_hat and keep every invariant."""

from __future__ import annotations

import heapq
import itertools
import math
import os
from contextlib import AbstractContextManager
from unittest import mock

import pytest
import torch
from helpers import MARGINAL_KINDS, random_marginals
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_bastion.tree import build_trees, lattice_size


def heap_path_scores(probs: torch.Tensor, top_k: int, max_nodes: int) -> list[float]:
    """Reference: DDTree-style best-first expansion of one request, returning rho in pop order."""
    q = probs.topk(top_k, dim=-1).values.double().tolist()  # [D][K], descending
    depth = len(q)
    rhos = [1.0]
    heap: list[tuple[float, int, float, int, int]] = []
    counter = itertools.count()
    if depth and max_nodes > 1:
        heapq.heappush(heap, (-q[0][0], next(counter), 1.0, 1, 0))
    while heap and len(rhos) < max_nodes:
        neg, _, parent_rho, d, rank = heapq.heappop(heap)
        rhos.append(-neg)
        if rank + 1 < top_k:  # next sibling
            heapq.heappush(
                heap, (-parent_rho * q[d - 1][rank + 1], next(counter), parent_rho, d, rank + 1)
            )
        if d < depth:  # first child
            heapq.heappush(heap, (neg * q[d][0], next(counter), -neg, d + 1, 0))
    return rhos


# On CPU tensors build_trees runs the compiled merge; with kernels disabled, the torch pools.
CPU_BUILDERS = {"compiled": "0", "torch": "1"}


def cpu_builder(name: str) -> AbstractContextManager:
    """Context in which build_trees uses the named CPU implementation."""
    return mock.patch.dict(os.environ, {"SGLANG_BASTION_DISABLE_KERNELS": CPU_BUILDERS[name]})


def assert_matches_heap(probs: torch.Tensor, top_k: int, max_nodes: int) -> None:
    batch = probs.shape[0]
    trees = build_trees(probs, torch.arange(batch), top_k=top_k, max_nodes=max_nodes)
    trees.check()
    for b in range(batch):
        ref = heap_path_scores(probs[b], top_k, max_nodes)
        n = int(trees.num_nodes[b])
        assert n == len(ref)
        got = torch.cumsum(trees.log_scores[b, :n].double().exp(), 0)
        want = torch.cumsum(torch.tensor(ref, dtype=torch.float64), 0)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("implementation", CPU_BUILDERS)
@settings(max_examples=150, deadline=None)
@given(
    batch=st.integers(1, 5),
    depth=st.integers(1, 6),
    vocab=st.integers(2, 12),
    k=st.integers(1, 5),
    max_nodes=st.integers(1, 48),
    kind=st.sampled_from(MARGINAL_KINDS),
    seed=st.integers(0, 2**31 - 1),
)
def test_surrogate_matches_heap_builder_for_every_prefix(
    implementation, batch, depth, vocab, k, max_nodes, kind, seed
):
    probs = random_marginals(batch, depth, vocab, kind, torch.Generator().manual_seed(seed))
    with cpu_builder(implementation):
        assert_matches_heap(probs, min(k, vocab), max_nodes)


@pytest.mark.parametrize("implementation", CPU_BUILDERS)
@pytest.mark.parametrize("max_nodes", [16, 64, 256])
def test_surrogate_matches_heap_builder_at_batch_64(implementation, max_nodes):
    probs = random_marginals(64, 15, 300, "smooth", torch.Generator().manual_seed(max_nodes))
    with cpu_builder(implementation):
        assert_matches_heap(probs * 3, 8, max_nodes)  # unnormalised scale must not matter


@pytest.mark.parametrize("implementation", CPU_BUILDERS)
def test_ties_keep_parents_before_children(implementation):
    probs = random_marginals(3, 6, 5, "one_hot", torch.Generator().manual_seed(0))
    with cpu_builder(implementation):
        trees = build_trees(probs, torch.zeros(3, dtype=torch.long), top_k=3, max_nodes=40)
    trees.check()


@pytest.mark.parametrize("implementation", CPU_BUILDERS)
@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(MARGINAL_KINDS),
    seed=st.integers(0, 2**31 - 1),
    k=st.integers(1, 4),
    max_nodes=st.integers(1, 30),
)
def test_every_node_is_a_top_k_token_with_consistent_log_score(
    implementation, kind, seed, k, max_nodes
):
    probs = random_marginals(4, 5, 9, kind, torch.Generator().manual_seed(seed))
    with cpu_builder(implementation):
        trees = build_trees(probs, torch.full((4,), 7), top_k=k, max_nodes=max_nodes)
    kth = probs.topk(k, dim=-1).values[..., -1]  # [B, D]: the K-th largest q per position
    for b in range(4):
        for i in range(1, int(trees.num_nodes[b])):
            d, tok, par = (
                int(trees.depths[b, i]),
                int(trees.token_ids[b, i]),
                int(trees.parents[b, i]),
            )
            q = probs[b, d - 1, tok]
            assert q >= kth[b, d - 1], "token outside the position's top-K"
            assert trees.log_scores[b, i] == trees.log_scores[b, par] + q.log(), "log rho adds up"
        assert trees.token_ids[b, 0] == 7, "the root carries the committed token"


@pytest.mark.parametrize(
    ("depth", "k", "max_nodes"), [(3, 2, 100), (4, 1, 3), (4, 1, 50), (0, 3, 4)]
)
@pytest.mark.parametrize("implementation", CPU_BUILDERS)
def test_num_nodes_is_capped_by_the_lattice(implementation, depth, k, max_nodes):
    probs = torch.softmax(torch.randn(2, depth, 6), dim=-1)
    with cpu_builder(implementation):
        trees = build_trees(probs, torch.zeros(2, dtype=torch.long), top_k=k, max_nodes=max_nodes)
    expected = min(max_nodes, lattice_size(depth, k))
    assert trees.num_nodes.tolist() == [expected, expected]
    assert trees.max_nodes == max_nodes
    trees.check()


def test_top_k_one_gives_the_dflash_chain():
    probs = torch.softmax(torch.randn(3, 7, 20), dim=-1)
    trees = build_trees(probs, torch.zeros(3, dtype=torch.long), top_k=1, max_nodes=8)
    assert trees.parents.tolist() == [[-1, 0, 1, 2, 3, 4, 5, 6]] * 3
    assert torch.equal(trees.token_ids[:, 1:], probs.argmax(dim=-1))


def test_first_n_nodes_are_the_optimal_prefix_closed_tree_by_brute_force():
    # Lattice of depth 2, K = 3: 13 nodes; enumerate every prefix-closed subtree.
    probs = torch.softmax(2 * torch.randn(1, 2, 6, generator=torch.Generator().manual_seed(3)), -1)
    q = probs.topk(3, dim=-1).values[0].double()
    nodes = [()] + [(a,) for a in range(3)] + [(a, b) for a in range(3) for b in range(3)]
    rho = {n: math.prod(float(q[d, t]) for d, t in enumerate(n)) for n in nodes}
    best: dict[int, float] = {}
    for mask in range(1 << (len(nodes) - 1)):
        chosen = [()] + [n for i, n in enumerate(nodes[1:]) if mask >> i & 1]
        if all(n[:-1] in chosen for n in chosen if n):
            size = len(chosen)
            best[size] = max(best.get(size, 0.0), sum(rho[n] for n in chosen))
    trees = build_trees(probs, torch.zeros(1, dtype=torch.long), top_k=3, max_nodes=13)
    a_hat = trees.surrogate()[0].double()
    for size, value in best.items():
        assert a_hat[size - 1].item() == pytest.approx(value, rel=1e-6)


@pytest.mark.parametrize(
    ("probs_shape", "roots_shape", "k", "n", "message"),
    [
        ((4, 5), (4,), 2, 4, "probs must be"),
        ((2, 3, 5), (3,), 2, 4, "root_tokens"),
        ((2, 3, 5), (2,), 6, 4, "top_k"),
        ((2, 3, 5), (2,), 0, 4, "top_k"),
        ((2, 3, 5), (2,), 2, 0, "max_nodes"),
    ],
)
def test_bad_arguments_are_refused_with_the_argument_named(probs_shape, roots_shape, k, n, message):
    with pytest.raises(ValueError, match=message):
        build_trees(
            torch.rand(probs_shape),
            torch.zeros(roots_shape, dtype=torch.long),
            top_k=k,
            max_nodes=n,
        )
