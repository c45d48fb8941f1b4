"""The never-slower table: each adaptive setup's median output tok/s against every alternative's
(no speculation, DFLASH, each fixed N) at each concurrency, and against the best of them.

A reference that the sweep's device cannot run faithfully is left out and named: on a CPU,
SGLang's DFLASH verifies greedily whatever the temperature, so at T > 0 it is not a valid
reference (its tokens are not the target's samples).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from sweep_medians import SYNC, Key, cell_label, is_fixed

REFERENCES = ("none", "dflash", "eagle3")  # alternatives that are not a fixed tree size


def excluded_references(folders: list[Path]) -> dict[str, str]:
    """References the sweeps could not run faithfully, each with the reason."""
    configs = [json.loads((f / "sweep.json").read_text()).get("config", {}) for f in folders]
    sampled_on_cpu = any(c.get("on_cpu") and (c.get("temperature") or 0) > 0 for c in configs)
    if sampled_on_cpu:
        return {"dflash": "on a CPU SGLang's DFLASH verifies greedily at any temperature"}
    return {}


def is_alternative(label: str) -> bool:
    """Whether a setup label is one the adaptive server must not be slower than."""
    return not label.endswith(SYNC) and (label in REFERENCES or is_fixed(label))


def round_ratios(runs: list[list[dict]], setup: str, against: str, concurrency: int) -> list[float]:
    """``setup``'s output tok/s over ``against``'s in each run that measured both at C."""
    ratios = []
    for cells in runs:
        here = {
            cell_label(c): c["output_tok_s"] for c in cells if int(c["concurrency"]) == concurrency
        }
        if setup in here and here.get(against):
            ratios.append(here[setup] / here[against])
    return ratios


def never_slower_rows(
    tok_s: dict[Key, list[float]],
    excluded: dict[str, str] | None = None,
    runs: list[list[dict]] | None = None,
) -> list[dict]:
    """One row per (adaptive setup, concurrency): its median over each alternative's median,
    and (given the ``runs``) the median of its ratios to the best alternative round by round,
    which a host that drifts between rounds moves less."""
    rows = []
    for concurrency in sorted({c for _, c in tok_s}):
        medians = {
            label: statistics.median(v) for (label, c), v in tok_s.items() if c == concurrency
        }
        alternatives = {
            label: m
            for label, m in medians.items()
            if is_alternative(label) and label not in (excluded or {})
        }
        adaptive = [label for label in medians if label.startswith("adaptive")]
        if not alternatives:
            continue
        best = max(alternatives, key=alternatives.__getitem__)
        for label in sorted(adaptive):
            if label.endswith(SYNC):
                continue
            rows.append({
                "C": concurrency, "setup": label, "median_tok_s": medians[label],
                "best": best, "best_tok_s": alternatives[best],
                "of_best": medians[label] / alternatives[best],
                "of": {alt: medians[label] / m for alt, m in sorted(alternatives.items())},
                "rounds": round_ratios(runs or [], label, best, concurrency),
            })  # fmt: skip
    return rows


def markdown(rows: list[dict], excluded: dict[str, str] | None = None) -> str:
    """The rows as a Markdown table (a cell under 100% in bold), with the left-out references."""
    if not rows:
        return ""
    columns = sorted({alt for r in rows for alt in r["of"]}, key=alternative_order)
    by_round = any(r.get("rounds") for r in rows)
    extra = " round by round | their median |" if by_round else ""
    lines = [
        "| C | setup | median tok/s | best alternative | its tok/s | of the best | "
        + " | ".join(f"of {c}" for c in columns)
        + " |"
        + extra,
        "|---|---|---|---|---|---|" + "---|" * (len(columns) + 2 * by_round),
    ]
    for r in rows:
        shares = [r["of"].get(c) for c in columns]
        rounds = r.get("rounds") or []
        per_round = (
            f" {' / '.join(f'{100 * v:.0f}%' for v in rounds)} "
            f"| {percent(statistics.median(rounds))} |" if rounds else " - | - |"
        )  # fmt: skip
        lines.append(
            f"| {r['C']} | {r['setup']} | {r['median_tok_s']:.1f} | {r['best']} "
            f"| {r['best_tok_s']:.1f} | {percent(r['of_best'])} | "
            + " | ".join(percent(s) if s is not None else "-" for s in shares)
            + " |"
            + (per_round if by_round else "")
        )
    notes = "".join(f"\n{name} is left out: {why}.\n" for name, why in (excluded or {}).items())
    return "\n".join(lines) + "\n" + notes


def percent(share: float) -> str:
    """A share as a percentage, in bold when under 100%."""
    text = f"{100 * share:.1f}%"
    return text if share >= 1.0 else f"**{text}**"


def alternative_order(label: str) -> tuple[int, int]:
    """References first (none, DFLASH, EAGLE3), then fixed sizes by N."""
    if label in REFERENCES:
        return (0, REFERENCES.index(label))
    return (1, int(label.removeprefix("bastion-")))
