"""Acceptance: the walk follows the target's own tokens, so output follows the target exactly.

`accept_path` (the walk) is checked against a loop and the target's distribution; the KV moves
of `accept_reference` by hand; the Triton kernel (interpreted) against the reference exactly.
"""

from __future__ import annotations

import pytest
import torch
from helpers import random_marginals, small_tree
from scipy.stats import chisquare

from sglang_bastion.tree import TreeBatch, accept_path, build_trees
from sglang_bastion.tree.acceptance import accept_reference, accept_triton


def test_walk_follows_matching_children_and_emits_the_first_miss_as_bonus():
    # target tokens per slot: at the root 12 (-> b), at b 14 (-> d), at d 99 (miss)
    target = torch.tensor([[12, 0, 14, 0, 99, 0, 0]])
    path, accepted, bonus = accept_path(small_tree(), target, max_depth=3)
    assert path.tolist() == [[0, 2, 4, -1]]
    assert accepted.tolist() == [2]
    assert bonus.tolist() == [99]


def test_a_miss_at_the_root_accepts_nothing():
    target = torch.tensor([[77, 13, 14, 0, 15, 0, 0]])
    path, accepted, bonus = accept_path(small_tree(), target, max_depth=3)
    assert path.tolist() == [[0, -1, -1, -1]]
    assert accepted.tolist() == [0]
    assert bonus.tolist() == [77]


def test_a_matching_grandchild_under_a_missed_child_is_not_accepted():
    # c (13) matches the target at a, but a itself is not the target's token at the root
    target = torch.tensor([[12, 13, 55, 0, 0, 0, 0]])
    path, accepted, bonus = accept_path(small_tree(), target, max_depth=3)
    assert path.tolist() == [[0, 2, -1, -1]] and accepted.tolist() == [1] and bonus.tolist() == [55]


def test_a_padding_slot_is_never_accepted():
    # the padding slot holds token 0 and the target says 0 everywhere
    target = torch.zeros(1, 7, dtype=torch.long)
    trees = small_tree()
    _, accepted, _ = accept_path(trees, target, max_depth=3)
    assert accepted.tolist() == [0]
    # even when the padding slot's token equals what the root's target token is
    truncated = trees.truncate(torch.tensor([2]))  # keeps root and a; b.. become padding
    target = torch.tensor([[12, 0, 0, 0, 0, 0, 0]])
    _, accepted, bonus = accept_path(truncated, target, max_depth=3)
    assert accepted.tolist() == [0] and bonus.tolist() == [12]


def loop_accept(trees: TreeBatch, target: torch.Tensor, max_depth: int):
    """Reference: walk each tree with a plain loop over children."""
    paths, counts, bonuses = [], [], []
    for b in range(trees.batch_size):
        n = int(trees.num_nodes[b])
        cur, path = 0, [0]
        while True:
            want = int(target[b, cur])
            kids = [i for i in range(1, n) if int(trees.parents[b, i]) == cur]
            nxt = [i for i in kids if int(trees.token_ids[b, i]) == want]
            if not nxt:
                break
            cur = nxt[0]
            path.append(cur)
        counts.append(len(path) - 1)
        bonuses.append(int(target[b, cur]))
        paths.append(path + [-1] * (max_depth + 1 - len(path)))
    return paths, counts, bonuses


