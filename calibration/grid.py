"""The calibration grid: which verify passes to time, and in which order.

A grid is batch sizes x tokens per request x context lengths, plus how often to time each
pass. The default is sized for about a minute on an 8B target on one GPU (the paper's
calibration takes 70 s); ``QUICK`` is for CI and the tiny CPU pair.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Grid:
    """Shapes to time and how: ``warmup`` untimed runs, then ``repeats`` timed runs each."""

    batch_sizes: tuple[int, ...]
    tokens: tuple[int, ...]  # tokens per request in one verify pass (the tree width)
    context_lens: tuple[int, ...]  # committed prefix length of every request
    repeats: int = 5
    warmup: int = 2

    def __post_init__(self) -> None:
        """Reject empty axes, non-positive sizes and a repeat count below one."""
        for name in ("batch_sizes", "tokens", "context_lens"):
            values = getattr(self, name)
            if not values:
                raise ValueError(f"calibration grid: {name} is empty")
            low = 0 if name == "context_lens" else 1
            if min(values) < low:
                raise ValueError(f"calibration grid: {name} must be >= {low}, got {values}")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError(
                f"calibration grid: repeats must be >= 1 and warmup >= 0, got {self.repeats} "
                f"and {self.warmup}"
            )

    def fitted_to(self, max_tokens: int, max_context: int) -> Grid:
        """This grid without the widths above ``max_tokens`` and contexts above ``max_context``.

        Contexts that are too long are replaced by the longest one that fits.
        """
        if max_tokens < 1 or max_context < 0:
            raise ValueError(
                f"calibration grid: no room for a verify pass (at most {max_tokens} tokens "
                f"per request at contexts up to {max_context})"
            )
        tokens = tuple(t for t in self.tokens if t <= max_tokens) or (max_tokens,)
        contexts = tuple(c for c in self.context_lens if c <= max_context)
        if len(contexts) < len(self.context_lens):  # the longest that fits replaces the rest
            contexts += (max_context,)
        return replace(self, tokens=_sorted(tokens), context_lens=_sorted(contexts))

    def points(self) -> Iterator[tuple[int, int]]:
        """(batch size, context length) pairs, smallest batch first.

        Each pair is one set-up (KV slots for every request); L_AR and a step at every verify
        width are timed inside it. Small batches come first so that an early Ctrl-C still leaves a
        profile spanning several widths.
        """
        for batch in _sorted(self.batch_sizes):
            for context in _sorted(self.context_lens):
                yield batch, context

    @property
    def num_timings(self) -> int:
        """Timed passes per round: a step at every width plus L_AR, per (batch, context)."""
        return len(self.batch_sizes) * len(self.context_lens) * (len(self.tokens) + 1)


def _sorted(values: tuple[int, ...]) -> tuple[int, ...]:
    """Distinct values in increasing order."""
    return tuple(sorted(set(values)))


DEFAULT = Grid(
    batch_sizes=(1, 2, 4, 8, 16, 32),
    tokens=(1, 4, 8, 16, 32, 64),
    context_lens=(256, 2048, 8192),
    repeats=5,
    warmup=2,
)
QUICK = Grid(
    batch_sizes=(1, 4, 16),
    tokens=(2, 8, 32),
    context_lens=(64, 512),
    repeats=5,
    warmup=1,
)
