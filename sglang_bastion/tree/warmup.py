"""Compile every tree op at every verify width before the first step, not inside one.

The Triton tree ops specialise on the tree budget N (the builder) and on the verify width W
(verify inputs, acceptance); the batch size and prefix lengths are not specialised. Without a
warm-up, the first step at each new width compiles while it is timed, and the EMA controller
would learn the compile as the verify's price.
"""

from __future__ import annotations

import torch

from sglang_bastion.tree.acceptance import accept
from sglang_bastion.tree.builder import build_trees_from_top_k
from sglang_bastion.tree.verify_inputs import verify_inputs


def warm_tree_ops(
    device: torch.device, widths: tuple[int, ...], *, depth: int, top_k: int, max_nodes: int,
    window: int, kernels: bool = True,
) -> list[int]:  # fmt: skip
    """Run build, verify inputs and acceptance once per verify width; the widths run."""
    q = torch.linspace(0.9, 0.1, depth * top_k, device=device).view(1, depth, top_k)  # [1, D, K]
    q = torch.sort(q, dim=-1, descending=True).values
    ids = torch.arange(depth * top_k, device=device).view(1, depth, top_k)  # [1, D, K]
    root = torch.zeros(1, dtype=torch.long, device=device)  # [B=1]
    trees = build_trees_from_top_k(q, ids, root, max_nodes=max_nodes, kernels=kernels)
    prefix = torch.full((1,), 8, dtype=torch.long, device=device)  # [B=1]
    slots = torch.arange(window, device=device).view(1, window)  # [B=1, window] KV slots
    warmed = []
    for width in sorted(set(widths)):  # each at most N, the trees' slots
        narrow = trees.narrow(width)
        verify_inputs(narrow, prefix, prefix.cpu(), kernels=kernels)
        target = narrow.token_ids.clone()  # [1, W]: the target agrees with every draft
        accept(narrow, target, slots, max_depth=depth, kernels=kernels)
        warmed.append(width)
    return warmed
