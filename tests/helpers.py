"""Shared test helpers: random marginals of the shapes and pathologies the builder must handle,
and a small hand-drawn tree."""

from __future__ import annotations

import torch

from sglang_bastion.tree import TreeBatch

MARGINAL_KINDS = ("smooth", "peaked", "flat", "ties", "one_hot")


def random_marginals(
    batch: int, depth: int, vocab: int, kind: str, generator: torch.Generator
) -> torch.Tensor:
    """[B, D, V] float32 probability rows of the requested kind."""
    shape = (batch, depth, vocab)
    if kind == "smooth":
        probs = torch.softmax(torch.randn(shape, generator=generator), dim=-1)
    elif kind == "peaked":  # underflows to exact zeros and (near) ones
        probs = torch.softmax(30 * torch.randn(shape, generator=generator), dim=-1)
    elif kind == "flat":  # every entry ties
        probs = torch.full(shape, 1.0 / vocab)
    elif kind == "ties":  # few distinct values
        levels = torch.randint(1, 4, shape, generator=generator).float()
        probs = levels / levels.sum(dim=-1, keepdim=True)
    elif kind == "one_hot":  # q = 1 exactly on one token, 0 elsewhere
        hot = torch.randint(0, vocab, (batch, depth, 1), generator=generator)
        probs = torch.zeros(shape).scatter_(-1, hot, 1.0)
    else:
        raise ValueError(kind)
    return probs.float()


def small_tree() -> TreeBatch:
    """One hand-drawn tree of six nodes and a padding slot."""
    # root(10) ─ a(11) ─ c(13)
    #          └ b(12) ─ d(14) ─ e(15)        slot 6 is padding
    return TreeBatch(
        token_ids=torch.tensor([[10, 11, 12, 13, 14, 15, 0]]),
        parents=torch.tensor([[-1, 0, 0, 1, 2, 4, -1]]),
        depths=torch.tensor([[0, 1, 1, 2, 2, 3, 0]]),
        log_scores=torch.tensor([[0.0, -0.1, -0.2, -0.3, -0.4, -0.5, float("-inf")]]),
        num_nodes=torch.tensor([6]),
    )
