"""Medians over repeated sweeps: each server setup's output tok/s per concurrency, against the
best fixed tree size. Repeats on a shared host spread by several percent, so a 2% question
(the adaptive controller against the best fixed N) is answered on medians of runs.

python benchmarks/sweep_medians.py FOLDER [FOLDER ...] [--output PATH.md]

(``sweep.py --repeats R`` runs R sweeps and writes this table, with a plot, by itself.)

Cells are grouped by what the server ran: ``bastion-N`` (fixed N), ``adaptive N_max=M`` (from
the server's ``--speculative-num-draft-tokens``), then the controller mode when it is not the
default ``static`` (``SGLANG_BASTION_MODE``), with ``+ overhead`` when the controller
reported a measured step overhead, and every other method by name.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from sweep_methods import SYNC_ARGS, SYNC_SUFFIX

Key = tuple[str, int]  # (setup label, concurrency)


SYNC = " sync"  # the label's suffix for a setup on SGLang's synchronous schedule


def cell_label(cell: dict) -> str:
    """The server setup a cell measured (see the module docstring)."""
    args = cell.get("server", {}).get("args", [])
    schedule = SYNC if all(a in args for a in SYNC_ARGS) else ""
    method = cell["method"].removesuffix(SYNC_SUFFIX)
    if not method.startswith("bastion-adaptive"):
        return method + schedule
    flag = "--speculative-num-draft-tokens"
    label = f"adaptive N_max={args[args.index(flag) + 1]}" if flag in args else "adaptive"
    mode = cell.get("server", {}).get("env", {}).get("SGLANG_BASTION_MODE", "static")
    label += "" if mode == "static" else f" {mode}"
    return label + (" + overhead" if cell.get("controller_overhead_ms") else "") + schedule


def load_runs(folders: list[Path]) -> list[list[dict]]:
    """Every cell of each sweep folder's ``sweep.json``, one list per run."""
    return [json.loads((folder / "sweep.json").read_text())["cells"] for folder in folders]


def collect(
    runs: list[list[dict]],
) -> tuple[dict[Key, list[float]], dict[Key, list[float]], dict[Key, list[float]]]:
    """Output tok/s, mean tree sizes and median ITLs of every cell, by (setup, concurrency)."""
    tok_s: dict[Key, list[float]] = defaultdict(list)
    trees: dict[Key, list[float]] = defaultdict(list)
    itl: dict[Key, list[float]] = defaultdict(list)
    for cells in runs:
        for cell in cells:
            key = (cell_label(cell), int(cell["concurrency"]))
            tok_s[key].append(float(cell["output_tok_s"]))
            if cell.get("tree_size") is not None:
                trees[key].append(float(cell["tree_size"]))
            if cell.get("itl_p50_ms") is not None:
                itl[key].append(float(cell["itl_p50_ms"]))
    return tok_s, trees, itl


def is_fixed(label: str) -> bool:
    """Whether a setup label is a fixed tree size (``bastion-N``)."""
    return label.removeprefix("bastion-").isdigit()


def run_shares(runs: list[list[dict]]) -> dict[Key, list[float]]:
    """Each setup's output tok/s over the best fixed N's in the same run, run by run."""
    shares: dict[Key, list[float]] = defaultdict(list)
    for cells in runs:
        for concurrency in sorted({int(c["concurrency"]) for c in cells}):
            here = [c for c in cells if int(c["concurrency"]) == concurrency]
            fixed = [c["output_tok_s"] for c in here if is_fixed(cell_label(c))]
            for cell in here if fixed else []:
                shares[(cell_label(cell), concurrency)].append(cell["output_tok_s"] / max(fixed))
    return shares


def summary_rows(
    tok_s: dict[Key, list[float]],
    trees: dict[Key, list[float]],
    itl: dict[Key, list[float]] | None = None,
    shares: dict[Key, list[float]] | None = None,
) -> list[dict]:
    """One row per (setup, concurrency): median tok/s and ITL, % of the best fixed N's median,
    and of the same setup's on the synchronous schedule when the sweep ran it."""
    rows = []
    for concurrency in sorted({c for _, c in tok_s}):
        medians = {
            label: statistics.median(v) for (label, c), v in tok_s.items() if c == concurrency
        }
        fixed = [m for label, m in medians.items() if is_fixed(label)]
        best = max(fixed, default=None)
        for label in sorted(medians):
            size = trees.get((label, concurrency))
            rows.append({
                "C": concurrency, "setup": label, "runs": len(tok_s[(label, concurrency)]),
                "median_tok_s": medians[label],
                "of_best_fixed": medians[label] / best if best else None,
                "of_sync": medians[label] / medians[label + SYNC]
                if label + SYNC in medians else None,
                "itl_p50_ms": statistics.median(v) if (v := (itl or {}).get(
                    (label, concurrency))) else None,
                "mean_tree": statistics.fmean(size) if size else None,
                "runs_tok_s": tok_s[(label, concurrency)],
                "run_shares": (shares or {}).get((label, concurrency), []),
            })  # fmt: skip
    return rows


