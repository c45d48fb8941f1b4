"""The budget controller as the server runs it: one decision per step, and what it learned.

Each step the worker hands over the batch's trees and context lengths and gets back the
nodes every request verifies and the verify width W (the padded tokens per request of the one
target pass). Modes:

- ``fixed``: every request verifies min(N, its tree) nodes; W = N, known without a host sync.
- ``static`` / ``ema`` / ``ema_calib``: the latency model (budget/latency.py) prices a cycle
  with 1..N tokens per request at the batch's current size and mean context, then
  - layout ``uniform``: one width W for the batch maximising sum_r A_hat_r(W) / C(W)
    (controller.uniform_width), every request verifies W nodes;
  - layout ``ragged``: each request stops at its own first drop of A_hat(n) L_AR / C(n)
    (controller.per_request_sizes), and W is the largest of those sizes (the verify pass
    pads the others).
  The ema modes scale the verify prediction by gamma, the EMA of observed / predicted verify
  time, one per batch size (a batch size not yet observed takes the nearest one's): how much
  slower the served pass runs than predicted depends on the batch (on a shared CPU, the
  tokenizer, detokenizer and clients take more of it as more requests stream).

The model prices the draft (T_aux) and the verify pass; a served decode step also spends time
the profile cannot see: acceptance, KV moves, the scheduler and output processing between two
steps. With ``measure_overhead`` (the server's default) every adaptive mode adds that time as
measured: the period from one decode step's start to the next (when no prefill ran between
them) minus the model's cycle for the step, an EMA per batch size. Leaving it out prices a
larger tree as a larger share of the step than it is, and the controller undershoots.

The adaptive widths come from a short ladder (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, ... and N):
every distinct pass shape costs once (kernel primitives built on first use on CPU, one CUDA
graph per width on GPU), and a width that changes every step would keep paying that.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sglang_bastion.budget.latency import LatencyModel, ema_update
from sglang_bastion.controller import fixed_sizes, per_request_sizes, uniform_width
from sglang_bastion.tree.batch import TreeBatch


def width_ladder(max_nodes: int) -> tuple[int, ...]:
    """The verify widths an adaptive controller may pick: 1, 2, 4, then steps of ~1.5x, and N."""
    ladder, width = [1, 2, 4], 8
    while width < max_nodes:
        ladder += [width, width * 3 // 2]
        width *= 2
    return tuple(sorted({w for w in ladder if w < max_nodes} | {max_nodes}))


@dataclass(frozen=True)
class Decision:
    """One step's tree sizes and the latency the model predicted for them."""

    sizes: torch.Tensor  # [B] long: nodes each request verifies (root included)
    width: int  # W: tokens per request in the verify pass (max of sizes)
    predicted_verify_ms: float | None  # the model's T_verify at W (None in fixed mode)
    predicted_cycle_ms: float | None  # T_aux + T_verify at W, plus the overhead below
    overhead_ms: float = 0.0  # the measured per-step overhead included in the cycle