@pytest.mark.parametrize("seed", range(8))
def test_matches_a_plain_loop_on_random_trees(seed):
    gen = torch.Generator().manual_seed(seed)
    batch, depth, vocab = 16, 5, 6
    probs = random_marginals(batch, depth, vocab, "smooth", gen)
    trees = build_trees(probs, torch.zeros(batch, dtype=torch.long), top_k=3, max_nodes=20)
    trees = trees.truncate(torch.randint(1, 21, (batch,), generator=gen))
    # Targets that often agree with the tree: each slot's first child's token, sometimes noise.
    first_child = torch.full((batch, 20), 0, dtype=torch.long)
    for b in range(batch):
        for i in range(int(trees.num_nodes[b]) - 1, 0, -1):
            first_child[b, trees.parents[b, i]] = trees.token_ids[b, i]
    noise = torch.randint(0, vocab, (batch, 20), generator=gen)
    target = torch.where(torch.rand(batch, 20, generator=gen) < 0.7, first_child, noise)
    path, accepted, bonus = accept_path(trees, target, max_depth=depth)
    ref_path, ref_accepted, ref_bonus = loop_accept(trees, target, depth)
    assert path.tolist() == ref_path
    assert accepted.tolist() == ref_accepted
    assert bonus.tolist() == ref_bonus


# --- sampled output follows the target's distribution -------------------------------------

VOCAB, DEPTH, EMIT = 4, 3, 3
START = (1, 2)  # the two tokens before the first step: (previous token, committed root)


def markov_target(gen: torch.Generator) -> torch.Tensor:
    """[V, V, V] a second-order Markov target: row (a, b) is p(next | a, b)."""
    return torch.distributions.Dirichlet(torch.ones(VOCAB)).sample((VOCAB, VOCAB)).to(torch.float64)


def draw_target_tokens(table, trees, prev, rule, gen):
    """The target's token at every node: a sample (exact), or a rule that favours the drafts."""
    parent_tok = torch.where(
        trees.parents >= 0, trees.token_ids.gather(1, trees.parents.clamp(min=0)), prev.unsqueeze(1)
    )
    dist = table[parent_tok, trees.token_ids]  # [T, N, V]
    sample = torch.multinomial(dist.flatten(0, 1), 1, generator=gen).view(trees.token_ids.shape)
    if rule == "sample":
        return sample
    # "greedy on drafts": take the drafter's best child whenever the target allows it
    best_child = torch.full_like(sample, -1)
    n = trees.max_nodes
    for i in range(n - 1, 0, -1):  # lowest slot (best child) written last
        par = trees.parents[:, i]
        ok = par >= 0
        best_child[ok, par[ok]] = trees.token_ids[ok, i]
    allowed = (best_child >= 0) & (
        dist.gather(2, best_child.clamp(min=0).unsqueeze(2)).squeeze(2) > 0
    )
    return torch.where(allowed, best_child, sample)


