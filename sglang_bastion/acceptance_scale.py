"""Online calibration of the drafter's surrogate A_hat against what the target accepts.

A_hat(n) - 1 is the number of drafts the drafter expects accepted from its first n nodes:
its own confidence. A drafter trained on greedy continuations is overconfident for a sampled
target, and any drafter can be for some workload, so the controller never prices with A_hat
alone. A request's scale c, clipped to [0, MAX_SCALE], scales the surrogate: A_cal(n) =
min(1 + c (A_hat(n) - 1), deepest + 1), where deepest is the tree's depth (no step accepts
more). A_cal stays concave and non-decreasing in n, so the first-drop rule and the
uniform-width goodput stay optimal for it, and c = 0 prices every tree as its root alone: no
speculation. c above 1 is common under greedy verification: a drafter's probabilities follow
the target's distribution, and the target's argmax agrees with a draft more often than that.

c is the product of two ratios of decayed sums, kept on the device:

- the pool's rho: the accepted drafts over A_hat's predicted ones of every request of the
  same sampling kind (greedy or sampled) at the same age, the tokens it has emitted since
  its prompt, in octaves (0, 1-2, 3-6, 7-14, 15-30, 31 and more);
- the request's own u, indexed by SGLang's request slot (``req_pool_indices``): its accepted
  drafts over what its pool's rho, at its age then, predicted for its drafted steps, next to
  a prior of u = 1 that weighs a constant ``prior`` drafts. The request's evidence is decayed
  (about ten steps), so it never grows past about ten steps' drafts, and the prior keeps u
  shrunk towards 1 by a fixed share however long the request runs: over ten greedy steps a
  request's accepted drafts vary far more than requests differ on the tiny pair, and
  replayed against served traces (issue 22) a prior that faded gave u that priced nodes into
  the wrong requests (see ``AcceptanceScale.prior``).

So a new sampled request is priced with what sampled requests accepted before it, and a
request of any kind with what requests accepted at its age: a drafter may be much less sure
of a completion's first tokens than of its middle (the tiny pair accepts almost nothing in a
request's first two steps, and more than the drafter expects from its sixth on). A wave of
new requests is then not priced as the batch it joins, and a request's poor first steps,
which its age explains, do not hold its trees back once it is older. Where acceptance does
not depend on age, every age's pool holds the same rho and c is the request's own ratio.

A step whose request verified its root alone still observes: the target's token at the root
is compared with the tree's depth-1 children (what would have been accepted had they been
verified), against their predicted mass. So a request that stopped speculating keeps
measuring, and speculates again when its drafts would be accepted again. Nothing here reads
a value to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_bastion.tree.batch import TreeBatch

GREEDY, SAMPLED = 0, 1  # a request's kind: its pool
GREEDY_TOP_K = 1  # SGLang stores a greedy request (temperature 0) as top-k 1, temperature 1
MAX_SCALE = 4.0  # the most the calibration inflates the drafter's expected accepted drafts
AGE_EDGES = (1, 3, 7, 15, 31)  # tokens emitted since the prompt where the next age pool starts
AGES = len(AGE_EDGES) + 1  # A: age pools per kind
ACCEPTING = 0.5  # pooled rho from which a kind's drafts count as accepted at that age
EVIDENCE = 2.0  # predicted drafts (decayed) a pool needs before its rho counts


@dataclass(frozen=True)
class AcceptanceScale:
    """Decayed predicted and realised accepted drafts, per kind and age and per request slot.

    A request's numbers are one row of its slot, and the 2 x A pools are flat (kind-major)
    beside each other: a step reads and writes each of them with one op.
    """

    slot: torch.Tensor  # [P, 2] float32: per slot, its pool's predicted drafts and its
    # realised drafts, decayed per step
    pool_of: torch.Tensor  # [P, 2] long: per slot, its kind's first pool (kind * A), its start
    # (the sequence length the request started decoding at)
    pools: torch.Tensor  # [2, 2 * A] float32: predicted, realised drafts of each (kind, age)
    rho: torch.Tensor  # [2 * A] float32: each pool's realised over predicted drafts, clipped
    # to MAX_SCALE, kept with the pools (a step reads it once, in `scales`)
    edges: torch.Tensor  # long: AGE_EDGES
    # weight of a request's past per new step (about 10 steps of memory): a greedy step accepts
    # anything from none to the tree's depth, and a shorter memory shrinks a request's trees,
    # or stops them, on one or two poor steps
    decay: float = 0.9
    # a pool's weight of its past per step that observes it: the pools see a whole batch per
    # step, and a pool a step does not observe keeps its evidence (one request at a time
    # reaches the youngest ages once per request; decayed every step, their pools would hold
    # the last request's first steps alone)
    pool_decay: float = 0.9
    # weight, in its pool's expected drafts, of every request's prior u = 1: about what a
    # greedy request's decayed evidence holds on the tiny pair (4 drafts a step, over ten
    # steps), so that its own ratio counts half. Replayed on served C=4 and C=16 traces of
    # that pair (each step's trees re-split at its recorded total), a prior of 2 drafts that
    # decayed with the evidence emitted 1.1-2.0% fewer tokens than the pools alone (u = 1);
    # 40 constant, within 0.2% of them.
    prior: float = 40.0


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
    return AcceptanceScale(
        slot=torch.zeros(slots, 2, dtype=torch.float32, device=device),  # [P, 2]
        pool_of=torch.zeros(slots, 2, dtype=torch.long, device=device),  # [P, 2]
        pools=torch.ones(2, 2 * AGES, dtype=torch.float32, device=device),  # [2, 2A]
        rho=torch.ones(2 * AGES, dtype=torch.float32, device=device),  # [2A]
        edges=torch.tensor(AGE_EDGES, dtype=torch.long, device=device),
        decay=decay, prior=prior,
    )  # fmt: skip


def accepting_kinds(state: AcceptanceScale, least: float = ACCEPTING) -> frozenset[int]:
    """The kinds (GREEDY, SAMPLED) whose drafts are accepted: over the kind's pools with
    evidence (``EVIDENCE`` predicted drafts, decayed), realised drafts at least ``least`` of
    the predicted. A host read of the [2, 2A] pools: for the prefill path, never the decode
    step."""
    pools = state.pools.view(2, 2, AGES)  # [predicted / realised, kind, age]
    evident = (pools[0] >= EVIDENCE).to(pools.dtype)  # [2, A]
    predicted, realised = (pools * evident).sum(dim=2)  # [2] each: per kind
    accepted = ((predicted > 0) & (realised >= least * predicted)).tolist()
    return frozenset(kind for kind, yes in enumerate(accepted) if yes)


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


def start_requests(
    state: AcceptanceScale, slots: torch.Tensor, kinds: torch.Tensor, lengths: torch.Tensor
) -> None:
    """Start the requests now in ``slots`` [B] of ``kinds`` [B] at sequence ``lengths`` [B]."""
    state.slot.index_fill_(0, slots, 0.0)
    pool_of = torch.stack([kinds.to(torch.long) * AGES, lengths.to(torch.long)], dim=1)  # [B, 2]
    state.pool_of.index_copy_(0, slots, pool_of)


def pool_index(state: AcceptanceScale, slots: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[B] long: the (kind, age) pool, kind-major, of ``slots``' requests at ``lengths`` [B]."""
    first, start = state.pool_of.index_select(0, slots).unbind(1)  # [B] each
    return first + torch.bucketize(lengths.to(torch.long) - start, state.edges, right=True)


