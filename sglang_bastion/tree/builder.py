"""Batched best-first tree builder: the N largest-rho nodes of each request's top-K lattice.

Because every marginal q <= 1, a child's path score never exceeds its parent's, so the size-N
best-first tree (Proposition 3.3) is simply the N best nodes of the lattice. The builder first
gathers a prefix-closed *pool* of lattice nodes that provably contains such a tree, then takes
the N best pool nodes in one selection ordered by score, ties going to the shallower node, so
every parent precedes its children. Two exact ways to form the pool, chosen from the static
sizes alone:

* ``"lattice"`` (small N): a fixed pool. With each position's top-K sorted, every node whose
  ranks are position-wise at most a prefix of r_1..r_d scores at least as well as the node
  with those ranks, whatever the marginals: sum_{e<=d} prod_{i<=e} (r_i + 1) nodes. Only the
  nodes where that count is at most N can be needed: 294 of them at D = 15, K = 8, N = 16.
  Their scores are summed down fixed root-to-leaf paths by D - 1 in-place adds.
* ``"beam"``: the depth-d entries are the W_d best depth-d paths, found among {the depth-(d-1)
  entries} x {top-K tokens of q_d} by one top-k per depth. W_d is the least width for which
  W_d nodes and the ancestors they need number at least N, so a full beam already holds N
  nodes at least as good as any it drops: 212-223 at N = 256 rather than N - 1.

* ``"merge"`` (CPU tensors, compiled C in ``kernels/tree_build_cpu.c``): each depth's nodes
  best first, as a merge of K sorted lists over the depth above, produced lazily; the tree is
  the merge of those D + 1 lists. It visits about N + K * D nodes per request where the pools
  hold thousands, and it exists because at B = 1 the torch beam is D - 1 sequential steps of
  a few microseconds of dispatch each, slower than a Python heap. Set
  ``SGLANG_BASTION_DISABLE_KERNELS=1`` to run the torch pools on CPU instead.

The top-K of each position is one `torch.topk` per row or, for large B * D * V, a two-stage
top-K over strided vocabulary groups (the K best entries lie in the K groups with the best
maxima). The final selection is one top-k over a float64 key that adds the depth tie-break
below float32 resolution. Scores are summed in float32 from the root down, so every child's
log score is its parent's plus log q exactly. No heap, no host synchronisation, no Python loop
over requests or nodes (only over the D depths); every shape follows from (B, D, V, K, N), and
the static choices from those, the device and the CPU thread count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import torch

from sglang_bastion.tree.batch import TreeBatch

Strategy = Literal["lattice", "beam", "merge"]

# Above this many fixed-pool nodes the beam is cheaper (N = 16 needs 294 at D = 15, K = 8).
_LATTICE_POOL_LIMIT = 2048
# On CPU with T threads, below T^2 times this many probabilities (B * D * V) one `torch.topk`
# per row beats the grouped top-K (which parallelises less well at small sizes).
_GROUPED_TOP_K_MIN = 25_000
# Selection key: score * (1 + depth * 2^-40) - depth * 2^-1000 in float64 puts the shallower of
# two equal float32 scores (0 and -inf, after clamping, included) first and keeps distinct
# float32 scores in order: the shift is below one float32 step.
_DEPTH_SCALE = 2.0**-40
_DEPTH_BIAS = 2.0**-1000


@lru_cache(maxsize=256)
def lattice_size(depth: int, top_k: int) -> int:
    """Number of nodes in the top-K lattice of the given depth, root included."""
    return depth + 1 if top_k == 1 else (top_k ** (depth + 1) - 1) // (top_k - 1)


@dataclass(frozen=True)
class _Plan:
    """Everything about one (strategy, D, K, N, device) that does not depend on the data.

    Pool entries are laid out depth by depth (the root first), so index order is a valid
    tie-break too. Candidate ids index ``cand_parent`` / ``cand_token``: in the lattice pool
    an entry is its own candidate; in the beam pool depth d has K * W_{d-1} candidates, the
    one with flat index k * W_{d-1} + i extending entry i of depth d-1 by the rank-k token.
    """

    size: int  # real nodes per tree: min(N, lattice size)
    widths: tuple[int, ...]  # beam: entries per depth, the root first
    rows: int  # lattice: depth of the deepest pool node
    grid_index: torch.Tensor  # lattice: [rows * columns] flat log q index feeding each cell
    entry_index: torch.Tensor  # [U] lattice: the grid cell of each node; beam: see below
    cand_parent: torch.Tensor  # [C] parent entry of each candidate; the root's is U
    cand_token: torch.Tensor  # [C] its column of [root token | top-K tokens of each position]
    key_scale: torch.Tensor  # [U] float64 1 + depth * 2^-40
    key_bias: torch.Tensor  # [U] float64 -depth * 2^-1000
    node_depth: torch.Tensor  # [U]
    slots: torch.Tensor  # [n] 0..n-1
    # Beam: entry_index holds each entry's candidate id where its depth keeps every candidate,
    # else the first candidate id of its depth (the picked flat index is added at run time);
    # head_zeros covers the entries before the first depth chosen by top-k.
    head_zeros: torch.Tensor  # [1, 1, F] long


def _lattice_nodes(
    depth: int, top_k: int, max_nodes: int, limit: int
) -> tuple[list[int], list[int], list[tuple[int, ...]]] | None:
    """Parent, depth and ranks of every fixed-pool node, breadth first; None past ``limit``."""
    parent, node_depth, ranks = [-1], [0], [()]
    level = [(0, 1, 1)]  # (node, nodes scoring at least as well, product of (r_i + 1))
    for d in range(1, depth + 1):
        nxt = []
        for node, at_least, prod in level:
            for r in range(top_k):
                count = at_least + prod * (r + 1)
                if count > max_nodes:
                    break  # larger ranks have even more
                nxt.append((len(parent), count, prod * (r + 1)))
                parent.append(node)
                node_depth.append(d)
                ranks.append((*ranks[node], r))
                if len(parent) > limit:
                    return None
        level = nxt
    return parent, node_depth, ranks


def _beam_widths(depth: int, top_k: int, max_nodes: int) -> tuple[int, ...]:
    """Entries per depth, the root first: all K * W_{d-1} candidates or the W_d best."""
    widths = [1]
    for d in range(1, min(depth, max_nodes - 1) + 1):  # depth >= N holds no tree node
        full = widths[-1] * top_k
        width = 1
        while width < full and width + _ancestors(width, d, top_k) < max_nodes:
            width += 1
        widths.append(width)
    return tuple(widths)


def _ancestors(count: int, depth: int, top_k: int) -> int:
    """Fewest distinct ancestors (root included) that ``count`` depth-``depth`` nodes have."""
    return sum(max(1, -(-count // top_k ** (depth - e))) for e in range(depth))


@lru_cache(maxsize=64)
def _choose_strategy(depth: int, top_k: int, max_nodes: int) -> Strategy:
    """The cheaper exact pool for these static sizes."""
    small = _lattice_nodes(depth, top_k, max_nodes, _LATTICE_POOL_LIMIT) is not None
    return "lattice" if small else "beam"


def _strategy_for(
    data: torch.Tensor, root_tokens: torch.Tensor, depth: int, top_k: int, max_nodes: int
) -> Strategy:
    """The compiled merge for CPU tensors where it was built, else the cheaper torch pool."""
    from sglang_bastion.kernels.dispatch import use_compiled_cpu  # kernels import this module

    if use_compiled_cpu(data, root_tokens) and _compiled() is not None:
        return "merge"
    return _choose_strategy(depth, top_k, max_nodes)


@lru_cache(maxsize=1)
def _compiled():
    """The compiled CPU builder (``kernels/tree_build_cpu.c``), or None if it was not built."""
    try:
        from sglang_bastion.kernels import _tree_build_cpu
    except ImportError:
        return None
    return _tree_build_cpu


def _choose_groups(rows: int, vocab: int, top_k: int, device: torch.device) -> int:
    """Vocabulary groups for the two-stage top-K (CPU only), or 0 for one top-k per row."""
    if device.type != "cpu" or rows * vocab < _GROUPED_TOP_K_MIN * torch.get_num_threads() ** 2:
        return 0
    for size in range(math.isqrt(vocab // top_k), 1, -1):  # group size; the count is V / size
        if vocab % size == 0:
            return vocab // size
    return 0


@lru_cache(maxsize=64)
def _make_plan(
    strategy: Strategy, depth: int, top_k: int, max_nodes: int, device: torch.device
) -> _Plan:
    """Index tables of the pool of ``strategy`` (see `_lattice_pool` and `_beam_pool`)."""
    widths: tuple[int, ...] = ()
    rows, grid, head = 0, [], 1
    if strategy == "lattice":
        nodes = _lattice_nodes(depth, top_k, max_nodes, limit=lattice_size(depth, top_k))
        assert nodes is not None
        parent, node_depth, ranks = nodes
        entries = len(parent)
        # One grid column per leaf, holding its root-to-leaf path; row t is depth t + 1. Each
        # node's score is read from the first column whose path passes through it.
        has_child = set(parent)
        leaves = [u for u in range(1, entries) if u not in has_child]
        rows = max((node_depth[u] for u in leaves), default=1)
        columns = len(leaves) + 1  # the last column stays 0 and gives the root its score
        zero = depth * top_k  # index of the 0 appended to the flattened log q
        grid = [zero] * (rows * columns)
        cell = [rows * columns - 1] * entries
        for c, leaf in enumerate(leaves):
            path = ranks[leaf]
            for t in range(rows):  # past the leaf the cells hold unused sums
                grid[t * columns + c] = t * top_k + (path[t] if t < len(path) else 0)
            u = leaf
            while u > 0 and cell[u] == rows * columns - 1:
                cell[u] = (node_depth[u] - 1) * columns + c
                u = parent[u]
        cand_parent = [entries if p < 0 else p for p in parent]
        cand_token = [0] + [1 + (len(r) - 1) * top_k + r[-1] for r in ranks[1:]]
    else:
        widths = _beam_widths(depth, top_k, max_nodes)
        entries = sum(widths)
        node_depth = [d for d, w in enumerate(widths) for _ in range(w)]
        cand_parent, cand_token, cell = [entries], [0], [0]
        offset = 0  # first entry of depth d - 1
        for d in range(1, len(widths)):
            prev, start = widths[d - 1], len(cand_parent)
            cand_parent += [offset + f % prev for f in range(top_k * prev)]
            cand_token += [1 + (d - 1) * top_k + f // prev for f in range(top_k * prev)]
            if head == len(cell) and widths[d] == top_k * prev:  # keeps every candidate
                cell += range(start, start + widths[d])
                head += widths[d]
            else:  # chosen by top-k
                cell += [start] * widths[d]
            offset += prev
    size = min(max_nodes, entries)
    d64 = torch.tensor(node_depth, dtype=torch.float64)
    return _Plan(
        size=size,
        widths=widths,
        rows=rows,
        grid_index=torch.tensor(grid, dtype=torch.long, device=device),
        entry_index=torch.tensor(cell, device=device),
        cand_parent=torch.tensor(cand_parent, device=device),
        cand_token=torch.tensor(cand_token, device=device),
        key_scale=(1.0 + d64 * _DEPTH_SCALE).to(device),
        key_bias=(-d64 * _DEPTH_BIAS).to(device),
        node_depth=torch.tensor(node_depth, device=device),
        slots=torch.arange(size, device=device),
        head_zeros=torch.zeros(1, 1, head, dtype=torch.long, device=device),
    )


def build_trees(
    probs: torch.Tensor, root_tokens: torch.Tensor, *, top_k: int, max_nodes: int
) -> TreeBatch:
    """Best-first trees of up to ``max_nodes`` nodes from position-wise draft marginals."""
    if probs.dim() != 3:
        raise ValueError(f"probs must be (B, D, V), got shape {tuple(probs.shape)}")
    batch, depth, vocab = probs.shape
    if root_tokens.shape != (batch,):
        raise ValueError(f"root_tokens must be ({batch},), got {tuple(root_tokens.shape)}")
    if not 1 <= top_k <= vocab:
        raise ValueError(f"top_k must be in [1, vocab size {vocab}], got {top_k}")
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be at least 1 (the root), got {max_nodes}")
    strategy = _strategy_for(probs, root_tokens, depth, top_k, max_nodes)
    groups = _choose_groups(batch * depth, vocab, top_k, probs.device)
    return _build(probs, root_tokens, top_k, max_nodes, strategy, groups)


def _check_top_k(top_q: torch.Tensor, top_tokens: torch.Tensor, root_tokens: torch.Tensor) -> None:
    """Raise ValueError unless the shapes are [B, D, K], [B, D, K] and [B]."""
    if top_q.dim() != 3 or top_tokens.shape != top_q.shape:
        raise ValueError(
            f"top_q and top_tokens must both be (B, D, K), got {tuple(top_q.shape)} "
            f"and {tuple(top_tokens.shape)}"
        )
    if root_tokens.shape != top_q.shape[:1]:
        raise ValueError(f"root_tokens must be ({top_q.shape[0]},), got {tuple(root_tokens.shape)}")


def build_trees_from_top_k(
    top_q: torch.Tensor,
    top_tokens: torch.Tensor,
    root_tokens: torch.Tensor,
    *,
    max_nodes: int,
    compiled: bool = True,
) -> TreeBatch:
    """`build_trees` from [B, D, K] descending top-K probabilities and their [B, D, K] tokens.

    ``compiled=False`` keeps to the torch pools even where the compiled CPU merge would run.
    """
    _check_top_k(top_q, top_tokens, root_tokens)
    _, depth, top_k = top_q.shape
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be at least 1, got {max_nodes}")
    if compiled:
        strategy = _strategy_for(top_q, root_tokens, depth, top_k, max_nodes)
    else:
        strategy = _choose_strategy(depth, top_k, max_nodes)
    return _build_from_top_k(top_q, top_tokens, root_tokens, max_nodes, strategy)


def _build(
    probs: torch.Tensor,
    root_tokens: torch.Tensor,
    top_k: int,
    max_nodes: int,
    strategy: Strategy,
    groups: int,
) -> TreeBatch:
    """`build_trees` with its static choices given (arguments already validated)."""
    with torch.inference_mode():
        top_q, top_tokens = _top_k(probs, top_k, groups)  # [B, D, K] each, q descending
    return _build_from_top_k(top_q, top_tokens, root_tokens, max_nodes, strategy)


def _build_from_top_k(
    top_q: torch.Tensor,
    top_tokens: torch.Tensor,
    root_tokens: torch.Tensor,
    max_nodes: int,
    strategy: Strategy,
) -> TreeBatch:
    """The best-first trees of [B, D, K] top-K marginals under a given pool strategy."""
    if strategy == "merge":
        return _merge_build(top_q, top_tokens, root_tokens, max_nodes)
    batch, depth, top_k = top_q.shape
    plan = _make_plan(strategy, depth, top_k, max_nodes, top_q.device)
    size = plan.size
    entries = plan.node_depth.shape[0]
    # Intermediates skip autograd bookkeeping; the outputs are made outside, as ordinary
    # tensors that callers may still modify in place.
    with torch.inference_mode():
        log_q = top_q.float().log()  # [B, D, K]
        if strategy == "lattice":
            pool, cand_id = _lattice_pool(log_q, plan), None
        else:
            pool, cand_id = _beam_pool(log_q, plan)
        # Order by score, then depth: the key's depth shift is below one float32 step, and
        # the clamp keeps -inf scores (q = 0) in depth order too.
        key = torch.addcmul(plan.key_bias, pool.double().clamp_(min=-1e30), plan.key_scale)
        order = key.topk(size, dim=1).indices  # [B, n]: best first, the root at slot 0
        picked = order if cand_id is None else cand_id.gather(1, order)  # [B, n]
        slot = torch.full((batch, entries + 1), -1, dtype=torch.long, device=pool.device)
        slot.scatter_(1, order, plan.slots.expand(batch, size))  # [B, U + 1]: -1 if unpicked
        parent_entry = plan.cand_parent.take(picked)  # [B, n]
        token_col = plan.cand_token.take(picked)  # [B, n]
        token_table = torch.cat([root_tokens.view(batch, 1), top_tokens.reshape(batch, -1)], dim=1)
    pad = max_nodes - size
    return TreeBatch(
        token_ids=_pad(token_table.gather(1, token_col), pad, 0),
        parents=_pad(slot.gather(1, parent_entry), pad, -1),
        depths=_pad(plan.node_depth.take(order), pad, 0),
        log_scores=_pad(pool.gather(1, order), pad, float("-inf")),
        num_nodes=torch.full((batch,), size, dtype=torch.long, device=top_q.device),
    )


def _merge_build(
    top_q: torch.Tensor, top_tokens: torch.Tensor, root_tokens: torch.Tensor, max_nodes: int
) -> TreeBatch:
    """The beam pool's trees from CPU [B, D, K] top-K, by the compiled merges."""
    batch, depth, top_k = top_q.shape
    size = min(max_nodes, lattice_size(depth, top_k))
    with torch.inference_mode():
        log_q = top_q.float().log().contiguous()  # [B, D, K]
        tokens = top_tokens.to(torch.long).contiguous()  # [B, D, K]
        roots = root_tokens.to(torch.long).contiguous()  # [B]
    token_ids = torch.empty(batch, max_nodes, dtype=torch.long)  # [B, N] each, written in C
    parents = torch.empty(batch, max_nodes, dtype=torch.long)
    depths = torch.empty(batch, max_nodes, dtype=torch.long)
    log_scores = torch.empty(batch, max_nodes, dtype=torch.float32)
    _compiled().build(
        log_q.data_ptr(),
        tokens.data_ptr(),
        roots.data_ptr(),
        token_ids.data_ptr(),
        parents.data_ptr(),
        depths.data_ptr(),
        log_scores.data_ptr(),
        batch,
        depth,
        top_k,
        size,
        max_nodes,
    )
    num_nodes = torch.full((batch,), size, dtype=torch.long)
    return TreeBatch(token_ids, parents, depths, log_scores, num_nodes)


