"""Acceptance walk and KV bookkeeping in one launch: `accept_path` plus the slot moves.

Besides `accept_path`'s (path, num_accepted, bonus), the worker moves the accepted nodes' KV
to the front of each request's window: the k-th emitted position (k < num_accepted + 1) reads
slot ``window[b, path[b, k]]`` and lands in ``window[b, k]``, unless the two coincide. Both are
returned as fixed-shape [B, D + 1] tables, -1 where nothing moves, so the kernel needs no host
read; the caller compacts them (``source[target >= 0]``) where it hands them to the KV pool.

Kernel: one program per request walks down from the root, at each depth taking the child
whose token is the target's token at the current node (siblings carry distinct tokens, so at
most one), with the tree row, target row and window row loaded once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sglang_bastion.kernels.dispatch import next_power_of_2, use_triton
from sglang_bastion.tree.acceptance import accept_path
from sglang_bastion.tree.batch import TreeBatch


@dataclass(frozen=True)
class Acceptance:
    """One step's accepted paths and the KV moves that keep them."""

    path: torch.Tensor  # [B, D+1] long: accepted slots from the root, -1 padded
    num_accepted: torch.Tensor  # [B] long: accepted nodes beyond the root
    bonus_tokens: torch.Tensor  # [B] long: the target's token after the path
    kv_source: torch.Tensor  # [B, D+1] long: KV slot to copy from, -1 where nothing moves
    kv_target: torch.Tensor  # [B, D+1] long: KV slot to copy to, -1 where nothing moves


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


def accept(
    trees: TreeBatch, target_tokens: torch.Tensor, window: torch.Tensor, *, max_depth: int
) -> Acceptance:
    """Accepted paths and KV moves of every tree: Triton on CUDA, torch elsewhere."""
    if use_triton(trees.parents, target_tokens, window):
        return accept_triton(trees, target_tokens, window, max_depth=max_depth)
    return accept_reference(trees, target_tokens, window, max_depth=max_depth)


@triton.jit
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
