"""BASTION runs on SGLang's default overlapped scheduler, and on the synchronous one on request.

Under overlap the scheduler launches step i before it processes step i-1's result, and the
worker hands each step's new lengths to SGLang's future map (``on_publish``) for the next one.
Penalties under overlap are checked in ``test_server_exact_sampling``, whose BASTION servers
run overlapped against a synchronous plain reference.
"""

from __future__ import annotations

import pytest
import requests
from server_utils import SERVER_ENV, assert_all_same, bastion_args, run_all, sglang_server

pytestmark = pytest.mark.slow

BACKEND = ["--attention-backend", "bastion_cpu", "--max-total-tokens", "8192"]
PROMPTS = [f"def g{i}(x):\n    return x - {i} *" for i in range(6)]
BATCH = [{"prompt": p, "max_tokens": 24 + 5 * (i % 3)} for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def plain_url(pair, tmp_path_factory):
    """The target without speculation, scheduled synchronously."""
    log = tmp_path_factory.mktemp("logs") / "plain.log"
    with sglang_server(
        pair[0], [*BACKEND, "--disable-overlap-schedule"], log, env=SERVER_ENV
    ) as url:
        yield url


@pytest.mark.parametrize("schedule", ["overlapped", "synchronous"])
def test_bastion_serves_the_plain_servers_tokens_on_either_schedule(
    pair, plain_url, tmp_path, schedule
):
    args = [*BACKEND, *bastion_args(pair[1], 16)]
    if schedule == "synchronous":
        args.append("--disable-overlap-schedule")
    with sglang_server(pair[0], args, tmp_path / "bastion.log", env=SERVER_ENV) as url:
        info = requests.get(f"{url}/server_info", timeout=60).json()
        assert info["disable_overlap_schedule"] is (schedule == "synchronous")
        assert_all_same(plain_url, BATCH, run_all(url, BATCH), run_all(plain_url, BATCH))
    log = (tmp_path / "bastion.log").read_text()
    assert "does not support overlap scheduling" not in log
