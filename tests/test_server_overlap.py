"""Exact on either schedule: SGLang's default overlapped one and the synchronous one.

Under overlap the scheduler launches step i before it processes step i-1's result: the worker
hands each step's new lengths to SGLang's future map (``on_publish``), and a grammar batch
advances its grammars over the queued step through the scheduler's barrier. Each BASTION
server here (fixed trees of 16 nodes and the adaptive controller on the overlapped schedule,
the adaptive controller on the synchronous one, whose step is the same code) answers
the same requests, one at a time and 18 at once, with every sampling parameter (stop strings
included), grammars, logprobs and aborted streams, against the plain server on SGLang's
synchronous schedule (the ``plain_url`` fixture says why). One more BASTION server runs
SGLang's retraction test mode, where requests are retracted mid-decode and resume later.

Sampled output under overlap is checked in ``test_server_exact_sampling`` and
``test_server_bastion``, whose BASTION servers run overlapped.
"""

from __future__ import annotations

import contextlib
import re
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import NamedTuple

import pytest
import requests
from exactness_cases import CASES, PROMPTS, assert_all_same, batch
from server_utils import (
    TRAINED_ARGS,
    TRAINED_ENV,
    TRAINED_PAIR,
    all_at_once,
    bastion_args,
    complete,
    generate,
    run_all,
    sglang_server,
    stream_then_abort,
    used_tokens,
)

pytestmark = pytest.mark.slow

# SGLang's own retraction test mode: every 5th step the server retracts requests from the
# decode batch (as a full KV pool would); they are re-prefilled and resume later. SGLang's
# penalizers restart from zero for a re-prefilled request, so a penalised request's output
# under retraction is not the plain server's even without speculation: these have none.
RETRACTING = {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "5"}
RETRACTED = re.compile(r"Testing retraction\. #retracted_reqs: ([1-9]\d*)")
UNPENALISED = [*batch({}), *batch(CASES["stop_token_ids"]), *batch(CASES["logit_bias"])]
# 18 requests, every parameter twice: the batch that shares a step.
SHARED = [request for params in CASES.values() for request in batch(params, PROMPTS[:2])]
# One at a time, each parameter on its own, cut at lengths that end inside accepted paths.
ONE_BY_ONE = [
    {"prompt": PROMPTS[2], "max_tokens": 5 + 3 * i, **params}
    for i, params in enumerate(CASES.values())
]
REGEXES = [r"    return [a-z]{1,8}\([a-z, ]{0,12}\)\n", r"    [a-z_]{1,10} = [0-9]{1,3}\n"]
GRAMMAR_BATCH = [
    *({"prompt": p, "max_tokens": 32, "regex": r} for p in PROMPTS for r in REGEXES),
    *batch({}),
]  # fmt: skip
DEPRECATED = "Migrate the plugin worker to support overlap scheduling"


class Served(NamedTuple):
    """A running BASTION server: its URL, log, and the schedule it was given."""

    url: str
    log: Path
    overlapped: bool


@pytest.fixture(scope="module")
def plain_outputs(plain_url):
    """The plain server's greedy outputs for every batch the tests send."""
    return {
        "shared": run_all(plain_url, SHARED, at_once=len(SHARED)),
        "one by one": run_all(plain_url, ONE_BY_ONE, at_once=1),
        "grammar": run_all(plain_url, GRAMMAR_BATCH),
        "unpenalised": run_all(plain_url, UNPENALISED),
    }


@pytest.fixture(
    scope="module",
    params=["overlapped-fixed", "overlapped-adaptive", "synchronous-adaptive"],
)
def bastion(request, tmp_path_factory, tiny_pair_profile):
    """Each BASTION server in turn: fixed N=16 or adaptive (N_max 32) overlapped, adaptive
    synchronous."""
    if request.param == "overlapped-fixed":  # SGLang's defaults: the run's shared server
        yield Served(*request.getfixturevalue("fixed_server"), overlapped=True)
        return
    log = tmp_path_factory.mktemp(request.param) / "bastion.log"
    with bastion_server(request.param, log, tiny_pair_profile) as served:
        yield served


