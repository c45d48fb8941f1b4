"""Overhead of one budget-controller decision per policy, on CPU, at B=64 and N_max=256.

Also the decision as the server makes it (`Controller.decide`: the batch-global layout packed
ragged, calibrated acceptance, measured per-width overheads and rates), priced by the block-16
pair's float32 CPU profile at N_max=32, the adaptive width of the never-slower sweeps; and all
of the controller's work in one drafted server step (the requests' acceptance scales, the
decision, the trees' cut, the step's evidence folded into the pools), in time and in torch ops
(on a CPU each small op costs several microseconds, and more after a model's forward has
flushed the caches: the count is the host-independent measure).

python benchmarks/bench_controller.py [--quick] [--output-json PATH]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
from common import markdown_table, median_us, write_results
from torch.utils._python_dispatch import TorchDispatchMode

from sglang_bastion.acceptance_scale import (
    new_acceptance_scale,
    observe,
    pool_index,
    scales,
    start_requests,
    step_evidence,
)
from sglang_bastion.budget import LatencyModel, ModelShape, load_profile
from sglang_bastion.controller import Controller, fixed_sizes, per_request_sizes, uniform_width
from sglang_bastion.tree import build_trees

ROOT = Path(__file__).resolve().parent.parent
PROFILE = ROOT / "calibration" / "profiles" / "pair-b16-cpu-fp32.json"
TARGET_CONFIG = ROOT / "training" / "pair-b16" / "target" / "config.json"


def convex_cost(length: int) -> torch.Tensor:
    """[length] a convex increasing cycle cost in ms for 1..length tokens."""
    n = torch.arange(1, length + 1, dtype=torch.float64)
    return 8.0 + 0.02 * n + 1e-4 * n**2


def server_controller(batch: int, max_nodes: int) -> Controller:
    """The server's default adaptive controller after it measured overheads and rates."""
    shape = ModelShape.from_hf_config(json.loads(TARGET_CONFIG.read_text()))
    model = LatencyModel.from_profile(load_profile(PROFILE), shape)
    budget = Controller(
        "ema", max_nodes, "global", model, packs_ragged=True, measure_overhead=True,
        learn_acceptance=True, width_overheads=True,
    )  # fmt: skip
    budget.gamma[batch] = 1.1
    budget.overhead_ms[batch], budget.plain_overhead_ms[batch] = 3.0, 2.0
    budget.width_offset_ms[batch] = {w: 0.1 * w for w in budget.widths}  # over the 3 ms
    budget.spec_rate[batch], budget.plain_rate[batch], budget.spec_period[batch] = 0.2, 0.1, 20.0
    return budget


def server_rows(batches: list[int], repeats: int, max_nodes: int = 32) -> list[dict]:
    """One row per batch size: `Controller.decide` as a speculating server calls it."""
    rows = []
    for batch in batches:
        probs = torch.softmax(2 * torch.randn(batch, 15, 300), dim=-1)
        trees = build_trees(
            probs, torch.zeros(batch, dtype=torch.long), top_k=8, max_nodes=max_nodes
        )  # fmt: skip
        contexts, scale = torch.full((batch,), 300), torch.ones(batch)  # [B], [B]
        budget = server_controller(batch, max_nodes)
        decide = partial(budget.decide, trees, contexts, scale)
        us = median_us(decide, repeats=repeats)
        policy = "server (global, calibrated)"
        rows.append({
            "B": batch, "N_max": max_nodes, "policy": policy, "median_us": us,
            "torch_ops": torch_ops(decide),
        })  # fmt: skip
    return rows


class _OpCount(TorchDispatchMode):
    """Counts the aten ops dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def torch_ops(fn: Callable[[], object]) -> int:
    """The aten ops one call of ``fn`` dispatches."""
    with _OpCount() as count:
        fn()
    return count.ops


def server_step(batch: int, max_nodes: int = 32) -> Callable[[], None]:
    """The controller's work in one drafted server step, as `BastionWorker._tree_step` does it:
    pools and scales, the decision, the cut, the evidence folded in (fresh trees each call)."""
    probs = torch.softmax(3 * torch.randn(batch, 7, 300), dim=-1)  # [B, D, V]: block 8
    built = build_trees(probs, torch.zeros(batch, dtype=torch.long), top_k=4, max_nodes=max_nodes)
    budget = server_controller(batch, max_nodes)
    budget.width_slope_moments[batch] = (0.5, 0.1)  # a measured slope inside the widths
    budget.width_cycle_ms[batch] = {w: 10.0 + w for w in budget.widths}
    state = new_acceptance_scale(4 * batch, "cpu")
    slots = torch.arange(batch) * 2  # [B]: SGLang's request slots
    start_requests(state, slots, torch.zeros(batch, dtype=torch.long), torch.full((batch,), 250))
    lengths = torch.full((batch,), 300)  # [B]
    accept_lens, root_tokens = torch.randint(1, 6, (batch,)), torch.randint(0, 300, (batch,))

    def step() -> None:
        trees = replace(built)  # a new step's trees: nothing computed on them yet
        pool = pool_index(state, slots, lengths)
        decision = budget.decide(trees, lengths, scales(state, slots, lengths, pool))
        decision.cut(trees)
        predicted, realised = step_evidence(trees, decision.sizes, accept_lens, root_tokens)
        observe(state, slots, lengths, predicted, realised, pool)

    return step


def step_rows(batches: list[int], repeats: int) -> list[dict]:
    """One row per batch size: the controller's work in one drafted server step."""
    rows = []
    with torch.inference_mode():  # as SGLang's scheduler runs a step
        for batch in batches:
            step = server_step(batch)
            us = median_us(step, repeats=repeats)
            rows.append({
                "B": batch, "N_max": 32, "policy": "server step (scales, decide, cut, evidence)",
                "median_us": us, "torch_ops": torch_ops(step),
            })  # fmt: skip
    return rows


def main() -> None:
    """Time every policy's decision and record the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="small sizes, few repeats (smoke test)"
    )
    parser.add_argument("--output-json", type=Path, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    sizes = [(8, 32)] if args.quick else [(1, 256), (8, 256), (64, 64), (64, 256)]
    repeats = 5 if args.quick else 50
    widths = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    rows = []
    for batch, nodes in sizes:
        probs = torch.softmax(2 * torch.randn(batch, 15, 300), dim=-1)
        trees = build_trees(probs, torch.zeros(batch, dtype=torch.long), top_k=8, max_nodes=nodes)
        cost = convex_cost(nodes)
        allowed = [w for w in widths if w <= nodes]
        policies = {
            "per_request": (per_request_sizes, (trees, cost, 8.0)),
            "uniform": (uniform_width, (trees, cost, allowed)),
            "fixed": (fixed_sizes, (trees, 16)),
        }
        for policy, (decide, decide_args) in policies.items():
            call = partial(decide, *decide_args)
            us = median_us(call, repeats=repeats)
            rows.append({
                "B": batch, "N_max": nodes, "policy": policy, "median_us": us,
                "torch_ops": torch_ops(call),
            })  # fmt: skip
    rows += server_rows([16] if args.quick else [1, 16, 64], 20 if args.quick else 200)
    rows += step_rows([4] if args.quick else [1, 4, 16, 64], 20 if args.quick else 400)
    columns = ["B", "N_max", "policy", "median_us", "torch_ops"]
    print(markdown_table(rows, columns))
    if not args.quick or args.output_json:
        path = write_results(
            "controller_cpu",
            rows,
            columns,
            "Budget controller overhead per decision (CPU)",
            args.output_json,
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