def first_tokens(rule: str, trials: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """First EMIT tokens of tree-speculative sampling per trial, and the target table."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # the Dirichlet draws take the global generator: one fixed run
    table = markov_target(gen)
    prev = torch.full((trials,), START[0])
    root = torch.full((trials,), START[1])
    out = torch.full((trials, EMIT + DEPTH + 1), -1)
    count = torch.zeros(trials, dtype=torch.long)
    while int(count.min()) < EMIT:
        probs = torch.distributions.Dirichlet(torch.ones(VOCAB) * 0.5).sample((trials, DEPTH))
        trees = build_trees(probs.float(), root, top_k=2, max_nodes=6)
        target = draw_target_tokens(table, trees, prev, rule, gen)
        path, accepted, bonus = accept_path(trees, target, max_depth=DEPTH)
        tokens = trees.token_ids.gather(1, path[:, 1:].clamp(min=0))  # [T, D]
        emitted = torch.cat([tokens, torch.zeros_like(bonus).unsqueeze(1)], 1)
        emitted.scatter_(1, accepted.unsqueeze(1), bonus.unsqueeze(1))  # [T, D+1]
        n_emit = accepted + 1
        cols = count.unsqueeze(1) + torch.arange(DEPTH + 1)
        keep = torch.arange(DEPTH + 1) < n_emit.unsqueeze(1)
        out.scatter_(
            1,
            torch.where(keep, cols, out.shape[1] - 1).clamp(max=out.shape[1] - 1),
            torch.where(keep, emitted, out[:, -1:].expand_as(emitted)),
        )
        last_accepted = trees.token_ids.gather(1, path.gather(1, accepted.unsqueeze(1))).squeeze(1)
        prev, root, count = last_accepted, bonus, count + n_emit
    return out[:, :EMIT], table


def chi_square_p(rule: str) -> float:
    samples, table = first_tokens(rule, trials=20000, seed=1234)
    a, b = START
    p1 = table[a, b]  # [V]
    joint = p1[:, None, None] * table[b][:, :, None] * table  # p(x1) p(x2|b,x1) p(x3|x1,x2)
    codes = samples[:, 0] * VOCAB * VOCAB + samples[:, 1] * VOCAB + samples[:, 2]
    observed = torch.bincount(codes, minlength=VOCAB**3).double()
    expected = joint.flatten() / joint.sum() * samples.shape[0]
    return float(chisquare(observed.numpy(), expected.numpy()).pvalue)


def test_tree_speculative_sampling_reproduces_the_target_distribution():
    assert chi_square_p("sample") > 1e-3


def test_the_distribution_test_rejects_greedy_on_drafts():
    assert chi_square_p("draft_greedy") < 1e-6


FIELDS = ("path", "num_accepted", "bonus_tokens", "kv_source", "kv_target")


def planted_targets(trees: TreeBatch, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Random target tokens, except along a random root-to-node path, which they accept."""
    batch, nodes = trees.token_ids.shape
    targets = torch.randint(0, vocab, (batch, nodes), generator=generator)
    for b in range(batch):
        node = int(torch.randint(0, int(trees.num_nodes[b]), (), generator=generator))
        while node > 0:
            parent = int(trees.parents[b, node])
            targets[b, parent] = trees.token_ids[b, node]
            node = parent
    return targets


def test_kv_moves_bring_the_accepted_path_to_the_front_of_the_window():
    window = torch.arange(100, 107).unsqueeze(0)  # KV slots of the 7 tree slots
    target = torch.tensor([[12, 0, 14, 0, 99, 0, 0]])  # accepts b (slot 2) then d (slot 4)
    out = accept_triton(small_tree(), target, window, max_depth=3)
    assert out.path.tolist() == [[0, 2, 4, -1]]
    assert out.kv_source.tolist() == [[-1, 102, 104, -1]]
    assert out.kv_target.tolist() == [[-1, 101, 102, -1]]


def test_a_path_already_in_place_moves_nothing():
    window = torch.arange(100, 107).unsqueeze(0)
    target = torch.tensor([[11, 13, 0, 0, 0, 0, 0]])  # accepts a (slot 1) then c (slot 3)
    out = accept_triton(small_tree(), target, window, max_depth=3)
    assert out.num_accepted.tolist() == [2]
    assert out.kv_source.tolist() == [[-1, -1, 103, -1]]


@pytest.mark.parametrize(("depth", "top_k", "nodes"), [(4, 3, 16), (15, 8, 16), (2, 2, 7)])
def test_kernel_equals_accept_path_on_ragged_trees(depth, top_k, nodes):
    generator = torch.Generator().manual_seed(depth + nodes)
    batch, vocab = 5, 30
    probs = random_marginals(batch, depth, vocab, "smooth", generator)
    trees = build_trees(probs, torch.arange(batch), top_k=top_k, max_nodes=nodes)
    trees = trees.truncate(torch.randint(1, nodes + 1, (batch,), generator=generator))
    targets = planted_targets(trees, vocab, generator)
    window = torch.randperm(1000, generator=generator)[: batch * (nodes + 2)].view(batch, -1)
    out = accept_triton(trees, targets, window, max_depth=depth)
    expected = accept_reference(trees, targets, window, max_depth=depth)
    assert int(expected.num_accepted.sum()) > 0  # the planted paths are walked
    for name in FIELDS:
        assert torch.equal(getattr(out, name), getattr(expected, name)), name