@contextlib.contextmanager
def bastion_server(setup: str, log: Path, profile: Path, env: dict | None = None):
    """A BASTION server of ``setup`` (schedule-mode) with ``env`` added."""
    schedule, mode = setup.split("-")
    args = [*TRAINED_ARGS, *bastion_args(TRAINED_PAIR / "drafter", 16)]
    env = {**TRAINED_ENV, **(env or {})}
    if mode == "adaptive":
        args = [*TRAINED_ARGS, *bastion_args(TRAINED_PAIR / "drafter", 32)]
        env["SGLANG_BASTION_PROFILE"] = str(profile)
    if schedule == "synchronous":
        args.append("--disable-overlap-schedule")
    with sglang_server(TRAINED_PAIR / "target", args, log, env=env) as url:
        yield Served(url, log, schedule == "overlapped")


@pytest.fixture(scope="module", params=["overlapped-adaptive"])
def retracting(request, tmp_path_factory, tiny_pair_profile):
    """A BASTION server that retracts requests every 5th step (SGLang's test mode): on the
    overlapped schedule, adaptive, whose per-request acceptance state restarts with each
    re-prefill."""
    log = tmp_path_factory.mktemp(f"retracting-{request.param}") / "bastion.log"
    with bastion_server(request.param, log, tiny_pair_profile, RETRACTING) as served:
        yield served


def test_the_server_runs_on_the_schedule_it_was_given_without_a_deprecation_warning(bastion):
    info = requests.get(f"{bastion.url}/server_info", timeout=60).json()
    assert info["disable_overlap_schedule"] is not bastion.overlapped
    log = bastion.log.read_text()
    assert DEPRECATED not in log and "does not support overlap scheduling" not in log


def test_one_request_at_a_time_equals_the_plain_server(bastion, plain_url, plain_outputs):
    got = run_all(bastion.url, ONE_BY_ONE, at_once=1)
    assert_all_same(plain_url, ONE_BY_ONE, got, plain_outputs["one by one"])


def test_requests_with_every_parameter_at_once_equal_the_plain_server(
    bastion, plain_url, plain_outputs
):
    got = run_all(bastion.url, SHARED, at_once=len(SHARED))
    assert_all_same(plain_url, SHARED, got, plain_outputs["shared"])


def test_grammar_requests_sharing_a_batch_follow_their_grammar_as_without_speculation(
    bastion, plain_url, plain_outputs
):
    with ThreadPoolExecutor(max_workers=len(GRAMMAR_BATCH)) as pool:
        replies = list(pool.map(lambda r: generate(bastion.url, temperature=0, **r), GRAMMAR_BATCH))
    got = [(r["output_ids"], r["meta_info"]["finish_reason"]["type"]) for r in replies]
    assert_all_same(plain_url, GRAMMAR_BATCH, got, plain_outputs["grammar"])
    for request, reply in zip(GRAMMAR_BATCH, replies, strict=True):
        assert "regex" not in request or re.fullmatch(request["regex"], reply["text"]), reply


def test_aborted_streams_leave_the_others_exact_and_the_pool_idle(
    bastion, plain_url, plain_outputs
):
    idle = used_tokens(bastion.url)
    jobs = [partial(complete, bastion.url, **request) for request in SHARED[:12]]
    jobs += [partial(stream_then_abort, bastion.url, r["prompt"], chunks=2) for r in SHARED[12:16]]
    got = all_at_once(jobs)[:12]
    assert_all_same(plain_url, SHARED[:12], got, plain_outputs["shared"][:12])
    assert used_tokens(bastion.url) == idle


def test_requests_retracted_mid_decode_resume_with_the_plain_servers_tokens(
    retracting, plain_url, plain_outputs
):
    idle = used_tokens(retracting.url)
    got = run_all(retracting.url, UNPENALISED, at_once=len(UNPENALISED))
    assert RETRACTED.search(retracting.log.read_text())  # requests were retracted
    assert_all_same(plain_url, UNPENALISED, got, plain_outputs["unpenalised"])
    assert used_tokens(retracting.url) == idle


def test_logprobs_are_those_of_the_emitted_tokens_as_without_speculation(bastion, plain_url):
    body = {"text": PROMPTS[1], "sampling_params": {"max_new_tokens": 24, "temperature": 0},
            "return_logprob": True}  # fmt: skip
    tree, plain = (
        requests.post(f"{u}/generate", json=body, timeout=600).json()
        for u in (bastion.url, plain_url)
    )
    assert tree["output_ids"] == plain["output_ids"]
    got, want = (
        tree["meta_info"]["output_token_logprobs"],
        plain["meta_info"]["output_token_logprobs"],
    )
    assert [t for _, t, _ in got] == tree["output_ids"]
    for (mine, _, _), (theirs, _, _) in zip(got, want, strict=True):
        assert mine == pytest.approx(theirs, abs=0.05)  # bf16: verify against decode pass
