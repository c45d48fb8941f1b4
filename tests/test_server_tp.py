"""``--tp-size 2`` on this CPU: two ranks, each with half of the LM head, build the same trees.

SGLang's CPU path needs each rank's cores named (``SGLANG_CPU_OMP_THREADS_BIND``) and, on a
host without NCCL, gloo groups (a stand-in in ``sglang_standins``). Two servers: the plain
target (the run's shared one, on one rank) and BASTION on two ranks; trained pair, HumanEval
prompts, greedy. That the merged shards give the unsharded draft head exactly is tested
without servers (``test_kernels_draft_head.py``).
"""

from __future__ import annotations

import pytest
import requests
from server_utils import (
    TRAINED_ARGS,
    TRAINED_ENV,
    TRAINED_PAIR,
    assert_all_same,
    bastion_args,
    run_all,
    sglang_server,
)

pytestmark = pytest.mark.slow

ENV = {**TRAINED_ENV, "SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def push(self, x):\n",
    "def is_prime(n: int) -> bool:\n",
]
BATCH = [{"prompt": p, "max_tokens": 40} for p in PROMPTS]


@pytest.fixture(scope="module")
def plain(plain_url):
    """(URL, greedy replies) of the plain target, kept up to settle ties."""
    return plain_url, run_all(plain_url, BATCH)


@pytest.fixture(scope="module")
def bastion(plain, tmp_path_factory):
    """(greedy replies, BASTION counters) of BASTION on two ranks."""
    log = tmp_path_factory.mktemp("logs") / "tp2.log"
    args = [*TRAINED_ARGS, *bastion_args(TRAINED_PAIR / "drafter", 16), "--tp-size", "2"]
    with sglang_server(TRAINED_PAIR / "target", args, log, env=ENV) as url:
        replies = run_all(url, BATCH)
        info = requests.get(f"{url}/server_info", timeout=60).json()["internal_states"][0]
        return replies, info["bastion"]


def test_two_ranks_serve_the_plain_servers_greedy_tokens(plain, bastion):
    assert_all_same(plain[0], BATCH, bastion[0], plain[1])


def test_two_ranks_accept_more_than_two_tokens_per_step(bastion):
    # As one rank does on this pair (test_server_trained_pair); a sharded draft head that
    # drafted worse would not.
    assert bastion[1]["mean_accept_length"] > 2.0
