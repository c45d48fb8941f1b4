"""A root-only verify (a plain step): its inputs and its acceptance, built directly.

When every request verifies its bonus token alone, the verify pass is a decode step in
SGLang's tree-verify layout. `verify_inputs` and `accept` give the same results for one-node
trees, through the general tree ops; these build them in a few tensor ops, with no device
read, for the step that must cost no more than SGLang's own decode step.
"""

from __future__ import annotations

import torch

from sglang_bastion.tree.acceptance import Acceptance
from sglang_bastion.tree.verify_inputs import VerifyInputs


def root_verify_inputs(
    roots: torch.Tensor, prefix_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor,
    *, mask_tail: int = 0,
) -> VerifyInputs:  # fmt: skip
    """Verify-pass inputs of B root-only trees: `verify_inputs` of `TreeBatch.roots(roots)`.

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


def root_acceptance(target_tokens: torch.Tensor, max_depth: int) -> Acceptance:
    """Acceptance of B root-only trees: `accept` of `TreeBatch.roots`; the target's [B, 1]
    token is the bonus, and no KV moves."""
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
