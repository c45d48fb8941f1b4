"""Verify-inputs kernel: mask, positions and retrieve arrays in one launch, as `linearize`."""

from __future__ import annotations

import pytest
import torch
from helpers import random_marginals

from sglang_bastion.kernels import verify_inputs_triton
from sglang_bastion.tree import TreeBatch, build_trees, linearize

FIELDS = (
    "input_ids",
    "positions",
    "custom_mask",
    "retrieve_index",
    "retrieve_next_token",
    "retrieve_next_sibling",
)


def ragged_trees(batch: int, nodes: int, seed: int) -> TreeBatch:
    """Trees cut to random sizes 1..N, so most carry padding slots."""
    generator = torch.Generator().manual_seed(seed)
    probs = random_marginals(batch, 5, 30, "smooth", generator)
    trees = build_trees(probs, torch.arange(batch), top_k=3, max_nodes=nodes)
    return trees.truncate(torch.randint(1, nodes + 1, (batch,), generator=generator))


@pytest.mark.parametrize(
    ("nodes", "prefix"), [(8, [0, 5, 1300, 17]), (16, [3, 40]), (5, [9])]
)  # a prefix of 0, one longer than a mask block, ragged, and a non-power-of-two width
def test_kernel_outputs_equal_linearize(nodes, prefix):
    trees = ragged_trees(len(prefix), nodes, seed=nodes)
    prefix_lens = torch.tensor(prefix)
    out = verify_inputs_triton(trees, prefix_lens.int())
    expected = linearize(trees, prefix_lens)
    for name in FIELDS:
        assert torch.equal(getattr(out, name), getattr(expected, name)), name


def test_host_prefix_lengths_size_the_mask_without_reading_the_device():
    trees = ragged_trees(3, 8, seed=3)
    prefix_lens = torch.tensor([4, 0, 11])
    out = verify_inputs_triton(trees, prefix_lens, prefix_lens_cpu=prefix_lens.clone())
    assert torch.equal(out.custom_mask, linearize(trees, prefix_lens).custom_mask)
