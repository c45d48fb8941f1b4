"""Each tree node's logits exactly as the plain server computes them after emitting its path.

Glossary. A request has emitted n tokens (its committed output, the root's bonus token
included); node i of its tree sits at depth d and its path is the d draft tokens from depth 1
down to i. The plain server, having emitted those n + d tokens, would draw the token after
node i from logits transformed by the request's penalty state after all n + d tokens:

- frequency: subtract ``f`` once per occurrence of a token in the output;
- presence: subtract ``p`` from every token the output holds;
- repetition: divide a positive logit by ``r`` (multiply a negative one) for those tokens;
- min_new_tokens: the stop tokens are -inf while the output is shorter than ``m``.

SGLang keeps that state per request ([B, V] tensors, its penalizers) and applies it to whole
rows. At node i only the columns of its path tokens (frequency, presence, repetition) and of
its stop tokens (min_new_tokens, by output length n + d) differ from the committed state, so
the committed transform runs on every row as the plain server runs it, and those few columns
are recomputed from their raw logits with the node's own counts and written back: at most D
path columns plus the request's stop tokens per node, no host sync, no Python per node.
The arithmetic (its order and its roundings) is the plain server's, so the values are equal
bit for bit.

Everything else the plain server applies (logit bias, grammar masks, temperature, top-k/p)
does not depend on the path and is applied to every node as to the root.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from sglang_bastion.late_read import to_device
from sglang_bastion.tree.batch import TreeBatch


@dataclass(frozen=True)
class PenaltyState:
    """B requests' committed penalty state, as SGLang's penalizers hold it; None where off."""

    frequency: torch.Tensor | None = None  # [B, 1] float32: f per request
    cumulated_frequency: torch.Tensor | None = None  # [B, V] float32: f added per occurrence
    presence: torch.Tensor | None = None  # [B, 1] float32: p per request
    cumulated_presence: torch.Tensor | None = None  # [B, V] float32: p where present, else 0
    repetition: torch.Tensor | None = None  # [B, 1] float32: r per request
    cumulated_repetition: torch.Tensor | None = None  # [B, V] float32: r where present, else 1
    min_new_tokens: torch.Tensor | None = None  # [B, 1] int32: m per request
    output_lens: torch.Tensor | None = None  # [B, 1] int32: tokens emitted so far (n)
    stop_penalties: torch.Tensor | None = None  # [B, V] float32: -inf at stop tokens, else 0
    stop_ids: torch.Tensor | None = None  # [B, S] long: each request's stop tokens (padded)

    @property
    def active(self) -> bool:
        """True when any penalty is on (else the transform is the identity)."""
        return any(
            t is not None
            for t in (self.frequency, self.presence, self.repetition, self.min_new_tokens)
        )


def path_tokens(trees: TreeBatch, max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, W, D] tokens of every node's path (itself first, then its ancestors) and validity.

    Entry k is the token of the node's k-th ancestor (k = 0: the node itself); it is valid
    while that ancestor is a draft node (depth >= 1): the root's token is already committed.
    """
    slot = torch.arange(trees.max_nodes, device=trees.token_ids.device).expand_as(trees.parents)
    tokens, valid = [], []
    for _ in range(max(max_depth, 1)):
        tokens.append(trees.token_ids.gather(1, slot))
        valid.append(trees.depths.gather(1, slot) >= 1)
        slot = trees.parents.gather(1, slot).clamp(min=0)
    return torch.stack(tokens, dim=2), torch.stack(valid, dim=2)  # [B, W, D] each


ScaleFn = Callable[[torch.Tensor, torch.Tensor], None]


def scale_logits(logits: torch.Tensor, scales: torch.Tensor) -> None:
    """Repetition scaling in place: a negative logit times its scale, another divided by it."""
    logits[:] = torch.where(logits < 0, logits * scales, logits / scales)


def apply_committed_penalties(
    logits: torch.Tensor,
    additive: torch.Tensor | None,
    scaling: torch.Tensor | None,
    scale_fn: ScaleFn = scale_logits,
) -> None:
    """Apply the requests' accumulated [B, V] additive, then scaling penalties to [B*W, V] logits.

    ``scale_fn``: the server's own scaling function (SGLang compiles it), so roundings match.
    """
    bs = (additive if additive is not None else scaling).shape[0]
    rows = logits.view(bs, -1, logits.shape[1])  # [B, W, V]
    if additive is not None:
        rows.add_(additive.unsqueeze(1))
    if scaling is not None:
        scale_fn(logits, scaling.repeat_interleave(rows.shape[1], dim=0))  # [B*W, V]


