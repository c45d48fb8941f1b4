"""The README's demo runs end to end on real text and shows what it claims (quick variant)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_core_demo_quick(tmp_path: Path) -> None:
    md, js = tmp_path / "demo.md", tmp_path / "demo.json"
    command = [sys.executable, "benchmarks/core_demo.py", "--quick", "--output-md", str(md)]
    # The package importable even without an install (the script's sys.path[0] is benchmarks/).
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [*command, "--output-json", str(js)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert md.read_text().startswith("# BASTION core demo")
    report = json.loads(js.read_text())

    acceptance = report["acceptance"]
    chain = next(row for row in acceptance if row["tree"].startswith("chain"))
    best_first = [row for row in acceptance if row["tree"] == "best-first"]
    assert chain["K"] == 1 and best_first
    largest = max(best_first, key=lambda row: row["N"])
    assert largest["accept_len"] > chain["accept_len"]
    # A bigger best-first tree never accepts less (its first n nodes are the size-n tree).
    lengths = [row["accept_len"] for row in sorted(best_first, key=lambda row: row["N"])]
    assert lengths == sorted(lengths)
    assert all(row["pearson_r"] > 0 for row in acceptance)

    controller = {row["batch"]: row for row in report["controller"]}
    assert controller[64]["per-req mean N"] <= controller[1]["per-req mean N"]
    assert controller[64]["uniform W"] <= controller[1]["uniform W"]
