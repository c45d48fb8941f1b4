"""What a served BASTION step costs at each fixed tree size, against what the profile prices.

python benchmarks/served_widths.py --model-path T --draft-model-path D \
    [--sizes 8,16,32] [--concurrency 1,4] [--seconds 15] [--output-len 64] \
    [--profile P] [--out DIR]

For each fixed tree size N a real server (``bastion-N``, the sweep's CPU recipe) runs under a
steady load of ``C`` clients sending greedy, non-streaming HumanEval requests (``ignore_eos``),
with the worker's step trace on (``SGLANG_BASTION_TRACE``). From the steps whose batch held all
``C`` requests it takes the medians of the verify span (T_verify as the controller prices it),
the worker's cycle, the period from one step's start to the next and the tokens each step
emitted; with ``--profile``, the profile's verify price at that batch, width and median
context stands beside them. So whether a profile still prices width as the server pays it can
be read off directly: a stale profile on a drifting host prices large trees too cheaply, and
the adaptive controller then verifies trees that do not pay.

Writes served_widths.{json,md} into ``--out`` (default benchmarks/results/); server logs and
traces stay in a temporary folder, printed at the start.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from common import RESULTS, machine, markdown_table
from step_decomposition import steady_load
from sweep_bench import humaneval_prompts
from sweep_methods import parse_methods, server_setup
from sweep_server import running_server, warm_up

GAP_LIMIT_S = 1.0  # a longer gap between two steps is an idle server, not a step's period


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", type=Path, required=True, help="target model")
    parser.add_argument("--draft-model-path", type=Path, required=True, help="DFlash drafter")
    parser.add_argument("--sizes", default="8,16,32", help="comma list of fixed tree sizes N")
    parser.add_argument("--concurrency", default="1,4", help="comma list of clients")
    parser.add_argument("--seconds", type=float, default=15.0, help="loaded window per cell")
    parser.add_argument("--output-len", type=int, default=64, help="tokens per request")
    parser.add_argument("--profile", type=Path, help="latency profile to set beside the steps")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    return parser.parse_args(argv)


def step_summary(records: list[dict], batch: int) -> dict[str, float] | None:
    """Medians over the traced steps whose batch held ``batch`` requests (None: no such step).

    ``records``: the trace's step records in order; a step's period runs from its start to
    the next traced step's, counted only when that gap is under ``GAP_LIMIT_S``.
    """
    full = [r for r in records if len(r["sizes"]) == batch and r["verify_ms"] is not None]
    if not full:
        return None
    counted = {id(r) for r in full}
    periods = [
        (after["started_s"] - before["started_s"]) * 1e3
        for before, after in itertools.pairwise(records)
        if id(before) in counted and 0 < after["started_s"] - before["started_s"] < GAP_LIMIT_S
    ]
    emitted = [sum(len(tokens) for tokens in r["emitted"]) for r in full]
    period = statistics.median(periods) if periods else float("nan")
    return {
        "steps": len(full),
        "verify_ms": statistics.median(r["verify_ms"] for r in full),
        "cycle_ms": statistics.median(r["cycle_ms"] for r in full),
        "period_ms": period,
        "tokens_per_step": statistics.mean(emitted),
        "tokens_per_s": 1e3 * statistics.mean(emitted) / period,
        "context": statistics.median(c for r in full for c in r["context_lens"]),
    }


def read_trace(path: Path) -> list[dict]:
    """The step records of a worker trace (JSONL)."""
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, lines) if r.get("kind") == "step"]


def latency_model(profile: Path, target: Path) -> Any:
    """The server's latency model of ``profile`` for the target model at ``target``."""
    from sglang_bastion.budget import LatencyModel, ModelShape, load_profile

    shape = ModelShape.from_hf_config(json.loads((target / "config.json").read_text()))
    return LatencyModel.from_profile(load_profile(profile), shape)


def profile_price(model: Any, batch: int, tokens: int, context: float) -> float:
    """The model's verify price in ms at ``batch`` requests of ``tokens`` tokens each."""
    import torch

    width = torch.tensor([float(tokens)], dtype=torch.float64)
    return float(model.verify_price_ms(batch, width, context, "static")[0])


def measure(url: str, prompts: list[str], clients: int, args: argparse.Namespace) -> None:
    """A steady load of ``clients`` requests for ``args.seconds`` after a warm-up."""
    warm_up(url, prompts, clients, args.output_len)
    stop = threading.Event()
    threads = steady_load(url, prompts, clients, args.output_len, stop)
    time.sleep(args.seconds)
    stop.set()
    for thread in threads:
        thread.join(timeout=600)


def main(argv: list[str] | None = None) -> None:
    """Measure every (N, C) cell and write the table."""
    args = parse_args(argv)
    sizes = [int(n) for n in args.sizes.split(",")]
    levels = [int(c) for c in args.concurrency.split(",")]
    methods = parse_methods([f"bastion-{n}" for n in sizes], args.draft_model_path, None)
    prompts = [p["prompt"] for p in humaneval_prompts()]
    model = latency_model(args.profile, args.model_path) if args.profile else None
    logs = Path(tempfile.mkdtemp(prefix="served_widths_"))
    print(f"logs and traces: {logs}", flush=True)
    rows = []
    for size, method in zip(sizes, methods, strict=True):
        for clients in levels:  # one server per cell: its trace holds that cell alone
            server_args, env = server_setup(method, [], on_cpu=True)
            trace = logs / f"{method.name}.c{clients}.trace.jsonl"
            env |= {"SGLANG_BASTION_TRACE": str(trace), "SGLANG_BASTION_TRACE_STEPS": "100000"}
            log = logs / f"{method.name}.c{clients}.server.log"
            with running_server(args.model_path, server_args, env, log) as url:
                measure(url, prompts, clients, args)
            summary = step_summary(read_trace(trace), clients)
            if summary is None:
                raise RuntimeError(f"no traced step at batch {clients}; see {log}")
            row = {"N": size, "C": clients, **summary}
            if model is not None:
                row["profile_verify_ms"] = profile_price(model, clients, size, summary["context"])
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(write_report(rows, vars(args), args.out))


def write_report(rows: list[dict], options: dict, out: Path) -> str:
    """served_widths.{json,md} in ``out``; the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    meta = machine()
    columns = ["N", "C", "steps", "verify_ms", "profile_verify_ms", "cycle_ms", "period_ms",
               "tokens_per_step", "tokens_per_s"]  # fmt: skip
    shown = [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()} for r in rows]
    text = "\n".join([
        "# Served step cost by fixed tree size",
        "",
        f"Command: `{meta['command']}`",
        "",
        "Medians over the traced decode steps whose batch held all C requests (steady load, "
        "greedy, `ignore_eos`). verify_ms: the worker's verify span (what the controller "
        "prices as T_verify); profile_verify_ms: the profile's price for it; period_ms: from "
        "one step's start to the next. Each cell ran its own server, one after another, so a "
        "shared host's drift falls between the cells.",
        "",
        markdown_table(shown, [c for c in columns if any(c in r for r in rows)]),
        "",
    ])  # fmt: skip
    (out / "served_widths.md").write_text(text)
    body = {"machine": meta, "options": {k: str(v) for k, v in options.items()}, "rows": rows}
    (out / "served_widths.json").write_text(json.dumps(body, indent=2) + "\n")
    return text


if __name__ == "__main__":
    main()
