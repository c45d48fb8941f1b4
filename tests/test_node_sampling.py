"""Every tree node's logits are the plain server's after emitting that node's path.

The oracle is SGLang's own penalizers: for each node, a fresh orchestrator for its request is
fed the committed output and then the node's path, one token per decode step as the plain
server feeds it, and its accumulated penalties are applied to the node's raw logits the way
the plain server's sampler applies them. The batched transform must equal that bit for bit.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang.srt.sampling.penaltylib import (
    BatchedFrequencyPenalizer,
    BatchedMinNewTokensPenalizer,
    BatchedPenalizerOrchestrator,
    BatchedPresencePenalizer,
    BatchedRepetitionPenalizer,
)
from sglang.srt.sampling.penaltylib.repetition_penalty import apply_scaling_penalties

from sglang_bastion.node_sampling import (
    PenaltyState,
    apply_committed_penalties,
    commit_emitted,
    path_tokens,
    penalize_tree_logits,
    state_from_penalizers,
)
from sglang_bastion.tree import TreeBatch

V = 24  # vocabulary
PENALIZERS = {
    BatchedFrequencyPenalizer,
    BatchedPresencePenalizer,
    BatchedRepetitionPenalizer,
    BatchedMinNewTokensPenalizer,
}
EOS = 3


class Batch:
    """What SGLang's orchestrator reads from a ScheduleBatch: its requests and device."""

    def __init__(self, reqs: list) -> None:
        self.reqs, self.device = reqs, "cpu"


class Tokenizer:
    """The tokenizer fields the min_new_tokens penalizer reads."""

    eos_token_id = EOS
    additional_stop_token_ids = None


class Params:
    """A request's sampling parameters (the penalizers' fields)."""

    def __init__(self, **kw: float) -> None:
        self.frequency_penalty = kw.get("frequency", 0.0)
        self.presence_penalty = kw.get("presence", 0.0)
        self.repetition_penalty = kw.get("repetition", 1.0)
        self.min_new_tokens = int(kw.get("min_new", 0))
        self.stop_token_ids = set(kw.get("stops", ()))


class Req:
    """A request as the penalizers see it."""

    def __init__(self, **kw: float) -> None:
        self.sampling_params, self.eos_token_ids, self.tokenizer = Params(**kw), None, Tokenizer()


def orchestrator(reqs: list[Req], history: list[list[int]]) -> BatchedPenalizerOrchestrator:
    """SGLang's orchestrator for ``reqs`` after the plain server emitted ``history``."""
    batch = Batch(reqs)
    orch = BatchedPenalizerOrchestrator(V, batch, PENALIZERS)
    orch._keep = batch  # the orchestrator holds its batch weakly
    for step in zip(*history, strict=True):
        orch.cumulate_output_tokens(torch.tensor(step))
    return orch


def plain_logits(req: Req, history: list[int], raw: torch.Tensor) -> torch.Tensor:
    """[V] the plain server's penalised logits after ``history``, from SGLang's penalizers."""
    orch = orchestrator([req], [history])
    logits = raw.clone().unsqueeze(0)
    if orch.is_required:
        additive = torch.zeros(1, V)
        orch.accumulate_additive_penalties(additive)
        logits.add_(additive)
        scaling = orch.accumulate_scaling_penalties()
        if scaling is not None:
            apply_scaling_penalties(logits, scaling)
    return logits[0]


def random_trees(bs: int, width: int, seed: int) -> TreeBatch:
    """B random trees of W slots (some padding), tokens drawn from a small vocabulary."""
    rng = random.Random(seed)
    parents, depths, tokens, counts = [], [], [], []
    for _ in range(bs):
        n = rng.randint(1, width)
        par, dep, tok = [-1], [0], [rng.randrange(V)]
        for i in range(1, n):
            p = rng.randrange(i)
            par.append(p), dep.append(dep[p] + 1), tok.append(rng.randrange(6))  # repeats
        pad = width - n
        parents.append(par + [-1] * pad), depths.append(dep + [0] * pad)
        tokens.append(tok + [0] * pad), counts.append(n)
    scores = torch.zeros(bs, width)  # unused by the transform
    return TreeBatch(
        token_ids=torch.tensor(tokens), parents=torch.tensor(parents),
        depths=torch.tensor(depths), log_scores=scores, num_nodes=torch.tensor(counts),
    )  # fmt: skip


