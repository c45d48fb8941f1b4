"""The tree verify replays SGLang's own graph runner, with its graphs emulated on this CPU.

A CPU host has no CUDA graphs. A stand-in (``STANDIN_EMULATED_GRAPHS``, see
sglang_standins/README.md) gives SGLang's decode graph runner a capture backend that records
each captured forward and re-runs it at replay over the runner's static buffers, with the
attention metadata its capture built (a real graph bakes its kernel arguments in at capture).
Whatever a replay fails to copy into a captured buffer (the tree mask, the nodes' depths as
positions, the KV slots, the lengths) then shows as wrong tokens, as it would on a GPU.

Triton runs interpreted, in float32 (its interpreter is wrong in bfloat16). BASTION with
fixed trees of 8 nodes captures batch sizes 1, 2 and 4 (a batch of 3 replays padded to 4);
adaptive BASTION (N_max 8) captures every width of its ladder at batch sizes 1 and 2, so a
batch of 3 verifies eagerly on the same server. Each answers the prompts one at a time (C=1)
and all three at once (C=3), against the plain target. A negative control, on the fixed
server while a flag file exists, replays with the mask buffer left as it was: its tokens
must differ.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from server_utils import SERVER_ENV, TRAINED_PAIR, bastion_args, run_all, sglang_server

pytestmark = pytest.mark.slow

PROMPTS = ("def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def push(self, x):")
BATCH = [{"prompt": prompt, "max_tokens": 12} for prompt in PROMPTS]
GRAPHS = {**SERVER_ENV, "SGLANG_BASTION_TOPK": "8", "STANDIN_EMULATED_GRAPHS": "1"}
TRITON = [
    "--attention-backend",
    "triton",
    "--dtype",
    "float32",
    "--cuda-graph-backend-decode",
    "full",
]


def state(url: str) -> dict:
    """The BASTION worker's counters from /server_info."""
    return requests.get(f"{url}/server_info", timeout=60).json()["internal_states"][0]["bastion"]


@contextlib.contextmanager
def graph_server(log: Path, args: list[str], env: dict | None = None) -> Iterator[str]:
    """A BASTION server of the trained pair on Triton with emulated decode graphs."""
    with sglang_server(
        TRAINED_PAIR / "target", [*TRITON, *args], log, env={**GRAPHS, **(env or {})}
    ) as url:
        yield url


@pytest.fixture(scope="module")
def want(triton_plain_url) -> list:
    """The plain target's greedy tokens for the prompts."""
    return run_all(triton_plain_url, BATCH)


@pytest.fixture(scope="module")
def stale_flag(tmp_path_factory) -> Path:
    """While this file exists, the fixed server's replays keep the mask buffer as it was."""
    return tmp_path_factory.mktemp("stale") / "stale-mask"


@pytest.fixture(scope="module")
def fixed(tmp_path_factory, stale_flag) -> Iterator[str]:
    """BASTION with trees of 8 nodes, verify graphs at batch sizes 1, 2 and 4."""
    log = tmp_path_factory.mktemp("graphs") / "fixed.log"
    args = [*bastion_args(TRAINED_PAIR / "drafter", 8), "--cuda-graph-bs-decode", "1", "2", "4"]
    with graph_server(log, args, {"STANDIN_STALE_VERIFY_MASK": str(stale_flag)}) as url:
        yield url


@pytest.fixture(scope="module")
def triton_profile(tiny_pair_profile, tmp_path_factory) -> Path:
    """The tiny pair's latency profile, relabelled for Triton in float32.

    Its prices were measured on ``bastion_cpu`` in bfloat16; here they only steer which
    widths the controller picks, which is what these tests need to vary.
    """
    profile = json.loads(tiny_pair_profile.read_text())
    profile["identity"] |= {"dtype": "float32", "attention_backend": "triton"}
    path = tmp_path_factory.mktemp("profile") / "triton.json"
    path.write_text(json.dumps(profile))
    return path


@pytest.fixture(scope="module")
def adaptive(tmp_path_factory, triton_profile) -> Iterator[str]:
    """Adaptive BASTION (N_max 8), verify graphs at ladder widths 1, 2, 4, 8, batch sizes 1, 2."""
    log = tmp_path_factory.mktemp("graphs") / "adaptive.log"
    args = [*bastion_args(TRAINED_PAIR / "drafter", 8), "--cuda-graph-bs-decode", "1", "2"]
    with graph_server(log, args, {"SGLANG_BASTION_PROFILE": str(triton_profile)}) as url:
        yield url


@pytest.mark.parametrize("concurrency", [1, 3])
def test_fixed_trees_verified_in_graphs_give_the_plain_targets_tokens(fixed, want, concurrency):
    before = state(fixed)
    assert run_all(fixed, BATCH, concurrency) == want
    after = state(fixed)
    steps = after["steps"] - before["steps"]
    assert steps > 0 and after["graph_verifies"] - before["graph_verifies"] == steps


@pytest.mark.parametrize("concurrency", [1, 3])
def test_adaptive_trees_verified_in_graphs_give_the_plain_targets_tokens(
    adaptive, want, concurrency
):
    before = state(adaptive)
    assert run_all(adaptive, BATCH, concurrency) == want
    assert state(adaptive)["graph_verifies"] > before["graph_verifies"]


def test_adaptive_graphs_serve_several_widths_and_a_larger_batch_verifies_eagerly(adaptive):
    run_all(adaptive, BATCH, 3)
    counts = state(adaptive)
    assert len(counts["steps_by_width"]) >= 2
    assert 0 < counts["graph_verifies"] < counts["steps"]  # the batch of 3 ran eagerly


def test_replays_that_keep_a_stale_mask_buffer_give_wrong_tokens(fixed, want, stale_flag):
    before = state(fixed)["graph_verifies"]
    stale_flag.touch()
    try:
        got = run_all(fixed, BATCH, 3)
    finally:
        stale_flag.unlink()
        requests.post(f"{fixed}/flush_cache", timeout=60)  # its KV was written under that mask
    assert state(fixed)["graph_verifies"] > before
    assert got != want
