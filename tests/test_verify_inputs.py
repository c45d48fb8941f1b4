"""Verify inputs: positions, the ancestor mask in SGLang's flat layout, and retrieve arrays.

The torch reference is checked against walks up the parent pointers; the Triton kernel
(interpreted here) against the reference, exactly.
"""

from __future__ import annotations

import pytest
import torch
from helpers import random_marginals

from sglang_bastion.tree import TreeBatch, accept_path, ancestor_mask, build_trees
from sglang_bastion.tree.verify_inputs import (
    verify_inputs,
    verify_inputs_reference,
    verify_inputs_triton,
)


def random_trees(seed: int, batch: int = 5, width: int = 12) -> TreeBatch:
    gen = torch.Generator().manual_seed(seed)
    probs = random_marginals(batch, 6, 7, "smooth", gen)
    trees = build_trees(probs, torch.arange(batch), top_k=3, max_nodes=width)
    return trees.truncate(torch.randint(1, width + 1, (batch,), generator=gen))


def ancestors_by_parent_pointers(trees: TreeBatch, b: int, i: int) -> set[int]:
    seen = {i}
    while (i := int(trees.parents[b, i])) >= 0:
        seen.add(i)
    return seen


@pytest.mark.parametrize("seed", range(5))
def test_ancestor_mask_equals_the_walk_up_parent_pointers(seed):
    trees = random_trees(seed)
    mask = ancestor_mask(trees)
    for b in range(trees.batch_size):
        for i in range(trees.max_nodes):
            assert {
                j for j in range(trees.max_nodes) if mask[b, i, j]
            } == ancestors_by_parent_pointers(trees, b, i)


@pytest.mark.parametrize("seed", range(5))
def test_flat_mask_rows_see_the_whole_prefix_then_ancestors_only(seed):
    trees = random_trees(seed)
    prefix = torch.tensor([0, 3, 1, 7, 2])
    inputs = verify_inputs_reference(trees, prefix)
    width = trees.max_nodes
    offset = 0
    for b in range(trees.batch_size):
        cols = int(prefix[b]) + width
        block = inputs.custom_mask[offset : offset + width * cols].view(width, cols)
        offset += width * cols
        assert block[:, : prefix[b]].all(), "every node sees the whole prefix"
        for i in range(width):
            expected = ancestors_by_parent_pointers(trees, b, i)
            assert {j for j in range(width) if block[i, prefix[b] + j]} == expected
    assert offset == inputs.custom_mask.numel()


@pytest.mark.parametrize("seed", range(3))
def test_a_draft_only_mask_is_the_flat_masks_tree_blocks(seed):
    trees = random_trees(seed)
    prefix = torch.tensor([0, 3, 1, 7, 2])
    width = trees.max_nodes
    full = verify_inputs_reference(trees, prefix).custom_mask
    rows = full.split([width * (int(p) + width) for p in prefix])
    blocks = torch.cat([
        row.view(width, int(p) + width)[:, int(p):].flatten()
        for row, p in zip(rows, prefix, strict=True)
    ])  # fmt: skip
    draft_only = verify_inputs(trees, prefix, prefix.clone(), draft_only=True).custom_mask
    assert draft_only.tolist() == blocks.tolist()
    assert draft_only.tolist() == ancestor_mask(trees).flatten().tolist()


def test_a_draft_only_mask_with_a_tail_is_refused():
    # bastion_cpu tells the layouts apart by the mask's size; a tail would hide which it is.
    trees = random_trees(0)
    prefix = torch.tensor([0, 3, 1, 7, 2])
    with pytest.raises(ValueError, match="a draft-only mask takes no tail"):
        verify_inputs(trees, prefix, prefix.clone(), mask_tail=4, draft_only=True)


def test_positions_are_prefix_length_plus_depth_and_ids_are_the_tokens():
    trees = random_trees(0)
    prefix = torch.tensor([4, 0, 9, 1, 2])
    inputs = verify_inputs_reference(trees, prefix)
    assert torch.equal(inputs.positions.view(5, -1), prefix.unsqueeze(1) + trees.depths)
    assert torch.equal(inputs.input_ids.view(5, -1), trees.token_ids)
    assert torch.equal(inputs.retrieve_index, torch.arange(5 * trees.max_nodes).view(5, -1))


