"""Medians over repeated sweeps: each server setup's output tok/s per concurrency, against the
best fixed tree size. Repeats on a shared host spread by several percent, so a 2% question
(the adaptive controller against the best fixed N) is answered on medians of runs.

python benchmarks/sweep_medians.py FOLDER [FOLDER ...] [--output PATH.md]

Cells are grouped by what the server ran: ``bastion-N`` (fixed N), ``adaptive N_max=M`` (from
the server's ``--speculative-num-draft-tokens``), with ``+ overhead`` when the controller
reported a measured step overhead, and every other method by name.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

Key = tuple[str, int]  # (setup label, concurrency)


def cell_label(cell: dict) -> str:
    """The server setup a cell measured (see the module docstring)."""
    if cell["method"] != "bastion-adaptive":
        return cell["method"]
    args = cell.get("server", {}).get("args", [])
    flag = "--speculative-num-draft-tokens"
    label = f"adaptive N_max={args[args.index(flag) + 1]}" if flag in args else "adaptive"
    return label + (" + overhead" if cell.get("controller_overhead_ms") else "")


def collect(folders: list[Path]) -> tuple[dict[Key, list[float]], dict[Key, list[float]]]:
    """Output tok/s and mean tree sizes of every cell in the folders, by (setup, concurrency)."""
    tok_s: dict[Key, list[float]] = defaultdict(list)
    trees: dict[Key, list[float]] = defaultdict(list)
    for folder in folders:
        for cell in json.loads((folder / "sweep.json").read_text())["cells"]:
            key = (cell_label(cell), int(cell["concurrency"]))
            tok_s[key].append(float(cell["output_tok_s"]))
            if cell.get("tree_size") is not None:
                trees[key].append(float(cell["tree_size"]))
    return tok_s, trees


def summary_rows(tok_s: dict[Key, list[float]], trees: dict[Key, list[float]]) -> list[dict]:
    """One row per (setup, concurrency): runs, median tok/s, % of the best fixed N's median."""
    rows = []
    for concurrency in sorted({c for _, c in tok_s}):
        medians = {
            label: statistics.median(v) for (label, c), v in tok_s.items() if c == concurrency
        }
        fixed = [m for label, m in medians.items() if label.removeprefix("bastion-").isdigit()]
        best = max(fixed, default=None)
        for label in sorted(medians):
            size = trees.get((label, concurrency))
            rows.append({
                "C": concurrency, "setup": label, "runs": len(tok_s[(label, concurrency)]),
                "median_tok_s": medians[label],
                "of_best_fixed": medians[label] / best if best else None,
                "mean_tree": statistics.fmean(size) if size else None,
                "runs_tok_s": tok_s[(label, concurrency)],
            })  # fmt: skip
    return rows


def markdown(rows: list[dict]) -> str:
    """The rows as a Markdown table."""
    lines = [
        "| C | setup | runs | median tok/s | of best fixed N | mean tree | every run |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        share = f"{100 * r['of_best_fixed']:.1f}%" if r["of_best_fixed"] else "-"
        tree = f"{r['mean_tree']:.1f}" if r["mean_tree"] is not None else "-"
        runs = " / ".join(f"{v:.1f}" for v in r["runs_tok_s"])
        lines.append(
            f"| {r['C']} | {r['setup']} | {r['runs']} | {r['median_tok_s']:.1f} | {share} "
            f"| {tree} | {runs} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    """Print (and optionally write) the medians table of the given sweep folders."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path, help="sweep results folders")
    parser.add_argument("--output", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()
    table = markdown(summary_rows(*collect(args.folders)))
    print(table, end="")
    if args.output:
        args.output.write_text(table)


if __name__ == "__main__":
    main()