def _top_k(probs: torch.Tensor, top_k: int, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, D, K] largest probabilities of each position, descending, and their tokens.

    With ``groups`` > 0, token t belongs to group t % groups. A group whose maximum is not
    among the K best group maxima has K entries at least as large in other groups, so the K
    largest values are all found among the members of those K groups.
    """
    if groups == 0:
        return probs.topk(top_k, dim=-1)
    batch, depth, vocab = probs.shape
    rows, size = batch * depth, vocab // groups
    flat = probs.reshape(rows, vocab)  # [R, V]
    best = flat.view(rows, size, groups).amax(dim=1).topk(top_k, dim=1, sorted=False).indices
    members = torch.arange(0, vocab, groups, device=probs.device)  # [size]
    tokens = (best.unsqueeze(2) + members).view(rows, top_k * size)  # [R, K * size]
    values, pick = flat.gather(1, tokens).topk(top_k, dim=1)  # [R, K] each
    return values.view(batch, depth, top_k), tokens.gather(1, pick).view(batch, depth, top_k)


def _lattice_pool(log_q: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """[B, U] scores of the fixed pool, summed in float32 from the root down."""
    batch = log_q.shape[0]
    flat = log_q.new_zeros(batch, log_q[0].numel() + 1)  # [B, D*K + 1], the last stays 0
    flat[:, :-1] = log_q.view(batch, -1)
    grid = flat.index_select(1, plan.grid_index).view(batch, plan.rows, -1)  # [B, rows, cols]
    steps = grid.unbind(1)
    for t in range(1, plan.rows):
        steps[t].add_(steps[t - 1])  # row t now holds the depth-(t+1) score of each path
    return grid.view(batch, -1).index_select(1, plan.entry_index)


def _beam_pool(log_q: torch.Tensor, plan: _Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, U] scores of the beam pool and [B, U] candidate id of every entry."""
    batch = log_q.shape[0]
    widths = plan.widths
    head = plan.head_zeros.shape[2]  # entries (the root first) that keep every candidate
    prev = log_q.new_zeros(batch, 1, 1)  # [B, 1, W_{d-1}]: the root's score
    scores, picks = [prev], [plan.head_zeros.expand(batch, 1, head)]
    columns = log_q.unsqueeze(3).unbind(1)  # D x [B, K, 1]
    kept = 1
    for d in range(1, len(widths)):
        # [B, 1, K * W_{d-1}]: flat index k * W_{d-1} + i extends entry i by the rank-k token
        beam = torch.add(columns[d - 1], prev).view(batch, 1, -1)
        if kept < head:
            prev = beam
            kept += widths[d]
        else:
            prev, picked = beam.topk(widths[d], dim=2, sorted=False)  # [B, 1, W_d] each
            picks.append(picked)
        scores.append(prev)
    picked_ids = plan.entry_index + torch.cat(picks, 2).view(batch, -1)
    return torch.cat(scores, 2).view(batch, -1), picked_ids


def _pad(x: torch.Tensor, pad: int, value: float) -> torch.Tensor:
    """Right-pad the last dimension with a constant."""
    return x if pad == 0 else torch.nn.functional.pad(x, (0, pad), value=value)
