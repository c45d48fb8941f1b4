"""Which requests' drafter context is whole, and which requests a step drafts.

A plain step must still write its tokens' target features into the draft KV, or the drafter
later reads a context with holes. That write is a drafter pass over the batch's new tokens,
a few percent of a plain step where the batch decodes plainly for long. A dormant plain step
(`Controller.dormant`: speculation judged not to pay four times in a row at a batch above
the probe sample) keeps that write only for a sample's worth of requests, the ones the next
sampled probe drafts; every other request of the batch falls behind for good.

A request that fell behind never drafts again: its drafts would read holes. Its steps verify
its root alone, which is exact and costs what a plain step costs it. Requests that join are
whole (their prefill writes the drafter's context), so the sample is refilled from them as
kept requests finish. A prefill while dormant writes the prompt context of only as many of
its requests as the kept ones that are still running leave a sample short of
(`joiners_kept_whole`); the others join behind. When a sample passes, dormancy ends and the
probes draft every whole request until the ones behind have finished, then the whole batch
again.

Exactness never depends on this state: drafts only propose tokens, and the target's own
tokens decide what is emitted. A request that reuses a cached prefix whose tokens were
decoded while dormant reads holes there too; its per-request acceptance calibration then
prices its trees down to the root, as for any drafter that guesses badly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftContext:
    """Requests (by id) whose draft KV fell behind, and those dormant steps keep whole."""

    behind: set[str] = field(default_factory=set)
    kept: frozenset[str] = frozenset()
    sample_at: int = 0  # where the next sample starts among the whole requests
    _last: tuple[tuple[str, ...], tuple[int, ...]] | None = None  # (batch, kept rows) cached


def kept_rows(state: DraftContext, requests: tuple[str, ...], keep: int) -> tuple[int, ...]:
    """Rows of ``requests`` whose context a dormant plain step still writes (up to ``keep``,
    the kept ones first, then whole ones in batch order); the others fall behind."""
    if state._last is not None and state._last[0] == requests:
        return state._last[1]
    rows = [i for i, rid in enumerate(requests) if rid in state.kept][:keep]
    for i, rid in enumerate(requests):
        if len(rows) >= keep:
            break
        if rid not in state.behind and rid not in state.kept:
            rows.append(i)
    rows.sort()
    members = set(requests)
    state.kept = frozenset(requests[i] for i in rows)
    state.behind = (state.behind & members) | (members - state.kept)  # finished ones dropped
    state._last = (requests, tuple(rows))
    return state._last[1]


def joiners_kept_whole(
    state: DraftContext, joiners: tuple[str, ...], running_kept: int, keep: int
) -> tuple[int, ...]:
    """Rows of ``joiners`` whose prompt context a dormant prefill still writes: enough to
    bring the ``running_kept`` requests kept whole up to ``keep``; the others join behind.

    A joiner seen before (a prompt prefilled in chunks, a retracted request) stays as it was.
    """
    again = [i for i, rid in enumerate(joiners) if rid in state.kept and rid not in state.behind]
    room = max(keep - running_kept - len(again), 0)
    new = [i for i, rid in enumerate(joiners) if rid not in state.kept and rid not in state.behind]
    rows = tuple(sorted(again + new[:room]))
    state.kept |= frozenset(joiners[i] for i in rows)
    state.behind |= {rid for i, rid in enumerate(joiners) if i not in rows}
    state._last = None
    return rows


def drafting_rows(state: DraftContext, requests: tuple[str, ...], rows: int) -> list[int] | None:
    """Rows a drafted step drafts: ``rows`` of the whole requests (a sample, a different run
    each time), or every whole request when ``rows`` is the batch (None: every request).

    With no whole request left, the sample is taken from all of them.
    """
    batch = len(requests)
    if rows >= batch and not state.behind:
        return None
    whole = (
        list(range(batch)) if not state.behind
        else [i for i, rid in enumerate(requests) if rid not in state.behind]
    )  # fmt: skip
    if not whole:
        whole = list(range(batch))
    if rows >= len(whole):
        return None if len(whole) == batch else whole
    start = state.sample_at % (len(whole) - rows + 1)
    state.sample_at = start + rows
    return whole[start : start + rows]


def probe_rows(
    state: DraftContext, requests: tuple[str, ...], rows: int
) -> tuple[list[int] | None, bool]:
    """The rows a drafted step drafts (`drafting_rows`) and whether it is a sampled probe.

    It is one only when fewer rows than the batch were asked for: a full probe of a batch
    whose other requests fell behind drafts the whole ones alone, and is judged as the full
    step it is (counted as a sample, it would pass as its sample did and probe again).
    """
    return drafting_rows(state, requests, rows), rows < len(requests)


def whole_count(state: DraftContext, requests: tuple[str, ...]) -> int:
    """How many of ``requests`` a full probe drafts: those whose drafter context is whole."""
    if not state.behind:
        return len(requests)
    return len(requests) - sum(rid in state.behind for rid in requests)


def full_step_mean(walked: torch.Tensor, whole: int, batch: int) -> torch.Tensor:
    """The mean tokens per request a full probe of ``batch`` requests would emit, when its
    ``whole`` requests walk as a sample's did (``walked`` [R]) and the rest emit a root each."""
    return 1.0 + (walked.float().mean() - 1.0) * (whole / batch)
