"""Ragged verify: every request's tree packed unpadded at its own size."""

from __future__ import annotations

import pytest
import torch
from helpers import random_marginals

from sglang_bastion.tree import TreeBatch, build_trees
from sglang_bastion.tree.ragged import pack_ragged, packed_argmax, unpack_rows
from sglang_bastion.tree.verify_inputs import verify_inputs_reference

SIZES = (5, 1, 3)
PREFIX = torch.tensor([7, 2, 4])


def trees(width: int = 6) -> TreeBatch:
    """Three best-first trees of ``width`` nodes."""
    probs = random_marginals(3, 4, 32, "smooth", torch.Generator().manual_seed(5))
    return build_trees(probs, torch.tensor([3, 9, 11]), top_k=4, max_nodes=width)


def one_request(batch: TreeBatch, b: int, size: int) -> TreeBatch:
    """Request ``b`` alone, cut to its first ``size`` nodes."""
    cut = batch.truncate(torch.tensor(SIZES))
    return TreeBatch(
        token_ids=cut.token_ids[b : b + 1, :size], parents=cut.parents[b : b + 1, :size],
        depths=cut.depths[b : b + 1, :size], log_scores=cut.log_scores[b : b + 1, :size],
        num_nodes=cut.num_nodes[b : b + 1],
    )  # fmt: skip


def test_each_request_packs_as_if_verified_alone_at_its_size():
    batch = trees()
    padded = verify_inputs_reference(batch.truncate(torch.tensor(SIZES)), PREFIX, mask_tail=9)
    packed = pack_ragged(padded, SIZES, PREFIX, width=6)
    alone = [
        verify_inputs_reference(one_request(batch, b, n), PREFIX[b : b + 1])
        for b, n in enumerate(SIZES)
    ]
    assert packed.input_ids.tolist() == torch.cat([a.input_ids for a in alone]).tolist()
    assert packed.positions.tolist() == torch.cat([a.positions for a in alone]).tolist()
    assert packed.custom_mask.tolist() == torch.cat([a.custom_mask for a in alone]).tolist()
    assert packed.lens_cpu == SIZES and packed.lens.tolist() == list(SIZES)


def test_a_draft_only_mask_packs_as_each_requests_tree_block_alone():
    batch = trees()
    cut = batch.truncate(torch.tensor(SIZES))
    padded = verify_inputs_reference(cut, PREFIX, draft_only=True)
    packed = pack_ragged(padded, SIZES, PREFIX, width=6, draft_only=True)
    alone = [
        verify_inputs_reference(one_request(batch, b, n), PREFIX[b : b + 1], draft_only=True)
        for b, n in enumerate(SIZES)
    ]
    assert packed.custom_mask.tolist() == torch.cat([a.custom_mask for a in alone]).tolist()
    with_prefix = pack_ragged(verify_inputs_reference(cut, PREFIX), SIZES, PREFIX, width=6)
    assert packed.rows.tolist() == with_prefix.rows.tolist()
    assert packed.custom_mask.numel() == sum(n * n for n in SIZES)


def test_a_packed_tree_mask_hides_other_branches():
    batch = trees()
    padded = verify_inputs_reference(batch.truncate(torch.tensor(SIZES)), PREFIX)
    mask = pack_ragged(padded, SIZES, PREFIX, width=6).custom_mask
    # Request 0: 5 rows of 7 + 5 columns; its tree has branches, so some node hides another.
    block = mask[: 5 * 12].view(5, 12)[:, 7:]
    assert bool(block.diagonal().all()) and not bool(block.all())
    assert not bool(block.triu(1).any())  # best-first: no node sees a later slot


def test_packed_rows_name_their_padded_rows():
    padded = verify_inputs_reference(trees().truncate(torch.tensor(SIZES)), PREFIX)
    packed = pack_ragged(padded, SIZES, PREFIX, width=6)
    assert packed.rows.tolist() == [0, 1, 2, 3, 4, 6, 12, 13, 14]
    assert packed.num_tokens == 9


def test_unpacking_restores_the_padded_layout_with_zero_rows_outside_the_trees():
    rows = torch.tensor([0, 1, 4])
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    out = unpack_rows(values, rows, 6)
    assert out.tolist() == [[1, 2], [3, 4], [0, 0], [0, 0], [5, 6], [0, 0]]


@pytest.mark.parametrize("sizes", [(0, 1, 1), (7, 1, 1), (1, 1)])
def test_sizes_outside_the_width_or_batch_are_refused(sizes):
    padded = verify_inputs_reference(trees(), PREFIX)
    with pytest.raises(ValueError, match=r"sizes must give each of 3 requests 1\.\.6 nodes"):
        pack_ragged(padded, sizes, PREFIX, width=6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_packed_argmax_is_the_argmax_of_the_unpacked_logits(dtype):
    packed = trees().truncate(torch.tensor(SIZES))
    rows = pack_ragged(verify_inputs_reference(packed, PREFIX), SIZES, PREFIX, width=6).rows
    logits = torch.randn(9, 50, generator=torch.Generator().manual_seed(3)).to(dtype) - 4.0
    logits[2].fill_(-1.0)  # a row of ties: its first column, as argmax takes it
    expected = unpack_rows(logits, rows, 18).argmax(dim=-1)
    assert packed_argmax(logits, rows, 18).tolist() == expected.tolist()
