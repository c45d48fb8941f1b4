"""Online calibration of the drafter's surrogate A_hat against what the target accepts.

A_hat(n) - 1 is the number of drafts the drafter expects accepted from its first n nodes:
its own confidence. A drafter trained on greedy continuations is overconfident for a sampled
target, and any drafter can be for some workload, so the controller never prices with A_hat
alone. Per request it keeps two decayed sums on the device, indexed by SGLang's request slot
(``req_pool_indices``):

- ``predicted``: A_hat(n_t) - 1 over the request's drafted steps (n_t nodes verified);
- ``realised``: the drafts the target accepted in the same steps.

Their ratio c, clipped to [0, MAX_SCALE], scales the surrogate: A_cal(n) =
min(1 + c (A_hat(n) - 1), deepest + 1), where deepest is the tree's depth (no step accepts
more). A_cal stays concave and non-decreasing in n, so the first-drop rule and the
uniform-width goodput stay optimal for it, and c = 0 prices every tree as its root alone: no
speculation. c above 1 is common under greedy verification: a drafter's probabilities follow
the target's distribution, and the target's argmax agrees with a draft more often than that.

A step whose request verified its root alone still observes: the target's token at the root
is compared with the tree's depth-1 children (what would have been accepted had they been
verified), against their predicted mass. So a request that stopped speculating keeps
measuring, and speculates again when its drafts would be accepted again.

A new request starts from its sampling kind's pool (greedy or sampled): the decayed sums of
every request of that kind, so the first step of a sampled request is already priced with
what sampled requests were accepted before it. Nothing here reads a value to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_bastion.tree.batch import TreeBatch

GREEDY, SAMPLED = 0, 1  # a request's kind: its pool
GREEDY_TOP_K = 1  # SGLang stores a greedy request (temperature 0) as top-k 1, temperature 1
MAX_SCALE = 4.0  # the most the calibration inflates the drafter's expected accepted drafts


@dataclass(frozen=True)
class AcceptanceScale:
    """Decayed predicted and realised accepted drafts, per request slot and per kind."""

    predicted: torch.Tensor  # [P] float32: per request slot
    realised: torch.Tensor  # [P] float32
    pool_predicted: torch.Tensor  # [2] float32: per kind (GREEDY, SAMPLED)
    pool_realised: torch.Tensor  # [2] float32
    # weight of a request's past per new step (about 10 steps of memory): a greedy step accepts
    # anything from none to the tree's depth, and a shorter memory shrinks a request's trees,
    # or stops them, on one or two poor steps
    decay: float = 0.9
    pool_decay: float = 0.9  # the pools see a whole batch per step
    prior: float = 2.0  # predicted drafts a new request's estimate starts with


def new_acceptance_scale(
    slots: int,
    device: torch.device | str,
    decay: float = AcceptanceScale.decay,
    prior: float = AcceptanceScale.prior,
) -> AcceptanceScale:
    """A fresh calibration for ``slots`` request slots: it trusts A_hat until it observes."""
    if not 0 < decay < 1:
        raise ValueError(f"decay must be in (0, 1), got {decay}")
    if prior <= 0:
        raise ValueError(f"prior must be positive, got {prior}")
    ones = torch.ones(slots, dtype=torch.float32, device=device)  # [P]
    return AcceptanceScale(
        predicted=ones * prior, realised=ones * prior,
        pool_predicted=torch.ones(2, dtype=torch.float32, device=device),  # [2]
        pool_realised=torch.ones(2, dtype=torch.float32, device=device),
        decay=decay, prior=prior,
    )  # fmt: skip


def request_kinds(sampling_info: object, batch_size: int, device: torch.device) -> torch.Tensor:
    """[B] long: GREEDY or SAMPLED for every request of a batch (SGLang's sampling info)."""
    if sampling_info is None or getattr(sampling_info, "is_all_greedy", True):
        return torch.full((batch_size,), GREEDY, dtype=torch.long, device=device)
    greedy = sampling_info.top_ks.view(-1) == GREEDY_TOP_K
    return torch.where(greedy, GREEDY, SAMPLED)


def host_request_kinds(reqs: list) -> frozenset[int]:
    """The kinds (GREEDY, SAMPLED) among SGLang requests, from their host sampling parameters."""
    return frozenset(
        GREEDY if req.sampling_params.top_k == GREEDY_TOP_K else SAMPLED for req in reqs
    )


def start_requests(state: AcceptanceScale, slots: torch.Tensor, kinds: torch.Tensor) -> None:
    """Reset the requests now in ``slots`` [B] to their kinds' [B] pooled ratio."""
    ratio = state.pool_realised / state.pool_predicted.clamp(min=1e-6)  # [2]
    state.predicted.index_fill_(0, slots, state.prior)
    state.realised.index_copy_(0, slots, (ratio.clamp(max=MAX_SCALE) * state.prior)[kinds])


def scales(state: AcceptanceScale, slots: torch.Tensor) -> torch.Tensor:
    """[B] c in [0, MAX_SCALE]: realised over predicted accepted drafts of ``slots``' requests."""
    predicted = state.predicted.index_select(0, slots)
    realised = state.realised.index_select(0, slots)
    return (realised / predicted.clamp(min=1e-6)).clamp(0.0, MAX_SCALE)


def calibrated_surrogate(trees: TreeBatch, scale: torch.Tensor) -> torch.Tensor:
    """[B, N] A_cal(n) = min(1 + c (A_hat(n) - 1), deepest + 1) for scales c [B]."""
    accepted = trees.surrogate()  # [B, N]
    deepest = trees.depths.max(dim=1, keepdim=True).values + 1  # [B, 1]: the most a step accepts
    scaled = 1.0 + scale.to(accepted.dtype).unsqueeze(1) * (accepted - 1.0)
    return torch.minimum(scaled, deepest.to(accepted.dtype))


def step_evidence(
    trees: TreeBatch, sizes: torch.Tensor, accept_lens: torch.Tensor, root_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B] predicted and [B] realised accepted drafts of one drafted step.

    ``trees``: the step's whole trees (before they were cut to ``sizes`` [B]);
    ``accept_lens`` [B]: accepted drafts + 1; ``root_tokens`` [B]: the target's token at the
    root. A request that verified only its root is judged at depth 1 (see the module doc).
    """
    surrogate = trees.surrogate()  # [B, N]
    verified = sizes.to(torch.long).clamp(min=1, max=trees.max_nodes) - 1  # [B]
    tree_predicted = surrogate.gather(1, verified.unsqueeze(1)).squeeze(1) - 1.0
    first = (trees.depths == 1) & trees.real_mask()  # [B, N]: the root's children
    depth1_predicted = (torch.exp(trees.log_scores) * first).sum(dim=1)
    depth1_realised = ((trees.token_ids == root_tokens.unsqueeze(1)) & first).any(dim=1)
    root_only = verified == 0
    predicted = torch.where(root_only, depth1_predicted, tree_predicted)
    accepted = (accept_lens - 1).to(predicted.dtype)
    realised = torch.where(root_only, depth1_realised.to(predicted.dtype), accepted)
    return predicted.float(), realised.float()


def observe(
    state: AcceptanceScale, slots: torch.Tensor, kinds: torch.Tensor,
    predicted: torch.Tensor, realised: torch.Tensor,
) -> None:  # fmt: skip
    """Fold one step's [B] predicted and realised accepted drafts into requests and pools."""
    for per_slot, new in ((state.predicted, predicted), (state.realised, realised)):
        per_slot.index_copy_(0, slots, per_slot.index_select(0, slots) * state.decay + new)
    for pool, new in ((state.pool_predicted, predicted), (state.pool_realised, realised)):
        pool.mul_(state.pool_decay).index_add_(0, kinds, new)
