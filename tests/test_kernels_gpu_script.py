"""The GPU check script's dry run: every kernel checked on tiny CPU shapes, results written."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKS = {
    "draft_head_topk",
    "draft_head_gemm",
    "tree_build",
    "verify_inputs",
    "accept",
    "prep_tree_vs_chain",
    "attn_split_vs_masked",
    "attn_split_vs_causal",
    "ladder",
}


@pytest.mark.slow  # about 10 s: the Triton interpreter runs every kernel once
def test_dry_run_checks_every_kernel_and_writes_json_and_markdown(tmp_path):
    env = os.environ | {"OUT": str(tmp_path), "PYTHON": "python"}
    script = ROOT / "benchmarks" / "gpu" / "run_checks.sh"
    done = subprocess.run(
        ["bash", str(script), "--dry-run"], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (result,) = tmp_path.glob("kernels_dry-run_*.json")
    report = json.loads(result.read_text())
    assert {row["check"] for row in report["rows"]} == CHECKS
    assert all(row["ok"] for row in report["rows"])
    assert report["meta"]["sglang_modules_loaded"] == []
    assert result.with_suffix(".md").read_text().count("\n| ") == len(report["rows"]) + 1


@pytest.mark.slow  # about 7 s: Triton compiles every kernel to sm_90 SASS on the CPU
def test_every_kernel_compiles_for_sm90_without_spilling(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from an earlier cache
    done = subprocess.run(
        ["python", str(ROOT / "benchmarks" / "gpu" / "compile_check.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count(": ok;") == 7
