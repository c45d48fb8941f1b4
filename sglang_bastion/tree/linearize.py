"""Tree linearisation: what one target verify pass over every tree needs, in SGLang's layout.

Each request's W tree slots are verified as W consecutive tokens. SGLang's tree-verify path
(shared by its FlashInfer and Triton backends) takes:
- positions: prefix_len + depth, so rotary embeddings see each node at its true position;
- a flat bool custom mask: per request, W rows of (prefix_len + W) columns, row-major, requests
  concatenated; a node sees the whole prefix, its ancestors and itself, never other branches;
- EAGLE-style retrieve arrays: retrieve_index (flat token index of each slot),
  retrieve_next_token (first child slot, -1 if none) and retrieve_next_sibling (next slot with
  the same parent, -1 if none); children are linked in increasing slot order.
Padding slots see the prefix and themselves, and no link leads to them, so they are never
accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_bastion.tree.batch import TreeBatch


@dataclass(frozen=True)
class VerifyInputs:
    """Inputs of one tree-verify forward pass for B requests of W slots each."""

    input_ids: torch.Tensor  # [B*W] long
    positions: torch.Tensor  # [B*W] long: prefix_len + depth
    custom_mask: torch.Tensor  # [sum_b W*(prefix_len_b + W)] bool, SGLang's flat layout
    retrieve_index: torch.Tensor  # [B, W] long: flat token index b*W + slot
    retrieve_next_token: torch.Tensor  # [B, W] long: first child slot or -1
    retrieve_next_sibling: torch.Tensor  # [B, W] long: next sibling slot or -1


def ancestor_mask(trees: TreeBatch) -> torch.Tensor:
    """[B, N, N] bool: entry (b, i, j) is True when slot j is slot i or one of its ancestors."""
    batch, nodes = trees.parents.shape
    slots = torch.arange(nodes, device=trees.parents.device)
    mask = (slots.unsqueeze(1) == slots.unsqueeze(0)).expand(batch, nodes, nodes).clone()
    # Pointer doubling: after s rounds every slot sees its 2^s - 1 nearest ancestors.
    hop = torch.where(trees.parents >= 0, trees.parents, slots)  # [B, N]: root, padding: self
    for _ in range(max(nodes - 1, 1).bit_length()):
        mask |= mask.gather(1, hop.unsqueeze(2).expand(batch, nodes, nodes))
        hop = hop.gather(1, hop)
    return mask


def linearize(trees: TreeBatch, prefix_lens: torch.Tensor) -> VerifyInputs:
    """Verify-pass inputs for every tree at its width W = ``trees.max_nodes``."""
    batch, width = trees.token_ids.shape
    if prefix_lens.shape != (batch,):
        raise ValueError(f"prefix_lens must be ({batch},), got {tuple(prefix_lens.shape)}")
    device = trees.token_ids.device
    prefix_lens = prefix_lens.to(device=device, dtype=torch.long)
    slots = torch.arange(width, device=device)

    positions = (prefix_lens.unsqueeze(1) + trees.depths).flatten()  # [B*W]
    retrieve_index = (torch.arange(batch, device=device).unsqueeze(1) * width + slots).expand(
        batch, width
    )

    # Links: child c of p, sibling s after i (same parent, larger slot); padding has parent -1.
    real_child = (trees.parents >= 0).unsqueeze(1)  # [B, 1, W]
    is_child = (trees.parents.unsqueeze(1) == slots.view(1, width, 1)) & real_child  # [B, W, W]
    retrieve_next_token = _first_true(is_child)
    later = slots.view(1, 1, width) > slots.view(1, width, 1)
    same_parent = (trees.parents.unsqueeze(2) == trees.parents.unsqueeze(1)) & real_child
    retrieve_next_sibling = _first_true(same_parent & later & real_child.transpose(1, 2))

    # Flat mask: rows of [prefix (all True) | tree block (ancestors)], requests concatenated.
    # Its length depends on the prefix lengths, so this reads them on the host (once per step).
    tree_block = ancestor_mask(trees)  # [B, W, W]
    columns = torch.arange(int(prefix_lens.max()) + width, device=device)  # [C]
    col = columns.view(1, 1, -1)
    in_prefix = col < prefix_lens.view(batch, 1, 1)
    tree_col = (col - prefix_lens.view(batch, 1, 1)).clamp(0, width - 1)  # [B, 1, C]
    dense = torch.where(
        in_prefix, True, tree_block.gather(2, tree_col.expand(batch, width, -1))
    )  # [B, W, C]
    valid = (col < (prefix_lens + width).view(batch, 1, 1)).expand_as(dense)
    return VerifyInputs(
        input_ids=trees.token_ids.flatten(),
        positions=positions,
        custom_mask=dense[valid],
        retrieve_index=retrieve_index.contiguous(),
        retrieve_next_token=retrieve_next_token,
        retrieve_next_sibling=retrieve_next_sibling,
    )


def _first_true(flags: torch.Tensor) -> torch.Tensor:
    """Index of the first True along the last dimension, -1 where there is none."""
    first = flags.to(torch.uint8).argmax(dim=-1)
    return torch.where(flags.any(dim=-1), first, -1)
