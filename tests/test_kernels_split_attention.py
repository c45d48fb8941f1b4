"""Split verification attention: dense prefix pass + masked tree block = full-mask attention."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from helpers import random_marginals

from sglang_bastion.cpu_attention import kernels as full_mask
from sglang_bastion.kernels import (
    attend_with_lse,
    merge_states,
    split_tree_attention_reference,
    split_tree_attention_triton,
    split_verify_padded,
)
from sglang_bastion.tree import ancestor_mask, build_trees

SCALE = 0.3
TOL = {"rtol": 1e-5, "atol": 1e-5}  # float32 throughout; only the summation order differs


@dataclass
class Case:
    q: torch.Tensor  # [B, N, H, D]
    k_buf: torch.Tensor  # [slots, Hkv, D]
    v_buf: torch.Tensor  # [slots, Hkv, D]
    prefix_slots: torch.Tensor  # [B, P]
    prefix_lens: torch.Tensor  # [B]
    tree_slots: torch.Tensor  # [B, N]
    tree_mask: torch.Tensor  # [B, N, N]
    tree_lens: torch.Tensor  # [B]

    def split_args(self) -> tuple:
        return (
            self.q, self.k_buf, self.v_buf, self.prefix_slots, self.prefix_lens,
            self.tree_slots, self.tree_mask, self.tree_lens, SCALE,
        )  # fmt: skip


def make_case(prefix: list[int], tree: list[int], nodes: int, heads: int, kv_heads: int) -> Case:
    """Ragged prefixes in a shuffled pool, trees cut to ``tree`` sizes, head dim 16."""
    generator = torch.Generator().manual_seed(sum(prefix) + nodes)
    batch, width = len(prefix), max(max(prefix), 1)
    slots = batch * (width + nodes) + 1
    perm = torch.randperm(slots, generator=generator)
    probs = random_marginals(batch, 4, 20, "smooth", generator)
    trees = build_trees(probs, torch.zeros(batch, dtype=torch.long), top_k=3, max_nodes=nodes)
    tree_lens = torch.tensor(tree)
    return Case(
        q=torch.randn(batch, nodes, heads, 16, generator=generator),
        k_buf=torch.randn(slots, kv_heads, 16, generator=generator),
        v_buf=torch.randn(slots, kv_heads, 16, generator=generator),
        prefix_slots=perm[: batch * width].view(batch, width),
        prefix_lens=torch.tensor(prefix),
        tree_slots=perm[batch * width : batch * (width + nodes)].view(batch, nodes),
        tree_mask=ancestor_mask(trees.truncate(tree_lens)),
        tree_lens=tree_lens,
    )


def padded_columns(case: Case) -> tuple[torch.Tensor, torch.Tensor, int]:
    """bastion_cpu's [B, S, Hkv, D] keys and values: each prefix, then the tree's own keys."""
    batch, nodes = case.tree_slots.shape
    columns = case.prefix_slots.shape[1] + nodes
    kv_slots = torch.zeros(batch, columns, dtype=torch.long)
    for b in range(batch):
        length = int(case.prefix_lens[b])
        kv_slots[b, :length] = case.prefix_slots[b, :length]
        kv_slots[b, length : length + nodes] = case.tree_slots[b]
    return (
        full_mask.gather_kv(case.k_buf, kv_slots),
        full_mask.gather_kv(case.v_buf, kv_slots),
        columns,
    )


def full_mask_attention(case: Case) -> torch.Tensor:
    """bastion_cpu's tree verify: one [B, N, P + N] custom mask over [prefix | tree] columns."""
    k, v, columns = padded_columns(case)
    nodes = case.tree_slots.shape[1]
    visible = full_mask.visibility(
        case.prefix_lens, case.tree_lens, nodes, columns, causal=True, draft_mask=case.tree_mask
    )
    mask = full_mask.additive_mask(visible)
    return full_mask.attend(case.q, k, v, mask=mask, is_causal=True, scale=SCALE)


def real_rows(case: Case) -> torch.Tensor:
    nodes = case.tree_slots.shape[1]
    return torch.arange(nodes).unsqueeze(0) < case.tree_lens.unsqueeze(1)  # [B, N]


# Ragged prefixes (one empty, one spanning several blocks), ragged trees, GQA and plain MHA.
CASES = [([0, 37, 20], [8, 5, 1], 8, 4, 2), ([50], [16], 16, 2, 2), ([3, 9], [2, 3], 3, 4, 1)]


@pytest.mark.parametrize(("prefix", "tree", "nodes", "heads", "kv_heads"), CASES)
def test_torch_split_equals_full_mask_attention(prefix, tree, nodes, heads, kv_heads):
    case = make_case(prefix, tree, nodes, heads, kv_heads)
    out = split_tree_attention_reference(*case.split_args())
    real = real_rows(case)
    torch.testing.assert_close(out[real], full_mask_attention(case)[real], **TOL)


@pytest.mark.parametrize(("prefix", "tree", "nodes", "heads", "kv_heads"), CASES)
def test_triton_split_equals_full_mask_attention(prefix, tree, nodes, heads, kv_heads):
    case = make_case(prefix, tree, nodes, heads, kv_heads)
    out = split_tree_attention_triton(*case.split_args(), block_s=16, splits=2)
    real = real_rows(case)
    torch.testing.assert_close(out[real], full_mask_attention(case)[real], **TOL)


@pytest.mark.parametrize(("prefix", "tree", "nodes", "heads", "kv_heads"), CASES)
def test_split_over_bastion_cpu_padded_columns_equals_full_mask(
    prefix, tree, nodes, heads, kv_heads
):
    case = make_case(prefix, tree, nodes, heads, kv_heads)
    k, v, _ = padded_columns(case)
    args = (case.q, k, v, case.prefix_lens, case.tree_lens, case.tree_mask, SCALE)
    out = split_verify_padded(*args)
    real = real_rows(case)
    torch.testing.assert_close(out[real], full_mask_attention(case)[real], **TOL)
    assert bool((out[~real] == 0).all())


def test_query_rows_cut_into_blocks_give_the_same_attention():
    case = make_case([30, 7], [8, 6], 8, 4, 1)  # G x N = 32 stacked rows, blocks of 16
    out = split_tree_attention_triton(*case.split_args(), block_s=16, block_m=16)
    real = real_rows(case)
    torch.testing.assert_close(out[real], full_mask_attention(case)[real], **TOL)


def test_padding_rows_are_zero():
    case = make_case([6, 4], [2, 4], 4, 2, 1)
    out = split_tree_attention_triton(*case.split_args(), block_s=16)
    assert bool((out[~real_rows(case)] == 0).all())


def test_merging_two_column_halves_equals_attention_over_all_columns():
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(2, 3, 4, 8, generator=generator)
    k = torch.randn(2, 10, 2, 8, generator=generator)
    v = torch.randn(2, 10, 2, 8, generator=generator)
    everything = torch.ones(1, 1, 10, dtype=torch.bool)
    whole, whole_lse = attend_with_lse(q, k, v, everything, SCALE)
    first = attend_with_lse(q, k[:, :6], v[:, :6], everything[..., :6], SCALE)
    second = attend_with_lse(q, k[:, 6:], v[:, 6:], everything[..., 6:], SCALE)
    merged, merged_lse = merge_states(*first, *second)
    torch.testing.assert_close(merged, whole, **TOL)
    torch.testing.assert_close(merged_lse, whole_lse, **TOL)
