"""Running counters of a BASTION server, for SGLang's ``/server_info`` and the sweeps.

The worker adds one step at a time; device-side sums stay on the device until someone reads
them, so counting never synchronises the step with the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

PACKED = (
    "steps", "plain_steps", "request_steps", "verify_tokens", "tree_nodes", "root_only",
    "priced_tokens",
)  # fmt: skip


@dataclass
class BastionStats:
    """Cumulative counts since the server started (read deltas for a window)."""

    steps: int = 0  # decode steps
    plain_steps: int = 0  # decode steps that verified every request's root alone
    graph_verifies: int = 0  # decode steps whose tree verify replayed a captured graph
    decoded_plain_steps: int = 0  # plain steps the target ran as SGLang's decode forward
    ragged_verifies: int = 0  # decode steps whose verify packed each tree unpadded
    sampled_probes: int = 0  # decode steps where only a sample of the requests drafted
    dormant_request_steps: int = 0  # plain request-steps whose drafter context was not written
    dormant_prompt_tokens: int = 0  # prompt tokens whose drafter context a prefill did not write
    steps_by_width: dict[int, int] = field(default_factory=dict)  # decode steps per verify width
    request_steps: int = 0  # sum over steps of requests in the batch
    verify_tokens: int = 0  # sum over steps of the tokens verified (padded: batch x width)
    timed_steps: int = 0  # steps with an observed verify time
    predicted_verify_ms: float = 0.0  # sum over timed steps of the model's prediction
    observed_verify_ms: float = 0.0  # sum over timed steps of the measured verify time
    last: dict[str, Any] = field(default_factory=dict)  # the latest step's decision
    _tree_nodes: torch.Tensor | None = None  # 0-dim: sum of verified tree sizes
    _accepted: torch.Tensor | None = None  # 0-dim: accepted drafts + bonus, summed
    _root_only: torch.Tensor | None = None  # 0-dim: request-steps that verified the root alone
    _priced: torch.Tensor | None = None  # 0-dim: tokens the controller priced, summed
    _accept_counts: torch.Tensor | None = None  # [L]: request-steps by tokens emitted (0..L-1)
    max_accept: int = 16  # the most tokens one step emits per request (the drafter's block)
    # request-steps of plain steps: a root each, one token each (counted on the host alone)
    _plain_request_steps: int = 0

    def add_step(
        self, sizes: torch.Tensor, accept_lens: torch.Tensor, width: int, predicted: float | None,
        plain: bool = False, priced: torch.Tensor | None = None,
        ragged: tuple[int, ...] | None = None,
    ) -> None:  # fmt: skip
        """Count one step: its tree sizes [B], acceptance lengths [B] and verify width.

        ``priced`` [B]: the tokens the controller expected each request to emit (None: its
        acceptance lengths, as for a plain step); ``ragged``: the sizes on the host when the
        pass verified them unpadded.
        """
        batch = int(sizes.shape[0])
        nodes, accepted, root_only = sizes.sum(), accept_lens.sum(), (sizes == 1).sum()
        expected = accepted.to(torch.float64) if priced is None else priced.sum(dtype=torch.float64)
        self._tree_nodes = nodes if self._tree_nodes is None else self._tree_nodes + nodes
        self._accepted = accepted if self._accepted is None else self._accepted + accepted
        self._root_only = root_only if self._root_only is None else self._root_only + root_only
        self._priced = expected if self._priced is None else self._priced + expected
        if self._accept_counts is None:  # [L]
            self._accept_counts = torch.zeros(
                self.max_accept + 1, dtype=torch.float64, device=accept_lens.device
            )
        lengths = accept_lens.to(torch.long).clamp(0, self.max_accept)
        self._accept_counts.scatter_add_(0, lengths, torch.ones_like(lengths, dtype=torch.float64))
        self.steps += 1
        self.plain_steps += int(plain)
        self.request_steps += batch
        self.verify_tokens += batch * width if ragged is None else sum(ragged)
        self.ragged_verifies += ragged is not None
        self.steps_by_width[width] = self.steps_by_width.get(width, 0) + 1
        self.last = {
            "batch_size": batch, "width": width, "predicted_verify_ms": predicted, "plain": plain
        }  # fmt: skip

    def add_plain_step(self, batch: int, predicted: float | None = None) -> None:
        """Count one plain step of ``batch`` requests (every one its root alone, one token)."""
        self._plain_request_steps += batch
        self.steps += 1
        self.plain_steps += 1
        self.request_steps += batch
        self.verify_tokens += batch
        self.steps_by_width[1] = self.steps_by_width.get(1, 0) + 1
        self.last = {
            "batch_size": batch, "width": 1, "predicted_verify_ms": predicted, "plain": True
        }  # fmt: skip

    def add_timing(self, predicted_ms: float | None, observed_ms: float) -> None:
        """Count an observed verify time beside the model's prediction."""
        self.last["observed_verify_ms"] = observed_ms
        if predicted_ms is not None:
            self.timed_steps += 1
            self.predicted_verify_ms += predicted_ms
            self.observed_verify_ms += observed_ms

    def packed(self) -> torch.Tensor | None:
        """[7 + L] float64 on the device: the counters in `PACKED` order, then the counts by
        tokens emitted (None before the first step)."""
        if self.steps == 0:
            return None
        plain = float(self._plain_request_steps)  # nodes, roots alone, priced: one each
        host = [self.steps, self.plain_steps, self.request_steps, self.verify_tokens]
        head = torch.tensor(host + [plain] * 3, dtype=torch.float64)  # [7]
        counts = torch.zeros(self.max_accept + 1, dtype=torch.float64)  # [L]
        counts[1] = plain
        if self._tree_nodes is None:
            return torch.cat([head, counts])
        device = self._accept_counts.device
        sums = torch.stack([self._tree_nodes.to(torch.float64), self._root_only.to(torch.float64),
                            self._priced])  # fmt: skip
        head = head.to(device, non_blocking=True)
        counts = counts.to(device, non_blocking=True)
        return torch.cat([head[:4], head[4:] + sums, self._accept_counts + counts])

    def as_dict(self) -> dict[str, Any]:
        """Counters and derived means as plain JSON values."""
        plain = self._plain_request_steps  # plain steps' requests: one node, one token each
        nodes = plain + (int(self._tree_nodes) if self._tree_nodes is not None else 0)
        accepted = plain + (int(self._accepted) if self._accepted is not None else 0)
        root_only = plain + (int(self._root_only) if self._root_only is not None else 0)
        priced = plain + (float(self._priced) if self._priced is not None else 0.0)
        per_request = max(self.request_steps, 1)
        return {
            "steps": self.steps,
            "plain_steps": self.plain_steps,
            "graph_verifies": self.graph_verifies,
            "decoded_plain_steps": self.decoded_plain_steps,
            "ragged_verifies": self.ragged_verifies,
            "sampled_probes": self.sampled_probes,
            "dormant_request_steps": self.dormant_request_steps,
            "dormant_prompt_tokens": self.dormant_prompt_tokens,
            "steps_by_width": {str(w): n for w, n in sorted(self.steps_by_width.items())},
            "root_only_request_steps": root_only,
            "request_steps": self.request_steps,
            "tree_nodes": nodes,
            "accepted_tokens": accepted,
            "verify_tokens": self.verify_tokens,
            "mean_tree_size": nodes / per_request if self.request_steps else None,
            "mean_accept_length": accepted / per_request if self.request_steps else None,
            "mean_priced_accept_length": priced / per_request if self.request_steps else None,
            "mean_batch_size": self.request_steps / self.steps if self.steps else None,
            "timed_steps": self.timed_steps,
            "mean_predicted_verify_ms": self.predicted_verify_ms / self.timed_steps
            if self.timed_steps
            else None,
            "mean_observed_verify_ms": self.observed_verify_ms / self.timed_steps
            if self.timed_steps
            else None,
            "last": dict(self.last),
        }