def markdown(rows: list[dict]) -> str:
    """The rows as a Markdown table."""
    lines = [
        "| C | setup | runs | median tok/s | of best fixed N | of its synchronous | median ITL ms "
        "| mean tree | every run | of the run's best fixed N |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        share = f"{100 * r['of_best_fixed']:.1f}%" if r["of_best_fixed"] else "-"
        of_sync = f"{100 * r['of_sync']:.1f}%" if r.get("of_sync") else "-"
        itl = f"{r['itl_p50_ms']:.1f}" if r.get("itl_p50_ms") is not None else "-"
        tree = f"{r['mean_tree']:.1f}" if r["mean_tree"] is not None else "-"
        runs = " / ".join(f"{v:.1f}" for v in r["runs_tok_s"])
        per_run = " / ".join(f"{100 * v:.1f}%" for v in r.get("run_shares", [])) or "-"
        lines.append(
            f"| {r['C']} | {r['setup']} | {r['runs']} | {r['median_tok_s']:.1f} | {share} "
            f"| {of_sync} | {itl} | {tree} | {runs} | {per_run} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, title: str, against: list[dict] | None = None) -> None:
    """Median output tok/s (bars: min to max run), share of the best fixed N and, given the
    never-slower rows, each adaptive setup's share of the best alternative, by concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from sweep_report import concurrency_axis

    levels = sorted({r["C"] for r in rows})
    fig, axes = plt.subplots(1, 3 if against else 2, figsize=(18 if against else 12, 4.2))
    left, right = axes[0], axes[1]
    for setup in dict.fromkeys(r["setup"] for r in rows):
        mine = [r for r in rows if r["setup"] == setup]
        xs = [r["C"] for r in mine]
        ys = [r["median_tok_s"] for r in mine]
        low = [y - min(r["runs_tok_s"]) for y, r in zip(ys, mine, strict=True)]
        high = [max(r["runs_tok_s"]) - y for y, r in zip(ys, mine, strict=True)]
        style = "--" if is_fixed(setup) else "-"
        left.errorbar(xs, ys, yerr=[low, high], marker="o", ls=style, capsize=3, label=setup)
        shared = [(r["C"], 100 * r["of_best_fixed"]) for r in mine if r["of_best_fixed"]]
        if shared:
            right.plot(*zip(*shared, strict=True), marker="o", ls=style, label=setup)
    right.axhline(98, color="grey", lw=0.8, ls=":")
    for ax, label in ((left, "output tokens/s (median; bars: min-max)"),
                      (right, "% of the best fixed N's median")):  # fmt: skip
        concurrency_axis(ax, levels, label)
    if against:
        never = axes[2]
        for setup in dict.fromkeys(r["setup"] for r in against):
            mine = [r for r in against if r["setup"] == setup]
            never.plot([r["C"] for r in mine], [100 * r["of_best"] for r in mine], marker="o",
                       label=setup)  # fmt: skip
            for r in mine:
                never.annotate(r["best"], (r["C"], 100 * r["of_best"]), fontsize=7,
                               textcoords="offset points", xytext=(0, 6), ha="center")  # fmt: skip
        never.axhline(100, color="grey", lw=0.8, ls=":")
        concurrency_axis(never, levels, "% of the best alternative's median (named)")
        never.legend(fontsize=8)
    left.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_medians(folders: list[Path], out: Path, title: str, command: str = "") -> str:
    """Write medians.md and medians.png of the sweep folders into ``out``; return the text."""
    import sweep_never_slower as never

    runs = load_runs(folders)
    measured = collect(runs)
    rows = summary_rows(*measured, run_shares(runs))
    excluded = never.excluded_references(folders)
    against = never.never_slower_rows(measured[0], excluded, runs)
    names = ", ".join(f"`{f.name}`" for f in folders)
    ran = f"Command: `{command}`\n\n" if command else ""
    text = f"# {title}\n\n{ran}Runs: {names}.\n\n" + markdown(rows)
    if against:
        text += "\n## Never slower\n\n" + never.markdown(against, excluded)
    out.mkdir(parents=True, exist_ok=True)
    (out / "medians.md").write_text(text)
    if rows:
        plot(rows, out / "medians.png", title, against)
    return text


def main() -> None:
    """Print (and optionally write) the medians table of the given sweep folders."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path, help="sweep results folders")
    parser.add_argument("--output", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()
    runs = load_runs(args.folders)
    table = markdown(summary_rows(*collect(runs), run_shares(runs)))
    print(table, end="")
    if args.output:
        args.output.write_text(table)


if __name__ == "__main__":
    main()
