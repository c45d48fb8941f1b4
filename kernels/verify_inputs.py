"""Verify-pass inputs for a batch of trees in one launch: the same outputs as `linearize`.

One program per (request, slot) writes that slot's input id, position, retrieve entries and
its row of SGLang's flat custom mask (prefix columns all True, then the slot's ancestors and
itself in the W x W tree block). The slot's ancestors are found by walking the parent row held
in registers, so the only memory traffic is the [B, W] tree in and the outputs. The mask's
length, W * sum(prefix) + B * W^2, is needed on the host to allocate it: pass the host copy of
the prefix lengths (SGLang has it as ``seq_lens_cpu``) to avoid a device read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_bastion.kernels.dispatch import next_power_of_2, use_triton
from sglang_bastion.tree.batch import TreeBatch
from sglang_bastion.tree.linearize import VerifyInputs, linearize

_BLOCK_PREFIX = 1024


def verify_inputs_reference(
    trees: TreeBatch, prefix_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor | None = None
) -> VerifyInputs:
    """`linearize` (the torch reference; ``prefix_lens_cpu`` is unused)."""
    del prefix_lens_cpu
    return linearize(trees, prefix_lens)


def verify_inputs_triton(
    trees: TreeBatch, prefix_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor | None = None
) -> VerifyInputs:
    """`linearize` in one launch; ``prefix_lens_cpu`` (host copy) spares a device read."""
    batch, width = trees.token_ids.shape
    if prefix_lens.shape != (batch,):
        raise ValueError(f"prefix_lens must be ({batch},), got {tuple(prefix_lens.shape)}")
    device = trees.token_ids.device
    host = prefix_lens if prefix_lens_cpu is None else prefix_lens_cpu
    mask_len = width * int(host.sum()) + batch * width * width
    tokens = batch * width
    input_ids = torch.empty(tokens, dtype=torch.int64, device=device)
    positions = torch.empty(tokens, dtype=torch.int64, device=device)
    mask = torch.empty(mask_len, dtype=torch.uint8, device=device)  # viewed as bool below
    retrieve = torch.empty(3, batch, width, dtype=torch.int64, device=device)
    if tokens:
        _verify_inputs_kernel[(batch, width)](
            trees.token_ids.contiguous(), trees.parents.contiguous(),
            trees.depths.contiguous(), prefix_lens.to(device).contiguous(), batch,
            input_ids, positions, mask, retrieve,
            W=width, WP=next_power_of_2(width), BP=next_power_of_2(batch),
            BLOCK=_BLOCK_PREFIX,
        )  # fmt: skip
    return VerifyInputs(
        input_ids=input_ids,
        positions=positions,
        custom_mask=mask.view(torch.bool),
        retrieve_index=retrieve[0],
        retrieve_next_token=retrieve[1],
        retrieve_next_sibling=retrieve[2],
    )


def verify_inputs(
    trees: TreeBatch, prefix_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor | None = None
) -> VerifyInputs:
    """Verify-pass inputs of every tree: Triton on CUDA, `linearize` elsewhere."""
    if use_triton(trees.parents):
        return verify_inputs_triton(trees, prefix_lens, prefix_lens_cpu)
    return verify_inputs_reference(trees, prefix_lens, prefix_lens_cpu)


@triton.jit
def _verify_inputs_kernel(
    tok_ptr, par_ptr, dep_ptr, prefix_ptr, batch,
    ids_ptr, pos_ptr, mask_ptr, retrieve_ptr,
    W: tl.constexpr, WP: tl.constexpr, BP: tl.constexpr, BLOCK: tl.constexpr,
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
    r = tl.arange(0, BP)
    earlier = tl.sum(tl.load(prefix_ptr + r, mask=r < b, other=0).to(tl.int64), axis=0)
    start = W * earlier + b * W * W + i * (prefix + W)
    cols = tl.arange(0, BLOCK)
    ones = tl.full([BLOCK], 1, tl.uint8)
    for off in range(0, prefix, BLOCK):
        tl.store(mask_ptr + start + off + cols, ones, mask=off + cols < prefix)
    tl.store(mask_ptr + start + prefix + j, seen.to(tl.uint8), mask=j < W)
