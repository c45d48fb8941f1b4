"""Batch-global budget: one best-first expansion across every request's tree.

Every non-root node of every request's tree is a candidate with a gain, its request's
marginal priced acceptance A(n) - A(n-1) (A = A_hat, or A_cal when learning). The step verifies
T tokens in all, B roots plus the T - B best candidates of the whole batch, and the controller
picks the T that maximises the batch's goodput

    G(T) / C(T),   G(T) = sum_r A_r(1) + (sum of the T - B largest gains),

with C(T) the predicted cycle of a verify pass over T tokens in all. For a fixed T the top
T - B gains are the largest total acceptance any split of T tokens over the requests reaches
when each request's gains are non-increasing (A concave, as best-first order makes it): that
is exchange-argument optimal, and every T is tried, so the chosen sizes maximise G / C over
every split of every total (`tests/test_global_budget.py` checks it by brute force). A
request whose gains are all below what the batch's last chosen token earns gets its root
alone: no speculation for it this step; T = B is the whole batch decoding plainly.

It pays only where the verify pass is ragged (each request's rows packed, no padding): a
padded pass costs C(B * max size), so there every request's tree is free up to the widest,
and the batch-global optimum is `uniform_width`'s one width for all.
"""

from __future__ import annotations

import torch


def global_sizes(
    accepted: torch.Tensor, num_nodes: torch.Tensor, cost_ms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """([B] long sizes, 0-dim goodput): the split of the batch's verify tokens with the best
    G(T) / C(T).

    ``accepted`` [B, N]: each request's priced acceptance A_r(n) for n = 1..N (non-decreasing,
    concave); ``num_nodes`` [B]: real nodes per tree (slots past it are never chosen);
    ``cost_ms`` [B*N]: the cycle of a pass over T = 1..B*N tokens in all.
    """
    batch, nodes = accepted.shape
    if cost_ms.dim() != 1 or cost_ms.numel() != batch * nodes:
        raise ValueError(
            f"cost_ms must hold C(T) for T = 1..B*N = {batch * nodes} tokens in all, "
            f"got {tuple(cost_ms.shape)}"
        )
    device = accepted.device
    roots = accepted[:, 0].sum()  # every request verifies its root
    if nodes == 1:
        return torch.ones(batch, dtype=torch.long, device=device), roots / cost_ms[batch - 1]
    slots = torch.arange(1, nodes, device=device)  # [N-1]: candidate slots after the root
    real = slots.unsqueeze(0) < num_nodes.unsqueeze(1)  # [B, N-1]
    gains = (accepted[:, 1:] - accepted[:, :-1]).masked_fill(~real, float("-inf"))  # [B, N-1]
    order = gains.reshape(-1).sort(descending=True)  # [B*(N-1)]: best first, across requests
    best = order.values
    emitted = roots + torch.cat([best.new_zeros(1), best.clamp(min=0).cumsum(0)])  # [B*(N-1)+1]
    goodput = emitted / cost_ms[batch - 1 :].to(emitted)  # T = B .. B*N
    past_real = torch.cat([best.new_zeros(1, dtype=torch.bool), best == float("-inf")])
    goodput = goodput.masked_fill(past_real, float("-inf"))
    extra = goodput.argmax()  # T - B; the fewest tokens among equals
    rank = torch.empty_like(order.indices)
    rank[order.indices] = torch.arange(best.numel(), device=device)
    chosen = rank.view(batch, nodes - 1) < extra  # [B, N-1]
    sizes = 1 + chosen.sum(dim=1)  # each request's gains fall, so its chosen slots lead
    return sizes, goodput[extra]


def total_tokens(batch: int, max_nodes: int) -> torch.Tensor:
    """[B*N] float64 tokens per request, T / B, of a pass over T = 1..B*N tokens in all."""
    return torch.arange(1, batch * max_nodes + 1, dtype=torch.float64) / batch  # [B*N]
