"""A sweep's results folder: the cells as JSON (resumable), CSV, a Markdown table and PNG plots."""

from __future__ import annotations

import csv
import datetime as dt
import json
import re
from pathlib import Path

COLUMNS = [
    "method", "concurrency", "output_tok_s", "speedup", "request_s",
    "ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms", "itl_mean_ms", "itl_p50_ms", "itl_p99_ms",
    "accept_len", "tree_size",
]  # fmt: skip
HEADERS = {
    "method": "method", "concurrency": "C", "output_tok_s": "output tok/s",
    "speedup": "speedup vs none", "request_s": "req/s",
    "ttft_mean_ms": "TTFT mean ms", "ttft_p50_ms": "TTFT p50 ms", "ttft_p99_ms": "TTFT p99 ms",
    "itl_mean_ms": "ITL mean ms", "itl_p50_ms": "ITL p50 ms", "itl_p99_ms": "ITL p99 ms",
    "accept_len": "accept len", "tree_size": "tree size",
}  # fmt: skip
GENERIC_NAMES = {"target", "model", "base", "main", "checkpoint"}
# What must match for a folder's cells to be reused.
CONFIG_KEYS = (
    "model", "dataset", "num_prompts", "num_prompts_text", "output_len", "temperature", "extra",
)  # fmt: skip


def slug(text: str) -> str:
    """``text`` reduced to letters, digits, dots and dashes."""
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-")


def model_name(model: str) -> str:
    """A short name of a model path or hub id (``training/pair/target`` -> ``pair-target``)."""
    path = Path(model.rstrip("/"))
    name = path.name
    if name.lower() in GENERIC_NAMES and path.parent.name:
        name = f"{path.parent.name}-{name}"
    return slug(name)


def folder_name(hardware: str, model: str, date: dt.date | None = None) -> str:
    """The results folder of a sweep: date, hardware and model."""
    return f"{(date or dt.date.today()).isoformat()}_{slug(hardware)}_{model_name(model)}"


class ResultStore:
    """The cells measured so far in one results folder (``sweep.json``)."""

    def __init__(self, folder: Path, config: dict, machine: dict) -> None:
        self.folder, self.path = folder, folder / "sweep.json"
        self.config, self.machine = config, machine
        self.cells: list[dict] = []
        if self.path.exists():
            saved = json.loads(self.path.read_text())
            differing = [k for k in CONFIG_KEYS if saved["config"].get(k) != config.get(k)]
            if differing:
                raise ValueError(
                    f"{self.path} was measured with other settings ({', '.join(differing)}); "
                    "choose another --out folder"
                )
            self.cells = saved["cells"]

    def has(self, method: str, concurrency: int, server: dict | None = None) -> bool:
        """Whether the cell was measured (with this server setup, when ``server`` is given)."""
        return any(
            c["method"] == method
            and c["concurrency"] == concurrency
            and (server is None or c.get("server") == server)
            for c in self.cells
        )

    def add(self, cell: dict) -> None:
        """Record a cell (replacing an older one) and save at once: a later run resumes here."""
        key = (cell["method"], cell["concurrency"])
        self.cells = [c for c in self.cells if (c["method"], c["concurrency"]) != key]
        self.cells.append(cell)
        self.save()

    def save(self) -> None:
        """Write ``sweep.json``."""
        self.folder.mkdir(parents=True, exist_ok=True)
        body = {"config": self.config, "machine": self.machine, "cells": self.cells}
        self.path.write_text(json.dumps(body, indent=2) + "\n")


def with_speedups(cells: list[dict], methods: list[str]) -> list[dict]:
    """Cells ordered by method then concurrency, each with its speedup over ``none``."""
    base = {c["concurrency"]: c["output_tok_s"] for c in cells if c["method"] == "none"}
    order = {m: i for i, m in enumerate(methods)}
    rows = []
    for cell in sorted(cells, key=lambda c: (order.get(c["method"], 99), c["concurrency"])):
        reference = base.get(cell["concurrency"])
        speedup = cell["output_tok_s"] / reference if reference else None
        rows.append({**cell, "speedup": speedup})
    return rows


def cell_text(value: object) -> str:
    """A table cell: floats to two decimals, missing values as a dash."""
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def markdown(rows: list[dict], title: str, notes: list[str]) -> str:
    """The Markdown report: title, notes and one table row per cell."""
    lines = [f"# {title}", "", *notes, ""]
    lines.append("| " + " | ".join(HEADERS[c] for c in COLUMNS) + " |")
    lines.append("|" + "---|" * len(COLUMNS))
    lines += ["| " + " | ".join(cell_text(r.get(c)) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_csv(rows: list[dict], path: Path) -> None:
    """The cells as CSV (the table's columns, then the sources of each estimate)."""
    fields = [*COLUMNS, "completed", "output_tokens", "duration_s", "load_1m", "accept_source"]
    fields.append("tree_source")
    with path.open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def concurrency_axis(ax: object, levels: list[int], label: str) -> None:
    """Style a panel against concurrency: log2 x axis ticked at the levels, labels, grid."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.minorticks_off()
    ax.set_xlabel("concurrency")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)


def plot(rows: list[dict], methods: list[str], path: Path, title: str) -> None:
    """Three panels against concurrency: output tokens/s, acceptance, speedup over none."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("output_tok_s", "output tokens/s"),
        ("accept_len", "accept length (tokens/step)"),
        ("speedup", "speedup over none"),
    ]
    levels = sorted({r["concurrency"] for r in rows})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (key, label) in zip(axes, panels, strict=True):
        for method in methods:
            points = [(r["concurrency"], r[key]) for r in rows if r["method"] == method]
            points = [(c, v) for c, v in points if v is not None]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o", label=method)
        concurrency_axis(ax, levels, label)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_reports(store: ResultStore, methods: list[str], title: str) -> str:
    """Write sweep.csv, sweep.md and sweep.png next to sweep.json; return the Markdown."""
    rows = with_speedups(store.cells, methods)
    cfg, machine = store.config, store.machine
    notes = [
        f"Command: `{machine.get('command', '')}`",
        "",
        f"Machine: {machine.get('hardware')} ({machine.get('cpu')}; bfloat16 instructions: "
        f"{machine.get('cpu_bf16', 'not recorded')}), torch {machine.get('torch')}, "
        f"{machine.get('date')}",
        "",
        f"Model: `{cfg['model']}`, drafter: `{cfg['drafter']}`; workload: {cfg['dataset']} "
        f"({cfg.get('workload', 'streaming')}), "
        f"{cfg['output_len']} output tokens per request, temperature {cfg['temperature']}, "
        f"prompts per cell: {cfg['num_prompts_text']}. Measured by `sglang.bench_serving`; "
        "acceptance and tree size from the server's own counters (per cell).",
    ]
    loads = [r["load_1m"] for r in rows if r.get("load_1m") is not None]
    if loads:
        notes += [
            "",
            f"1-minute load average after each cell: {min(loads):.1f} to {max(loads):.1f} "
            "(other work on the machine lowers throughput; see `load_1m` in sweep.csv).",
        ]
    text = markdown(rows, title, notes)
    store.folder.mkdir(parents=True, exist_ok=True)
    (store.folder / "sweep.md").write_text(text)
    write_csv(rows, store.folder / "sweep.csv")
    if rows:
        plot(rows, methods, store.folder / "sweep.png", title)
    return text
