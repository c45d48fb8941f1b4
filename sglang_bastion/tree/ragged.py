"""Ragged verify: each request's tree packed unpadded, for backends that take per-request lengths.

`verify_inputs` lays every request out over W slots. When the controller gives request b only
n_b <= W nodes (the batch-global budget), `pack_ragged` keeps its first n_b slots (best-first
order: a kept node's ancestors are kept too): n_b input ids and positions, and n_b mask rows of
(prefix_b + n_b) columns (n_b where the mask is draft-only), SGLang's flat layout with
per-request lengths (its ``RaggedVerifyLayout``). ``rows`` maps each packed token back to
its padded row b * W + slot, so `unpack_rows` rebuilds the [B * W, ...] logits and features
every later op reads; the rows it leaves out are zero and belong to slots outside the trees,
which are never accepted.
Where the target's tokens are the logits' argmax and nothing else reads the logits,
`packed_argmax` takes it on the T packed rows and scatters the tokens alone: the
vocabulary-wide work then scales with T, not with B * W (the widest tree's W for every request).

The gather indices are built from host lengths (the prefix lengths' host copy and the sizes the
controller read), so packing reads nothing back from the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sglang_bastion.tree.verify_inputs import VerifyInputs


@dataclass(frozen=True)
class RaggedVerify:
    """One verify pass over sum(n_b) = T tokens, request b's n_b after its prefix."""

    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    custom_mask: torch.Tensor  # [sum_b n_b * (prefix_b + n_b)] bool; [sum_b n_b^2] draft-only
    rows: torch.Tensor  # [T] long: the padded row b * W + slot of each packed token
    lens: torch.Tensor  # [B] int32 on the device: n_b
    lens_cpu: tuple[int, ...]  # n_b on the host

    @property
    def num_tokens(self) -> int:
        """T: the tokens the pass verifies."""
        return int(self.rows.numel())


def pack_ragged(
    verify: VerifyInputs, sizes: Sequence[int], prefix_cpu: torch.Tensor, width: int,
    draft_only: bool = False,
) -> RaggedVerify:  # fmt: skip
    """The first ``sizes[b]`` slots of every request of a W-wide ``verify``, packed
    (``draft_only``: its mask holds the tree blocks alone, and so does the packed one)."""
    device = verify.input_ids.device
    prefix = prefix_cpu.to(torch.int64)  # [B]: the prefix columns of a mask row
    if draft_only:
        prefix = torch.zeros_like(prefix)
    lens = torch.tensor(sizes, dtype=torch.int64)  # [B]
    batch = prefix.numel()
    if lens.numel() != batch or int(lens.min()) < 1 or int(lens.max()) > width:
        raise ValueError(f"sizes must give each of {batch} requests 1..{width} nodes, got {sizes}")
    owner = torch.repeat_interleave(torch.arange(batch), lens)  # [T]: request of each token
    first = torch.cumsum(lens, 0) - lens  # [B]: its first packed token
    slot = torch.arange(owner.numel()) - first[owner]  # [T]
    padded_len = prefix + width  # [B]: a padded mask row
    padded_start = torch.cumsum(width * padded_len, 0) - width * padded_len  # [B]
    row_len = (prefix + lens)[owner]  # [T]: a packed mask row
    source_row = padded_start[owner] + slot * padded_len[owner]  # [T]
    total = int(row_len.sum())
    element_row = torch.repeat_interleave(torch.arange(owner.numel()), row_len)  # [M]
    row_first = torch.cumsum(row_len, 0) - row_len  # [T]
    column = torch.arange(total) - row_first[element_row]  # [M]
    source = (source_row[element_row] + column).to(device)  # [M]
    rows = (owner * width + slot).to(device)  # [T]
    return RaggedVerify(
        input_ids=verify.input_ids.index_select(0, rows),
        positions=verify.positions.index_select(0, rows),
        custom_mask=verify.custom_mask.index_select(0, source),
        rows=rows,
        lens=lens.to(device=device, dtype=torch.int32),
        lens_cpu=tuple(int(n) for n in sizes),
    )


def unpack_rows(packed: torch.Tensor, rows: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """[padded_rows, ...] ``packed`` [T, ...] scattered to its padded rows, zeros elsewhere."""
    out = packed.new_zeros((padded_rows, *packed.shape[1:]))
    return out.index_copy_(0, rows, packed)


def packed_argmax(packed: torch.Tensor, rows: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """[padded_rows] long: the argmax of every row of `unpack_rows` (``packed`` [T, V])."""
    return unpack_rows(packed.argmax(dim=-1), rows, padded_rows)  # a zero row's argmax: 0
