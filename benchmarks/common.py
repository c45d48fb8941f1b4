"""What every benchmark here shares: timing medians, machine description, result files."""

from __future__ import annotations

import datetime as dt
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
if str(ROOT) not in sys.path:  # the trainer and the trained pairs are read from the repository
    sys.path.insert(0, str(ROOT))

from sglang_bastion.budget.identity import cpu_bf16_flags, cpu_model  # noqa: E402


def median_us(fn: Callable[[], object], repeats: int = 30, warmup: int = 5) -> float:
    """Median wall time of ``fn()`` in microseconds after a warm-up."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def machine() -> dict[str, object]:
    """The machine and software a measurement was taken on."""
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "cpu_bf16": cpu_bf16_flags(),  # bfloat16 instructions: the hosts' "AMD EPYC" differ
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
    }


def markdown_table(rows: list[dict[str, object]], columns: list[str]) -> str:
    """A Markdown table of ``rows`` restricted to ``columns``."""

    def cell(value: object) -> str:
        return f"{value:.2f}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def write_results(
    name: str, rows: list[dict[str, object]], columns: list[str], title: str, out: Path | None
) -> Path:
    """Write ``rows`` as JSON and Markdown (with the machine) under results/; return the JSON."""
    json_path = out or RESULTS / f"{name}.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    meta = machine()
    json_path.write_text(json.dumps({"machine": meta, "rows": rows}, indent=2) + "\n")
    md = [f"# {title}", "", f"Command: `python {meta['command']}`", ""]
    md += [
        f"Machine: {meta['cpu']}, {meta['threads']} torch threads, torch {meta['torch']}, "
        f"{meta['date']}",
        "",
        markdown_table(rows, columns),
        "",
    ]
    json_path.with_suffix(".md").write_text("\n".join(md))
    return json_path
