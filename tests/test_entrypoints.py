"""BASTION through SGLang's other entry points: the offline Engine and ``sglang serve``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from server_utils import SERVER_ENV, SGLANG_SERVE, bastion_args, complete, server_env, sglang_server

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parent
PAIR = TESTS.parent / "training" / "pair"


@pytest.fixture(scope="module")
def engine_outputs(tmp_path_factory) -> dict[str, list[list[int]]]:
    """Greedy output ids of a plain and a BASTION ``sglang.Engine`` on the trained pair."""
    out = tmp_path_factory.mktemp("engine") / "outputs.json"
    command = [sys.executable, str(TESTS / "engine_generate.py"), str(PAIR / "target"),
               str(PAIR / "drafter"), str(out)]  # fmt: skip
    result = subprocess.run(command, env=server_env(SERVER_ENV), capture_output=True, text=True,
                            timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


def test_the_offline_engine_generates_the_plain_engines_tokens(engine_outputs):
    assert engine_outputs["bastion"] == engine_outputs["plain"]
    assert all(len(ids) == 24 for ids in engine_outputs["bastion"])


def test_sglang_serve_serves_bastion_with_the_engines_tokens(engine_outputs, tmp_path):
    from engine_generate import PROMPTS

    args = ["--attention-backend", "bastion_cpu", *bastion_args(PAIR / "drafter", 16)]
    with sglang_server(PAIR / "target", args, tmp_path / "serve.log", env=SERVER_ENV,
                       launcher=SGLANG_SERVE) as url:  # fmt: skip
        ids, _ = complete(url, prompt=PROMPTS[0], max_tokens=24)
        state = requests.get(f"{url}/server_info", timeout=60).json()["internal_states"][0]
    assert ids == engine_outputs["plain"][0]
    assert state["bastion"]["steps"] > 0
