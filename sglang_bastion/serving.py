"""Server-side wiring of the budget controller: the profile, the mode, and /server_info.

The worker builds its ``LiveBudget`` here at start-up: with ``SGLANG_BASTION_PROFILE`` the
profile is loaded and checked against this server (target, drafter, dtype, attention
backend, block size, TP degree and device, each named when it differs), and the latency model
prices every step; without one the tree size is fixed. ``add_server_info`` is registered with
SGLang's plugin hook registry so ``/server_info`` shows ``internal_states[0]["bastion"]``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from sglang_bastion.budget import LatencyModel, ModelShape, load_profile
from sglang_bastion.budget.identity import device_name, worker_identity
from sglang_bastion.budget.live import LiveBudget
from sglang_bastion.options import BastionOptions

logger = logging.getLogger(__name__)

INTERNAL_STATE_HOOK = (
    "sglang.srt.managers.scheduler_components.internal_state."
    "SchedulerInternalStateController._add_speculative"
)


def make_budget(worker: Any, options: BastionOptions, max_nodes: int) -> LiveBudget:
    """The controller of a starting BASTION worker (loads and checks the profile)."""
    mode = options.resolved_mode
    if mode == "fixed" or not options.profile:
        return LiveBudget(mode="fixed", max_nodes=max_nodes, layout=options.layout)
    expect = worker_identity(worker, worker.server_args)
    profile = load_profile(
        options.profile, expect, expect_device_name=device_name(torch.device(worker.device))
    )
    target_config = worker.target_worker.model_runner.model_config.hf_config.to_dict()
    model = LatencyModel.from_profile(profile, ModelShape.from_hf_config(target_config))
    measure = measures_overhead(options, getattr(worker.server_args, "tp_size", 1) or 1)
    if options.measure_overhead and not measure:
        logger.info("BASTION: step overhead not measured under tensor parallelism")
    budget = LiveBudget(
        mode=mode, max_nodes=max_nodes, layout=options.layout, model=model,
        ema_alpha=options.ema_alpha, measure_overhead=measure, widths=options.widths,
    )  # fmt: skip
    measured = max(p.tokens_per_request for p in profile.grid)
    if unmeasured := unmeasured_widths(budget.widths, measured):
        logger.warning(
            "BASTION: the profile measured verify widths up to %d tokens per request; widths "
            "%s are priced by extrapolating its fit. To measure them, recalibrate with "
            "bastion-calibrate ... --speculative-num-draft-tokens %d",
            measured, ", ".join(map(str, unmeasured)), max_nodes,
        )  # fmt: skip
    return budget


def unmeasured_widths(widths: tuple[int, ...], measured_up_to: int) -> list[int]:
    """The controller's widths beyond the largest the profile measured (priced by the fit)."""
    return [w for w in widths if w > measured_up_to]


def measures_overhead(options: BastionOptions, tp_size: int) -> bool:
    """Whether the controller prices its measured step overhead (never under TP > 1)."""
    # Every tensor-parallel rank must choose the same trees, and each would time its own steps.
    return options.measure_overhead and tp_size == 1


def profile_summary(budget: LiveBudget, options: BastionOptions) -> dict[str, Any]:
    """What /server_info and the start-up log say about the controller."""
    summary: dict[str, Any] = {
        "mode": budget.mode,
        "layout": budget.layout,
        "max_nodes": budget.max_nodes,
        "widths": list(budget.widths) if budget.model is not None else None,
        "profile": options.profile if budget.model is not None else None,
        "measure_overhead": budget.measure_overhead,
    }
    if budget.model is not None:
        summary["hardware"] = budget.model.hardware.name
        summary["calibration"] = {
            "slope": budget.model.calibration.slope,
            "intercept_ms": budget.model.calibration.intercept_ms,
            "grid_residual": budget.model.residual is not None,
        }
    return summary


def add_server_info(result: Any, controller: Any, state: dict[str, Any]) -> Any:
    """SGLang hook (after ``_add_speculative``): add the BASTION worker's state."""
    worker = getattr(controller.scheduler, "draft_worker", None)
    read = getattr(worker, "bastion_state", None)
    if callable(read):
        try:
            state["bastion"] = read()
        except Exception:  # never break /server_info for the stats
            logger.exception("BASTION: could not read the worker's state")
    return result
