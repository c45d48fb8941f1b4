"""build_trees' interchangeable exact paths agree with a heap and with each other.

From the static sizes alone the builder picks a fixed lattice pool or a per-depth beam (the
compiled lazy merge for CPU tensors), and one top-K per vocabulary row or a grouped two-stage
top-K. Every combination is forced here on
small random inputs, ties and zero / one probabilities included.
"""

from __future__ import annotations

import heapq

import pytest
import torch
from helpers import MARGINAL_KINDS, random_marginals

from sglang_bastion.tree import builder

PATHS = [
    (strategy, grouped) for strategy in ("lattice", "beam", "merge") for grouped in (False, True)
]


def mixed_marginals(batch: int, depth: int, vocab: int, seed: int) -> torch.Tensor:
    """[B, D, V] rows whose kind changes from position to position (chains, fans, ties)."""
    gen = torch.Generator().manual_seed(seed)
    kinds = torch.randint(0, len(MARGINAL_KINDS), (depth,), generator=gen).tolist()
    rows = [random_marginals(batch, 1, vocab, MARGINAL_KINDS[k], gen) for k in kinds]
    return torch.cat(rows, dim=1)


def heap_rhos(probs: torch.Tensor, top_k: int, max_nodes: int) -> list[float]:
    """Reference A_hat terms of one request: rho of each node in DDTree's heap pop order."""
    q = probs.topk(top_k, dim=-1).values.double().tolist()  # [D][K], descending
    rhos = [1.0]
    heap = [(-q[0][0], 0, 1.0, 1, 0)] if q and max_nodes > 1 else []  # (-rho, tie, parent, d, r)
    ties = 1
    while heap and len(rhos) < max_nodes:
        neg_rho, _, parent_rho, d, rank = heapq.heappop(heap)
        rhos.append(-neg_rho)
        if rank + 1 < top_k:  # next sibling
            sibling = parent_rho * q[d - 1][rank + 1]
            heapq.heappush(heap, (-sibling, ties, parent_rho, d, rank + 1))
            ties += 1
        if d < len(q):  # first child
            heapq.heappush(heap, (neg_rho * q[d][0], ties, -neg_rho, d + 1, 0))
            ties += 1
    return rhos