def apply_node_penalties(
    logits: torch.Tensor,
    raw: torch.Tensor,
    columns: torch.Tensor,
    state: PenaltyState,
    path: tuple[torch.Tensor, torch.Tensor],
    depths: torch.Tensor,
    scale_fn: ScaleFn = scale_logits,
) -> None:
    """Overwrite ``columns`` of [B*W, V] logits with their values after each node's path.

    ``raw``: [B, W, C] the logits at ``columns`` before any penalty; ``path``: ``path_tokens``;
    ``depths``: [B, W] node depths. Call after ``apply_committed_penalties``.
    """
    bs, width, _ = columns.shape
    tokens, valid = path
    hits = valid.unsqueeze(3) & (tokens.unsqueeze(3) == columns.unsqueeze(2))  # [B, W, D, C]
    in_path = hits.any(dim=2)  # [B, W, C]
    penalty = torch.zeros_like(raw, dtype=torch.float32)  # [B, W, C]: SGLang's additive sum
    if state.frequency is not None:
        counted = _gather(state.cumulated_frequency, columns)
        step = state.frequency.view(bs, 1, 1)
        for k in range(tokens.shape[2]):  # one addition per occurrence, as the plain server
            counted = counted + torch.where(hits[:, :, k], step, 0.0)
        penalty = penalty - counted
    if state.presence is not None:
        committed = _gather(state.cumulated_presence, columns)
        penalty = penalty - torch.where(in_path, state.presence.view(bs, 1, 1), committed)
    if state.min_new_tokens is not None:
        short = (state.output_lens + depths) < state.min_new_tokens  # [B, W]
        stop = _gather(state.stop_penalties, columns)
        penalty = penalty + torch.where(short.unsqueeze(2), stop, 0.0)
    values = (raw + penalty).to(logits.dtype)
    if state.repetition is not None:
        committed = _gather(state.cumulated_repetition, columns)
        scale = torch.where(in_path, state.repetition.view(bs, 1, 1), committed)
        flat = values.view(bs * width, -1)
        scale_fn(flat, scale.view(bs * width, -1))
    logits.view(bs, width, -1).scatter_(2, columns, values)


def node_columns(path: tuple[torch.Tensor, torch.Tensor], state: PenaltyState) -> torch.Tensor:
    """[B, W, C] the columns whose value can differ between a node and its root.

    A node's path tokens (D columns; invalid entries repeat a valid column, which is
    harmless: every listed column gets its exact value) and, under min_new_tokens, the
    request's stop tokens.
    """
    tokens, _ = path
    if state.min_new_tokens is None or state.stop_ids is None:
        return tokens
    stops = state.stop_ids.unsqueeze(1).expand(-1, tokens.shape[1], -1)  # [B, W, S]
    return torch.cat([tokens, stops], dim=2)


def commit_emitted(state: PenaltyState, emitted: torch.Tensor, lens: torch.Tensor) -> None:
    """Advance the committed state in place by each request's first ``lens[b]`` tokens.

    ``emitted``: [B, D+1] the step's emitted run (accepted drafts, then the bonus) and padding;
    ``lens``: [B] how many are real (at least 1). As the plain server does, token by token.
    """
    real = torch.arange(emitted.shape[1], device=emitted.device).unsqueeze(0) < lens.unsqueeze(1)
    # Padding points at the request's first emitted token: presence and repetition write the
    # same value there again, frequency adds 0.
    where = torch.where(real, emitted, emitted[:, :1])  # [B, D+1]
    if state.frequency is not None:
        step = torch.where(real, state.frequency, 0.0)
        state.cumulated_frequency.scatter_add_(1, where, step)
    if state.presence is not None:
        state.cumulated_presence.scatter_(1, where, state.presence.expand_as(where).contiguous())
    if state.repetition is not None:
        values = state.repetition.expand_as(where).contiguous()
        state.cumulated_repetition.scatter_(1, where, values)
    if state.min_new_tokens is not None:
        state.output_lens.add_(lens.view(-1, 1).to(state.output_lens.dtype))


