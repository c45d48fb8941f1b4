"""Exact under every sampling parameter, and a bad request never takes the server down.

Real servers of the shipped trained pair: plain, BASTION with trees of 16 nodes, and adaptive
BASTION with the shipped profile. Every penalty and stop parameter is sent with prompts where
it changes the plain server's greedy output (checked first, so no test passes vacuously),
several requests at once so that different parameters share a batch.

The plain reference runs SGLang's synchronous schedule (the ``plain_url`` fixture says why).
"""

from __future__ import annotations

import pytest
import requests
from exactness_cases import CASES, LENGTH, PROMPTS, assert_all_same, batch
from scipy.stats import chi2_contingency
from server_utils import (
    TRAINED_ARGS,
    TRAINED_ENV,
    TRAINED_PAIR,
    bastion_args,
    complete,
    run_all,
    sglang_server,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fixed_url(fixed_server):
    """BASTION with trees of 16 nodes."""
    return fixed_server[0]


@pytest.fixture(scope="module")
def adaptive_url(tmp_path_factory, tiny_pair_profile):
    """BASTION with the adaptive controller (N_max 32, the tiny pair's profile), with
    SGLang's Prometheus metrics published every 4 decode steps."""
    log = tmp_path_factory.mktemp("logs") / "adaptive.log"
    metrics = ["--enable-metrics", "--decode-log-interval", "4"]
    args = [*TRAINED_ARGS, *bastion_args(TRAINED_PAIR / "drafter", 32), *metrics]
    env = {**TRAINED_ENV, "SGLANG_BASTION_PROFILE": str(tiny_pair_profile)}
    with sglang_server(TRAINED_PAIR / "target", args, log, env=env, timeout_s=480) as url:
        yield url


@pytest.fixture(scope="module", params=["fixed", "adaptive"])
def bastion_url(request):
    """Each BASTION server in turn."""
    return request.getfixturevalue(f"{request.param}_url")


@pytest.fixture(scope="module")
def plain_outputs(plain_url):
    """The plain server's greedy outputs per case, and without any parameter."""
    outputs = {name: run_all(plain_url, batch(params)) for name, params in CASES.items()}
    return outputs, run_all(plain_url, batch({}))


@pytest.mark.parametrize("case", CASES)
def test_the_parameter_changes_the_plain_servers_output(case, plain_outputs):
    outputs, unpenalised = plain_outputs
    changed = [got != base for got, base in zip(outputs[case], unpenalised, strict=True)]
    assert all(changed), (case, outputs[case], unpenalised)


def test_min_new_tokens_holds_a_stop_token_back(plain_outputs):
    outputs, _ = plain_outputs
    stopped = outputs["stop_token_ids"]
    held = outputs["min_new_tokens"]
    assert all(len(ids) < 14 for ids, _ in stopped)  # the stop token cuts early ...
    assert all(len(ids) >= 14 for ids, _ in held)  # ... unless min_new_tokens holds it back
    assert all(15 not in ids[:14] for ids, _ in held)
    # once the output is long enough, the stop token comes out and stops the request
    assert any(ids[-1] == 15 and reason == "stop" for ids, reason in held), held


@pytest.mark.parametrize("case", CASES)
def test_greedy_output_equals_the_plain_server(case, plain_url, fixed_url, plain_outputs):
    got = run_all(fixed_url, batch(CASES[case]))
    assert_all_same(plain_url, batch(CASES[case]), got, plain_outputs[0][case])


def test_every_parameter_in_one_batch_equals_the_plain_server(
    plain_url, bastion_url, plain_outputs
):
    mixed = [request for params in CASES.values() for request in batch(params)]
    want = [output for name in CASES for output in plain_outputs[0][name]]
    assert_all_same(plain_url, mixed, run_all(bastion_url, mixed), want)


SAMPLE_PROMPT = "x = [1, 1, 1, 1, 1, 1,"  # the prompt every sample continues
SAMPLE_BATCH = 50  # samples requested at once


def sampled_prefixes(url: str, samples: int, length: int, **params: float) -> dict:
    """Counts of the first ``length`` tokens of ``samples`` top-2 samples at temperature 1."""
    counts: dict[tuple, int] = {}
    for start in range(0, samples, SAMPLE_BATCH):
        body = {
            "text": [SAMPLE_PROMPT] * min(SAMPLE_BATCH, samples - start),
            "sampling_params": {
                "max_new_tokens": length, "temperature": 1.0, "top_k": 2, **params,
            },
        }  # fmt: skip
        for reply in requests.post(f"{url}/generate", json=body, timeout=600).json():
            key = tuple(reply["output_ids"][:length])
            counts[key] = counts.get(key, 0) + 1
    return counts


def homogeneity(one: dict, other: dict) -> float:
    """Chi-square test of homogeneity of two samples' counts: its p-value."""
    cells = sorted(set(one) | set(other))
    return float(
        chi2_contingency([[one.get(c, 0) for c in cells], [other.get(c, 0) for c in cells]]).pvalue
    )


@pytest.fixture(scope="module")
def plain_samples(plain_url):
    """The plain server's sampled continuations with a repetition penalty, and without."""
    return sampled_prefixes(plain_url, SAMPLES, 3, **PENALTY), sampled_prefixes(
        plain_url, SAMPLES, 3
    )


SAMPLES, PENALTY = 400, {"repetition_penalty": 1.4}


def test_the_penalty_moves_the_sampled_distribution(plain_samples):
    penalised, unpenalised = plain_samples
    assert homogeneity(penalised, unpenalised) < 1e-6


def test_sampled_output_under_a_penalty_follows_the_plain_servers_distribution(
    plain_samples, bastion_url
):
    # 3-token continuations at temperature 1, top-2: tokens 2 and 3 come out of the trees
    served = sampled_prefixes(bastion_url, SAMPLES, 3, **PENALTY)
    assert homogeneity(plain_samples[0], served) > 1e-3, (plain_samples[0], served)


def bastion_state(url: str) -> dict:
    """The server's BASTION counters and controller state (/server_info)."""
    return requests.get(f"{url}/server_info", timeout=60).json()["internal_states"][0]["bastion"]


def test_sampling_that_accepts_little_falls_back_to_plain_steps(adaptive_url, plain_url):
    # At temperature 1 this target rarely draws the drafter's tokens: trees do not pay.
    before = bastion_state(adaptive_url)
    body = {
        "text": PROMPTS * 3,
        "sampling_params": {"max_new_tokens": 48, "temperature": 1.0, "ignore_eos": True},
    }
    replies = requests.post(f"{adaptive_url}/generate", json=body, timeout=600).json()
    assert all(len(r["output_ids"]) == 48 for r in replies)
    after = bastion_state(adaptive_url)
    steps = after["steps"] - before["steps"]
    assert after["controller"]["learn_acceptance"] is True
    assert after["plain_steps"] - before["plain_steps"] > steps / 2, (before, after)
    # SGLang's decode forward ran them, as the plain server runs its steps
    plain = after["plain_steps"] - before["plain_steps"]
    assert after["decoded_plain_steps"] - before["decoded_plain_steps"] == plain
    # and greedy requests after it still get the plain server's output
    assert complete(adaptive_url, PROMPTS[0], LENGTH) == complete(plain_url, PROMPTS[0], LENGTH)


def test_probes_of_a_batch_larger_than_the_sample_draft_a_sample_and_stay_exact(
    adaptive_url, plain_url
):
    # 12 sampled requests that accept little: the probes of their plain waits draft 4 of them.
    # The earlier tests may have left a long plain wait (at most 512 steps): up to 5 batches
    # of 128 steps outlast it.
    body = {
        "text": PROMPTS * 3,
        "sampling_params": {"max_new_tokens": 128, "temperature": 1.0, "ignore_eos": True},
    }
    before = after = bastion_state(adaptive_url)
    for _ in range(5):
        replies = requests.post(f"{adaptive_url}/generate", json=body, timeout=600).json()
        assert all(len(r["output_ids"]) == 128 for r in replies)
        after = bastion_state(adaptive_url)
        if after["sampled_probes"] > before["sampled_probes"]:
            break
    assert after["sampled_probes"] > before["sampled_probes"], (before, after)
    assert complete(adaptive_url, PROMPTS[1], LENGTH) == complete(plain_url, PROMPTS[1], LENGTH)


def test_sampled_output_in_plain_steps_follows_the_plain_servers_distribution(
    adaptive_url, plain_samples
):
    # once the controller has learned that sampled requests accept little, they step
    # plainly, and what they emit there is still the target's distribution. It learns from
    # longer requests of the very batch and parameters it then serves: what the earlier
    # tests left at other batch sizes does not decide how the samples' batches step.
    learn = {"max_new_tokens": 48, "temperature": 1.0, "top_k": 2, "ignore_eos": True}
    body = {"text": [SAMPLE_PROMPT] * SAMPLE_BATCH, "sampling_params": {**learn, **PENALTY}}
    requests.post(f"{adaptive_url}/generate", json=body, timeout=600).raise_for_status()
    before = bastion_state(adaptive_url)
    served = sampled_prefixes(adaptive_url, SAMPLES, 3, **PENALTY)
    after = bastion_state(adaptive_url)
    steps = after["steps"] - before["steps"]
    assert after["plain_steps"] - before["plain_steps"] > steps / 2, (before, after)
    assert homogeneity(plain_samples[0], served) > 1e-3, (plain_samples[0], served)


BASTION_SERIES = (
    "sglang:bastion_mean_tree_size", "sglang:bastion_verify_width",
    "sglang:bastion_predicted_accept_length", "sglang:bastion_realised_accept_length",
    "sglang:bastion_accept_depth_share", "sglang:bastion_plain_step_share",
    "sglang:bastion_root_only_request_share",
)  # fmt: skip


def prometheus(url: str) -> dict[str, float]:
    """Every sample on SGLang's /metrics: 'name{labels}' -> value."""
    text = requests.get(f"{url}/metrics", timeout=60).text
    samples = (line.rsplit(" ", 1) for line in text.splitlines() if line and line[0] != "#")
    return {name: float(value) for name, value in samples}


def total(samples: dict[str, float], name: str) -> float:
    """The sum of a series over its labels."""
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def test_the_controller_is_on_sglangs_prometheus_endpoint(adaptive_url):
    batch_ = [{"prompt": p, "max_tokens": LENGTH} for p in PROMPTS]
    run_all(adaptive_url, batch_)
    before = prometheus(adaptive_url)
    run_all(adaptive_url, batch_)
    after = prometheus(adaptive_url)
    assert total(after, "sglang:bastion_steps_total") > total(before, "sglang:bastion_steps_total")
    assert "sglang:spec_accept_length" in "".join(after)  # beside SGLang's own series
    for name in BASTION_SERIES:
        assert any(k.startswith(name + "{") for k in after), name
    depth1 = [v for k, v in after.items() if k.startswith(BASTION_SERIES[4]) and 'depth="1"' in k]
    assert depth1 and 0.0 <= depth1[0] <= 1.0


KILLERS = {
    "empty prompt": ({"text": ""}, "prompt is empty"),
    "id at the vocabulary size": ({"input_ids": [202, 4096]}, "outside the vocabulary"),
    "negative id": ({"input_ids": [202, -3]}, "outside the vocabulary"),
    "top_logprobs_num above the vocabulary": (
        {"text": "x = 1", "return_logprob": True, "top_logprobs_num": 5000},
        "exceeds the vocabulary size",
    ),
}


@pytest.mark.parametrize("case", KILLERS)
def test_a_request_that_would_kill_the_server_gets_400_and_the_next_is_served(
    case, bastion_url, plain_outputs
):
    body, reason = KILLERS[case]
    body = {**body, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    reply = requests.post(f"{bastion_url}/generate", json=body, timeout=120)
    assert reply.status_code == 400 and reason in reply.text, reply.text
    assert complete(bastion_url, PROMPTS[0], LENGTH) == plain_outputs[1][0]
