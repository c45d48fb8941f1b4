"""The README's "core in one screen" runs, and calls the functions the server calls."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def core_block() -> str:
    """The first Python block under the README's "The core in one screen" heading."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## The core in one screen", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_core_runs_one_consistent_step(monkeypatch):
    monkeypatch.chdir(ROOT)  # its paths are the repository's
    scope: dict = {}
    exec(compile(core_block(), "README.md", "exec"), scope)
    trees, decision, accepted = scope["trees"], scope["decision"], scope["accepted"]
    trees.check()
    assert decision.width in scope["controller"].widths
    assert trees.max_nodes == decision.width
    assert scope["verify"].input_ids.shape == (scope["B"] * decision.width,)
    assert bool((accepted.num_accepted < decision.width).all())
    assert scope["emitted"].shape == (scope["B"], scope["D"] + 1)


def test_the_readme_core_calls_what_the_worker_calls():
    called = {
        node.func.id
        for node in ast.walk(ast.parse(core_block()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    }
    worker = (ROOT / "sglang_bastion" / "worker.py").read_text()
    for name in ("build_trees_from_top_k", "verify_inputs", "accept"):
        assert name in called and f"{name}(" in worker, name