def _gather(table: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """[B, W, C] entries of a [B, V] table at each node's columns."""
    bs, width, count = columns.shape
    return table.gather(1, columns.reshape(bs, width * count)).view(bs, width, count)


def penalize_tree_logits(
    logits: torch.Tensor,
    trees: TreeBatch,
    max_depth: int,
    additive: torch.Tensor | None,
    scaling: torch.Tensor | None,
    state: PenaltyState,
    scale_fn: ScaleFn = scale_logits,
) -> None:
    """The plain server's penalties at every node of [B*W, V] verify logits, in place.

    ``additive`` / ``scaling``: the committed [B, V] penalties SGLang accumulated for the step.
    """
    bs, width = trees.token_ids.shape
    path = path_tokens(trees, max_depth)
    columns = node_columns(path, state)  # [B, W, C]
    raw = logits.view(bs, width, -1).gather(2, columns)  # [B, W, C]: before any penalty
    if additive is not None or scaling is not None:
        apply_committed_penalties(logits, additive, scaling, scale_fn)
    apply_node_penalties(logits, raw, columns, state, path, trees.depths, scale_fn)


def state_from_penalizers(penalizers: Iterable[Any], reqs: list[Any] | None = None) -> PenaltyState:
    """The committed state held by SGLang's prepared penalizers (its tensors, not copies).

    ``reqs``: the batch's requests, whose stop tokens penalising nodes under min_new_tokens
    needs (committing tokens does not). They are read on the host once per batch
    composition: SGLang replaces the penalizer's tensors whenever the batch changes.
    """
    fields: dict[str, torch.Tensor] = {}
    for penalizer in penalizers:
        if not penalizer.is_prepared():
            continue
        if hasattr(penalizer, "cumulated_frequency_penalties"):
            fields["frequency"] = penalizer.frequency_penalties
            fields["cumulated_frequency"] = penalizer.cumulated_frequency_penalties
        elif hasattr(penalizer, "cumulated_presence_penalties"):
            fields["presence"] = penalizer.presence_penalties
            fields["cumulated_presence"] = penalizer.cumulated_presence_penalties
        elif hasattr(penalizer, "cumulated_repetition_penalties"):
            fields["repetition"] = penalizer.repetition_penalties
            fields["cumulated_repetition"] = penalizer.cumulated_repetition_penalties
        elif hasattr(penalizer, "stop_token_penalties"):
            fields["min_new_tokens"] = penalizer.min_new_tokens
            fields["output_lens"] = penalizer.len_output_tokens
            fields["stop_penalties"] = penalizer.stop_token_penalties
            if reqs is not None:
                fields["stop_ids"] = _stop_ids(penalizer, reqs)
    return PenaltyState(**fields)


def stop_token_ids(req: Any) -> set[int]:
    """The tokens SGLang's min_new_tokens penalizer holds back for ``req``."""
    tokenizer = req.tokenizer
    ids = (
        set(req.sampling_params.stop_token_ids or ())
        | set(req.eos_token_ids or ())
        | set(tokenizer.additional_stop_token_ids or ())
        | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
    )
    return {int(i) for i in ids if i is not None}


def _stop_ids(penalizer: Any, reqs: list[Any]) -> torch.Tensor:
    """[B, S] the requests' stop tokens, cached on the min_new_tokens penalizer."""
    table = penalizer.stop_token_penalties
    cached = getattr(penalizer, "_bastion_stop_ids", None)
    if cached is None or cached[0] is not table:  # the batch changed since
        cached = (table, _padded([stop_token_ids(r) for r in reqs], table.device))
        penalizer._bastion_stop_ids = cached
    return cached[1]


def _padded(sets: list[set[int]], device: torch.device) -> torch.Tensor:
    """[B, S] each set's ids, padded by repeating one (0 for an empty set: any column works)."""
    rows = [sorted(s) or [0] for s in sets]
    width = max(len(r) for r in rows)
    padded = torch.tensor([r + [r[0]] * (width - len(r)) for r in rows], dtype=torch.long)
    return to_device(padded, device)


# SGLang hands the worker ``SamplingBatchInfo.copy_for_forward()``: the copy drops the
# penalizers after accumulating them, so this hook keeps a reference on the copy.
COPY_FOR_FORWARD_HOOK = "sglang.srt.sampling.sampling_batch_info.SamplingBatchInfo.copy_for_forward"
_KEPT = "bastion_penalizers"


def keep_penalizers(result: Any, info: Any, *args: Any, **kwargs: Any) -> Any:
    """SGLang hook (after ``copy_for_forward``): the copy keeps its batch's penalizers."""
    setattr(result, _KEPT, info.penalizer_orchestrator)
    return result


def penalizers_of(info: Any) -> Any:
    """The penalizer orchestrator behind a forward's sampling info (None if there is none)."""
    if info is None:
        return None
    kept = getattr(info, _KEPT, None)
    return kept if kept is not None else getattr(info, "penalizer_orchestrator", None)