def node_path(trees: TreeBatch, b: int, i: int) -> list[int]:
    """Draft tokens from depth 1 down to node i (Python walk)."""
    path = []
    while trees.parents[b, i] >= 0:
        path.append(int(trees.token_ids[b, i]))
        i = int(trees.parents[b, i])
    return path[::-1]


def served_logits(reqs: list[Req], history: list[list[int]], trees: TreeBatch, raw: torch.Tensor):
    """[B*W, V] logits after the batched transform (committed state, then each node's path)."""
    orch = orchestrator(reqs, history)
    additive = torch.zeros(len(reqs), V)
    orch.accumulate_additive_penalties(additive)
    scaling = orch.accumulate_scaling_penalties()
    state = state_from_penalizers(orch.penalizers.values(), reqs)
    logits = raw.clone()
    depth = int(trees.depths.max())
    penalize_tree_logits(logits, trees, depth, additive, scaling, state, apply_scaling_penalties)
    return logits


def expect_plain(reqs: list[Req], history: list[list[int]], trees: TreeBatch, raw: torch.Tensor):
    """[B*W, V] the plain server's logits at every node (real nodes; padding as the root)."""
    bs, width = trees.token_ids.shape
    rows = []
    for b in range(bs):
        for i in range(width):
            path = node_path(trees, b, i) if i < int(trees.num_nodes[b]) else []
            rows.append(plain_logits(reqs[b], history[b] + path, raw[b * width + i]))
    return torch.stack(rows)


CASES = {
    "frequency": {"frequency": 0.7},
    "presence": {"presence": 0.9},
    "negative presence": {"presence": -0.6},
    "repetition": {"repetition": 1.7},
    "min_new_tokens": {"min_new": 4, "stops": (4,)},
    "all together": {"frequency": 0.3, "presence": 0.45, "repetition": 1.3, "min_new": 5},
}


@pytest.mark.parametrize("params", CASES.values(), ids=CASES.keys())
def test_every_node_gets_the_plain_servers_logits_after_its_own_path(params):
    trees = random_trees(bs=3, width=9, seed=1)
    reqs = [Req(**params), Req(), Req(**params)]  # a request without penalties in between
    history = [[1, 2, 1], [0, 5, 5], [2, 2, 4]]  # 3 tokens emitted each: min_new reached at d=3
    raw = torch.randn(3 * 9, V) * 3
    got = served_logits(reqs, history, trees, raw)
    want = expect_plain(reqs, history, trees, raw)
    assert torch.equal(got, want)
    # non-vacuous: the committed state alone (what every node got before) is wrong somewhere
    committed = torch.cat([plain_logits(reqs[b], history[b], raw[b * 9 + i]).unsqueeze(0)
                           for b in range(3) for i in range(9)])  # fmt: skip
    assert not torch.equal(committed, want)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    frequency=st.sampled_from([0.0, 0.1, 0.3, 1.9]),
    presence=st.sampled_from([0.0, -1.1, 0.7]),
    repetition=st.sampled_from([1.0, 0.8, 1.25]),
    min_new=st.integers(0, 8),
)
def test_random_trees_and_penalty_mixes_equal_the_plain_server(
    seed, frequency, presence, repetition, min_new
):
    trees = random_trees(bs=2, width=7, seed=seed)
    params = {"frequency": frequency, "presence": presence, "repetition": repetition,
              "min_new": min_new, "stops": (EOS + 1,)}  # fmt: skip
    reqs = [Req(**params), Req(**params)]
    gen = torch.Generator().manual_seed(seed)
    history = torch.randint(0, 6, (2, 2), generator=gen).tolist()
    raw = torch.randn(2 * 7, V, generator=gen) * 4
    assert torch.equal(
        served_logits(reqs, history, trees, raw), expect_plain(reqs, history, trees, raw)
    )


def test_the_root_keeps_the_committed_logits():
    trees = random_trees(bs=2, width=5, seed=3)
    reqs = [Req(frequency=0.5, repetition=1.4), Req(presence=0.5)]
    history = [[1, 1], [2, 0]]
    raw = torch.randn(10, V)
    got = served_logits(reqs, history, trees, raw)
    for b in range(2):
        assert torch.equal(got[b * 5], plain_logits(reqs[b], history[b], raw[b * 5]))


