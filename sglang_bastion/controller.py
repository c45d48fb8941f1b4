"""Budget controller: how many tree nodes each request verifies this step.

All policies read the trees' surrogate A_hat (cumulative rho in best-first order, so concave
and non-decreasing in the tree size) and a verify-cycle cost vector from the latency model.
They are vectorised over the batch, never synchronise with the host and return tensors.

- `per_request_sizes`: the paper's rule. S_hat(n) = A_hat(n) * L_AR / C(n), stop at the first
  n with S_hat(n+1) < S_hat(n); optimal when A_hat is concave and C convex (Proposition 3.4).
- `uniform_width`: one width W for the whole batch (what CUDA graphs and SGLang's verify path
  take), maximising the batch goodput sum_r A_hat_r(W) / C(W) over the allowed widths.
- `fixed_sizes`: a fixed budget N, for ablations.

The controller as the server runs it is a `Controller` (``self.controller`` in the worker,
built at start-up by `Controller.for_worker`, which loads and checks the profile): one decision
per step, and what it learned. Each step the worker hands over the batch's trees and context
lengths and gets back the nodes every request verifies and the verify width W (the padded
tokens per request of the one target pass). Modes:

- ``fixed``: every request verifies min(N, its tree) nodes; W = N, known without a host sync.
- ``static`` / ``ema`` / ``ema_calib``: the latency model (budget/latency.py) prices a cycle
  with 1..N tokens per request at the batch's current size and mean context, then
  - layout ``uniform``: one width W for the batch maximising sum_r A_hat_r(W) / C(W)
    (`uniform_width`), every request verifies W nodes;
  - layout ``ragged``: each request stops at its own first drop of A_hat(n) L_AR / C(n)
    (`per_request_sizes`), and W is the largest of those sizes (the verify pass
    pads the others).
  - layout ``global`` (the server's default): one best-first expansion over every request's
    nodes, priced by the cycle of the batch's total verify tokens (`global_sizes`); each
    request verifies its own size and the pass packs them unpadded, where the attention
    backend verifies ragged (``bastion_cpu``); the batch's total comes from a fixed ladder
    (`packed_totals`), so the packed passes have few distinct shapes. On a backend that
    pads (Triton, FlashInfer) every tree is free up to the widest, so the global optimum
    there is the uniform width, and the layout decides as ``uniform`` does; so it does for
    a lone request, whose packed pass would save only the padding its next nodes fill.
  The ema modes scale the verify prediction by gamma, the EMA of observed / predicted verify
  time, one per batch size (a batch size not yet observed takes the nearest one's): how much
  slower the served pass runs than predicted depends on the batch (on a shared CPU, the
  tokenizer, detokenizer and clients take more of it as more requests stream).

The model prices the draft (T_aux) and the verify pass; a served decode step also spends time
the profile cannot see: acceptance, KV moves, the scheduler and output processing between two
steps. With ``measure_overhead`` (the server's default) every adaptive mode adds that time as
measured: the period from one decode step's start to the next (when no prefill ran between
them) minus the model's cycle for the step, an EMA per batch size. Leaving it out prices a
larger tree as a larger share of the step than it is, and the controller undershoots. The
server also keeps that overhead per verify width (``width_overheads``): a profile can misprice
how the cycle grows with the width (on a CPU host it priced a 16-node step of the block-16
pair 13 ms above an 8-node one, and the two cost the same), and each width's measured
overhead corrects its price. A width keeps its offset from the batch size's overhead: an EMA,
from none, of each warm period's overhead less the batch size's before it (a sample counts at
most 1.5 times the width's priced cycle: a stall). The batch size's overhead, which every step
measures, follows the host for every width alike, and a width not measured yet is priced by
it alone; a width seldom verified is priced by few samples, and one slow pass moves it by
``ema_alpha`` of its excess, no more. A width explored now and then gets a few samples a
minute, too few to follow a drifting host: as overheads of their own, started from the batch
size's when first measured, two explored widths began at 18 and 20 ms after a warm-up on a CPU
host at one request, against about 7 ms for the two widths run most, and were still at 6.5 and
7.4 ms 1600 and 1900 steps later, when those two were at 1 to 5 ms; and at the end of 45 s of
steady load the width run was priced 3 to 4 ms below all its neighbours, whose last samples
dated from a slower host. A packed pass's
tokens per request vary inside its width (a width of 8 holds 5 to 8), and there the overhead's
slope against the model's cycle is learned too (`width_slope`): at batch 16 on a CPU host,
the served verify rose 2.3 ms from 4 to 8 tokens a request where the profile prices 4.1, so
the profile's rise alone cut trees short. The slope is shrunk towards the profile's and kept
in [-1, 1], so a price never falls as tokens are added. At a batch of at most ``probe_rows``
requests, every ``explore_every`` speculative steps a stretch of ``explore_run`` steps
verifies the ladder width next to the chosen one, wider and narrower in turn, so a width the
profile overprices is measured and then taken, and the widths beside the chosen one stay
measured (at the widest width, the narrower alone). A stretch's first ``explore_cold`` steps,
and the step back from it, price no width: a pass shape met seldom runs cold, and priced by
such steps every width but the one a server runs looked dearer than it is.

With ``learn_acceptance`` (the server's default in the adaptive modes) the worker hands each
step its requests' acceptance calibration (``acceptance_scale``): trees are priced by A_cal,
and a plain step (no draft, every request its root alone) is one of the options, chosen by
the model until both kinds of step have measured rates at a similar batch size, then by the
rates (`drafts_this_step`, `decide`).

The adaptive widths come from a short ladder (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, ... and N):
every distinct pass shape costs once (kernel primitives built on first use on CPU, one CUDA
graph per width on GPU), and a width that changes every step would keep paying that.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang_bastion.acceptance_scale import calibrated_surrogate
from sglang_bastion.budget import LatencyModel, ModelShape, ema_update, load_profile
from sglang_bastion.budget.global_budget import (
    allowed_totals,
    global_sizes,
    packed_totals,
    total_tokens,
)
from sglang_bastion.budget.identity import device_name, worker_identity
from sglang_bastion.late_read import to_device
from sglang_bastion.options import BastionOptions
from sglang_bastion.tree.batch import TreeBatch

logger = logging.getLogger(__name__)


def per_request_sizes(
    trees: TreeBatch, cost_ms: torch.Tensor, ar_ms: float = 1.0,
    surrogate: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """[B] tree sizes by the first-drop rule on S_hat(n) = A_hat(n) * L_AR / C(n).

    ``surrogate`` [B, N]: the A_hat to price with (default the trees' own).
    """
    nodes = trees.max_nodes
    _check_costs(cost_ms, nodes, "cost_ms", "C(n) for n = 1..N tokens per request")
    accepted = trees.surrogate() if surrogate is None else surrogate
    speedup = accepted * ar_ms / cost_ms.to(trees.log_scores).unsqueeze(0)  # [B, N]
    return _first_drop(speedup).clamp(max=trees.num_nodes)


def uniform_width(
    trees: TreeBatch, cost_ms: torch.Tensor, widths: Sequence[int] | None = None,
    surrogate: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """0-dim width W (from ``widths``, default 1..N) maximising sum_r A_hat_r(W) / C(W).

    ``surrogate`` [B, N]: the A_hat to price with (default the trees' own).
    """
    allowed, goodput = _goodput(trees, cost_ms, widths, surrogate)
    best = goodput.argmax().view(1)  # the smallest width among equals
    return allowed.index_select(0, best).squeeze(0)  # indexing by a 0-dim tensor reads it


def uniform_choice(
    trees: TreeBatch, cost_ms: torch.Tensor, widths: Sequence[int] | torch.Tensor | None,
    surrogate: torch.Tensor | None, plain_ms: float,
) -> torch.Tensor:  # fmt: skip
    """[2] long: `uniform_width`'s W, and 1 when a plain step (one token per request at
    ``plain_ms``, no draft) yields at least its goodput, else 0."""
    allowed, goodput = _goodput(trees, cost_ms, widths, surrogate)
    best = goodput.argmax().view(1)
    plain = (goodput.index_select(0, best) <= trees.batch_size / plain_ms).to(allowed.dtype)
    return torch.cat([allowed.index_select(0, best), plain])


def _goodput(
    trees: TreeBatch, cost_ms: torch.Tensor, widths: Sequence[int] | torch.Tensor | None,
    surrogate: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """[widths] the allowed widths and their predicted goodput sum_r A_r(W) / C(W)."""
    nodes = trees.max_nodes
    _check_costs(cost_ms, nodes, "cost_ms", "C(W) for W = 1..N tokens per request")
    device = trees.log_scores.device
    if isinstance(widths, torch.Tensor):  # sorted and checked by the caller, maybe on device
        allowed = widths.to(device)
    else:
        allowed = torch.tensor(sorted(set(widths))) if widths else torch.arange(1, nodes + 1)
        if allowed.numel() == 0 or allowed[0] < 1 or allowed[-1] > nodes:
            raise ValueError(f"widths must be non-empty and within [1, {nodes}], got {widths}")
        allowed = allowed.to(device)
    accepted = trees.surrogate() if surrogate is None else surrogate  # [B, N]
    return allowed, accepted[:, allowed - 1].sum(dim=0) / cost_ms.to(device)[allowed - 1]


def read_width(width: torch.Tensor) -> int:
    """The step's one host read of a device value: the verify width the controller chose."""
    return int(width)


def read_choice(choice: torch.Tensor) -> tuple[int, bool]:
    """The step's one host read when it may step plainly: (width, whether plain pays more)."""
    width, plain = choice.tolist()
    return int(width), bool(plain)


def fixed_sizes(trees: TreeBatch, budget: int) -> torch.Tensor:
    """[B] sizes for a fixed budget of ``budget`` nodes (root included) per request."""
    if budget < 1:
        raise ValueError(f"budget must be at least 1 (the root), got {budget}")
    return trees.num_nodes.clamp(max=budget)


def _first_drop(values: torch.Tensor) -> torch.Tensor:
    """[R] the 1-based index n of the first n with values[n+1] < values[n], else the length."""
    drops = values[:, 1:] < values[:, :-1]  # [R, L-1]
    drops = torch.cat([drops, drops.new_ones(drops.shape[0], 1)], dim=1)  # sentinel at the end
    return drops.to(torch.uint8).argmax(dim=1) + 1


def _check_costs(cost: torch.Tensor, length: int, name: str, meaning: str) -> None:
    """Raise ValueError unless ``cost`` is a 1-D vector of ``length`` entries."""
    if cost.dim() != 1 or cost.numel() != length:
        raise ValueError(f"{name} must hold {meaning} ({length} values), got {tuple(cost.shape)}")


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
    plain: bool = False  # every request verifies its root alone: no speculation this step
    drafted: bool = True  # the step ran the draft pass (False: a plain step, no draft at all)
    expected: torch.Tensor | None = None  # [B] tokens priced per request (None: plain step)
    ragged: tuple[int, ...] | None = None  # host sizes when the verify packs them unpadded
    probe: bool = False  # drafted while speculation was judged not to pay (a probe, its judge)
    sampled: bool = False  # a sampled probe: `Controller.draft_rows` drafted; roots emitted
    overhead_width: int = 0  # the ladder width whose measured overhead priced it (0: none)
    # a step whose pass shape is cold (a width's first step at its batch size, an
    # exploration's first steps, the step back from one): its period prices no width
    # (`Controller.explore_run`)
    warming: bool = False
    # the sizes are every tree's nodes up to the width: narrowing the trees alone cuts them
    narrows_only: bool = False

    def cut(self, trees: TreeBatch) -> TreeBatch:
        """The drafted ``trees`` cut to these sizes, as a batch of width-``width`` trees."""
        if self.narrows_only:
            return trees.narrow(self.width)
        return trees.narrow(self.width).truncate(self.sizes)  # sizes <= width


@dataclass
class Controller:
    """The controller's per-server state: mode, latency model and the EMA correction."""

    mode: str  # "fixed", "static", "ema" or "ema_calib"
    max_nodes: int  # N: the largest tree a request may verify
    layout: str = "uniform"  # "uniform", "ragged" or "global"
    model: LatencyModel | None = None
    packs_ragged: bool = False  # the verify pass packs each request's rows (no padding)
    ema_alpha: float = 0.1
    gamma: dict[int, float] = field(default_factory=dict)  # batch size -> EMA (ema modes)
    observed_steps: int = field(default=0)
    context_bucket: int = 16  # mean contexts are priced at the nearest multiple of this
    widths: tuple[int, ...] = ()  # allowed verify widths; () means width_ladder(max_nodes)
    measure_overhead: bool = False  # add the measured per-step time the model leaves out
    overhead_ms: dict[int, float] = field(default_factory=dict)  # batch size -> EMA, ms
    plain_overhead_ms: dict[int, float] = field(default_factory=dict)  # the same, plain steps
    # With ``width_overheads``, a speculative step's overhead is also kept per verify width, as
    # its offset from the batch size's overhead when it was measured (batch size -> ladder
    # width -> ms): the profile may misprice how the cycle grows with the width, and the
    # offset measured at each width corrects it there, while the batch size's overhead, which
    # every step measures, follows the host's drift for every width alike. Explorations
    # (``explore_every``, ``explore_run``) keep the widths beside the chosen one measured.
    width_overheads: bool = False
    width_offset_ms: dict[int, dict[int, float]] = field(default_factory=dict)
    # The overhead's slope inside a packed width (module doc, `width_slope`): batch size ->
    # ladder width -> EMA of the model cycle its passes were priced at, and batch size -> EMA
    # of u^2 and u*v, u and v a pass's cycle and overhead deviations from its width's means as
    # shares of the width's mean cycle (`benchmarks/results/served_widths_amd_c16/`).
    width_cycle_ms: dict[int, dict[int, float]] = field(default_factory=dict)  # B -> W -> EMA
    width_slope_moments: dict[int, tuple[float, float]] = field(default_factory=dict)
    slope_alpha: float = 0.05
    slope_prior: float = 1e-3  # a spread of about 3% of the cycle weighs as much as no slope
    explore_every: int = 64
    # An exploration verifies its width for ``explore_run`` drafted steps in a row, and its
    # first ``explore_cold`` steps price nothing, nor does the step back: a pass shape met once
    # in a while runs slower than the same shape met every step (on a CPU host at batch 1, the
    # first step at another width came 1.0 ms above the fourth at 8 and 16 tokens, 3.1 ms at
    # 24, on periods of 11.5-12 ms, the second 0.3-0.4 ms (2.6 at 24), and the step back to the
    # chosen width 1.2 ms above its other steps), so single explorations priced every other
    # width above the chosen one, whichever the warm-up had left the server at.
    explore_run: int = 4
    explore_cold: int = 2
    _since_explore: int = field(default=0, repr=False)
    _explore_left: int = field(default=0, repr=False)  # steps left in the current stretch
    _explore_width: int | None = field(default=None, repr=False)  # the stretch's width
    _explored: bool = field(default=False, repr=False)  # the last step was an exploration
    _widths_run: set[tuple[int, int]] = field(default_factory=set, repr=False)  # (B, W) run
    _explored_wider: bool = field(default=False, repr=False)  # the last exploration's side
    _ladder: list[int] = field(default_factory=list, repr=False)  # [N] ladder width holding n
    _verify_cache: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict, repr=False)
    _seen_shapes: set[tuple[int, int]] = field(default_factory=set, repr=False)  # (B, W) timed
    _device_cache: dict[tuple, torch.Tensor] = field(default_factory=dict, repr=False)
    _device_widths: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    _plain_verify: dict[tuple[int, int], float] = field(default_factory=dict, repr=False)
    _roots: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict, repr=False)
    # Learning what is accepted (adaptive modes): the worker passes each step's calibration
    # scales, and a plain step (no draft, the root alone) is an option of every decision.
    learn_acceptance: bool = False
    # At most this many plain steps between two drafted probes: where trees keep losing, a
    # probe (a draft pass, or a speculative step that loses) costs about one plain step, so
    # probes then draft in under 3% of the steps.
    max_backoff: int = 64
    plain_left: int = 0  # plain steps still to run before the next drafted probe
    backoff: int = 0  # plain steps the last probe that chose plain scheduled
    # EMA weight of the newest measured rate: one greedy step emits 1 to the tree's depth, so a
    # heavier weight lets a few poor steps in a row price speculation below plain steps
    rate_alpha: float = 0.1
    plain_every: int = 64  # speculative steps between two plain steps that measure plain rate
    spec_rate: dict[int, float] = field(default_factory=dict)  # batch size -> tokens/request/ms
    plain_rate: dict[int, float] = field(default_factory=dict)  # the same, plain steps
    # Plain periods folded per batch size. A batch size's first plain period is not folded:
    # the first decode forward at a batch shape runs cold (2-3x slower on a CPU), and plain
    # steps are too rare (one in ``plain_every``) for an EMA to wash such a sample out; the
    # next ones are averaged until ``1 / rate_alpha`` of them make the EMA.
    plain_periods: dict[int, int] = field(default_factory=dict)
    # Plain steps' worth of time the probes of one plain wait lose (batch size -> EMA): the
    # waits then grow until probes lose at most probe_share of the time.
    probe_loss: dict[int, float] = field(default_factory=dict)
    probe_share: float = 0.01
    # A probe at a larger batch first drafts this many of its requests (a sampled probe); what
    # they accept decides whether the whole batch's draft pass, the full probe, is worth it.
    probe_rows: int = 4
    # From this plain wait on (after four plain judgements in a row), the drafter's context
    # writes of a plain step are kept only for the requests the next sample may draft
    # (`dormant`): the others' draft KV falls behind and they decode plainly until they end.
    dormant_backoff: int = 8
    spec_period: dict[int, float] = field(default_factory=dict)  # batch size -> speculative ms
    _sample_passed: bool = field(default=False, repr=False)  # the next probe drafts everyone
    _probed: bool = field(default=False, repr=False)  # a probe speculates: judge it when done
    _wait_loss: float | None = field(default=None, repr=False)  # probes' loss since the last wait
    # A probe speculates for up to ``probe_steps`` measured steps, until they took
    # ``probe_time`` plain steps' time, and is judged by what they emitted per ms together:
    # one step's tokens vary too much (1 to the tree's depth at T=0) to stand for what
    # speculation yields now, while a probe where trees lose by far stops after one step.
    probe_steps: int = 4
    probe_time: float = 8.0
    _probe: tuple[int, float, float] = field(default=(0, 0.0, 0.0), repr=False)  # steps, tok, ms
    # (the plain wait a passing probe ended, tokens per request, ms) of the speculative steps
    # since (None: no probe resumed speculation): if they lose to plain steps, the next wait
    # doubles that one (the probe was lucky) instead of starting over from one plain step.
    _resumed: tuple[int, float, float] | None = field(default=None, repr=False)
    _since_plain: int = field(default=0, repr=False)  # drafted steps since the last plain one
    _kinds: frozenset[int] = field(default=frozenset(), repr=False)  # request kinds joined
    _joined: int = field(default=0, repr=False)  # requests joined since the last decode step
    _joined_accept: bool = field(default=False, repr=False)  # all of accepting kinds
    _plain_kinds: frozenset[int] = field(default=frozenset(), repr=False)  # judged not to pay
    # Whether a drafted step was judged to pay since the last wave joined (speculation went
    # on, or a probe passed): only then does a new wave start the plain waits over.
    _wave_paid: bool = field(default=True, repr=False)

    def __post_init__(self) -> None:
        """Refuse an adaptive mode without a latency model; settle the width ladder."""
        if self.mode != "fixed" and self.model is None:
            raise ValueError(f"controller mode {self.mode!r} needs a latency model (a profile)")
        self.use_widths(self.widths or width_ladder(self.max_nodes))

    def use_widths(self, widths: tuple[int, ...]) -> None:
        """Choose among ``widths`` from now on (an adaptive mode: those verified in graphs)."""
        chosen = tuple(sorted(set(widths)))
        if not chosen or chosen[0] < 1 or chosen[-1] > self.max_nodes:
            raise ValueError(f"widths must lie in [1, {self.max_nodes}], got {widths}")
        self.widths = chosen
        self._device_widths.clear()
        self._ladder = [next(w for w in chosen if w >= n) if n <= chosen[-1] else chosen[-1]
                        for n in range(1, self.max_nodes + 1)]  # fmt: skip

    @classmethod
    def for_worker(cls, worker: Any, options: BastionOptions, max_nodes: int) -> Controller:
        """The controller of a starting BASTION worker (loads and checks its profile)."""
        mode = options.resolved_mode
        if mode == "fixed" or not options.profile:
            return cls(mode="fixed", max_nodes=max_nodes, layout=options.layout)
        expect = worker_identity(worker, worker.server_args)
        profile = load_profile(
            options.profile, expect, expect_device_name=device_name(torch.device(worker.device))
        )
        target_config = worker.target_worker.model_runner.model_config.hf_config.to_dict()
        model = LatencyModel.from_profile(profile, ModelShape.from_hf_config(target_config))
        measure = measures_overhead(options, getattr(worker.server_args, "tp_size", 1) or 1)
        if options.measure_overhead and not measure:
            logger.info("BASTION: step overhead not measured under tensor parallelism")
        budget = cls(
            mode=mode, max_nodes=max_nodes, layout=options.layout, model=model,
            ema_alpha=options.ema_alpha, measure_overhead=measure, widths=options.widths,
            learn_acceptance=options.learn_acceptance, width_overheads=measure,
        )  # fmt: skip
        measured = max(p.tokens_per_request for p in profile.grid)
        if unmeasured := unmeasured_widths(budget.widths, measured):
            logger.warning(
                "BASTION: the profile measured verify widths up to %d tokens per request; "
                "widths %s are priced by extrapolating its fit. To measure them, recalibrate "
                "with bastion-calibrate ... --speculative-num-draft-tokens %d",
                measured, ", ".join(map(str, unmeasured)), max_nodes,
            )  # fmt: skip
        return budget

    def summary(self, profile: str | None) -> dict[str, Any]:
        """What /server_info and the start-up log say about the controller."""
        adaptive = self.model is not None
        summary: dict[str, Any] = {
            "mode": self.mode,
            "layout": self.layout,
            "packs_ragged": self.packs_ragged,
            "max_nodes": self.max_nodes,
            "widths": list(self.widths) if adaptive else None,
            "profile": profile if adaptive else None,
            "measure_overhead": self.measure_overhead,
            "learn_acceptance": self.learns_acceptance,
        }
        if adaptive:
            summary["hardware"] = self.model.hardware.name
            summary["calibration"] = {
                "slope": self.model.calibration.slope,
                "intercept_ms": self.model.calibration.intercept_ms,
                "grid_residual": self.model.residual is not None,
            }
        return summary

    @property
    def learns_acceptance(self) -> bool:
        """Whether decisions price calibrated acceptance and may fall back to plain steps."""
        return self.learn_acceptance and self.model is not None

    def drafts_this_step(self, batch: int) -> bool:
        """Whether the coming decode step of ``batch`` requests drafts; False: a plain step.

        Plain steps run while speculation does not pay (see `decide`; where the measured
        rates alone already decide it, before any draft pass is spent), and, when the step
        rates are measured, once every ``plain_every`` speculative steps (after 4 while no
        plain step of a similar batch size was measured): the plain rate speculation must
        beat is measured, not assumed.
        """
        self._new_wave(batch)
        if self.plain_left > 0:
            self.plain_left -= 1
            return False
        if self.learns_acceptance and self._plain_before_drafting(batch):
            return False
        if self.learns_acceptance and self.measure_overhead:
            self._since_plain += 1
            due = 4 if _near(self.plain_rate, batch) is None else self.plain_every
            if self._since_plain > due:
                self._since_plain = 0
                return False
        return True

    def draft_rows(self, batch: int) -> int:
        """Requests the coming drafted step drafts: all of ``batch``, or `probe_rows` of them
        when it is a probe whose sample has not yet shown that the full probe is worth it."""
        sampling = self.learns_acceptance and self.measure_overhead and self.probe_rows > 0
        if sampling and batch > self.probe_rows and self.backoff > 0 and not self._probed:
            return batch if self._sample_passed else self.probe_rows
        return batch

    def dormant(self, batch: int) -> bool:
        """Whether this plain step of ``batch`` requests may skip the drafter's context writes
        of all but a sample's worth of its requests: speculation has been judged not to pay
        at least four times in a row, probes here draft samples, and no sample has passed."""
        sampling = self.learns_acceptance and self.measure_overhead and self.probe_rows > 0
        return (
            sampling and batch > self.probe_rows and self.backoff >= self.dormant_backoff
            and not self._sample_passed and not self._wave_joined(batch)
        )  # fmt: skip

    def requests_joined(
        self, kinds: frozenset[int] | None = None, count: int = 0,
        accepting: frozenset[int] = frozenset(),
    ) -> None:  # fmt: skip
        """New requests of ``kinds`` (GREEDY, SAMPLED; None: unknown) are in the batch: the
        next decode step drafts and decides afresh, unless plain steps run and every joined
        kind was in the batch when speculation was last judged not to pay.

        ``count``: how many joined; ``accepting``: the kinds whose drafts are accepted
        (`acceptance_scale.accepting_kinds`). When the requests joined since the last
        decode step are at least half of its batch (a new wave) and of accepting kinds, the
        plain wait starts over (`_new_wave`).
        """
        if kinds is None or not kinds <= self._plain_kinds:
            self.plain_left = 0
        self._kinds |= kinds or frozenset()
        accepts = kinds is not None and kinds <= accepting
        self._joined_accept = accepts and (self._joined == 0 or self._joined_accept)
        self._joined += count

    def _wave_joined(self, batch: int) -> bool:
        """Whether the requests joined since the last decode step are a new wave of accepting
        kinds: at least half of a ``batch`` (the worker reports joiners before their prefill,
        so a prefill's own joiners count when it asks `dormant`)."""
        return bool(self._joined) and 2 * self._joined >= batch and self._joined_accept

    def _new_wave(self, batch: int) -> None:
        """Start the plain waits over where a wave of new requests of accepting kinds makes at
        least half of this ``batch``: what the batch's drafts were worth before (a long wait,
        dormant drafter contexts, speculation a probe resumed) came from requests that are
        gone or older than these. A drafter is least sure of a completion's first tokens, so
        a new wave's first steps often lose to plain steps where its later ones win by far;
        judged against the old wait, those first steps doubled it into dormancy (`dormant`),
        and the wave's requests decoded plainly to their end. Now the wave's waits double from
        one plain step, and its prefill writes every joiner's drafter context (`dormant` is
        false while a wave joins). A batch that speculates goes on as it was.

        Only a wave after one in which speculation was judged to pay (it went on, or a probe
        passed) starts over. Where no probe passes, as where short requests end and join in
        waves every few dozen steps, each restart's doubling waits drafted one probe in about
        13 steps instead of the share `_probe_wait` allows; such waves keep the wait, and a
        probe that passes in one of them lets the next wave start over."""
        if self._wave_joined(batch):
            self._resumed = None  # speculation since a probe: the old requests' to judge
            paid, self._wave_paid = self._wave_paid, False
            if self.backoff > 0 and paid:  # the measured rates judge the wave afresh
                self.backoff = self.plain_left = 0
                self._probed = self._sample_passed = False
                self._probe, self._plain_kinds = (0, 0.0, 0.0), frozenset()
        self._joined, self._joined_accept = 0, False

    def decide(
        self, trees: TreeBatch, context_lens: torch.Tensor, scale: torch.Tensor | None = None,
        sample: slice | torch.Tensor | None = None,
    ) -> Decision:  # fmt: skip
        """Sizes and width for this step's trees at the batch's size and contexts.

        ``scale`` [B]: each request's acceptance calibration (``acceptance_scale``); the
        trees are priced by A_cal instead of A_hat, and when no width beats a plain step the
        decision is plain and the next drafted probe waits (1, 2, 4, up to ``max_backoff``
        plain steps while probes keep choosing plain; requests of a kind not in the batch
        then end the wait). ``sample``: the rows that drafted (a slice or [R] row indices: a
        sampled probe; the others'
        trees are their roots). Sizes are then priced as if every request had drafted as the
        sample did on average, and the step speculates on the sample, to measure it.
        """
        if self.mode == "fixed":
            sizes = fixed_sizes(trees, self.max_nodes)
            # The width is static (no host sync): slots past a smaller tree are padding.
            width = min(self.max_nodes, trees.max_nodes)
            expected = _at(trees.surrogate(), sizes)
            return Decision(sizes, width, None, None, expected=expected, narrows_only=True)
        batch = trees.batch_size
        context = float(context_lens.sum()) / batch  # the host copy of the contexts
        overhead = self.step_overhead_ms(batch)
        widened = self._width_overheads(batch, overhead)  # [N] per width, or None

        def drafted() -> torch.Tensor:  # [N] on the host: the model's cycles, overheads in
            base = self.cost_vector_ms(batch, context)
            return base + (overhead if widened is None else torch.tensor(widened, dtype=base.dtype))

        cost = None  # [N] `drafted()`, where a branch prices per request

        device = trees.log_scores.device
        accepted = trees.surrogate() if scale is None else calibrated_surrogate(trees, scale)
        num_nodes = trees.num_nodes  # [B]
        if sample is not None:  # a full step's sizes, had every request drafted as these did
            accepted = accepted[sample].mean(dim=0, keepdim=True).expand(trees.batch_size, -1)
            num_nodes = trees.num_nodes[sample].max().expand(trees.batch_size)
        learning = self.learns_acceptance
        plain_ms = self._plain_ms(batch, context) if learning else 0.0
        explore, warming = self._explore_due(batch, sample)
        model_plain = False  # whether the model prices a plain step above every tree
        ragged = total = None  # a packed pass: each request's size, priced by all its tokens
        narrows_only = False  # sizes are every tree's nodes up to the width
        # One tree packs to nothing but its padding, which its next nodes fill instead: a lone
        # request is priced as the padded pass it runs (the uniform rule at one request).
        if self.layout == "global" and self.packs_ragged and batch > 1:
            total, modelled = self._total_cost(
                batch, context, overhead, trees.max_nodes, device, widened
            )
            allowed = self._allowed_totals(batch, trees.max_nodes, device)  # [B*N]
            sizes, goodput = global_sizes(accepted, num_nodes, total, allowed)
            sizes = torch.minimum(sizes, trees.num_nodes)  # a sampled probe's others: roots
            loses = goodput <= batch / plain_ms if learning else goodput.new_zeros(())
            parts = [sizes, loses.view(1).to(sizes)]
            if explore:  # and every tree's size, to widen them
                parts.append(trees.num_nodes.to(sizes))
            host = torch.cat(parts).tolist()  # the one host read
            ragged, model_plain = tuple(host[:batch]), bool(host[batch])
            if explore and (other := self._neighbour(self._ladder[max(ragged) - 1], explore)):
                if other > max(ragged):  # every tree up to the wider width
                    ragged = tuple(min(n, other) for n in host[batch + 1 :])
                    sizes = trees.num_nodes.clamp(max=other)
                else:  # the chosen sizes, cut to the narrower width
                    ragged = tuple(min(n, other) for n in ragged)
                    sizes = sizes.clamp(max=other)
            width = next((w for w in self.widths if w >= max(ragged)), self.widths[-1])
            if width < max(ragged):  # the widths stop short of N
                ragged = tuple(min(n, width) for n in ragged)
                sizes = sizes.clamp(max=width)
            if explore and sum(ragged) not in packed_totals(batch * self.max_nodes):
                ragged = None  # an exploration off the totals' ladder: padded to the width
        elif self.layout == "ragged":
            cost = drafted()
            priced = self._priced(cost, device, batch, context, overhead, widened)
            sizes = per_request_sizes(trees, priced, self.model.ar_ms(batch), accepted)
            largest = sizes.max()
            if learning:
                emitted = _at(accepted, sizes).sum()
                loses = emitted / priced.to(device)[largest - 1] <= batch / plain_ms
                largest, model_plain = read_choice(torch.stack([largest, loses.to(largest)]))
            else:
                largest = read_width(largest)
            width = next((w for w in self.widths if w >= largest), self.widths[-1])
            sizes = sizes.clamp(max=width)  # below N only where the widths stop short of it
        else:
            cost = drafted()
            priced = self._priced(cost, device, batch, context, overhead, widened)
            allowed = self._widths_on(device)
            if learning:
                choice = uniform_choice(trees, priced, allowed, accepted, plain_ms)
                width, model_plain = read_choice(choice)
            else:
                width = read_width(uniform_width(trees, priced, allowed, accepted))
            if explore:
                width = self._neighbour(width, explore) or width
            sizes, narrows_only = trees.num_nodes.clamp(max=width), True
        probe = learning and self.backoff > 0
        sampled = sample is not None
        plain = learning and not sampled and self._steps_plainly(model_plain, batch)
        if plain:  # this step drafted already: what it costs is the width-1 cycle
            sizes, width, ragged, narrows_only = sizes.new_ones(batch), 1, None, True
        keyed = 0 if plain or sampled else self._overhead_width(width, ragged, batch)
        if keyed and (batch, keyed) not in self._widths_run:  # its first pass: cold
            self._widths_run.add((batch, keyed))
            warming = True
        if ragged is None:
            cycle = float((drafted() if cost is None else cost)[width - 1])
            if widened is not None:  # the overhead the cycle was priced with
                overhead = float(widened[(keyed or 1) - 1])
        else:  # a packed pass: its overhead is all its price beyond the model's cycle
            at = sum(ragged) - 1
            cycle, model_cycle = torch.stack([total[at], modelled[at]]).tolist()
            overhead = cycle - model_cycle
        verify_ms = cycle - overhead - self.model.aux_ms(batch)
        expected = _at(accepted, sizes)
        return Decision(
            sizes, width, verify_ms, cycle, overhead, plain=plain, expected=expected,
            ragged=ragged, probe=probe, sampled=sampled,
            overhead_width=keyed if self.width_overheads else 0, narrows_only=narrows_only,
            warming=warming,
        )  # fmt: skip

    def _overhead_width(self, width: int, ragged: tuple[int, ...] | None, batch: int) -> int:
        """The ladder width whose overhead prices a pass: its width, or for a packed pass the
        smallest ladder width holding its mean tokens per request."""
        return width if ragged is None else self._ladder[-(-sum(ragged) // batch) - 1]

    def _width_overheads(self, batch: int, overhead: float) -> list[float] | None:
        """[N] ms: the overhead that prices 1..N tokens per request at this batch size:
        ``overhead`` (the batch size's) plus the measured offset of the ladder width holding
        each, none where unmeasured (None: no width measured here, or the per-width overheads
        are off)."""
        measured = self.width_offset_ms.get(batch) if self.width_overheads else None
        if not measured:
            return None
        # [N]: the overhead of the ladder width holding n = 1..N tokens per request
        return [overhead + measured.get(w, 0.0) for w in self._ladder]

    def _explore_due(self, batch: int, sample: slice | torch.Tensor | None) -> tuple[int, bool]:
        """This drafted step's place in an exploration's stretch (1 = its first; 0: not an
        exploration, see ``explore_run``) and whether its pass shape is cold; counts the steps
        since the last stretch."""
        back, self._explored = self._explored, False
        if not self.width_overheads or self.explore_every <= 0 or sample is not None:
            self._explore_left = 0  # a stretch is broken off by anything else
            return 0, False
        if batch > self.probe_rows or not self.measure_overhead:
            self._explore_left = 0
            return 0, False
        run = max(1, self.explore_run)
        if self._explore_left == 0:
            self._since_explore += 1
            if self._since_explore < self.explore_every:
                return 0, back
            self._since_explore = 0
            self._explore_left = run
            self._explore_width = None  # chosen by the stretch's first step
        self._explore_left -= 1
        self._explored = True
        place = run - self._explore_left
        return place, place <= self.explore_cold

    def _neighbour(self, width: int, place: int) -> int | None:
        """The ladder width an exploration from ``width`` verifies: the next wider and the next
        narrower in turn, stretch by stretch, the other where one side has none (None:
        neither). Never narrower than 2: a width of 1 verifies no draft, and prices the draft
        pass for nothing. A stretch's later steps (``place`` > 1) keep its first step's width."""
        if place > 1 and self._explore_width is not None:
            return self._explore_width
        wider = next((w for w in self.widths if w > width), None)
        narrower = next((w for w in reversed(self.widths) if 2 <= w < width), None)
        self._explored_wider = not self._explored_wider
        first, other = (wider, narrower) if self._explored_wider else (narrower, wider)
        self._explore_width = first if first is not None else other
        return self._explore_width

    def _steps_plainly(self, model_plain: bool, batch: int) -> bool:
        """Whether this drafted step verifies roots alone; schedules plain steps and probes.

        Coming back from plain steps, drafted steps speculate (a probe: what do trees yield
        now?) until `_probing` ends, whatever the model prices (only speculative steps
        measure what trees yield), and the next step judges the probe's steps together.
        Otherwise a step goes plain when the measured rates say a plain step emits more per
        millisecond than a speculative one at this batch size, or, before both are measured,
        when the model says so. Each plain decision doubles the plain wait, up to
        ``max_backoff`` or, where probes cost more, up to `_probe_wait`; speculating ends
        it, and the probe's measured rate replaces the speculative rate from before the wait.
        Speculation that a probe resumed and that lost by the next plain decision doubles the
        probe's wait instead (`_wait_plainly`).
        """
        waiting = self.backoff > 0
        if waiting and not self._probed:
            self._probed, self._probe = True, (0, 0.0, 0.0)
            return False
        if self._probing(batch):
            return False
        loses = self._measured_loses(batch, judged=self._probed)
        if not (model_plain if loses is None else loses):
            if waiting:  # a probe passed: speculation resumes, and is judged as it goes
                self._resumed = (self.backoff, 0.0, 0.0)
                steps, tokens, ms = self._probe
                if steps and ms > 0:  # from what the probe measured, not the rate before it
                    self.spec_rate[batch] = tokens / ms
            self.backoff, self._probed, self._plain_kinds = 0, False, frozenset()
            self._sample_passed, self._wave_paid = False, True
            return False
        self._wait_plainly(batch)
        return True

    def _plain_before_drafting(self, batch: int) -> bool:
        """Whether this step goes plain on the measured rates alone, so drafts nothing.

        `_steps_plainly` reads the drafted trees only where no probe was judged and the
        rates are not both measured, or to launch a probe; otherwise the rates decide, and a
        step they judge plain would spend its draft pass for nothing (the last probe lost, or
        speculation measures slower than plain steps at this batch size).
        """
        if (self.backoff > 0 and not self._probed) or self._probing(batch):
            return False  # a probe is due or under way: it drafts
        if not self._measured_loses(batch, judged=self._probed):
            return False
        self._wait_plainly(batch)
        return True

    def _wait_plainly(self, batch: int) -> None:
        """Double the plain wait (up to its cap) and start it; speculation was judged. After
        speculation a probe resumed, the wait doubles the probe's own wait unless the steps
        since emitted at least what plain steps would have (`_resumed_lost`)."""
        cap = max(self.max_backoff, self._probe_wait(batch))
        base = self.backoff
        if self._resumed is not None and self._resumed_lost(batch):
            base = max(base, self._resumed[0])
        self._resumed = None
        self.backoff = min(max(1, 2 * base), cap)
        self.plain_left, self._probed, self._plain_kinds = self.backoff, False, self._kinds
        self._sample_passed = False

    def _probe_wait(self, batch: int) -> int:
        """Plain steps a wait needs for its probes to lose at most ``probe_share`` of the time
        (0 until probes were measured; at most 8 x ``max_backoff``, so speculation resumes).

        Folds the probes' measured loss since the last wait into this batch size's EMA first.
        """
        if self._wait_loss is not None:
            self._fold_rate(self.probe_loss, batch, self._wait_loss)
            self._wait_loss = None
        loss = _near(self.probe_loss, batch)
        if loss is None:
            return 0
        return min(math.ceil(loss / self.probe_share), 8 * self.max_backoff)

    def _resumed_lost(self, batch: int) -> bool:
        """Whether the speculative steps since a probe resumed speculation emitted less per
        ms than plain steps at this batch size (False: none measured)."""
        _, tokens, ms = self._resumed
        plain = _near(self.plain_rate, batch)
        return ms > 0 and plain is not None and tokens / ms < plain

    def _probing(self, batch: int) -> bool:
        """Whether a probe speculates and has measured fewer than ``probe_steps`` steps, and
        less than ``probe_time`` plain steps' time (one step where no plain rate judges it)."""
        if not self._probed or self.backoff == 0 or not self.measure_overhead:
            return False
        steps, _, ms = self._probe
        plain = _near(self.plain_rate, batch)
        if steps == 0:
            return True
        return plain is not None and steps < self.probe_steps and ms * plain < self.probe_time

    def _measured_loses(self, batch: int, judged: bool) -> bool | None:
        """Whether speculation emitted less per ms than plain steps (None: not measured).

        ``judged``: compare the probe's steps together, not the average of every step.
        """
        plain = _near(self.plain_rate, batch)
        steps, tokens, ms = self._probe
        spec = (tokens / ms if steps else None) if judged else _near(self.spec_rate, batch)
        if plain is None or spec is None:
            return None
        return spec < plain

    def plain_decision(
        self, batch: int, context_lens: torch.Tensor, device: torch.device
    ) -> Decision:
        """A plain step's decision: every request verifies its root alone, nothing drafted."""
        context = float(context_lens.float().mean())
        verify = self.gamma_at(batch) * self._one_token_ms(batch, context)
        overhead = self.plain_overhead_at(batch)
        sizes = self._roots.get((batch, str(device)))
        if sizes is None:  # [B] ones, made once per batch size (read, never written)
            sizes = torch.ones(batch, dtype=torch.long, device=device)
            self._roots[(batch, str(device))] = sizes
        return Decision(sizes, 1, verify, verify + overhead, overhead, plain=True, drafted=False)

    def _plain_ms(self, batch: int, context: float) -> float:
        """A plain step's predicted cycle at this batch size and mean context."""
        verify = self.gamma_at(batch) * self._one_token_ms(batch, context)
        return verify + self.plain_overhead_at(batch)

    def _one_token_ms(self, batch: int, context: float) -> float:
        """The verify price of one token each at gamma = 1 (cached per batch and bucket)."""
        key = (batch, round(context / self.context_bucket) * self.context_bucket)

        def one_token() -> float:
            self.cost_vector_ms(batch, context)  # fills the verify price cache at this key
            return float(self._verify_cache[key][0])

        return _cached(self._plain_verify, key, one_token)

    def plain_overhead_at(self, batch: int) -> float:
        """Measured time a plain step spends beyond its verify: this batch size's, else the
        nearest, else what drafted steps spend beyond the model's cycle."""
        if self.plain_overhead_ms:
            return _nearest(self.plain_overhead_ms, batch, 0.0)
        return self.step_overhead_ms(batch)

    def cost_vector_ms(self, batch: int, context: float) -> torch.Tensor:
        """[N] float64: predicted cycle ms for 1..N tokens per request (cached verify terms)."""
        bucket = round(context / self.context_bucket) * self.context_bucket
        key = (batch, bucket)

        def price() -> torch.Tensor:  # [N]: the mode's verify price at gamma = 1
            tokens = torch.arange(1, self.max_nodes + 1, dtype=torch.float64)  # [N]
            return self.model.verify_price_ms(batch, tokens, bucket, self.mode)

        verify = _cached(self._verify_cache, key, price)
        # gamma is linear in the ema modes' price; static mode never learns one (it stays 1).
        return self.model.aux_ms(batch) + self.gamma_at(batch) * verify

    def _priced(
        self, cost: torch.Tensor, device: torch.device, batch: int, context: float,
        overhead: float, widened: list[float] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """[N] the drafted cycles ``cost`` (host) as the decision prices them on ``device``
        (``widened`` [N]: the per-width overheads that replace ``overhead``)."""
        if device.type == "cpu":
            return cost
        priced = self._priced_on(device, batch, context, overhead)
        if widened is None:
            return priced
        return priced + to_device(torch.tensor(widened, dtype=torch.float64) - overhead, device)

    def _priced_on(
        self, device: torch.device, batch: int, context: float, overhead: float
    ) -> torch.Tensor:
        """`cost_vector_ms` plus ``overhead`` on ``device``, from a verify price copied once."""
        bucket = round(context / self.context_bucket) * self.context_bucket
        key = (batch, bucket, str(device))

        def copied() -> torch.Tensor:
            self.cost_vector_ms(batch, context)  # fills the host cache
            return self._verify_cache[key[:2]].to(device)

        verify = _cached(self._device_cache, key, copied)
        return (self.model.aux_ms(batch) + overhead) + self.gamma_at(batch) * verify

    def _total_cost(
        self, batch: int, context: float, overhead: float, nodes: int, device: torch.device,
        widened: list[float] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """([B*N] predicted cycle ms, [B*N] the model's part of it) of a ragged pass over
        T = 1..B*N tokens in all (``widened`` [N]: per-width overheads, each T priced at
        ceil(T / B) per request, plus the learned slope inside each width)."""
        bucket = round(context / self.context_bucket) * self.context_bucket
        key = ("total", batch, bucket, nodes, str(device))
        verify = _cached(  # [B*N]: priced at T / B tokens per request
            self._device_cache, key,
            lambda: self.model.verify_price_ms(
                batch, total_tokens(batch, nodes), bucket, self.mode
            ).to(device),
        )  # fmt: skip
        modelled = self.model.aux_ms(batch) + self.gamma_at(batch) * verify  # [B*N]
        if widened is None:
            return modelled + overhead, modelled
        # Per ladder slot n, the cycle at T tokens is a[n] + b[n] * modelled(T), n = ceil(T / B):
        # the slot's overhead, plus inside a measured width its slope around the width's mean
        # model cycle (a[n] = overhead[n] - slope * anchor, b[n] = 1 + slope).
        beta = self.width_slope(batch) or 0.0
        anchors = self.width_cycle_ms.get(batch, {})
        coefficients = [
            (o - beta * anchors[w], 1.0 + beta) if beta and w in anchors else (o, 1.0)
            for o, w in zip(widened, self._ladder, strict=True)
        ]  # fmt: skip
        rows = to_device(torch.tensor(coefficients, dtype=torch.float64).T, device)  # [2, N]
        slot = _cached(  # [B*N]: ceil(T / B) - 1 for T = 1..B*N
            self._device_cache, ("slot", batch, nodes, str(device)),
            lambda: torch.arange(batch * nodes, device=device) // batch,
        )  # fmt: skip
        a, b = rows.index_select(1, slot)  # [B*N] each
        return torch.addcmul(a, b, modelled), modelled

    def width_slope(self, batch: int) -> float | None:
        """The overhead's learned slope inside a width at this batch size, as a share of the
        model's cycle (None: not measured)."""
        moments = self.width_slope_moments.get(batch)
        if moments is None or not self.width_cycle_ms.get(batch):
            return None
        return min(1.0, max(-1.0, moments[1] / (moments[0] + self.slope_prior)))

    def _fold_slope(self, batch: int, width: int, model_cycle: float, deviation: float) -> None:
        """Fold one packed pass's model cycle and its overhead's deviation from its width's
        into the width's mean cycle and the batch size's slope moments."""
        anchors = self.width_cycle_ms.setdefault(batch, {})
        anchor = anchors.get(width)
        if anchor is None or anchor <= 0:
            anchors[width] = model_cycle
            return
        u, v = (model_cycle - anchor) / anchor, deviation / anchor
        uu, uv = self.width_slope_moments.get(batch, (0.0, 0.0))
        a = self.slope_alpha
        self.width_slope_moments[batch] = (uu + a * (u * u - uu), uv + a * (u * v - uv))
        anchors[width] = anchor + self.ema_alpha * (model_cycle - anchor)

    def _allowed_totals(self, batch: int, nodes: int, device: torch.device) -> torch.Tensor:
        """[B*N] bool `allowed_totals` on ``device``, made once per batch size."""
        key = ("allowed", batch, nodes, str(device))
        return _cached(self._device_cache, key, lambda: allowed_totals(batch, nodes).to(device))

    def _widths_on(self, device: torch.device) -> torch.Tensor:
        """[widths] the allowed verify widths as a tensor on ``device``, copied once."""
        allowed = self._device_widths.get(str(device))
        if allowed is None:
            allowed = torch.tensor(self.widths, device=device)
            self._device_widths[str(device)] = allowed
        return allowed

    def gamma_at(self, batch: int) -> float:
        """The verify price's online scale at this batch size (nearest observed; 1 before any)."""
        return _nearest(self.gamma, batch, 1.0)

    def step_overhead_ms(self, batch: int) -> float:
        """Measured per-step time beyond the model's cycle: this batch size's, else the nearest."""
        return _nearest(self.overhead_ms, batch, 0.0)

    def observe_period(
        self,
        decision: Decision,
        batch: int,
        period_ms: float,
        emitted: float | None = None,
        sampled: float | None = None,
    ) -> None:
        """Fold one decode step's period (its start to the next step's start) into the overhead.

        Drafted and plain steps keep separate overheads: what a drafted step spends beyond
        the model's cycle includes the draft pass's mispricing, which a plain step never pays.
        ``emitted``: the step's mean tokens per request, when known, for the measured rates
        that decide between plain and speculative steps; ``sampled``: a sampled probe's mean
        over the requests that drafted (see `_judge_sample`).
        """
        if not self.measure_overhead or decision.predicted_cycle_ms is None:
            return
        if decision.sampled:  # its period prices neither a plain nor a speculative step
            self._count_probe_loss(decision, batch, period_ms, emitted)
            self._judge_sample(batch, sampled)
            return
        if not decision.drafted and self._cold_plain(batch):
            return
        table = self.overhead_ms if decision.drafted else self.plain_overhead_ms
        old = table.get(batch)
        if period_ms <= 0 or (old is not None and period_ms > 4 * decision.predicted_cycle_ms):
            return  # a stall (GC, a paused client) once the batch size has an estimate
        model_cycle = decision.predicted_cycle_ms - decision.overhead_ms
        sample = max(period_ms - model_cycle, -0.5 * model_cycle)
        table[batch] = sample if old is None else old + self.ema_alpha * (sample - old)
        if decision.overhead_width and not decision.warming and old is not None:
            self._fold_width(decision, batch, model_cycle, sample, old)  # its width's offset
        self._count_probe_loss(decision, batch, period_ms, emitted)
        if not decision.drafted:
            self._fold_rate(self.plain_rate, batch, 1.0 / period_ms, self.plain_periods[batch])
        elif not decision.plain and emitted is not None:
            if self._resumed is not None:
                wait, tokens, ms = self._resumed
                self._resumed = (wait, tokens + emitted, ms + period_ms)
            if self._probing(batch):
                steps, tokens, ms = self._probe
                self._probe = (steps + 1, tokens + emitted, ms + period_ms)
            self._fold_rate(self.spec_rate, batch, emitted / period_ms)
            self._fold_rate(self.spec_period, batch, period_ms)

    def _fold_width(
        self, decision: Decision, batch: int, model_cycle: float, sample: float, base: float
    ) -> None:
        """Fold one warm period's overhead ``sample``, less its batch size's overhead ``base``
        before it, into its width's offset (and a packed pass's slope): from none, by
        ``ema_alpha``; a sample counts at most 1.5 times the width's priced cycle (a stall)."""
        width = decision.overhead_width
        widths = self.width_offset_ms.setdefault(batch, {})
        capped = min(sample, 1.5 * decision.predicted_cycle_ms - model_cycle) - base
        was = widths.get(width, 0.0)
        if decision.ragged is not None:  # a packed pass: the slope inside its width
            self._fold_slope(batch, width, model_cycle, capped - was)
        widths[width] = was + self.ema_alpha * (capped - was)

    def observe_cut(self, decision: Decision, batch: int, sampled: float | None) -> None:
        """A decode period a prefill cut short: its time is not the step's, but a sampled
        probe is judged by what its sample accepted (unjudged, every step would probe)."""
        if self.measure_overhead and decision.sampled:
            self._judge_sample(batch, sampled)

    def _count_probe_loss(
        self, decision: Decision, batch: int, period_ms: float, emitted: float | None
    ) -> None:
        """Add a probe's time in plain steps, less what it emitted: the plain steps it cost."""
        if decision.probe and emitted is not None and (plain := _near(self.plain_rate, batch)):
            self._wait_loss = (self._wait_loss or 0.0) + max(0.0, period_ms * plain - emitted)

    def _judge_sample(self, batch: int, sampled: float | None) -> None:
        """After a sampled probe: the full probe goes ahead when its requests emitted, per
        step, what a speculative step must emit to match plain steps' rate at this batch size
        (its measured period over a plain step's), or when either is not measured yet;
        otherwise the plain wait doubles. No value (a read still in flight): sample again."""
        if sampled is None:
            return
        plain, period = _near(self.plain_rate, batch), _near(self.spec_period, batch)
        if plain is None or period is None or sampled >= period * plain:
            self._sample_passed = True
        else:
            self._wait_plainly(batch)

    def _cold_plain(self, batch: int) -> bool:
        """Whether this plain period is the batch size's first (cold: not folded); counts it."""
        seen = self.plain_periods.get(batch, -1) + 1
        self.plain_periods[batch] = seen
        return seen == 0

    def _fold_rate(self, table: dict[int, float], batch: int, rate: float, seen: int = 0) -> None:
        """EMA of a measured rate (tokens per request per ms) or period (ms) at one batch size;
        ``seen``: this sample's count among those folded (from 1): the first 1 / rate_alpha
        samples are averaged."""
        old = table.get(batch)
        weight = max(self.rate_alpha, 1.0 / seen) if seen > 0 else self.rate_alpha
        table[batch] = rate if old is None else old + weight * (rate - old)

    def observe(self, decision: Decision, verify_ms: float) -> None:
        """Fold an observed verify time into its batch size's gamma (ema modes; else counted).

        Not learned from: the first pass at each (batch, width) shape, which may include a
        kernel compile or allocator growth, and, once the batch size has a gamma, a pass four
        times slower than predicted (a stall: garbage collection, another process).
        """
        self.observed_steps += 1
        if self.mode not in ("ema", "ema_calib") or not decision.predicted_verify_ms:
            return
        batch = decision.sizes.numel()
        shape = (batch, decision.width)
        if shape not in self._seen_shapes:
            self._seen_shapes.add(shape)
            return
        if batch in self.gamma and verify_ms > 4 * decision.predicted_verify_ms:
            return
        gamma = self.gamma_at(batch)
        bare = decision.predicted_verify_ms / gamma  # the prediction before gamma
        self.gamma[batch] = ema_update(gamma, verify_ms, bare, self.ema_alpha)

    def verify_widths(self) -> tuple[int, ...]:
        """Every verify width this controller can choose (fixed: N, cut to the tree's size)."""
        return (self.max_nodes,) if self.mode == "fixed" else self.widths

    @property
    def needs_timing(self) -> bool:
        """Whether decisions depend on observed step times."""
        return self.mode in ("ema", "ema_calib")


def _cached(cache: dict, key: tuple, make: Callable[[], Any]) -> Any:
    """``cache[key]``, made by ``make`` on a miss; a full cache (4096 keys: long-running
    servers see many) is emptied first."""
    value = cache.get(key)
    if value is None:
        if len(cache) >= 4096:
            cache.clear()
        value = cache.setdefault(key, make())
    return value


def _nearest(table: dict[int, float], batch: int, default: float | None) -> float | None:
    """The table's value at this batch size, else at the nearest (the smaller on ties)."""
    if batch in table:
        return table[batch]
    if not table:
        return default
    return table[min(table, key=lambda b: (abs(b - batch), b))]


def _near(table: dict[int, float], batch: int) -> float | None:
    """`_nearest`, but only from a batch size within a factor of two of ``batch``."""
    if not table:
        return None
    nearest = min(table, key=lambda b: (abs(b - batch), b))
    return table[nearest] if batch / 2 <= nearest <= 2 * batch else None


def _at(accepted: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """[B] each request's priced acceptance [B, N] at its size [B]."""
    return accepted.gather(1, (sizes - 1).clamp(min=0).unsqueeze(1)).squeeze(1)


def unmeasured_widths(widths: tuple[int, ...], measured_up_to: int) -> list[int]:
    """The controller's widths beyond the largest the profile measured (priced by the fit)."""
    return [w for w in widths if w > measured_up_to]


def verifies_ragged(attn_backend: Any) -> bool:
    """Whether a target attention backend verifies trees packed unpadded (``bastion_cpu``)."""
    return bool(getattr(attn_backend, "verifies_ragged", False))


def measures_overhead(options: BastionOptions, tp_size: int) -> bool:
    """Whether the controller prices its measured step overhead (never under TP > 1)."""
    # Every tensor-parallel rank must choose the same trees, and each would time its own steps.
    return options.measure_overhead and tp_size == 1