@dataclass
class LiveBudget:
    """The controller's per-server state: mode, latency model and the EMA correction."""

    mode: str  # "fixed", "static", "ema" or "ema_calib"
    max_nodes: int  # N: the largest tree a request may verify
    layout: str = "uniform"  # "uniform" or "ragged"
    model: LatencyModel | None = None
    ema_alpha: float = 0.1
    gamma: dict[int, float] = field(default_factory=dict)  # batch size -> EMA (ema modes)
    observed_steps: int = field(default=0)
    context_bucket: int = 16  # mean contexts are priced at the nearest multiple of this
    widths: tuple[int, ...] = ()  # allowed verify widths; () means width_ladder(max_nodes)
    measure_overhead: bool = False  # add the measured per-step time the model leaves out
    overhead_ms: dict[int, float] = field(default_factory=dict)  # batch size -> EMA, ms
    _verify_cache: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        """Refuse an adaptive mode without a latency model; settle the width ladder."""
        if self.mode != "fixed" and self.model is None:
            raise ValueError(f"controller mode {self.mode!r} needs a latency model (a profile)")
        self.widths = tuple(sorted(set(self.widths))) or width_ladder(self.max_nodes)
        if self.widths[0] < 1 or self.widths[-1] > self.max_nodes:
            raise ValueError(f"widths must lie in [1, {self.max_nodes}], got {self.widths}")

    def decide(self, trees: TreeBatch, context_lens: torch.Tensor) -> Decision:
        """Sizes and width for this step's trees at the batch's size and contexts."""
        if self.mode == "fixed":
            sizes = fixed_sizes(trees, self.max_nodes)
            # The width is static (no host sync): slots past a smaller tree are padding.
            return Decision(sizes, min(self.max_nodes, trees.max_nodes), None, None)
        batch = trees.batch_size
        context = float(context_lens.float().mean())
        overhead = self.step_overhead_ms(batch)
        cost = self.cost_vector_ms(batch, context) + overhead
        if self.layout == "ragged":
            sizes = per_request_sizes(trees, cost, self.model.ar_ms(batch))
            largest = int(sizes.max())
            width = next((w for w in self.widths if w >= largest), self.widths[-1])
        else:
            width = int(uniform_width(trees, cost, self.widths))
            sizes = trees.num_nodes.clamp(max=width)
        cycle = float(cost[width - 1])
        return Decision(sizes, width, cycle - overhead - self.model.aux_ms(batch), cycle, overhead)

    def cost_vector_ms(self, batch: int, context: float) -> torch.Tensor:
        """[N] float64: predicted cycle ms for 1..N tokens per request (cached verify terms)."""
        bucket = round(context / self.context_bucket) * self.context_bucket
        key = (batch, bucket)
        verify = self._verify_cache.get(key)
        if verify is None:  # the verify term before gamma: calibrated, or bare in "ema"
            if len(self._verify_cache) >= 4096:  # bounded: long-running servers see many keys
                self._verify_cache.clear()
            tokens = torch.arange(1, self.max_nodes + 1, dtype=torch.float64)  # [N]
            price = self.model.roofline_ms if self.mode == "ema" else self.model.verify_ms
            verify = self._verify_cache.setdefault(key, price(batch, tokens, bucket))
        scale = 1.0 if self.mode == "static" else self.gamma_at(batch)
        return self.model.aux_ms(batch) + scale * verify

    def gamma_at(self, batch: int) -> float:
        """The verify price's online scale at this batch size (nearest observed; 1 before any)."""
        return _nearest(self.gamma, batch, 1.0)

    def step_overhead_ms(self, batch: int) -> float:
        """Measured per-step time beyond the model's cycle: this batch size's, else the nearest."""
        return _nearest(self.overhead_ms, batch, 0.0)

    def observe_period(self, decision: Decision, batch: int, period_ms: float) -> None:
        """Fold one decode step's period (its start to the next step's start) into the overhead."""
        if not self.measure_overhead or decision.predicted_cycle_ms is None:
            return
        old = self.overhead_ms.get(batch)
        if period_ms <= 0 or (old is not None and period_ms > 4 * decision.predicted_cycle_ms):
            return  # a stall (GC, a paused client) once the batch size has an estimate
        model_cycle = decision.predicted_cycle_ms - decision.overhead_ms
        sample = max(period_ms - model_cycle, -0.5 * model_cycle)
        self.overhead_ms[batch] = sample if old is None else old + self.ema_alpha * (sample - old)

    def observe(self, decision: Decision, verify_ms: float) -> None:
        """Fold an observed verify time into its batch size's gamma (ema modes; else counted)."""
        self.observed_steps += 1
        if self.mode in ("ema", "ema_calib") and decision.predicted_verify_ms:
            batch = decision.sizes.numel()
            gamma = self.gamma_at(batch)
            bare = decision.predicted_verify_ms / gamma  # the prediction before gamma
            self.gamma[batch] = ema_update(gamma, verify_ms, bare, self.ema_alpha)

    @property
    def needs_timing(self) -> bool:
        """Whether decisions depend on observed step times."""
        return self.mode in ("ema", "ema_calib")


def _nearest(table: dict[int, float], batch: int, default: float) -> float:
    """The table's value at this batch size, else at the nearest (the smaller on ties)."""
    if batch in table:
        return table[batch]
    if not table:
        return default
    return table[min(table, key=lambda b: (abs(b - batch), b))]
