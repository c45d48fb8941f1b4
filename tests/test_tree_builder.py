"""Tree build: the reference takes the N best lattice nodes, and the serving builders equal it.

The reference (`build_trees_reference`, a per-request heap) is checked against the definition:
every node of a small top-K lattice scored and sorted. The two builders that serve (the
compiled CPU merge and the Triton kernel, interpreted here) are then checked against the
reference: field for field where no two scores tie, and in A_hat, invariants and exact log
scores where they do (equal-score nodes may then come in either order).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from helpers import MARGINAL_KINDS, random_marginals
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_bastion.tree import (
    TreeBatch,
    build_trees,
    build_trees_from_top_k,
    builder,
    lattice_size,
)
from sglang_bastion.tree.builder import (
    build_trees_compiled,
    build_trees_reference,
    build_trees_triton,
)

SERVING = {"compiled": build_trees_compiled, "triton": build_trees_triton}
FIELDS = ("token_ids", "parents", "depths", "log_scores", "num_nodes")


def top_k_of(probs: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, D, K] descending probabilities and their tokens."""
    return probs.topk(top_k, dim=-1)


def lattice_scores(log_q: torch.Tensor) -> list[float]:
    """Float32 log rho of every non-root node of one request's [D, K] lattice, best first."""
    depth, top_k = log_q.shape
    scores = []
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(top_k), repeat=d):
            score = torch.zeros((), dtype=torch.float32)
            for e, r in enumerate(ranks):
                score = score + log_q[e, r]  # summed from the root down, as the builders do
            scores.append(float(score))
    return sorted(scores, reverse=True)


def assert_same_trees(actual: TreeBatch, expected: TreeBatch) -> None:
    for name in FIELDS:
        assert torch.equal(getattr(actual, name), getattr(expected, name)), name


def assert_like_reference(probs: torch.Tensor, top_k: int, trees: TreeBatch) -> None:
    """Invariants, exact log-score sums, top-K tokens, and the reference's A_hat curve."""
    trees.check()
    top_q, top_tokens = top_k_of(probs, top_k)
    roots = trees.token_ids[:, 0]
    ref = build_trees_reference(top_q, top_tokens, roots, max_nodes=trees.max_nodes)
    assert torch.equal(trees.num_nodes, ref.num_nodes)
    torch.testing.assert_close(trees.surrogate(), ref.surrogate(), rtol=1e-5, atol=1e-6)
    kth = top_q[..., -1]  # [B, D]
    for b in range(probs.shape[0]):
        n = int(trees.num_nodes[b])
        depth, token = trees.depths[b, 1:n], trees.token_ids[b, 1:n]
        q = probs[b, depth - 1, token]  # [n - 1]
        assert bool((q >= kth[b, depth - 1]).all()), "token outside the position's top-K"
        parent_score = trees.log_scores[b, trees.parents[b, 1:n]]
        assert torch.equal(trees.log_scores[b, 1:n], parent_score + q.log()), "log rho adds up"


@settings(max_examples=80, deadline=None)
@given(
    depth=st.integers(0, 4),
    k=st.integers(1, 4),
    max_nodes=st.integers(1, 60),
    kind=st.sampled_from(MARGINAL_KINDS),
    seed=st.integers(0, 2**31 - 1),
)
def test_the_reference_takes_the_n_best_lattice_nodes_parents_first(
    depth, k, max_nodes, kind, seed
):
    probs = random_marginals(2, depth, 6, kind, torch.Generator().manual_seed(seed))
    top_q, top_tokens = top_k_of(probs, k)
    trees = build_trees_reference(top_q, top_tokens, torch.tensor([3, 5]), max_nodes=max_nodes)
    trees.check()  # parents precede children, scores non-increasing, padding as specified
    for b in range(2):
        n = int(trees.num_nodes[b])
        assert n == min(max_nodes, lattice_size(depth, k))
        assert trees.log_scores[b, 1:n].tolist() == lattice_scores(top_q[b].log())[: n - 1]
    assert trees.token_ids[:, 0].tolist() == [3, 5], "the root carries the committed token"


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


