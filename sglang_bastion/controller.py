"""Budget controller: how many tree nodes each request verifies this step.

All policies read the trees' surrogate A_hat (cumulative rho in best-first order, so concave
and non-decreasing in the tree size) and a verify-cycle cost vector from the latency model.
They are vectorised over the batch, never synchronise with the host and return tensors.

- `per_request_sizes`: the paper's rule. S_hat(n) = A_hat(n) * L_AR / C(n), stop at the first
  n with S_hat(n+1) < S_hat(n); optimal when A_hat is concave and C convex (Proposition 3.4).
- `uniform_width`: one width W for the whole batch (what CUDA graphs and SGLang's verify path
  take), maximising the batch goodput sum_r A_hat_r(W) / C(W) over the allowed widths.
- `ragged_sizes`: per-request sizes sharing one verify pass. Assumption: the pass's cost
  depends on the allocation only through its total token count T (the roofline charges
  attention with the batch's contexts, which do not change with the allocation). Then, for
  any T, the best allocation takes the T - B largest rho increments over all requests
  (each request's increments are non-increasing), so batch goodput F(T) / C(T) has F concave;
  with C convex and positive the first drop is the global optimum.
- `fixed_sizes`: a fixed budget N, for ablations.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sglang_bastion.tree.batch import TreeBatch


def per_request_sizes(trees: TreeBatch, cost_ms: torch.Tensor, ar_ms: float = 1.0) -> torch.Tensor:
    """[B] tree sizes by the first-drop rule on S_hat(n) = A_hat(n) * L_AR / C(n)."""
    nodes = trees.max_nodes
    _check_costs(cost_ms, nodes, "cost_ms", "C(n) for n = 1..N tokens per request")
    speedup = trees.surrogate() * ar_ms / cost_ms.to(trees.log_scores).unsqueeze(0)  # [B, N]
    return _first_drop(speedup).clamp(max=trees.num_nodes)


def uniform_width(
    trees: TreeBatch, cost_ms: torch.Tensor, widths: Sequence[int] | None = None
) -> torch.Tensor:
    """0-dim width W (from ``widths``, default 1..N) maximising sum_r A_hat_r(W) / C(W)."""
    nodes = trees.max_nodes
    _check_costs(cost_ms, nodes, "cost_ms", "C(W) for W = 1..N tokens per request")
    device = trees.log_scores.device
    allowed = torch.arange(1, nodes + 1) if widths is None else torch.tensor(sorted(set(widths)))
    if allowed.numel() == 0 or allowed[0] < 1 or allowed[-1] > nodes:
        raise ValueError(f"widths must be non-empty and within [1, {nodes}], got {widths}")
    allowed = allowed.to(device)
    goodput = trees.surrogate()[:, allowed - 1].sum(dim=0) / cost_ms.to(device)[allowed - 1]
    return allowed[goodput.argmax()]  # the smallest width among equals


def ragged_sizes(trees: TreeBatch, total_cost_ms: torch.Tensor) -> torch.Tensor:
    """[B] per-request sizes maximising sum_r A_hat_r(n_r) / C(sum_r n_r) (see module doc)."""
    batch, nodes = trees.token_ids.shape
    _check_costs(total_cost_ms, batch * nodes, "total_cost_ms", "C(T) for T = 1..B*N tokens")
    device = trees.log_scores.device
    gains = torch.exp(trees.log_scores[:, 1:]).flatten()  # [B*(N-1)]: rho of non-root slots
    order = torch.sort(gains, descending=True, stable=True).indices  # global best-first merge
    surrogate = batch + torch.cumsum(gains[order], dim=0)  # [B*(N-1)]: F(B + k), k = 1..
    surrogate = torch.cat([surrogate.new_full((1,), batch), surrogate])  # [B*(N-1)+1]
    total = torch.arange(batch, batch * nodes + 1, device=device)  # tokens T = B + k
    goodput = surrogate / total_cost_ms.to(surrogate)[total - 1]
    extra = _first_drop(goodput.unsqueeze(0)).squeeze(0) - 1  # 0-dim: nodes beyond the roots
    owner = order.div(nodes - 1, rounding_mode="floor") if nodes > 1 else order
    taken = (torch.arange(order.numel(), device=device) < extra).to(torch.long)
    sizes = torch.ones(batch, dtype=torch.long, device=device).scatter_add_(0, owner, taken)
    return sizes.clamp(max=trees.num_nodes)


def fixed_sizes(trees: TreeBatch, budget: int) -> torch.Tensor:
    """[B] sizes for a fixed budget of ``budget`` nodes (root included) per request."""
    if budget < 1:
        raise ValueError(f"budget must be at least 1 (the root), got {budget}")
    return trees.num_nodes.clamp(max=budget)


def _first_drop(values: torch.Tensor) -> torch.Tensor:
    """[R] the 1-based index n of the first n with values[n+1] < values[n], else the length."""
    drops = values[:, 1:] < values[:, :-1]  # [R, L-1]
    drops = torch.cat([drops, drops.new_ones(drops.shape[0], 1)], dim=1)  # sentinel at the end
    return drops.to(torch.uint8).argmax(dim=1) + 1


def _check_costs(cost: torch.Tensor, length: int, name: str, meaning: str) -> None:
    """Raise ValueError unless ``cost`` is a 1-D vector of ``length`` entries."""
    if cost.dim() != 1 or cost.numel() != length:
        raise ValueError(f"{name} must hold {meaning} ({length} values), got {tuple(cost.shape)}")
