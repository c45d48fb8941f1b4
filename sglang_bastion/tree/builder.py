"""Tree build: each request's best-first tree of N nodes from its top-K draft marginals.

Because every marginal q <= 1, a child's path score never exceeds its parent's, so the size-N
best-first tree (Proposition 3.3) is the N best nodes of the request's top-K lattice, ties
going to the shallower node, so every parent precedes its children. Scores are float32 sums
from the root down: every child's log score is its parent's plus log q exactly.

One op, three implementations that give the same trees on tie-free marginals:

* `build_trees_reference`: the plain one, a per-request heap (DDTree's method) that pops the
  best open node and pushes its next sibling and its first child. It is the test oracle and
  runs where neither of the others can (a CPU install without the C extension, or kernels
  turned off); it reads the marginals on the host and loops over nodes in Python.
* the compiled CPU merge (``kernels/tree_build_cpu.c``, built at install): each depth's nodes
  best first as a lazy merge of K sorted lists over the depth above, the tree the merge of
  those D + 1 lists. It visits about N + K * D nodes per request and releases the GIL.
* `build_trees_triton`: one program per request keeps the lattice's frontier in registers.
  The best unpicked node always has its parent and its next-better sibling (rank r - 1)
  picked, so it is among {rank-0 child, next sibling} of the picked nodes: at most 2N
  candidates. Each of the N - 1 steps picks the best (score, then the shallower, then the
  first added), writes its slot and adds its first child and next sibling. A chain of torch
  ops would cost tens of launches of a few microseconds each; this is one
  (``benchmarks/gpu/driver.py`` measures both against the memory floor).

`build_trees_from_top_k` dispatches (Triton on CUDA, the compiled merge on CPU, else the
reference); `build_trees` is the same op on dense [B, D, V] marginals (the simulators and
benchmarks hold those), one `torch.topk` first. Exactness caveat: two nodes of equal score
*and* depth may come in either order (each order is a valid best-first tree).
"""

from __future__ import annotations

import heapq
from functools import lru_cache

import numpy as np
import torch
import triton
import triton.language as tl

from sglang_bastion.kernels.dispatch import next_power_of_2, use_compiled_cpu, use_triton
from sglang_bastion.tree.batch import TreeBatch


@lru_cache(maxsize=256)
def lattice_size(depth: int, top_k: int) -> int:
    """Number of nodes in the top-K lattice of the given depth, root included."""
    return depth + 1 if top_k == 1 else (top_k ** (depth + 1) - 1) // (top_k - 1)


def tree_size(depth: int, top_k: int, max_nodes: int) -> int:
    """Real nodes per tree for these static sizes: min(N, lattice size)."""
    return min(max_nodes, lattice_size(depth, top_k))


def build_trees(
    probs: torch.Tensor, root_tokens: torch.Tensor, *, top_k: int, max_nodes: int,
    kernels: bool = True,
) -> TreeBatch:  # fmt: skip
    """`build_trees_from_top_k` on dense [B, D, V] marginals (one top-K per position first)."""
    if probs.dim() != 3:
        raise ValueError(f"probs must be (B, D, V), got shape {tuple(probs.shape)}")
    batch, _, vocab = probs.shape
    if root_tokens.shape != (batch,):
        raise ValueError(f"root_tokens must be ({batch},), got {tuple(root_tokens.shape)}")
    if not 1 <= top_k <= vocab:
        raise ValueError(f"top_k must be in [1, vocab size {vocab}], got {top_k}")
    with torch.inference_mode():
        top_q, top_tokens = probs.topk(top_k, dim=-1)  # [B, D, K] each, q descending
    return build_trees_from_top_k(
        top_q, top_tokens, root_tokens, max_nodes=max_nodes, kernels=kernels
    )


def build_trees_from_top_k(
    top_q: torch.Tensor, top_tokens: torch.Tensor, root_tokens: torch.Tensor, *, max_nodes: int,
    kernels: bool = True,
) -> TreeBatch:  # fmt: skip
    """Best-first trees from [B, D, K] descending top-K probabilities and their tokens.

    Triton on CUDA, the compiled merge on CPU; ``kernels=False`` (or a CPU install without
    the C extension) runs `build_trees_reference`.
    """
    if use_triton(top_q, top_tokens, kernels=kernels):
        return build_trees_triton(top_q, top_tokens, root_tokens, max_nodes=max_nodes)
    if use_compiled_cpu(top_q, root_tokens, kernels=kernels) and _compiled() is not None:
        return build_trees_compiled(top_q, top_tokens, root_tokens, max_nodes=max_nodes)
    return build_trees_reference(top_q, top_tokens, root_tokens, max_nodes=max_nodes)


def _sizes(
    top_q: torch.Tensor, top_tokens: torch.Tensor, root_tokens: torch.Tensor, max_nodes: int
) -> tuple[int, int, int, int]:
    """(B, D, K, real nodes per tree); ValueError unless the inputs are [B, D, K] x 2 and [B]."""
    if top_q.dim() != 3 or top_tokens.shape != top_q.shape:
        raise ValueError(
            f"top_q and top_tokens must both be (B, D, K), got {tuple(top_q.shape)} "
            f"and {tuple(top_tokens.shape)}"
        )
    if root_tokens.shape != top_q.shape[:1]:
        raise ValueError(f"root_tokens must be ({top_q.shape[0]},), got {tuple(root_tokens.shape)}")
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be at least 1 (the root), got {max_nodes}")
    batch, depth, top_k = top_q.shape
    return batch, depth, top_k, tree_size(depth, top_k, max_nodes)


