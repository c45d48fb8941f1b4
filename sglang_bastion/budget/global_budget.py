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
every split of every total allowed (`tests/test_global_budget.py` checks it by brute force). A
request whose gains are all below what the batch's last chosen token earns gets its root
alone: no speculation for it this step; T = B is the whole batch decoding plainly.

It pays only where the verify pass is ragged (each request's rows packed, no padding): a
padded pass costs C(B * max size), so there every request's tree is free up to the widest,
and the batch-global optimum is `uniform_width`'s one width for all.

T comes from a fixed ladder of totals (`packed_totals`: every T up to 16, then steps of at
most 1/8), or is B (every request its root). Every pass shape a server meets costs once: on a
CPU whose matmuls are JIT-compiled per shape (oneDNN's bfloat16 kernels on AMX and
AVX512-BF16 hosts), a linear layer's first pass at a row count costs several times the next
(`benchmarks/results/cpu_gemm_first_pass.md`), and a free T would meet hundreds of row counts
per batch size. The ladder's few dozen stay compiled, and the best allowed T is at most 1/8
off the free optimum.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.functional import pad

SMALL_TOTALS = 16  # every total up to this is allowed; above, eight steps per doubling


@functools.lru_cache(maxsize=64)
def packed_totals(limit: int) -> frozenset[int]:
    """Token counts a packed verify pass may have, up to ``limit``: 1..16, then m * 2^k for
    m in 8..15 (18, 20, ..., 30, 32, 36, ...)."""
    totals = set(range(1, min(limit, SMALL_TOTALS) + 1))
    step = 2
    while 8 * step <= limit:
        totals.update(range(8 * step, min(16 * step, limit + 1), step))
        step *= 2
    return frozenset(totals)


def allowed_totals(batch: int, max_nodes: int) -> torch.Tensor:
    """[B*N] bool: whether a packed pass over T = 1..B*N tokens in all may run (T = B, every
    request its root, or T on `packed_totals`' ladder)."""
    ladder = packed_totals(batch * max_nodes)
    allowed = torch.tensor([t in ladder for t in range(1, batch * max_nodes + 1)])  # [B*N]
    allowed[batch - 1] = True
    return allowed


def global_sizes(
    accepted: torch.Tensor, num_nodes: torch.Tensor, cost_ms: torch.Tensor,
    allowed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """([B] long sizes, 0-dim goodput): the split of the batch's verify tokens with the best
    G(T) / C(T).

    ``accepted`` [B, N]: each request's priced acceptance A_r(n) for n = 1..N (non-decreasing,
    concave); ``num_nodes`` [B]: real nodes per tree (slots past it are never chosen);
    ``cost_ms`` [B*N]: the cycle of a pass over T = 1..B*N tokens in all; ``allowed`` [B*N]
    bool: the totals T the pass may have (`allowed_totals`; default every T).
    """
    batch, nodes = accepted.shape
    if cost_ms.dim() != 1 or cost_ms.numel() != batch * nodes:
        raise ValueError(
            f"cost_ms must hold C(T) for T = 1..B*N = {batch * nodes} tokens in all, "
            f"got {tuple(cost_ms.shape)}"
        )
    device = accepted.device
    if nodes == 1:
        roots = accepted[:, 0].sum()
        return torch.ones(batch, dtype=torch.long, device=device), roots / cost_ms[batch - 1]
    if batch == 1:  # one request: G is its own A, no expansion to order
        past = torch.arange(nodes, device=device) >= num_nodes  # [N]
        if allowed is not None:
            past = past | ~allowed
        goodput = (accepted[0] / cost_ms.to(accepted)).masked_fill(past, float("-inf"))  # [N]
        size = goodput.argmax()  # the fewest tokens among equals
        return (1 + size).view(1), goodput[size]
    roots = accepted[:, 0].sum()  # every request verifies its root
    past = _counted(1, nodes, device) >= num_nodes.unsqueeze(1)  # [B, N-1]: padding slots
    gains = accepted.diff(dim=1).masked_fill_(past, float("-inf"))  # [B, N-1]
    order = gains.view(-1).sort(descending=True)  # [B*(N-1)]: best first, across requests
    best = order.values
    emitted = pad(best.clamp(min=0).cumsum(0), (1, 0)) + roots  # [B*(N-1)+1]: T = B .. B*N
    goodput = emitted / cost_ms[batch - 1 :].to(emitted)
    blocked = pad(best == float("-inf"), (1, 0))  # T past the real nodes
    if allowed is not None:
        blocked |= ~allowed[batch - 1 :]
    goodput.masked_fill_(blocked, float("-inf"))
    extra = goodput.argmax()  # T - B; the fewest tokens among equals
    # each candidate's place in the batch's order; a request's gains fall, so its chosen lead
    rank = torch.empty_like(order.indices).scatter_(
        0, order.indices, _counted(0, best.numel(), device)
    )  # fmt: skip
    sizes = (rank.view(batch, nodes - 1) < extra).sum(dim=1).add_(1)  # [B]
    return sizes, goodput[extra]


@functools.lru_cache(maxsize=64)
def _counted(start: int, stop: int, device: torch.device) -> torch.Tensor:
    """[stop - start] long start..stop-1 on ``device``, made once (read, never written)."""
    return torch.arange(start, stop, device=device)


def total_tokens(batch: int, max_nodes: int) -> torch.Tensor:
    """[B*N] float64 tokens per request, T / B, of a pass over T = 1..B*N tokens in all."""
    return torch.arange(1, batch * max_nodes + 1, dtype=torch.float64) / batch  # [B*N]
