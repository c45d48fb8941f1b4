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

One op, the step's acceptance and its KV bookkeeping: besides the (path, num_accepted, bonus)
of the walk, the worker moves the accepted nodes' KV to the front of each request's window:
the k-th emitted position (k < num_accepted + 1) reads slot ``window[b, path[b, k]]`` and
lands in ``window[b, k]``, unless the two coincide. Both come as fixed-shape [B, D + 1]
tables, -1 where nothing moves, so no host read is needed; the caller compacts them where it
hands them to the KV pool. `accept` dispatches between `accept_reference` (torch: `accept_path`,
the walk alone, which the simulators also call, plus the moves) and `accept_triton`: one
program per request walks down from the root, at each depth taking the child whose token is
the target's token at the current node (siblings carry distinct tokens, so at most one), with
the tree row, target row and window row loaded once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sglang_bastion.kernels.dispatch import next_power_of_2, use_triton
from sglang_bastion.tree.batch import TreeBatch


@dataclass(frozen=True)
class Acceptance:
    """One step's accepted paths and the KV moves that keep them."""

    path: torch.Tensor  # [B, D+1] long: accepted slots from the root, -1 padded
    num_accepted: torch.Tensor  # [B] long: accepted nodes beyond the root
    bonus_tokens: torch.Tensor  # [B] long: the target's token after the path
    kv_source: torch.Tensor  # [B, D+1] long: KV slot to copy from, -1 where nothing moves
    kv_target: torch.Tensor  # [B, D+1] long: KV slot to copy to, -1 where nothing moves


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


def accept_reference(
    trees: TreeBatch, target_tokens: torch.Tensor, window: torch.Tensor, *, max_depth: int
) -> Acceptance:
    """`accept_path` and the worker's KV moves, in torch (``window`` [B, >= W] KV slots)."""
    path, num_accepted, bonus = accept_path(trees, target_tokens, max_depth=max_depth)
    steps = torch.arange(path.shape[1], device=path.device)
    moved = (steps < (num_accepted + 1).unsqueeze(1)) & (path != steps)  # [B, D+1]
    width = min(path.shape[1], window.shape[1])
    source = window.long().gather(1, path[:, :width].clamp(min=0))  # [B, D+1] (or W)
    target = window[:, :width].long()
    moved = moved[:, :width]
    pad = path.shape[1] - width
    return Acceptance(
        path=path,
        num_accepted=num_accepted,
        bonus_tokens=bonus,
        kv_source=torch.nn.functional.pad(torch.where(moved, source, -1), (0, pad), value=-1),
        kv_target=torch.nn.functional.pad(torch.where(moved, target, -1), (0, pad), value=-1),
    )


def accept_triton(
    trees: TreeBatch, target_tokens: torch.Tensor, window: torch.Tensor, *, max_depth: int
) -> Acceptance:
    """`accept_reference` in one launch (one program per request)."""
    batch, width = trees.token_ids.shape
    if target_tokens.shape != (batch, width):
        raise ValueError(
            f"target_tokens must be {(batch, width)}, got {tuple(target_tokens.shape)}"
        )
    device = trees.token_ids.device
    cols = max_depth + 1
    window = window if window.stride(1) == 1 else window.contiguous()
    out = torch.empty(3, batch, cols, dtype=torch.int64, device=device)  # path, source, target
    num_accepted = torch.empty(batch, dtype=torch.int64, device=device)
    bonus = torch.empty(batch, dtype=torch.int64, device=device)
    if batch:
        _accept_kernel[(batch,)](
            trees.token_ids.contiguous(), trees.parents.contiguous(), trees.num_nodes,
            target_tokens.contiguous(), window, window.stride(0), window.shape[1], batch,
            out, num_accepted, bonus,
            W=width, WP=next_power_of_2(width), DEPTH=max_depth, DP=next_power_of_2(cols),
            num_warps=1,
        )  # fmt: skip
    return Acceptance(out[0], num_accepted, bonus, out[1], out[2])


def accept_roots(target_tokens: torch.Tensor, max_depth: int) -> Acceptance:
    """Acceptance of B root-only trees (a plain step): the target's [B, 1] token is the bonus,
    and no KV moves."""
    batch, device = target_tokens.shape[0], target_tokens.device
    path = torch.full((batch, max_depth + 1), -1, dtype=torch.long, device=device)  # [B, D+1]
    path[:, 0] = 0
    stays = torch.full_like(path, -1)  # [B, D+1]: no slot moves
    return Acceptance(
        path=path,
        num_accepted=torch.zeros(batch, dtype=torch.long, device=device),  # [B]
        bonus_tokens=target_tokens[:, 0].to(torch.long),  # [B]
        kv_source=stays,
        kv_target=stays.clone(),
    )


def accept(
    trees: TreeBatch, target_tokens: torch.Tensor, window: torch.Tensor, *, max_depth: int,
    kernels: bool = True,
) -> Acceptance:  # fmt: skip
    """Accepted paths and KV moves of every tree: Triton on CUDA, torch elsewhere."""
    if trees.max_nodes == 1:  # roots alone: a plain step
        return accept_roots(target_tokens, max_depth)
    if use_triton(trees.parents, target_tokens, window, kernels=kernels):
        return accept_triton(trees, target_tokens, window, max_depth=max_depth)
    return accept_reference(trees, target_tokens, window, max_depth=max_depth)


@triton.jit(do_not_specialize=["window_stride", "window_width", "batch"])
def _accept_kernel(
    tok_ptr, par_ptr, num_ptr, target_ptr, window_ptr, window_stride, window_width, batch,
    out_ptr, num_acc_ptr, bonus_ptr,
    W: tl.constexpr, WP: tl.constexpr, DEPTH: tl.constexpr, DP: tl.constexpr,
):  # fmt: skip
    """One request: walk the matching children from the root; write path, bonus, KV moves."""
    b = tl.program_id(0)
    j = tl.arange(0, WP)
    real = j < tl.load(num_ptr + b)
    parents = tl.load(par_ptr + b * W + j, mask=j < W, other=-2)
    tokens = tl.load(tok_ptr + b * W + j, mask=j < W, other=-1)
    targets = tl.load(target_ptr + b * W + j, mask=j < W, other=-1)
    k = tl.arange(0, DP)
    path = tl.where(k == 0, 0, -1)
    node = tl.min(j, axis=0)  # the root, slot 0
    count = tl.min(j, axis=0)
    for d in tl.static_range(1, DEPTH + 1):
        want = tl.max(tl.where(j == node, targets, -1), axis=0)
        child = tl.min(tl.where(real & (parents == node) & (tokens == want), j, WP), axis=0)
        step = (child < WP) & (count == d - 1)  # still on the path and a child matches
        path = tl.where(step & (k == d), child, path)
        node = tl.where(step, child, node)
        count += step.to(tl.int32)
    tl.store(num_acc_ptr + b, count.to(tl.int64))
    tl.store(bonus_ptr + b, tl.max(tl.where(j == node, targets, -1), axis=0))
    cols = DEPTH + 1
    row = b * cols + k
    tl.store(out_ptr + row, path.to(tl.int64), mask=k < cols)
    moved = (k <= count) & (path != k) & (k < window_width)
    source = tl.load(window_ptr + b * window_stride + path, mask=moved, other=-1)
    target = tl.load(window_ptr + b * window_stride + k, mask=moved, other=-1)
    tl.store(out_ptr + batch * cols + row, source.to(tl.int64), mask=k < cols)
    tl.store(out_ptr + 2 * batch * cols + row, target.to(tl.int64), mask=k < cols)
