"""Where a decode step's time goes, stage by stage: BASTION's tree against DFLASH's chain.

python benchmarks/step_decomposition.py --model-path T --draft-model-path D \
    [--methods bastion-8,dflash,bastion-adaptive] [--concurrency 1,16,64] [--seconds 20] \
    [--rate 100] [--output-len 64] [--temperature 0] [--short] [--profile P] [--out DIR]

The paper's Table 3 on this machine. For each method a real server runs under a steady load
of ``C`` clients sending non-streaming HumanEval requests (``ignore_eos``; greedy unless
``--temperature``: at 1 the adaptive server's plain steps against SGLang's decode; with
``--short`` each prompt's first 3 lines, the sweep's short workload); py-spy then
samples the scheduler process for ``--seconds`` and every sample of its main thread is put in
a stage of the step (``step_stages.py``). The server logs one "Decode batch" line per decode
step (``--decode-log-interval 1``, the CPU recipe's), which counts the steps of the window.
On a CPU every stage runs on the host, so the samples are the stages' compute time; on a GPU
they would be host time only, and this tool says nothing about kernels.

Writes step_decomposition.{json,md,png} into ``--out`` (default benchmarks/results/): per
(method, C) the milliseconds per decode step of each stage, and the tree's preparation and
verification over the chain's at each C. Server logs and the raw samples stay in a temporary
folder, printed at the start. BASTION and DFLASH both default to 48 running requests, so at
C=64 both step batches of 48.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import psutil
import requests
from common import RESULTS, machine
from step_stages import (
    PREPARATION,
    STAGES,
    STEP_STAGES,
    VERIFICATION,
    parse_collapsed,
    stage_samples,
)
from sweep_bench import humaneval_prompts, short_prompts
from sweep_methods import parse_methods, server_setup
from sweep_server import running_server, warm_up

DECODE_LINE = "Decode batch"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", type=Path, required=True, help="target model")
    parser.add_argument("--draft-model-path", type=Path, required=True, help="DFlash drafter")
    parser.add_argument("--methods", default="bastion-8,dflash,bastion-adaptive")
    parser.add_argument("--concurrency", default="1,16,64", help="comma list of clients")
    parser.add_argument("--seconds", type=float, default=20.0, help="sampled window per cell")
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    parser.add_argument("--output-len", type=int, default=64, help="tokens per request")
    parser.add_argument("--temperature", type=float, default=0.0, help="the requests' temperature")
    parser.add_argument("--short", action="store_true", help="prompts of their first 3 lines")
    parser.add_argument("--profile", type=Path, help="latency profile for bastion-adaptive")
    parser.add_argument("--adaptive-max-nodes", type=int, help="N_max of bastion-adaptive")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    return parser.parse_args(argv)


def scheduler_pid(port: int) -> int:
    """The pid of the scheduler process of the server listening on ``port``."""
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "--port" in cmdline and cmdline[cmdline.index("--port") + 1] == str(port):
            for child in proc.children(recursive=True):
                if "scheduler" in child.name() or "scheduler" in " ".join(child.cmdline()):
                    return child.pid
    raise RuntimeError(f"no SGLang scheduler process under the server on port {port}")


def steady_load(
    url: str, prompts: list[str], clients: int, tokens: int, stop: threading.Event,
    temperature: float = 0.0,
) -> list[threading.Thread]:  # fmt: skip
    """``clients`` threads sending one request after another until ``stop`` (greedy unless
    ``temperature``)."""
    params = {"max_new_tokens": tokens, "temperature": temperature, "ignore_eos": True}
    body = {"sampling_params": params}

    def client(i: int) -> None:
        k = i
        while not stop.is_set():
            text = prompts[k % len(prompts)]
            requests.post(f"{url}/generate", json={"text": text, **body}, timeout=600)
            k += clients

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    return threads


def decode_lines(log: Path) -> int:
    """Decode steps the server has logged so far."""
    return log.read_text(errors="replace").count(DECODE_LINE)


def measure_cell(
    url: str, log: Path, prompts: list[str], clients: int, args: argparse.Namespace
) -> dict:
    """One (method, C) cell: samples per stage, steps and wall time of the sampled window."""
    warm_up(url, prompts, clients, 16, args.temperature)  # every batch size once, short
    stop = threading.Event()
    threads = steady_load(url, prompts, clients, args.output_len, stop, args.temperature)
    time.sleep(3.0 + 0.1 * clients)  # every client's first request in flight
    pid = scheduler_pid(int(url.rsplit(":", 1)[1]))
    out = log.with_suffix(f".c{clients}.pyspy.txt")
    steps_before, started = decode_lines(log), time.monotonic()
    subprocess.run(
        ["py-spy", "record", "-p", str(pid), "-d", str(int(args.seconds)), "-r", str(args.rate),
         "--format", "raw", "--nonblocking", "-o", str(out)],
        check=True, capture_output=True,
    )  # fmt: skip
    wall_s, steps = time.monotonic() - started, decode_lines(log) - steps_before
    stop.set()
    for thread in threads:
        thread.join(timeout=600)
    samples = stage_samples(parse_collapsed(out.read_text()))
    return {"C": clients, "steps": steps, "wall_s": wall_s, "rate": args.rate,
            "samples": {s: samples.get(s, 0) for s in STAGES}}  # fmt: skip


def per_step_ms(cell: dict) -> dict[str, float]:
    """Milliseconds per decode step of each stage of one cell."""
    steps = max(cell["steps"], 1)
    return {s: 1e3 * n / cell["rate"] / steps for s, n in cell["samples"].items()}


def summarise(cells: list[dict]) -> list[dict]:
    """Rows of the table: per (method, C) each stage's ms per step, and the step's total."""
    rows = []
    for cell in cells:
        ms = per_step_ms(cell)
        rows.append({
            "method": cell["method"], "C": cell["C"], "steps_per_s": cell["steps"] / cell["wall_s"],
            **ms, "step": sum(ms[s] for s in STEP_STAGES),
            "preparation": sum(ms[s] for s in PREPARATION),
            "verification": sum(ms[s] for s in VERIFICATION),
        })  # fmt: skip
    return rows


def tree_over_chain(rows: list[dict], tree: str, chain: str) -> list[dict]:
    """The tree's preparation, verification and decision against the chain's, at each C."""
    by = {(r["method"], r["C"]): r for r in rows}
    ratios = []
    for (method, c), row in sorted(by.items(), key=lambda kv: kv[0][1]):
        if method != tree or (chain, c) not in by:
            continue
        other = by[(chain, c)]
        # The draft pass is the same drafter forward in both: its ratio is the host's drift
        # between the two measurements, which a shared CPU has by several percent.
        drift = row["draft pass"] / other["draft pass"] if other["draft pass"] else 1.0
        ratios.append({
            "C": c,
            "preparation": row["preparation"] / other["preparation"] - 1,
            "verification": row["verification"] / other["verification"] - 1,
            "preparation_at_equal_drift": row["preparation"] / other["preparation"] / drift - 1,
            "verification_at_equal_drift": row["verification"] / other["verification"] / drift - 1,
            "decision_share": row["decision"] / row["step"],
        })  # fmt: skip
    return ratios


def markdown(rows: list[dict], ratios: dict[str, list[dict]], meta: dict) -> str:
    """The tables, as Markdown."""
    columns = ["method", "C", "steps/s", *STAGES, "step"]
    lines = [
        "# Decode-step decomposition (ms per step, py-spy samples of the scheduler)\n",
        f"`{meta['command']}` on {meta['cpu']}, {meta['date']}.\n",
        "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
    ]  # fmt: skip
    for r in rows:
        values = [f"{r[s]:.2f}" for s in STAGES]
        lines.append(
            f"| {r['method']} | {r['C']} | {r['steps_per_s']:.1f} | " + " | ".join(values)
            + f" | {r['step']:.2f} |"
        )  # fmt: skip
    for tree, table in ratios.items():
        lines += [f"\n{tree} over dflash (its chain is the drafter's block); 'at equal drift' "
                  "divides by the ratio of their draft passes, the same drafter forward:\n",
                  "| C | preparation | verification | preparation at equal drift "
                  "| verification at equal drift | decision share of the step |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        lines += [
            f"| {r['C']} | {100 * r['preparation']:+.1f}% | {100 * r['verification']:+.1f}% "
            f"| {100 * r['preparation_at_equal_drift']:+.1f}% "
            f"| {100 * r['verification_at_equal_drift']:+.1f}% "
            f"| {100 * r['decision_share']:.2f}% |"
            for r in table
        ]
    adaptive = [r for r in rows if r["method"].startswith("bastion-adaptive")]
    if adaptive:
        lines += [
            "\nThe adaptive controller's decision (its acceptance learning included):\n",
            "| method | C | decision ms per step | share of the step |",
            "|---|---|---|---|",
        ]
        lines += [f"| {r['method']} | {r['C']} | {r['decision']:.2f} "
                  f"| {100 * r['decision'] / r['step']:.2f}% |" for r in adaptive]  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """Stacked bars: ms per step of each stage, per (method, C)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['method']}\nC={r['C']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows)), 4.8))
    bottom = [0.0] * len(rows)
    for stage in STAGES[:-1]:  # prefill is outside the step
        heights = [r[stage] for r in rows]
        ax.bar(labels, heights, bottom=bottom, label=stage)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set_ylabel("ms per decode step")
    ax.legend(fontsize=7, ncol=2)
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    """Measure every (method, C) cell and write the tables and the plot."""
    args = parse_args(argv)
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    methods = parse_methods(
        names, args.draft_model_path, None, args.profile, args.adaptive_max_nodes
    )
    problems = humaneval_prompts()
    prompts = [p["prompt"] for p in (short_prompts(problems) if args.short else problems)]
    levels = [int(c) for c in args.concurrency.split(",")]
    logs = Path(tempfile.mkdtemp(prefix="step_decomposition_"))  # server logs, py-spy samples
    print(f"logs and samples: {logs}", flush=True)
    cells = []
    for method in methods:
        server_args, env = server_setup(method, [], on_cpu=True)
        log = logs / f"{method.name}.server.log"
        with running_server(args.model_path, server_args, env, log) as url:
            for clients in levels:
                cell = {"method": method.name, **measure_cell(url, log, prompts, clients, args)}
                print(json.dumps(cell), flush=True)
                cells.append(cell)
    print(write_report(cells, names, machine(), args.out))


def write_report(cells: list[dict], names: list[str], meta: dict, out: Path) -> str:
    """Write step_decomposition.{json,md,png} of measured cells into ``out``; the Markdown."""
    rows = summarise(cells)
    trees = [n for n in names if n.removeprefix("bastion-").isdigit()]  # fixed trees
    ratios = {t: tree_over_chain(rows, t, "dflash") for t in trees if "dflash" in names}
    out.mkdir(parents=True, exist_ok=True)
    record = {"meta": meta, "cells": cells, "rows": rows, "tree_over_chain": ratios}
    (out / "step_decomposition.json").write_text(json.dumps(record, indent=1))
    text = markdown(rows, ratios, meta)
    (out / "step_decomposition.md").write_text(text)
    plot(rows, out / "step_decomposition.png")
    return text


if __name__ == "__main__":
    main()
