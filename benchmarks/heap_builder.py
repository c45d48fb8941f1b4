"""The per-request heap builder (DDTree's method), the baseline `build_trees` is measured against.

One request at a time: numpy top-K over the vocabulary, then a Python heap that pops the best
open node and pushes its next sibling and its first child. Returns a TreeBatch so both
builders produce the same structure.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from sglang_bastion.tree import TreeBatch


def heap_tree(probs: np.ndarray, top_k: int, max_nodes: int) -> tuple[list, list, list, list]:
    """Best-first tree of one request from its (D, V) marginals: tokens, parents, depths, logs."""
    top = np.argpartition(-probs, top_k - 1, axis=-1)[:, :top_k]  # [D, K] unordered
    top_p = np.take_along_axis(probs, top, axis=-1)
    order = np.argsort(-top_p, axis=-1, kind="stable")
    tokens = np.take_along_axis(top, order, axis=-1).tolist()
    log_q = np.log(np.take_along_axis(top_p, order, axis=-1)).tolist()
    depth_limit = len(log_q)
    out_tok, out_par, out_dep, out_log = [-1], [-1], [0], [0.0]
    heap = [(-log_q[0][0], 0, 1, 0, log_q[0][0])] if depth_limit and max_nodes > 1 else []
    while heap and len(out_tok) < max_nodes:
        _, parent, depth, rank, score = heapq.heappop(heap)
        node = len(out_tok)
        out_tok.append(tokens[depth - 1][rank])
        out_par.append(parent)
        out_dep.append(depth)
        out_log.append(score)
        if rank + 1 < top_k:
            sibling = score - log_q[depth - 1][rank] + log_q[depth - 1][rank + 1]
            heapq.heappush(heap, (-sibling, parent, depth, rank + 1, sibling))
        if depth < depth_limit:
            child = score + log_q[depth][0]
            heapq.heappush(heap, (-child, node, depth + 1, 0, child))
    return out_tok, out_par, out_dep, out_log


def heap_build_trees(
    probs: torch.Tensor, root_tokens: torch.Tensor, *, top_k: int, max_nodes: int
) -> TreeBatch:
    """Per-request heap builds, packed into a TreeBatch (padding as in `build_trees`)."""
    batch = probs.shape[0]
    probs_np = probs.float().cpu().numpy()
    roots = root_tokens.tolist()
    tok = np.zeros((batch, max_nodes), dtype=np.int64)
    par = np.full((batch, max_nodes), -1, dtype=np.int64)
    dep = np.zeros((batch, max_nodes), dtype=np.int64)
    logs = np.full((batch, max_nodes), -np.inf, dtype=np.float32)
    sizes = np.zeros(batch, dtype=np.int64)
    for b in range(batch):
        t, p, d, s = heap_tree(probs_np[b], top_k, max_nodes)
        n = len(t)
        t[0] = roots[b]
        tok[b, :n], par[b, :n], dep[b, :n], logs[b, :n] = t, p, d, s
        sizes[b] = n
    return TreeBatch(
        token_ids=torch.from_numpy(tok),
        parents=torch.from_numpy(par),
        depths=torch.from_numpy(dep),
        log_scores=torch.from_numpy(logs),
        num_nodes=torch.from_numpy(sizes),
    )
