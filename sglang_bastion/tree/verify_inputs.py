"""Verify inputs: what one target verify pass over every tree needs, in SGLang's layout.

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

`verify_inputs` dispatches between `verify_inputs_reference` (torch) and
`verify_inputs_triton`, where one program per (request, slot) writes that slot's input id,
position, retrieve entries and its row of SGLang's flat custom mask (prefix columns all True,
then the slot's ancestors and itself in the W x W tree block). The slot's ancestors are found
by walking the parent row held in registers, so the only memory traffic is the [B, W] tree in
and the outputs. The mask's
length, W * sum(prefix) + B * W^2, is needed on the host to allocate it: pass the host copy of
the prefix lengths (SGLang has it as ``seq_lens_cpu``) to avoid a device read.

A backend that reads SGLang's other mask layout, the W x W tree blocks alone (``draft_only``:
``bastion_cpu`` tells the two apart by their size), is given that one: it is the ancestor
mask itself, without B * W * prefix entries that are all True.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sglang_bastion.kernels.dispatch import next_power_of_2, use_triton
from sglang_bastion.tree.batch import TreeBatch

_BLOCK_PREFIX = 1024
_BLOCK_BATCH = 128


@dataclass(frozen=True)
class VerifyInputs:
    """Inputs of one tree-verify forward pass for B requests of W slots each."""

    input_ids: torch.Tensor  # [B*W] long
    positions: torch.Tensor  # [B*W] long: prefix_len + depth
    # [sum_b W*(prefix_len_b + W)] bool, SGLang's flat layout; [B*W*W] when draft-only
    custom_mask: torch.Tensor
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


def verify_inputs_reference(
    trees: TreeBatch, prefix_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor | None = None,
    *, mask_tail: int = 0, draft_only: bool = False,
) -> VerifyInputs:  # fmt: skip
    """Verify-pass inputs for every tree at its width W = ``trees.max_nodes``, in torch.

    ``prefix_lens_cpu`` is unused: the mask's length is read from ``prefix_lens`` (one host
    read per step; none when ``draft_only``). ``mask_tail`` True entries follow the mask (see
    `verify_inputs`); a draft-only mask has none.
    """
    batch, width = trees.token_ids.shape
    if draft_only and mask_tail:
        raise ValueError(
            "a draft-only mask takes no tail: its reader tells the layouts apart by size"
        )
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

    tree_block = ancestor_mask(trees)  # [B, W, W]
    # Draft-only: the tree blocks alone, requests concatenated.
    mask = tree_block.flatten() if draft_only else _with_prefix(tree_block, prefix_lens, mask_tail)
    return VerifyInputs(
        input_ids=trees.token_ids.flatten(),
        positions=positions,
        custom_mask=mask,
        retrieve_index=retrieve_index.contiguous(),
        retrieve_next_token=retrieve_next_token,
        retrieve_next_sibling=retrieve_next_sibling,
    )


def _with_prefix(tree_block: torch.Tensor, prefix_lens: torch.Tensor, tail: int) -> torch.Tensor:
    """SGLang's flat mask of the [B, W, W] ancestor blocks after ``prefix_lens`` [B] prefixes,
    then ``tail`` True entries."""
    batch, width, _ = tree_block.shape
    # Rows of [prefix (all True) | tree block (ancestors)], requests concatenated. Its length
    # depends on the prefix lengths, so this reads them on the host (once per step).
    columns = torch.arange(int(prefix_lens.max()) + width, device=tree_block.device)  # [C]
    col = columns.view(1, 1, -1)
    in_prefix = col < prefix_lens.view(batch, 1, 1)
    tree_col = (col - prefix_lens.view(batch, 1, 1)).clamp(0, width - 1)  # [B, 1, C]
    dense = torch.where(
        in_prefix, True, tree_block.gather(2, tree_col.expand(batch, width, -1))
    )  # [B, W, C]
    valid = (col < (prefix_lens + width).view(batch, 1, 1)).expand_as(dense)
    return torch.cat([dense[valid], dense.new_ones(tail)])


def _first_true(flags: torch.Tensor) -> torch.Tensor:
    """Index of the first True along the last dimension, -1 where there is none."""
    first = flags.to(torch.uint8).argmax(dim=-1)
    return torch.where(flags.any(dim=-1), first, -1)


def verify_inputs_triton(
    trees: TreeBatch, prefix_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor | None = None,
    *, mask_tail: int = 0,
) -> VerifyInputs:  # fmt: skip
    """`verify_inputs_reference` in one launch; ``prefix_lens_cpu`` spares a device read."""
    batch, width = trees.token_ids.shape
    if prefix_lens.shape != (batch,):
        raise ValueError(f"prefix_lens must be ({batch},), got {tuple(prefix_lens.shape)}")
    device = trees.token_ids.device
    host = prefix_lens if prefix_lens_cpu is None else prefix_lens_cpu
    mask_len = width * int(host.sum()) + batch * width * width
    tokens = batch * width
    input_ids = torch.empty(tokens, dtype=torch.int64, device=device)
    positions = torch.empty(tokens, dtype=torch.int64, device=device)
    mask = torch.empty(mask_len + mask_tail, dtype=torch.uint8, device=device)  # as bool below
    mask[mask_len:].fill_(1)
    retrieve = torch.empty(3, batch, width, dtype=torch.int64, device=device)
    if tokens:
        _verify_inputs_kernel[(batch, width)](
            trees.token_ids.contiguous(), trees.parents.contiguous(),
            trees.depths.contiguous(), prefix_lens.to(device).contiguous(), batch,
            input_ids, positions, mask, retrieve,
            W=width, WP=next_power_of_2(width), BLOCK=_BLOCK_PREFIX, BLOCK_B=_BLOCK_BATCH,
        )  # fmt: skip
    return VerifyInputs(
        input_ids=input_ids,
        positions=positions,
        custom_mask=mask.view(torch.bool),
        retrieve_index=retrieve[0],
        retrieve_next_token=retrieve[1],
        retrieve_next_sibling=retrieve[2],
    )


def verify_inputs_roots(
    roots: torch.Tensor, prefix_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor,
    *, mask_tail: int = 0,
) -> VerifyInputs:  # fmt: skip
    """Verify-pass inputs of B root-only trees (a plain step), built directly, no device read.

    ``prefix_lens_cpu``: the host copy of ``prefix_lens``, which sizes the mask. Each root
    sees its whole prefix and itself, so the flat mask is all True.
    """
    batch, device = roots.shape[0], roots.device
    mask_len = int(prefix_lens_cpu.sum()) + batch + mask_tail  # B rows of prefix + 1 columns
    no_link = torch.full((batch, 1), -1, dtype=torch.long, device=device)  # [B, 1]
    return VerifyInputs(
        input_ids=roots.to(torch.long),  # [B]
        positions=prefix_lens.to(device=device, dtype=torch.long),  # [B]
        custom_mask=torch.ones(mask_len, dtype=torch.bool, device=device),
        retrieve_index=torch.arange(batch, device=device).view(batch, 1),  # [B, 1]
        retrieve_next_token=no_link,
        retrieve_next_sibling=no_link.clone(),
    )


def verify_inputs(
    trees: TreeBatch, prefix_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor | None = None,
    *, kernels: bool = True, mask_tail: int = 0, draft_only: bool = False,
) -> VerifyInputs:  # fmt: skip
    """Verify-pass inputs of every tree: Triton on CUDA, the torch reference elsewhere.

    ``mask_tail`` True entries are allocated after the mask, which attention never reads:
    SGLang's FlashInfer and Triton verify expect W * seq_lens_sum + B * W^2 entries, where
    seq_lens_sum counts the W verify tokens too, and concatenate a padding every step
    otherwise (``DFlashVerifyInput.generate_attn_arg_prefill``). ``draft_only``: the mask is
    the [B, W, W] tree blocks alone, for a backend that reads that layout (``bastion_cpu``).
    """
    if draft_only:
        return verify_inputs_reference(trees, prefix_lens, mask_tail=mask_tail, draft_only=True)
    if trees.max_nodes == 1 and prefix_lens_cpu is not None:  # roots alone: a plain step
        return verify_inputs_roots(trees.token_ids[:, 0], prefix_lens, prefix_lens_cpu,
                                   mask_tail=mask_tail)  # fmt: skip
    if use_triton(trees.parents, kernels=kernels):
        return verify_inputs_triton(trees, prefix_lens, prefix_lens_cpu, mask_tail=mask_tail)
    return verify_inputs_reference(trees, prefix_lens, mask_tail=mask_tail)


@triton.jit(do_not_specialize=["batch"])  # the batch size changes every step
def _verify_inputs_kernel(
    tok_ptr, par_ptr, dep_ptr, prefix_ptr, batch,
    ids_ptr, pos_ptr, mask_ptr, retrieve_ptr,
    W: tl.constexpr, WP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    """One (request, slot): its token, position, links and mask row."""
    b = tl.program_id(0)
    i = tl.program_id(1)
    flat = b * W + i
    j = tl.arange(0, WP)
    parents = tl.load(par_ptr + b * W + j, mask=j < W, other=-2)  # [WP]; -2 past W
    mine = tl.load(par_ptr + flat)
    prefix = tl.load(prefix_ptr + b).to(tl.int64)
    tl.store(ids_ptr + flat, tl.load(tok_ptr + flat))
    tl.store(pos_ptr + flat, prefix + tl.load(dep_ptr + flat))
    # Links: the first child; the next slot with the same (real) parent.
    child = tl.min(tl.where(parents == i, j, WP), axis=0)
    sibling = tl.min(tl.where((parents == mine) & (j > i) & (mine >= 0), j, WP), axis=0)
    tl.store(retrieve_ptr + flat, flat.to(tl.int64))
    tl.store(retrieve_ptr + batch * W + flat, tl.where(child < WP, child, -1).to(tl.int64))
    tl.store(retrieve_ptr + 2 * batch * W + flat, tl.where(sibling < WP, sibling, -1).to(tl.int64))
    # Ancestors and self: walk up the parent row held in registers.
    seen = j == i
    up = mine
    while up >= 0:
        seen = seen | (j == up)
        up = tl.max(tl.where(j == up, parents, -2), axis=0)
    # Row start: rows of earlier requests, W * (prefix + W) each, then i rows of this one.
    r = tl.arange(0, BLOCK_B)
    earlier = tl.sum(tl.zeros([BLOCK_B], dtype=tl.int64), axis=0)
    for off in range(0, b, BLOCK_B):
        earlier += tl.sum(tl.load(prefix_ptr + off + r, mask=off + r < b, other=0).to(tl.int64), 0)
    start = W * earlier + b * W * W + i * (prefix + W)
    cols = tl.arange(0, BLOCK)
    ones = tl.full([BLOCK], 1, tl.uint8)
    for off in range(0, prefix, BLOCK):
        tl.store(mask_ptr + start + off + cols, ones, mask=off + cols < prefix)
    tl.store(mask_ptr + start + prefix + j, seen.to(tl.uint8), mask=j < W)