# (B, D, K, N): the paper's sizes at N = 16, 64 and 256, small lattices, one smaller than N.
SHAPES = [
    (3, 15, 8, 16),
    (2, 15, 8, 64),
    (2, 15, 8, 256),
    (3, 4, 4, 16),
    (2, 2, 2, 16),
    (1, 3, 3, 5),
]


@pytest.mark.parametrize("name", SERVING)
@pytest.mark.parametrize(("batch", "depth", "top_k", "nodes"), SHAPES)
def test_serving_builders_equal_the_reference_field_for_field(name, batch, depth, top_k, nodes):
    # Continuous scores: no two nodes tie, so the best-first order is unique.
    generator = torch.Generator().manual_seed(depth * top_k + nodes)
    probs = random_marginals(batch, depth, 40, "smooth", generator)
    roots = torch.randint(0, 40, (batch,), generator=generator)
    top_q, top_tokens = top_k_of(probs, top_k)
    expected = build_trees_reference(top_q, top_tokens, roots, max_nodes=nodes)
    assert_same_trees(SERVING[name](top_q, top_tokens, roots, max_nodes=nodes), expected)


@settings(max_examples=150, deadline=None)
@given(
    batch=st.integers(1, 5),
    depth=st.integers(0, 6),
    vocab=st.integers(2, 12),
    k=st.integers(1, 5),
    max_nodes=st.integers(1, 48),
    kind=st.sampled_from(MARGINAL_KINDS),
    seed=st.integers(0, 2**31 - 1),
)
def test_the_compiled_merge_gives_the_references_trees_ties_included(
    batch, depth, vocab, k, max_nodes, kind, seed
):
    probs = random_marginals(batch, depth, vocab, kind, torch.Generator().manual_seed(seed))
    top_q, top_tokens = top_k_of(probs, min(k, vocab))
    roots = torch.arange(batch)
    trees = build_trees_compiled(top_q, top_tokens, roots, max_nodes=max_nodes)
    assert_like_reference(probs, min(k, vocab), trees)


@pytest.mark.parametrize("kind", MARGINAL_KINDS)
def test_the_triton_kernel_gives_the_references_trees_ties_included(kind):
    probs = random_marginals(3, 5, 9, kind, torch.Generator().manual_seed(7))
    for top_k, max_nodes in [(1, 5), (3, 30), (4, 9)]:
        top_q, top_tokens = top_k_of(probs, top_k)
        trees = build_trees_triton(top_q, top_tokens, torch.arange(3), max_nodes=max_nodes)
        assert_like_reference(probs, top_k, trees)


@pytest.mark.parametrize("order", ["chain_then_fan", "fan_then_chain", "alternating"])
def test_all_tied_chains_and_fans_still_give_best_first_trees(order):
    # q = 1 (one-hot) positions make chains and flat positions make fans of equal scores.
    gen = torch.Generator().manual_seed(0)
    hot = random_marginals(2, 1, 12, "one_hot", gen)
    flat = random_marginals(2, 1, 12, "flat", gen)
    pattern = {
        "chain_then_fan": [hot, hot, hot, flat, flat, flat],
        "fan_then_chain": [flat, flat, flat, hot, hot, hot],
        "alternating": [flat, hot, flat, hot, flat, hot],
    }[order]
    probs = torch.cat(pattern, dim=1)
    top_q, top_tokens = top_k_of(probs, 4)
    for max_nodes in range(1, 70, 2):
        trees = build_trees_compiled(top_q, top_tokens, torch.arange(2), max_nodes=max_nodes)
        assert_like_reference(probs, 4, trees)


def test_cpu_tensors_take_the_compiled_merge_unless_kernels_are_off(monkeypatch):
    top_q = torch.rand(2, 3, 4).sort(dim=-1, descending=True).values
    tokens = torch.arange(4).expand(2, 3, 4)  # [B, D, K]: distinct tokens per position
    roots = torch.zeros(2, dtype=torch.long)
    assert builder._compiled() is not None, "the C extension was not built: pip install -e ."

    def no_merge(*_, **__):
        raise AssertionError("the compiled merge ran")

    monkeypatch.setattr(builder, "build_trees_compiled", no_merge)
    build_trees_from_top_k(top_q, tokens, roots, max_nodes=8, kernels=False).check()
    with pytest.raises(AssertionError, match="compiled merge ran"):
        build_trees_from_top_k(top_q, tokens, roots, max_nodes=8)