def test_stop_tokens_open_at_the_depth_where_the_output_reaches_min_new_tokens():
    # a chain root -> 7 -> 8 -> 9 after 4 emitted tokens, min_new_tokens 6: EOS is masked at
    # depths 0 and 1 (4 and 5 tokens emitted) and allowed at depths 2 and 3
    trees = TreeBatch(
        token_ids=torch.tensor([[1, 7, 8, 9]]), parents=torch.tensor([[-1, 0, 1, 2]]),
        depths=torch.tensor([[0, 1, 2, 3]]), log_scores=torch.zeros(1, 4),
        num_nodes=torch.tensor([4]),
    )  # fmt: skip
    got = served_logits([Req(min_new=6)], [[1, 2, 5, 1]], trees, torch.zeros(4, V))
    assert got[:, EOS].tolist() == [float("-inf"), float("-inf"), 0.0, 0.0]


def test_path_tokens_list_each_nodes_draft_tokens_from_itself_up():
    trees = TreeBatch(
        token_ids=torch.tensor([[1, 7, 8, 9, 5]]), parents=torch.tensor([[-1, 0, 1, 0, 2]]),
        depths=torch.tensor([[0, 1, 2, 1, 3]]), log_scores=torch.zeros(1, 5),
        num_nodes=torch.tensor([5]),
    )  # fmt: skip
    tokens, valid = path_tokens(trees, max_depth=3)
    listed = [[int(t) for t, v in zip(tokens[0, i], valid[0, i], strict=True) if v]
              for i in range(5)]  # fmt: skip
    assert listed == [[], [7], [8, 7], [9], [5, 8, 7]]


def test_committing_an_accepted_run_equals_feeding_it_token_by_token():
    reqs = [Req(frequency=0.3, presence=0.5, repetition=1.2, min_new=9), Req(frequency=0.7)]
    history = [[1, 2], [3, 3]]
    runs = [[4, 4, 2, 0], [5, 0, 0, 0]]  # emitted this step: 3 tokens, then 1 (rest padding)
    lens = torch.tensor([3, 1])
    batched = orchestrator(reqs, history)
    state = state_from_penalizers(batched.penalizers.values())
    commit_emitted(state, torch.tensor(runs), lens)
    for b, req in enumerate(reqs):
        one = orchestrator([req], [history[b] + runs[b][: lens[b]]])
        for mine, theirs in zip(batched.penalizers.values(), one.penalizers.values(), strict=True):
            for name, value in vars(theirs).items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(getattr(mine, name)[b], value[0]), (type(mine), name)


def test_without_penalties_the_state_is_inactive_and_logits_stay_as_they_are():
    orch = orchestrator([Req(), Req()], [[1], [2]])
    state = state_from_penalizers(orch.penalizers.values(), [Req(), Req()])
    assert not state.active
    assert state == PenaltyState()


def test_committed_penalties_broadcast_over_every_node_of_a_request():
    logits = torch.ones(2 * 3, 4)
    additive = torch.tensor([[0.0, -1.0, 0.0, 0.0], [0.0, 0.0, -2.0, 0.0]])
    apply_committed_penalties(logits, additive, None)
    assert logits.view(2, 3, 4)[0, :, 1].tolist() == [0.0] * 3
    assert logits.view(2, 3, 4)[1, :, 2].tolist() == [-1.0] * 3


def test_stop_tokens_are_read_from_the_requests_once_per_batch_composition():
    reqs = [Req(min_new=4, stops=(7,)), Req(min_new=2)]
    orch = orchestrator(reqs, [[1], [2]])
    first = state_from_penalizers(orch.penalizers.values(), reqs).stop_ids
    assert sorted(first[0].tolist()) == [EOS, 7] and set(first[1].tolist()) == {EOS}
    assert state_from_penalizers(orch.penalizers.values(), reqs).stop_ids is first
    orch.batch.reqs = reqs[1:]  # the first request finished: SGLang's tensors are new
    orch.filter(torch.tensor([1]))
    after = state_from_penalizers(orch.penalizers.values(), reqs[1:]).stop_ids
    assert after.tolist() == [[EOS]]
