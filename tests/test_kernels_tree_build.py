"""Tree build kernel: `build_trees` from top-K marginals, one program per request, exactly."""

from __future__ import annotations

import pytest
import torch
from helpers import random_marginals

from sglang_bastion.kernels import build_trees_from_top_k_reference, build_trees_from_top_k_triton
from sglang_bastion.tree import TreeBatch, build_trees

FIELDS = ("token_ids", "parents", "depths", "log_scores", "num_nodes")


def assert_same_trees(actual: TreeBatch, expected: TreeBatch) -> None:
    for name in FIELDS:
        assert torch.equal(getattr(actual, name), getattr(expected, name)), name


def marginals(batch: int, depth: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    probs = random_marginals(batch, depth, vocab, "smooth", generator)
    roots = torch.randint(0, vocab, (batch,), generator=generator)
    return probs, roots


# (B, D, K, N): the paper's lattice and beam pools, and a lattice smaller than N (padding).
SHAPES = [(3, 15, 8, 16), (2, 15, 8, 64), (3, 4, 4, 16), (2, 2, 2, 16), (1, 3, 3, 5)]


@pytest.mark.parametrize(("batch", "depth", "top_k", "nodes"), SHAPES)
def test_kernel_trees_equal_build_trees(batch, depth, top_k, nodes):
    probs, roots = marginals(batch, depth, 40, seed=depth * top_k + nodes)
    top_q, top_tokens = probs.topk(top_k, dim=-1)
    trees = build_trees_from_top_k_triton(top_q, top_tokens, roots, max_nodes=nodes)
    assert_same_trees(trees, build_trees(probs, roots, top_k=top_k, max_nodes=nodes))


@pytest.mark.parametrize(("batch", "depth", "top_k", "nodes"), SHAPES)
def test_reference_from_top_k_equals_build_trees_on_dense_marginals(batch, depth, top_k, nodes):
    probs, roots = marginals(batch, depth, 40, seed=depth + nodes)
    top_q, top_tokens = probs.topk(top_k, dim=-1)
    trees = build_trees_from_top_k_reference(top_q, top_tokens, roots, max_nodes=nodes)
    assert_same_trees(trees, build_trees(probs, roots, top_k=top_k, max_nodes=nodes))


def test_kernel_trees_satisfy_the_tree_invariants():
    probs, roots = marginals(4, 6, 30, seed=11)
    top_q, top_tokens = probs.topk(5, dim=-1)
    build_trees_from_top_k_triton(top_q, top_tokens, roots, max_nodes=24).check()


def test_mismatched_token_shape_is_refused():
    top_q = torch.rand(2, 3, 4)
    with pytest.raises(ValueError, match="top_tokens"):
        build_trees_from_top_k_triton(top_q, torch.zeros(2, 3, 5), torch.zeros(2), max_nodes=8)