def children_by_links(inputs, b: int, parent: int) -> list[int]:
    kids, child = [], int(inputs.retrieve_next_token[b, parent])
    while child != -1:
        kids.append(child)
        child = int(inputs.retrieve_next_sibling[b, child])
    return kids


@pytest.mark.parametrize("seed", range(5))
def test_retrieve_links_list_each_nodes_real_children_in_slot_order(seed):
    trees = random_trees(seed)
    inputs = verify_inputs_reference(trees, torch.zeros(5, dtype=torch.long))
    for b in range(trees.batch_size):
        for p in range(trees.max_nodes):
            real = [c for c in range(int(trees.num_nodes[b])) if int(trees.parents[b, c]) == p]
            assert children_by_links(inputs, b, p) == real


def test_padding_slots_are_unreachable_and_never_accepted():
    trees = random_trees(1, batch=3, width=10).truncate(torch.tensor([1, 4, 10]))
    inputs = verify_inputs_reference(trees, torch.tensor([2, 2, 2]))
    reachable = set()
    for b in range(3):
        stack = [0]
        while stack:
            node = stack.pop()
            reachable.add((b, node))
            stack.extend(children_by_links(inputs, b, node))
        assert {n for bb, n in reachable if bb == b} == set(range(int(trees.num_nodes[b])))
    # A target that names every slot's token everywhere still cannot reach padding.
    target = trees.token_ids.roll(-1, dims=1)
    path, _, _ = accept_path(trees, target)
    assert ((path < trees.num_nodes.unsqueeze(1)) | (path == -1)).all()


def test_mask_length_is_width_times_prefix_plus_width_per_request():
    trees = random_trees(2, batch=3, width=8)
    prefix = torch.tensor([5, 0, 11])
    inputs = verify_inputs_reference(trees, prefix)
    assert inputs.custom_mask.numel() == sum(8 * (int(p) + 8) for p in prefix)
    assert inputs.custom_mask.dtype == torch.bool


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
def test_kernel_outputs_equal_verify_inputs_reference(nodes, prefix):
    trees = ragged_trees(len(prefix), nodes, seed=nodes)
    prefix_lens = torch.tensor(prefix)
    out = verify_inputs_triton(trees, prefix_lens.int())
    expected = verify_inputs_reference(trees, prefix_lens)
    for name in FIELDS:
        assert torch.equal(getattr(out, name), getattr(expected, name)), name


def test_host_prefix_lengths_size_the_mask_without_reading_the_device():
    trees = ragged_trees(3, 8, seed=3)
    prefix_lens = torch.tensor([4, 0, 11])
    out = verify_inputs_triton(trees, prefix_lens, prefix_lens_cpu=prefix_lens.clone())
    assert torch.equal(out.custom_mask, verify_inputs_reference(trees, prefix_lens).custom_mask)


def sglang_padded_mask_length(inputs_width: int, seq_lens_sum: int, batch: int) -> int:
    """The mask length SGLang's FlashInfer/Triton verify pads to (generate_attn_arg_prefill)."""
    return seq_lens_sum * inputs_width + inputs_width**2 * batch


@pytest.mark.parametrize("impl", [verify_inputs_reference, verify_inputs_triton])
def test_a_mask_tail_makes_the_mask_as_long_as_sglang_pads_it_with_true(impl):
    trees = ragged_trees(3, 8, seed=4)
    prefix_lens = torch.tensor([4, 0, 11])
    plain = verify_inputs_reference(trees, prefix_lens).custom_mask
    padded = impl(trees, prefix_lens, mask_tail=3 * 8 * 8).custom_mask
    host_bound = int((prefix_lens + 8).sum())  # seq_lens_sum as the worker sets it
    assert padded.numel() == sglang_padded_mask_length(8, host_bound, 3)
    assert torch.equal(padded[: plain.numel()], plain) and bool(padded[plain.numel() :].all())
