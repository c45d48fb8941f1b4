"""Acceptance kernel: `accept_path` plus the KV-slot moves of the accepted path, in one launch."""

from __future__ import annotations

import pytest
import torch
from helpers import random_marginals, small_tree

from sglang_bastion.kernels import accept_reference, accept_triton
from sglang_bastion.tree import TreeBatch, build_trees

FIELDS = ("path", "num_accepted", "bonus_tokens", "kv_source", "kv_target")


def planted_targets(trees: TreeBatch, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Random target tokens, except along a random root-to-node path, which they accept."""
    batch, nodes = trees.token_ids.shape
    targets = torch.randint(0, vocab, (batch, nodes), generator=generator)
    for b in range(batch):
        node = int(torch.randint(0, int(trees.num_nodes[b]), (), generator=generator))
        while node > 0:
            parent = int(trees.parents[b, node])
            targets[b, parent] = trees.token_ids[b, node]
            node = parent
    return targets


def test_kv_moves_bring_the_accepted_path_to_the_front_of_the_window():
    window = torch.arange(100, 107).unsqueeze(0)  # KV slots of the 7 tree slots
    target = torch.tensor([[12, 0, 14, 0, 99, 0, 0]])  # accepts b (slot 2) then d (slot 4)
    out = accept_triton(small_tree(), target, window, max_depth=3)
    assert out.path.tolist() == [[0, 2, 4, -1]]
    assert out.kv_source.tolist() == [[-1, 102, 104, -1]]
    assert out.kv_target.tolist() == [[-1, 101, 102, -1]]


def test_a_path_already_in_place_moves_nothing():
    window = torch.arange(100, 107).unsqueeze(0)
    target = torch.tensor([[11, 13, 0, 0, 0, 0, 0]])  # accepts a (slot 1) then c (slot 3)
    out = accept_triton(small_tree(), target, window, max_depth=3)
    assert out.num_accepted.tolist() == [2]
    assert out.kv_source.tolist() == [[-1, -1, 103, -1]]


@pytest.mark.parametrize(("depth", "top_k", "nodes"), [(4, 3, 16), (15, 8, 16), (2, 2, 7)])
def test_kernel_equals_accept_path_on_ragged_trees(depth, top_k, nodes):
    generator = torch.Generator().manual_seed(depth + nodes)
    batch, vocab = 5, 30
    probs = random_marginals(batch, depth, vocab, "smooth", generator)
    trees = build_trees(probs, torch.arange(batch), top_k=top_k, max_nodes=nodes)
    trees = trees.truncate(torch.randint(1, nodes + 1, (batch,), generator=generator))
    targets = planted_targets(trees, vocab, generator)
    window = torch.randperm(1000, generator=generator)[: batch * (nodes + 2)].view(batch, -1)
    out = accept_triton(trees, targets, window, max_depth=depth)
    expected = accept_reference(trees, targets, window, max_depth=depth)
    assert int(expected.num_accepted.sum()) > 0  # the planted paths are walked
    for name in FIELDS:
        assert torch.equal(getattr(out, name), getattr(expected, name)), name
