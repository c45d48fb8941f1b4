"""One-node trees (a plain step) take a direct path that equals the tree ops' reference."""

from __future__ import annotations

import torch

from sglang_bastion.tree import TreeBatch
from sglang_bastion.tree.acceptance import accept, accept_reference
from sglang_bastion.tree.verify_inputs import verify_inputs, verify_inputs_reference

ROOTS = torch.tensor([17, 3, 250, 9])
PREFIX = torch.tensor([6, 0, 13, 1])  # an empty prefix too


def test_root_verify_inputs_equal_the_tree_inputs_of_one_node_trees():
    direct = verify_inputs(TreeBatch.roots(ROOTS), PREFIX, PREFIX.clone(), mask_tail=4)
    general = verify_inputs_reference(TreeBatch.roots(ROOTS), PREFIX, mask_tail=4)
    for field in ("input_ids", "positions", "custom_mask", "retrieve_index",
                  "retrieve_next_token", "retrieve_next_sibling"):  # fmt: skip
        got, want = getattr(direct, field), getattr(general, field)
        assert got.dtype == want.dtype and torch.equal(got, want), field


def test_root_acceptance_takes_the_target_token_as_bonus_and_moves_no_kv():
    target = torch.tensor([[5], [77], [0], [31]])  # [B, 1]: the target's token at each root
    window = torch.arange(4 * 9).view(4, 9) + 100  # [B, window] KV slots
    direct = accept(TreeBatch.roots(ROOTS), target, window, max_depth=7)
    general = accept_reference(TreeBatch.roots(ROOTS), target, window, max_depth=7)
    for field in ("path", "num_accepted", "bonus_tokens", "kv_source", "kv_target"):
        got, want = getattr(direct, field), getattr(general, field)
        assert got.dtype == want.dtype and torch.equal(got, want), field
    assert direct.bonus_tokens.tolist() == [5, 77, 0, 31]
