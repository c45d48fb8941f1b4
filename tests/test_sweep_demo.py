"""The quick CPU demo runs the sweep end to end on real servers and leaves none behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from subprocess import PIPE

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "training" / "pair"


def processes_with(marker: str) -> list[int]:
    """Process ids whose environment holds ``marker`` (every server child inherits it)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if marker.encode() in (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


@pytest.mark.slow
def test_quick_demo_writes_every_cell_and_stops_every_server(
    pair, tiny_pair_profile: Path, tmp_path: Path
) -> None:
    out = tmp_path / "demo"
    command = [sys.executable, "benchmarks/demo.py", "--quick", "--out", str(out)]
    command += ["--profile", str(tiny_pair_profile)]
    if not (SHIPPED / "drafter" / "config.json").exists():  # until the trained pair ships
        target, drafter = pair
        command += ["--target", str(target), "--drafter", str(drafter)]
    marker = f"SWEEP_TEST_{uuid.uuid4().hex}"
    proc = subprocess.Popen(
        command, cwd=ROOT, env={**os.environ, marker: "1"}, stdout=PIPE, stderr=PIPE, text=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the sweep stops its servers on SIGTERM
        stdout, stderr = proc.communicate(timeout=120)
    assert processes_with(marker) == []
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]

    report = json.loads((out / "sweep.json").read_text())
    methods, levels = report["config"]["methods"], report["config"]["concurrency"]
    assert "bastion-adaptive" in methods  # the host's profile prices the adaptive trees
    cells = {(c["method"], c["concurrency"]) for c in report["cells"]}
    assert cells == {(m, c) for m in methods for c in levels}
    assert all(c["completed"] > 0 and c["output_tok_s"] > 0 for c in report["cells"])
    assert all(c["accept_len"] >= 1.0 for c in report["cells"])
    table = (out / "sweep.md").read_text()
    assert all(f"| {m} | {c} |" in table for m, c in cells)
    assert (out / "sweep.png").stat().st_size > 0 and (out / "sweep.csv").exists()
