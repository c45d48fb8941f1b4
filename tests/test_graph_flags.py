"""Graphs are switched off with SGLang 0.5.23's current flags; the deprecated one still works."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from resolution import resolved_bastion_args

from calibration.cli import server_argv
from calibration.grid import QUICK

ROOT = Path(__file__).resolve().parent.parent
CURRENT = ["--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]
DEPRECATED = ["--disable-cuda-graph"]


def resolved_graph_backends(extra: list[str]) -> tuple[str, str]:
    """(decode, prefill) graph backends SGLang resolves for a CPU BASTION server with ``extra``."""
    graphs = resolved_bastion_args(["--attention-backend", "bastion_cpu", *extra])
    return str(graphs.cuda_graph_config.decode.backend), str(
        graphs.cuda_graph_config.prefill.backend
    )


@pytest.mark.parametrize("spelling", [CURRENT, DEPRECATED], ids=["current", "deprecated"])
def test_both_spellings_turn_every_graph_off_for_a_bastion_server(spelling):
    assert resolved_graph_backends(spelling) == ("disabled", "disabled")


def test_the_projects_cpu_recipes_use_the_current_flags():
    recipes = ["README.md", "tests/server_utils.py", "tests/engine_generate.py",
               "benchmarks/sweep_methods.py"]  # fmt: skip
    old = re.compile(r"disable[-_]cuda[-_]graph\b(?![-_])")
    assert [name for name in recipes if old.search((ROOT / name).read_text())] == []


def test_calibration_on_a_cpu_switches_graphs_off_with_the_current_flags():
    argv = server_argv(["--device", "cpu"], QUICK)
    assert "--disable-cuda-graph" not in argv
    flags = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--cuda")}
    assert flags == dict(zip(CURRENT[::2], CURRENT[1::2], strict=True))


def test_calibration_keeps_a_users_deprecated_spelling_alone():
    argv = server_argv(["--device", "cpu", *DEPRECATED], QUICK)
    assert "--cuda-graph-backend-decode" not in argv and argv.count("--disable-cuda-graph") == 1
