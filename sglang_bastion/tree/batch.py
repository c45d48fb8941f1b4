"""The tree structure every BASTION stage passes along: one best-first tree per request."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TreeBatch:
    """B draft trees, each stored best-first in N slots (node 0 is the root, then padding).

    Node order is best-first: within a request ``log_scores`` are non-increasing, every parent
    precedes its children, and the first n nodes form the optimal prefix-closed tree of size n.
    Slots at index >= ``num_nodes[b]`` are padding: parent -1, log score -inf. A batch is
    never written after it is built (its surrogate is computed once).
    """

    token_ids: torch.Tensor  # [B, N] long: token of each node (root: the committed bonus token)
    parents: torch.Tensor  # [B, N] long: parent slot, -1 for the root and for padding
    depths: torch.Tensor  # [B, N] long: distance from the root (root 0, padding 0)
    log_scores: torch.Tensor  # [B, N] float: log rho (root 0, padding -inf)
    num_nodes: torch.Tensor  # [B] long: real nodes per request, root included

    @property
    def batch_size(self) -> int:
        """Number of requests B."""
        return self.token_ids.shape[0]

    @property
    def max_nodes(self) -> int:
        """Slots per request N."""
        return self.token_ids.shape[1]

    @classmethod
    def roots(cls, root_tokens: torch.Tensor) -> TreeBatch:
        """B trees of their root alone (a plain step): the committed bonus tokens [B]."""
        tokens = root_tokens.to(torch.long).view(-1, 1)  # [B, 1]
        zeros = torch.zeros_like(tokens)
        return cls(
            token_ids=tokens, parents=zeros - 1, depths=zeros,
            log_scores=torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device),
            num_nodes=torch.ones(tokens.shape[0], dtype=torch.long, device=tokens.device),
        )  # fmt: skip

    def with_rows(self, rows: slice | torch.Tensor, part: TreeBatch) -> TreeBatch:
        """These trees with ``rows`` (a slice or [R] row indices) replaced by ``part``'s, all
        padded to the wider N."""
        n = max(self.max_nodes, part.max_nodes)

        def merged(mine: torch.Tensor, theirs: torch.Tensor, fill: float) -> torch.Tensor:
            out = torch.nn.functional.pad(mine, (0, n - mine.shape[1]), value=fill)  # [B, N]
            out[rows] = torch.nn.functional.pad(theirs, (0, n - theirs.shape[1]), value=fill)
            return out

        num_nodes = self.num_nodes.clone()  # [B]
        num_nodes[rows] = part.num_nodes
        return TreeBatch(
            token_ids=merged(self.token_ids, part.token_ids, 0),
            parents=merged(self.parents, part.parents, -1),
            depths=merged(self.depths, part.depths, 0),
            log_scores=merged(self.log_scores, part.log_scores, float("-inf")),
            num_nodes=num_nodes,
        )

    def real_mask(self) -> torch.Tensor:
        """[B, N] bool: True for real nodes, False for padding."""
        slots = torch.arange(self.max_nodes, device=self.token_ids.device)
        return slots.unsqueeze(0) < self.num_nodes.unsqueeze(1)

    def truncate(self, sizes: torch.Tensor) -> TreeBatch:
        """The same trees cut to their first ``sizes[b]`` nodes (best-first prefixes stay best)."""
        num_nodes = torch.minimum(self.num_nodes, sizes.to(self.num_nodes.dtype).clamp(min=1))
        keep = torch.arange(self.max_nodes, device=self.token_ids.device).unsqueeze(0)
        keep = keep < num_nodes.unsqueeze(1)  # [B, N]
        return TreeBatch(
            token_ids=self.token_ids,
            parents=torch.where(keep, self.parents, -1),
            depths=torch.where(keep, self.depths, 0),
            log_scores=torch.where(keep, self.log_scores, float("-inf")),
            num_nodes=num_nodes,
        )

    def narrow(self, width: int) -> TreeBatch:
        """The first ``width`` slots of every tree, as a batch of width-``width`` trees."""
        if not 1 <= width <= self.max_nodes:
            raise ValueError(f"width must be in [1, {self.max_nodes}], got {width}")
        return TreeBatch(
            token_ids=self.token_ids[:, :width],
            parents=self.parents[:, :width],
            depths=self.depths[:, :width],
            log_scores=self.log_scores[:, :width],
            num_nodes=self.num_nodes.clamp(max=width),
        )

    def surrogate(self) -> torch.Tensor:
        """[B, N] float: A_hat of the first n+1 nodes, i.e. the cumulative sum of rho."""
        cached = self.__dict__.get("_surrogate")  # a step prices and judges the same trees
        if cached is None:
            cached = torch.cumsum(torch.exp(self.log_scores), dim=1)
            object.__setattr__(self, "_surrogate", cached)
        return cached

    def check(self) -> None:
        """Raise AssertionError if any structural invariant is violated (host-syncing; tests)."""
        b, n = self.token_ids.shape
        for name in ("parents", "depths", "log_scores"):
            assert getattr(self, name).shape == (b, n), (
                f"{name} has shape {getattr(self, name).shape}"
            )
        assert self.num_nodes.shape == (b,)
        real = self.real_mask()
        assert bool((self.num_nodes >= 1).all()), "every tree has its root"
        assert bool((self.parents[:, 0] == -1).all()), "root has no parent"
        assert bool((self.depths[:, 0] == 0).all()), "root has depth 0"
        assert bool((self.log_scores[:, 0] == 0).all()), "root has log score 0"
        pad = ~real
        assert bool((self.parents[pad] == -1).all()), "padding has parent -1"
        assert bool(torch.isneginf(self.log_scores[pad]).all()), "padding has log score -inf"
        slots = torch.arange(n, device=self.parents.device).expand(b, n)
        child = real & (slots > 0)
        par = self.parents.clamp(min=0)
        assert bool(((self.parents < slots) & (self.parents >= 0))[child].all()), (
            "every parent precedes its child"
        )
        par_depth = self.depths.gather(1, par)
        assert bool((self.depths[child] == par_depth[child] + 1).all()), "depth = parent depth + 1"
        scores = self.log_scores.masked_fill(pad, float("-inf"))
        assert bool((scores[:, 1:] <= scores[:, :-1]).all()), "log scores are non-increasing"
        # siblings carry distinct tokens
        same_parent = (
            (self.parents.unsqueeze(2) == self.parents.unsqueeze(1))
            & child.unsqueeze(2)
            & child.unsqueeze(1)
        )
        same_token = self.token_ids.unsqueeze(2) == self.token_ids.unsqueeze(1)
        off_diag = ~torch.eye(n, dtype=torch.bool, device=self.parents.device)
        assert not bool((same_parent & same_token & off_diag).any()), (
            "siblings have distinct tokens"
        )
