"""Exact acceptance: walk each tree with the target's own tokens.

Glossary (used the same way everywhere in this package):
- root: node 0 of a tree, the token the previous step already committed (its bonus token).
- target token: the target's token at a node, drawn from the target's processed distribution
  given the prefix and that node's path (argmax at temperature 0, a sample otherwise).
- accepted: a non-root node whose token equals the target token at its parent, and whose
  parent is the root or accepted. At most one node per depth is accepted, since siblings
  carry distinct tokens, so the accepted nodes form one path from the root.
- bonus: the target token at the deepest accepted node (or at the root): the first target
  token the tree does not contain. It becomes the next step's root.
- emitted: the accepted nodes' tokens followed by the bonus token (num_accepted + 1 tokens).

Because every visited node contributes an independent draw from the target's conditional
distribution and the walk follows exactly those draws, the emitted tokens are distributed as
plain autoregressive sampling from the target, whatever tree the drafter proposed.
"""

from __future__ import annotations

import torch

from sglang_bastion.tree.batch import TreeBatch


def accept_path(
    trees: TreeBatch, target_tokens: torch.Tensor, *, max_depth: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Accepted path, number of accepted nodes and bonus token of every tree.

    ``target_tokens`` is [B, N], the target's token at every node. ``max_depth`` is the
    deepest a node can be (the drafter's D); by default N - 1. Returns ``path`` [B, D+1]
    (accepted node slots from the root, padded with -1), ``num_accepted`` [B] (accepted nodes
    beyond the root) and ``bonus_tokens`` [B].
    """
    batch, nodes = trees.token_ids.shape
    if target_tokens.shape != (batch, nodes):
        raise ValueError(
            f"target_tokens must be {(batch, nodes)}, got {tuple(target_tokens.shape)}"
        )
    depth = nodes - 1 if max_depth is None else max_depth
    device = trees.token_ids.device

    # A node matches when its token is the target token at its parent; padding never matches.
    up = trees.parents.clamp(min=0)  # [B, N]: parent slot, the root points at itself
    matches = trees.token_ids == target_tokens.gather(1, up)
    matches &= (trees.parents >= 0) & trees.real_mask()
    matches[:, 0] = True  # the root is always committed
    # Accepted = every node on the path from the root matches: pointer doubling over depth.
    on_path = matches
    for _ in range(max(depth, 1).bit_length()):
        on_path = on_path & on_path.gather(1, up)
        up = up.gather(1, up)
    accepted = on_path & (trees.depths > 0)  # [B, N]

    num_accepted = accepted.sum(dim=1)  # [B]
    slots = torch.arange(nodes, device=device).expand(batch, nodes)
    column = torch.where(accepted, trees.depths.clamp(max=depth), depth + 1)  # [B, N]
    path = torch.full((batch, depth + 2), -1, dtype=torch.long, device=device)
    path[:, 0] = 0
    path.scatter_(1, column, torch.where(accepted, slots, -1))
    path = path[:, : depth + 1]  # [B, D+1]
    last = path.gather(1, num_accepted.unsqueeze(1))  # [B, 1]: deepest accepted slot
    bonus_tokens = target_tokens.gather(1, last).squeeze(1)  # [B]
    return path, num_accepted, bonus_tokens
