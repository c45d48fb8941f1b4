"""Plain steps' draft-KV writes, held and made together in one pass.

A plain step commits one token per request, and the drafter's KV must hold its features
before the drafter next reads that request's context. Made one step at a time, that write is
a drafter pass of B tokens, paid every step of a plain stretch (on a CPU its fixed cost is
most of the pass). Held, the writes of up to ``limit`` steps go in one pass.

Holding changes no drafter input, because only drafter passes read or write the draft KV
pool, and the worker makes the held writes before any other drafter pass, in the order they
were held. It also makes them when the batch's requests change: the scheduler frees and
hands on a finished request's slots only after the request has left the batch, so no held
write can land on a slot that already belongs to another request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

HOLD_STEPS = 16  # plain steps whose draft-KV writes go in one pass


@dataclass
class HeldDraftKv:
    """Draft-KV writes of consecutive plain steps of one batch, in the order they were held."""

    limit: int = HOLD_STEPS
    requests: tuple[str, ...] = ()  # the batch the held writes belong to
    features: list[torch.Tensor] = field(default_factory=list)  # [B, F] per step
    cache_loc: list[torch.Tensor] = field(default_factory=list)  # [B] draft-pool slots
    positions: list[torch.Tensor] = field(default_factory=list)  # [B]

    def __len__(self) -> int:
        """Steps held."""
        return len(self.features)

    def belongs_to(self, requests: tuple[str, ...]) -> bool:
        """Whether the held writes (if any) are of a batch of exactly these requests."""
        return not self.features or requests == self.requests

    def hold(
        self, requests: tuple[str, ...], features: torch.Tensor, cache_loc: torch.Tensor,
        positions: torch.Tensor,
    ) -> bool:  # fmt: skip
        """Hold one step's writes for ``requests``; True once ``limit`` steps are held."""
        if not self.belongs_to(requests):
            raise ValueError("held draft-KV writes of another batch must be made first")
        self.requests = requests
        self.features.append(features)
        self.cache_loc.append(cache_loc)
        self.positions.append(positions)
        return len(self.features) >= self.limit

    def take(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """[T, F] features, [T] slots and [T] positions of every held write, oldest first
        (None when none is held); the hold is empty afterwards."""
        if not self.features:
            return None
        taken = (torch.cat(self.features), torch.cat(self.cache_loc), torch.cat(self.positions))
        self.features, self.cache_loc, self.positions, self.requests = [], [], [], ()
        return taken


def holding_allowed(server_args: object, draft_worker: object) -> str | None:
    """Why plain steps must write the draft KV at once on this server (None: they may hold).

    A hierarchical cache may copy a finished request's draft KV to the host as soon as the
    request leaves the batch, and DFLASH's LiLiCorr head reads each write's features.
    """
    if getattr(server_args, "enable_hierarchical_cache", False):
        return "the hierarchical cache may back up the draft KV as requests finish"
    if getattr(draft_worker, "lilicorr", None) is not None:
        return "the drafter's LiLiCorr head reads every write's features"
    return None