def build(probs: torch.Tensor, top_k: int, max_nodes: int, strategy: str, grouped: bool):
    """A TreeBatch from the forced path (grouped: the largest group count that works)."""
    vocab = probs.shape[2]
    groups = 0
    if grouped:
        groups = next(g for g in range(vocab // 2, 0, -1) if vocab % g == 0 and g >= top_k)
    root = torch.arange(probs.shape[0])
    return builder._build(probs, root, top_k, max_nodes, strategy, groups)


def check_against_heap(probs: torch.Tensor, top_k: int, max_nodes: int, trees) -> None:
    """Invariants, exact log-score sums, top-K tokens, and A_hat equal to the heap's."""
    trees.check()
    kth = probs.topk(top_k, dim=-1).values[..., -1]  # [B, D]
    for b in range(probs.shape[0]):
        n = int(trees.num_nodes[b])
        ref = heap_rhos(probs[b], top_k, max_nodes)
        assert n == len(ref)
        got = trees.log_scores[b, :n].double().exp().cumsum(0)
        want = torch.tensor(ref, dtype=torch.float64).cumsum(0)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        depth, token = trees.depths[b, 1:n], trees.token_ids[b, 1:n]
        q = probs[b, depth - 1, token]  # [n - 1]
        assert bool((q >= kth[b, depth - 1]).all()), "token outside the position's top-K"
        parent_score = trees.log_scores[b, trees.parents[b, 1:n]]
        assert torch.equal(trees.log_scores[b, 1:n], parent_score + q.log()), "log rho adds up"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("seed", range(8))
def test_each_path_matches_the_heap_on_mixed_marginals(path, seed):
    gen = torch.Generator().manual_seed(seed)
    depth, top_k = (int(x) for x in torch.randint(1, 6, (2,), generator=gen))
    max_nodes = int(torch.randint(1, 60, (1,), generator=gen))
    probs = mixed_marginals(3, depth, 12, seed)
    check_against_heap(probs, top_k, max_nodes, build(probs, top_k, max_nodes, *path))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", MARGINAL_KINDS)
def test_each_path_matches_the_heap_on_every_marginal_kind(path, kind):
    probs = random_marginals(4, 6, 24, kind, torch.Generator().manual_seed(7))
    for top_k, max_nodes in [(1, 5), (3, 40), (4, 70), (6, 9)]:
        check_against_heap(probs, top_k, max_nodes, build(probs, top_k, max_nodes, *path))


def test_paths_agree_at_benchmark_shapes():
    gen = torch.Generator().manual_seed(1)
    probs = torch.softmax(2 * torch.randn(3, 15, 300, generator=gen), dim=-1)
    for max_nodes in (16, 64):
        strategies = ("lattice", "beam", "merge") if max_nodes == 16 else ("beam", "merge")
        trees = [build(probs, 8, max_nodes, s, g) for s in strategies for g in (False, True)]
        for tree in trees:
            tree.check()
            torch.testing.assert_close(tree.surrogate(), trees[0].surrogate())
        check_against_heap(probs, 8, max_nodes, trees[-1])


def test_merge_trees_equal_the_torch_pools_at_benchmark_shapes():
    # Scores are continuous here, so no two nodes tie: every field must agree exactly.
    gen = torch.Generator().manual_seed(2)
    probs = torch.softmax(3 * torch.randn(4, 15, 300, generator=gen), dim=-1)
    for max_nodes in (1, 2, 16, 64, 256):
        want = build(probs, 8, max_nodes, builder._choose_strategy(15, 8, max_nodes), False)
        got = build(probs, 8, max_nodes, "merge", False)
        for field in ("token_ids", "parents", "depths", "log_scores", "num_nodes"):
            assert torch.equal(getattr(got, field), getattr(want, field)), field


def test_static_choices():
    assert builder._choose_strategy(15, 8, 16) == "lattice"
    assert builder._choose_strategy(15, 8, 64) == "beam"
    cpu, threads = torch.device("cpu"), torch.get_num_threads()
    assert builder._choose_groups(15, 300, 8, cpu) == 0  # B = 1: one top-K per row
    assert builder._choose_groups(64 * 15 * threads**2, 300, 8, cpu) == 50  # groups of 6
    assert builder._choose_groups(64 * 15 * threads**2, 307, 8, cpu) == 0  # V prime: no groups
    assert builder._choose_groups(64 * 15, 300, 8, torch.device("meta")) == 0  # CPU only


def test_cpu_tensors_take_the_compiled_merge_unless_kernels_are_disabled(monkeypatch):
    probs, roots = torch.rand(1, 15, 300), torch.zeros(1, dtype=torch.long)
    assert builder._compiled() is not None, "the C extension was not built: pip install -e ."
    assert builder._strategy_for(probs, roots, 15, 8, 64) == "merge"
    monkeypatch.setenv("SGLANG_BASTION_DISABLE_KERNELS", "1")
    assert builder._strategy_for(probs, roots, 15, 8, 64) == "beam"
    assert builder._strategy_for(probs, roots, 15, 8, 16) == "lattice"
    meta = probs.to("meta")
    monkeypatch.delenv("SGLANG_BASTION_DISABLE_KERNELS")
    assert builder._strategy_for(meta, roots.to("meta"), 15, 8, 64) == "beam"  # not on CPU


def test_compiled_false_keeps_to_the_torch_pools(monkeypatch):
    top_q = torch.rand(2, 3, 4).sort(dim=-1, descending=True).values
    tokens = torch.arange(4).expand(2, 3, 4)  # [B, D, K]: distinct tokens per position
    roots = torch.zeros(2, dtype=torch.long)

    def no_merge(*_):
        raise AssertionError("the compiled merge ran")

    monkeypatch.setattr(builder, "_merge_build", no_merge)
    builder.build_trees_from_top_k(top_q, tokens, roots, max_nodes=8, compiled=False).check()
    with pytest.raises(AssertionError, match="compiled merge ran"):
        builder.build_trees_from_top_k(top_q, tokens, roots, max_nodes=8)


@pytest.mark.parametrize(
    ("q_shape", "token_shape", "root_shape", "message"),
    [
        ((2, 12), (2, 12), (2,), "must both be \\(B, D, K\\)"),
        ((2, 3, 4), (2, 3, 5), (2,), "must both be \\(B, D, K\\)"),
        ((2, 3, 4), (2, 3, 4), (3,), "root_tokens must be \\(2,\\)"),
    ],
)
def test_top_k_inputs_of_the_wrong_shape_are_refused_by_name(
    q_shape, token_shape, root_shape, message
):
    top_q, tokens = torch.rand(q_shape), torch.zeros(token_shape, dtype=torch.long)
    with pytest.raises(ValueError, match=message):
        builder.build_trees_from_top_k(
            top_q, tokens, torch.zeros(root_shape, dtype=torch.long), max_nodes=8
        )


def test_merge_refuses_a_tree_larger_than_the_lattice():
    log_q = torch.rand(1, 2, 2).sort(dim=-1, descending=True).values.log()  # lattice: 7 nodes
    tokens, roots = torch.ones(1, 2, 2, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    outputs = [torch.empty(1, 9, dtype=torch.long) for _ in range(3)] + [torch.empty(1, 9)]
    addresses = [t.data_ptr() for t in (log_q, tokens, roots, *outputs)]
    with pytest.raises(ValueError, match="exceeds the number of nodes"):
        builder._compiled().build(*addresses, 1, 2, 2, 8, 9)


@pytest.mark.parametrize("order", ["chain_then_fan", "fan_then_chain", "alternating"])
def test_narrow_beams_hold_every_tree_size_when_all_scores_tie(order):
    # q = 1 (one-hot) positions make chains and flat positions make fans of equal scores: the
    # beam widths below N - d must still leave a best-first tree of every size in the pool.
    gen = torch.Generator().manual_seed(0)
    hot = random_marginals(2, 1, 12, "one_hot", gen)
    flat = random_marginals(2, 1, 12, "flat", gen)
    pattern = {
        "chain_then_fan": [hot, hot, hot, flat, flat, flat],
        "fan_then_chain": [flat, flat, flat, hot, hot, hot],
        "alternating": [flat, hot, flat, hot, flat, hot],
    }[order]
    probs = torch.cat(pattern, dim=1)
    for max_nodes in range(1, 70, 2):
        for strategy in ("beam", "merge"):
            check_against_heap(probs, 4, max_nodes, build(probs, 4, max_nodes, strategy, False))