def scales(
    state: AcceptanceScale, slots: torch.Tensor, lengths: torch.Tensor,
    pool: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """[B] c in [0, MAX_SCALE] of ``slots``' requests at sequence ``lengths`` [B] (``pool``
    [B]: their `pool_index`, when the step has it already)."""
    if pool is None:
        pool = pool_index(state, slots, lengths)
    expected, realised = state.slot.index_select(0, slots).unbind(1)  # [B] each
    own = (realised + state.prior) / (expected + state.prior)  # u
    return (state.rho.index_select(0, pool) * own).clamp(0.0, MAX_SCALE)


def calibrated_surrogate(trees: TreeBatch, scale: torch.Tensor) -> torch.Tensor:
    """[B, N] A_cal(n) = min(1 + c (A_hat(n) - 1), deepest + 1) for scales c [B]."""
    accepted = trees.surrogate()  # [B, N]
    deepest = trees.depths.amax(dim=1, keepdim=True) + 1  # [B, 1]: the most a step accepts
    c = scale.to(accepted.dtype).unsqueeze(1)  # [B, 1]
    return torch.minimum(torch.addcmul(1.0 - c, c, accepted), deepest)  # 1 + c (A_hat - 1)


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
    first = trees.parents == 0  # [B, N]: the root's children (padding's parent is -1)
    depth1_predicted = torch.exp(trees.log_scores).mul_(first).sum(dim=1)
    depth1_realised = ((trees.token_ids == root_tokens.unsqueeze(1)) & first).any(dim=1)
    root_only = verified == 0
    predicted = torch.where(root_only, depth1_predicted, tree_predicted)
    accepted = (accept_lens - 1).to(predicted.dtype)
    realised = torch.where(root_only, depth1_realised.to(predicted.dtype), accepted)
    return predicted.float(), realised.float()


def observe(
    state: AcceptanceScale, slots: torch.Tensor, lengths: torch.Tensor,
    predicted: torch.Tensor, realised: torch.Tensor, pool: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Fold one step's [B] predicted and realised accepted drafts into pools and requests
    (``lengths`` [B]: the requests' sequence lengths the step drafted from; ``pool`` [B]:
    their `pool_index`, when the step has it already)."""
    if pool is None:
        pool = pool_index(state, slots, lengths)
    # [2A]: pool_decay where this step observed the pool, 1 elsewhere
    decay = torch.ones_like(state.rho).index_fill_(0, pool, state.pool_decay)
    state.pools.mul_(decay).index_add_(1, pool, torch.stack([predicted, realised]))
    pooled, kept = state.pools
    torch.div(kept, pooled.clamp(min=1e-6), out=state.rho).clamp_(max=MAX_SCALE)
    expected = predicted * state.rho.index_select(0, pool)  # [B]: what the pools now expect
    new = torch.stack([expected, realised], dim=1)  # [B, 2]
    state.slot.index_copy_(0, slots, state.slot.index_select(0, slots) * state.decay + new)