def _empty_trees(
    batch: int, max_nodes: int, size: int, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """[B, N] token, parent, depth, log-score outputs and the [B] node counts."""
    return (
        torch.empty(batch, max_nodes, dtype=torch.int64, device=device),
        torch.empty(batch, max_nodes, dtype=torch.int64, device=device),
        torch.empty(batch, max_nodes, dtype=torch.int64, device=device),
        torch.empty(batch, max_nodes, dtype=torch.float32, device=device),
        torch.full((batch,), size, dtype=torch.int64, device=device),
    )


def build_trees_reference(
    top_q: torch.Tensor, top_tokens: torch.Tensor, root_tokens: torch.Tensor, *, max_nodes: int
) -> TreeBatch:
    """Best-first trees by a per-request heap, in Python (the oracle; any device)."""
    batch, depth, top_k, size = _sizes(top_q, top_tokens, root_tokens, max_nodes)
    log_q = top_q.float().log().cpu().numpy()  # [B, D, K] float32: torch's log, as the others
    tokens = top_tokens.long().cpu().tolist()  # [B][D][K]
    roots = root_tokens.long().cpu().tolist()  # [B]
    out_tok = np.zeros((batch, max_nodes), dtype=np.int64)
    out_par = np.full((batch, max_nodes), -1, dtype=np.int64)
    out_dep = np.zeros((batch, max_nodes), dtype=np.int64)
    out_score = np.full((batch, max_nodes), -np.inf, dtype=np.float32)
    for b in range(batch):
        out_tok[b, 0], out_score[b, 0] = roots[b], 0.0
        # Open nodes: (-score, depth, insertion, parent slot, rank); scores stay float32.
        heap = [(-log_q[b, 0, 0], 1, 0, 0, 0)] if depth and size > 1 else []
        added = 1
        for slot in range(1, size):
            neg, d, _, parent, rank = heapq.heappop(heap)
            out_tok[b, slot] = tokens[b][d - 1][rank]
            out_par[b, slot], out_dep[b, slot], out_score[b, slot] = parent, d, -neg
            if rank + 1 < top_k:  # next sibling: the parent's score plus its own log q
                sibling = out_score[b, parent] + log_q[b, d - 1, rank + 1]
                heapq.heappush(heap, (-sibling, d, added, parent, rank + 1))
                added += 1
            if d < depth:  # first child
                heapq.heappush(
                    heap, (-(out_score[b, slot] + log_q[b, d, 0]), d + 1, added, slot, 0)
                )
                added += 1
    device = top_q.device
    return TreeBatch(
        token_ids=torch.from_numpy(out_tok).to(device),
        parents=torch.from_numpy(out_par).to(device),
        depths=torch.from_numpy(out_dep).to(device),
        log_scores=torch.from_numpy(out_score).to(device),
        num_nodes=torch.full((batch,), size, dtype=torch.long, device=device),
    )


@lru_cache(maxsize=1)
def _compiled():
    """The compiled CPU merge (``kernels/tree_build_cpu.c``), or None if it was not built."""
    try:
        from sglang_bastion.kernels import _tree_build_cpu
    except ImportError:
        return None
    return _tree_build_cpu


def build_trees_compiled(
    top_q: torch.Tensor, top_tokens: torch.Tensor, root_tokens: torch.Tensor, *, max_nodes: int
) -> TreeBatch:
    """`build_trees_reference` on CPU tensors by the compiled lazy merges."""
    batch, depth, top_k, size = _sizes(top_q, top_tokens, root_tokens, max_nodes)
    with torch.inference_mode():
        log_q = top_q.float().log().contiguous()  # [B, D, K]
        tokens = top_tokens.to(torch.long).contiguous()  # [B, D, K]
        roots = root_tokens.to(torch.long).contiguous()  # [B]
    token_ids, parents, depths, log_scores, num_nodes = _empty_trees(
        batch, max_nodes, size, top_q.device
    )  # written in C
    _compiled().build(
        log_q.data_ptr(), tokens.data_ptr(), roots.data_ptr(),
        token_ids.data_ptr(), parents.data_ptr(), depths.data_ptr(), log_scores.data_ptr(),
        batch, depth, top_k, size, max_nodes,
    )  # fmt: skip
    return TreeBatch(token_ids, parents, depths, log_scores, num_nodes)


def build_trees_triton(
    top_q: torch.Tensor, top_tokens: torch.Tensor, root_tokens: torch.Tensor, *, max_nodes: int
) -> TreeBatch:
    """`build_trees_reference` in one launch (one program per request)."""
    batch, depth, top_k, size = _sizes(top_q, top_tokens, root_tokens, max_nodes)
    log_q = top_q.float().log().contiguous()  # [B, D, K]: torch's log, as the reference
    tokens = top_tokens.to(torch.int64).contiguous()  # [B, D, K]
    token_ids, parents, depths, scores, num_nodes = _empty_trees(
        batch, max_nodes, size, top_q.device
    )
    if batch:
        _best_first_kernel[(batch,)](
            log_q, tokens, root_tokens.to(torch.int64).contiguous(),
            token_ids, parents, depths, scores, size,
            DEPTH=depth, K=top_k, N=max_nodes, NP=next_power_of_2(max_nodes),
            C=next_power_of_2(2 * max_nodes), DK=next_power_of_2(depth * top_k),
            num_warps=1,
        )  # fmt: skip
    return TreeBatch(token_ids, parents, depths, scores, num_nodes)


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
