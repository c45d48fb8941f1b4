"""Best-first trees from each request's top-K draft marginals: one launch for the whole batch.

Input is what the draft head already produces, [B, D, K] top-K probabilities (descending) and
their token ids, instead of the dense [B, D, V] marginals `build_trees` takes; the torch
reference runs `build_trees`' own pools on it (the part of `build_trees` after its top-K) and
the Triton kernel must match it exactly.

Kernel: one program per request keeps the frontier of the top-K lattice in registers. The
best unpicked node always has its parent and its next-better sibling (rank r - 1) picked, so
it is among {rank-0 child, next sibling} of the picked nodes: at most 2N candidates. Each of
the N - 1 steps picks the best candidate (score, then the shallower, as `build_trees` orders
them), writes its slot and adds its first child and next sibling, with every score its
parent's plus log q in float32, exactly as the pools sum them. The [D, K] log q and token
tables are loaded once; nothing else touches memory until the [N] outputs are written.

Why not the torch version on GPU: its data is tiny (B = 64, D = 15, K = 8: 92 KB of top-K in,
B x N x 28 B out, a memory floor under 0.1 us on an H200), but it is a chain of small ops: 28
at N = 16 (lattice pool) and 43 at N = 64 (beam pool), counted with torch.profiler, each one a
kernel launch of a few microseconds on a GPU, so about 100-200 us per step against one launch
here (``linearize`` is 49-55 ops and a host read; `accept_path` plus the KV moves 51 ops).
``benchmarks/gpu/driver.py`` measures both sides against the floor.
Exactness caveat: two candidates of equal score *and* equal depth are ordered by insertion
here and arbitrarily by `torch.topk` in the reference (both valid best-first trees).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_bastion.kernels.dispatch import next_power_of_2, use_triton
from sglang_bastion.tree import builder
from sglang_bastion.tree.batch import TreeBatch
from sglang_bastion.tree.builder import _check_top_k, _choose_strategy, _make_plan


def tree_size(depth: int, top_k: int, max_nodes: int, device: torch.device) -> int:
    """Real nodes per tree `build_trees` makes for these static sizes: min(N, lattice size)."""
    strategy = _choose_strategy(depth, top_k, max_nodes)
    return _make_plan(strategy, depth, top_k, max_nodes, device).size


def build_trees_from_top_k_reference(
    top_q: torch.Tensor, top_tokens: torch.Tensor, root_tokens: torch.Tensor, *, max_nodes: int
) -> TreeBatch:
    """`build_trees` from [B, D, K] descending top-K probabilities and their [B, D, K] tokens.

    Always the torch pools, on any device (on CPU tensors `build_trees` itself takes the
    compiled merge of ``tree_build_cpu.c``, which the dispatcher below uses).
    """
    return builder.build_trees_from_top_k(
        top_q, top_tokens, root_tokens, max_nodes=max_nodes, compiled=False
    )


def build_trees_from_top_k_triton(
    top_q: torch.Tensor, top_tokens: torch.Tensor, root_tokens: torch.Tensor, *, max_nodes: int
) -> TreeBatch:
    """`build_trees_from_top_k_reference` in one launch (one program per request)."""
    _check_top_k(top_q, top_tokens, root_tokens)
    batch, depth, top_k = top_q.shape
    device = top_q.device
    size = tree_size(depth, top_k, max_nodes, device)
    log_q = top_q.float().log().contiguous()  # [B, D, K]: torch's log, as the reference
    tokens = top_tokens.to(torch.int64).contiguous()  # [B, D, K]
    token_ids = torch.empty(batch, max_nodes, dtype=torch.int64, device=device)
    parents = torch.empty(batch, max_nodes, dtype=torch.int64, device=device)
    depths = torch.empty(batch, max_nodes, dtype=torch.int64, device=device)
    scores = torch.empty(batch, max_nodes, dtype=torch.float32, device=device)
    if batch:
        _best_first_kernel[(batch,)](
            log_q, tokens, root_tokens.to(torch.int64).contiguous(),
            token_ids, parents, depths, scores, size,
            DEPTH=depth, K=top_k, N=max_nodes, NP=next_power_of_2(max_nodes),
            C=next_power_of_2(2 * max_nodes), DK=next_power_of_2(depth * top_k),
            num_warps=1,
        )  # fmt: skip
    return TreeBatch(
        token_ids=token_ids,
        parents=parents,
        depths=depths,
        log_scores=scores,
        num_nodes=torch.full((batch,), size, dtype=torch.long, device=device),
    )


def build_trees_from_top_k(
    top_q: torch.Tensor, top_tokens: torch.Tensor, root_tokens: torch.Tensor, *, max_nodes: int
) -> TreeBatch:
    """Best-first trees from top-K marginals: Triton on CUDA, the compiled merge on CPU."""
    if use_triton(top_q, top_tokens):
        return build_trees_from_top_k_triton(top_q, top_tokens, root_tokens, max_nodes=max_nodes)
    return builder.build_trees_from_top_k(top_q, top_tokens, root_tokens, max_nodes=max_nodes)


@triton.jit
def _pick(values, where, other):
    """The entry of ``values`` where the one-hot ``where`` is set (``other`` if none)."""
    return tl.max(tl.where(where, values, other), axis=0)


@triton.jit
def _best_first_kernel(
    log_q_ptr, tokens_ptr, root_ptr, out_tok_ptr, out_par_ptr, out_dep_ptr, out_score_ptr,
    size, DEPTH: tl.constexpr, K: tl.constexpr, N: tl.constexpr, NP: tl.constexpr,
    C: tl.constexpr, DK: tl.constexpr,
):  # fmt: skip
    """One request: N - 1 best-first picks from a frontier of at most 2N candidates."""
    b = tl.program_id(0)
    t = tl.arange(0, DK)
    lq = tl.load(log_q_ptr + b * DEPTH * K + t, mask=t < DEPTH * K, other=float("-inf"))
    tok = tl.load(tokens_ptr + b * DEPTH * K + t, mask=t < DEPTH * K, other=0)
    c = tl.arange(0, C)
    # Candidate table: node (depth, rank) under parent slot; its score and its parent's score.
    live = c == 0
    cand_par = tl.zeros([C], dtype=tl.int32)
    cand_dep = tl.where(c == 0, 1, 0)
    cand_rank = tl.zeros([C], dtype=tl.int32)
    cand_pscore = tl.zeros([C], dtype=tl.float32)
    cand_score = tl.where(c == 0, _pick(lq, t == 0, float("-inf")), float("-inf"))
    filled = tl.sum((c == 0).to(tl.int32), axis=0)  # candidates added so far: the first child
    if DEPTH == 0:
        live = c < 0
    s = tl.arange(0, NP)
    root = tl.load(root_ptr + b)
    out_tok = tl.where(s == 0, root, 0)
    out_par = tl.full([NP], -1, tl.int64)
    out_dep = tl.zeros([NP], dtype=tl.int64)
    out_score = tl.where(s == 0, 0.0, float("-inf"))
    for slot in range(1, size):
        # Best score (-inf clamped, so depth still orders those), then the shallowest, then
        # the first added.
        key = tl.where(live, tl.maximum(cand_score, -1e30), float("-inf"))
        best = tl.max(key, axis=0)
        tie = live & (key == best)
        shallow = tl.min(tl.where(tie, cand_dep, 1 << 30), axis=0)
        pick = tl.min(tl.where(tie & (cand_dep == shallow), c, C), axis=0)
        one = c == pick
        par = _pick(cand_par, one, -1)
        dep = shallow
        rank = _pick(cand_rank, one, -1)
        score = _pick(cand_score, one, float("-inf"))
        pscore = _pick(cand_pscore, one, float("-inf"))
        at = s == slot
        out_tok = tl.where(at, _pick(tok, t == (dep - 1) * K + rank, -1), out_tok)
        out_par = tl.where(at, par.to(tl.int64), out_par)
        out_dep = tl.where(at, dep.to(tl.int64), out_dep)
        out_score = tl.where(at, score, out_score)
        live = live & ~one
        # Its first child (rank 0 one level down) and its next sibling (rank + 1).
        child = (c == filled) & (dep < DEPTH)
        cand_par = tl.where(child, slot, cand_par)
        cand_dep = tl.where(child, dep + 1, cand_dep)
        cand_rank = tl.where(child, 0, cand_rank)
        cand_pscore = tl.where(child, score, cand_pscore)
        cand_score = tl.where(child, score + _pick(lq, t == dep * K, float("-inf")), cand_score)
        live = live | child
        filled += (dep < DEPTH).to(tl.int32)
        sibling = (c == filled) & (rank + 1 < K)
        cand_par = tl.where(sibling, par, cand_par)
        cand_dep = tl.where(sibling, dep, cand_dep)
        cand_rank = tl.where(sibling, rank + 1, cand_rank)
        cand_pscore = tl.where(sibling, pscore, cand_pscore)
        sib_q = _pick(lq, t == (dep - 1) * K + rank + 1, float("-inf"))
        cand_score = tl.where(sibling, pscore + sib_q, cand_score)
        live = live | sibling
        filled += (rank + 1 < K).to(tl.int32)
    row = b * N + s
    keep = s < N
    tl.store(out_tok_ptr + row, out_tok, mask=keep)
    tl.store(out_par_ptr + row, out_par, mask=keep)
    tl.store(out_dep_ptr + row, out_dep, mask=keep)
    tl.store(out_score_ptr + row, out_score, mask=keep)