@pytest.mark.parametrize(
    ("depth", "k", "max_nodes"), [(3, 2, 100), (4, 1, 3), (4, 1, 50), (0, 3, 4)]
)
@pytest.mark.parametrize("kernels", [True, False])
def test_num_nodes_is_capped_by_the_lattice(kernels, depth, k, max_nodes):
    probs = torch.softmax(torch.randn(2, depth, 6), dim=-1)
    roots = torch.zeros(2, dtype=torch.long)
    trees = build_trees(probs, roots, top_k=k, max_nodes=max_nodes, kernels=kernels)
    expected = min(max_nodes, lattice_size(depth, k))
    assert trees.num_nodes.tolist() == [expected, expected]
    assert trees.max_nodes == max_nodes
    trees.check()


def test_top_k_one_gives_the_dflash_chain():
    probs = torch.softmax(torch.randn(3, 7, 20), dim=-1)
    trees = build_trees(probs, torch.zeros(3, dtype=torch.long), top_k=1, max_nodes=8)
    assert trees.parents.tolist() == [[-1, 0, 1, 2, 3, 4, 5, 6]] * 3
    assert torch.equal(trees.token_ids[:, 1:], probs.argmax(dim=-1))


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


@pytest.mark.parametrize("build", [build_trees_reference, *SERVING.values()])
@pytest.mark.parametrize(
    ("q_shape", "token_shape", "root_shape", "message"),
    [
        ((2, 12), (2, 12), (2,), "must both be \\(B, D, K\\)"),
        ((2, 3, 4), (2, 3, 5), (2,), "must both be \\(B, D, K\\)"),
        ((2, 3, 4), (2, 3, 4), (3,), "root_tokens must be \\(2,\\)"),
    ],
)
def test_top_k_inputs_of_the_wrong_shape_are_refused_by_name(
    build, q_shape, token_shape, root_shape, message
):
    top_q, tokens = torch.rand(q_shape), torch.zeros(token_shape, dtype=torch.long)
    with pytest.raises(ValueError, match=message):
        build(top_q, tokens, torch.zeros(root_shape, dtype=torch.long), max_nodes=8)


def test_the_c_merge_refuses_a_tree_larger_than_the_lattice():
    log_q = torch.rand(1, 2, 2).sort(dim=-1, descending=True).values.log()  # lattice: 7 nodes
    tokens, roots = torch.ones(1, 2, 2, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    outputs = [torch.empty(1, 9, dtype=torch.long) for _ in range(3)] + [torch.empty(1, 9)]
    addresses = [t.data_ptr() for t in (log_q, tokens, roots, *outputs)]
    with pytest.raises(ValueError, match="exceeds the number of nodes"):
        builder._compiled().build(*addresses, 1, 2, 2, 8, 9)


def test_a_sampled_probes_trees_are_its_samples_trees_and_the_others_roots():
    generator = torch.Generator().manual_seed(5)
    probs = random_marginals(3, 4, 32, "smooth", generator)  # [P, D, V]: the sample's drafts
    roots = torch.arange(100, 106)  # [B]
    q, ids = top_k_of(probs, 4)
    sample = torch.tensor([1, 3, 4])  # rows that need not be adjacent
    drafted = build_trees_from_top_k(q, ids, roots[sample], max_nodes=8)
    merged = TreeBatch.roots(roots).with_rows(sample, drafted)
    merged.check()
    for name in FIELDS:
        assert torch.equal(getattr(merged, name)[sample], getattr(drafted, name)), name
    others = [0, 2, 5]
    assert merged.num_nodes[others].tolist() == [1, 1, 1]
    assert merged.token_ids[others, 0].tolist() == [100, 102, 105]
    assert merged.surrogate()[others].tolist() == [[1.0] * 8] * 3  # nothing to accept
