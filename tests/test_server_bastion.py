"""BASTION inside a real SGLang server on this CPU: lossless over HTTP.

Servers are real ``python -m sglang.launch_server`` processes on 127.0.0.1, started once for
this module (idle SGLang schedulers keep polling, so they stop when the module is done). The
target's LM head prefers one of four tokens (see ``tiny_models.write_target``), so the
drafter, which shares that head, proposes the target's tokens often and trees are accepted
several levels deep: acceptance, KV moves and mid-path stops are all exercised.
"""

from __future__ import annotations

import os
from collections import Counter
from functools import partial

import openai
import pytest
import requests
from scipy.stats import chi2_contingency
from server_utils import (
    SERVER_ENV,
    all_at_once,
    assert_all_same,
    assert_same_greedy,
    bastion_args,
    complete,
    dflash_args,
    run_all,
    sglang_server,
    stream_then_abort,
    used_tokens,
)

pytestmark = pytest.mark.slow

# BASTION_TEST_BACKEND=triton runs this module on SGLang's Triton backend (interpreted on a CPU,
# so float32) to time it against bastion_cpu: benchmarks/results/cpu_attention_serving.md.
ATTENTION = os.environ.get("BASTION_TEST_BACKEND", "bastion_cpu")
BACKEND = ["--attention-backend", ATTENTION, "--max-total-tokens", "8192", "--random-seed", "7"]
if ATTENTION == "triton":
    BACKEND += ["--dtype", "float32"]
PROMPTS = [f"def f{i}(x):\n    return x * {i} +" for i in range(12)] + [
    "import os\n", "class A:\n    pass\n", "for i in range(3):", "# comment\n",
]  # fmt: skip


@pytest.fixture(scope="module")
def plain_url(pair, tmp_path_factory):
    """The same target served without speculation."""
    log = tmp_path_factory.mktemp("logs") / "plain.log"
    with sglang_server(pair[0], BACKEND, log, env=SERVER_ENV) as url:
        yield url


@pytest.fixture(scope="module")
def dflash_url(pair, tmp_path_factory):
    """The target served with SGLang's own DFLASH (a chain of the drafter's block)."""
    log = tmp_path_factory.mktemp("logs") / "dflash.log"
    with sglang_server(pair[0], [*BACKEND, *dflash_args(pair[1])], log, env=SERVER_ENV) as url:
        yield url


@pytest.fixture(scope="module")
def bastion_url(pair, tmp_path_factory):
    """The target served with BASTION trees of up to 16 nodes."""
    log = tmp_path_factory.mktemp("logs") / "bastion.log"
    with sglang_server(pair[0], [*BACKEND, *bastion_args(pair[1], 16)], log, env=SERVER_ENV) as url:
        yield url


GREEDY_BATCH = [{"prompt": p, "max_tokens": 20 + 3 * (i % 4)} for i, p in enumerate(PROMPTS)]


def test_greedy_output_equals_the_plain_server_for_concurrent_prompts(plain_url, bastion_url):
    got, want = run_all(bastion_url, GREEDY_BATCH), run_all(plain_url, GREEDY_BATCH)
    assert_all_same(plain_url, GREEDY_BATCH, got, want)


def test_greedy_output_equals_dflash(dflash_url, bastion_url, plain_url):
    got, want = run_all(bastion_url, GREEDY_BATCH), run_all(dflash_url, GREEDY_BATCH)
    assert_all_same(plain_url, GREEDY_BATCH, got, want)


def test_stops_inside_an_accepted_path_cut_where_the_plain_server_cuts(plain_url, bastion_url):
    batch = [
        {"prompt": PROMPTS[0], "max_tokens": 7},  # max_tokens mid-block
        {"prompt": PROMPTS[1], "max_tokens": 30, "stop_token_ids": [303]},
        {"prompt": PROMPTS[2], "max_tokens": 30, "stop_token_ids": [300, 302]},
    ]
    plain, bastion = run_all(plain_url, batch), run_all(bastion_url, batch)
    assert_all_same(plain_url, batch, bastion, plain)
    assert plain[0][1] == bastion[0][1] == "length" and len(bastion[0][0]) == 7


def test_stop_strings_cut_where_the_plain_server_cuts(plain_url, bastion_url):
    text = (
        openai.OpenAI(base_url=f"{plain_url}/v1", api_key="none")
        .completions.create(model="default", prompt=PROMPTS[3], max_tokens=24, temperature=0)
        .choices[0]
        .text
    )
    stop = text[len(text) // 2 : len(text) // 2 + 2]  # a string that occurs mid-generation
    batch = [{"prompt": PROMPTS[3], "max_tokens": 24, "stop": [stop]}]
    assert_all_same(plain_url, batch, run_all(bastion_url, batch), run_all(plain_url, batch))


def test_streaming_chat_equals_non_streaming_chat(bastion_url, plain_url):
    client = openai.OpenAI(base_url=f"{bastion_url}/v1", api_key="none")
    messages = [{"role": "user", "content": "write a loop"}]
    whole = (
        client.chat.completions.create(
            model="default", messages=messages, max_tokens=20, temperature=0
        )
        .choices[0]
        .message.content
    )
    chunks = client.chat.completions.create(
        model="default", messages=messages, max_tokens=20, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    plain = (
        openai.OpenAI(base_url=f"{plain_url}/v1", api_key="none")
        .chat.completions.create(model="default", messages=messages, max_tokens=20, temperature=0)
        .choices[0]
        .message.content
    )
    assert streamed == whole == plain


def test_trees_are_accepted_more_than_one_token_per_step(bastion_url):
    reply = requests.post(
        f"{bastion_url}/generate",
        json={"text": PROMPTS[5], "sampling_params": {"max_new_tokens": 32, "temperature": 0}},
        timeout=600,
    ).json()
    assert reply["meta_info"]["spec_accept_length"] > 1.2  # random weights: real depth is tested
    # on the trained pair (test_server_trained_pair.py)


def sampled_prefixes(url: str, samples: int, length: int) -> Counter:
    """Counts of the first ``length`` sampled tokens over ``samples`` continuations."""
    counts: Counter = Counter()
    for start in range(0, samples, 50):
        reply = requests.post(
            f"{url}/generate",
            json={
                "text": [PROMPTS[6]] * min(50, samples - start),
                "sampling_params": {"max_new_tokens": length, "temperature": 1.0, "top_k": 2},
            },
            timeout=600,
        ).json()
        counts.update(tuple(r["output_ids"][:length]) for r in reply)
    return counts


def test_sampled_continuations_follow_the_plain_servers_distribution(plain_url, bastion_url):
    # Top-2 sampling keeps 2^3 possible 3-token continuations; the second and third tokens
    # come out of tree verification. Chi-square test of homogeneity, 400 samples each.
    plain, bastion = sampled_prefixes(plain_url, 400, 3), sampled_prefixes(bastion_url, 400, 3)
    cells = sorted(set(plain) | set(bastion))
    table = [[plain[c] for c in cells], [bastion[c] for c in cells]]
    assert chi2_contingency(table).pvalue > 1e-3, table


def test_token_usage_returns_to_idle_after_load(bastion_url):
    before = used_tokens(bastion_url)
    run_all(bastion_url, [{"prompt": p, "max_tokens": 12} for p in PROMPTS[:8]])
    assert used_tokens(bastion_url) == before


def tokens(url: str, text: str) -> list[int]:
    """``text`` as the server tokenises it."""
    reply = requests.post(f"{url}/tokenize", json={"prompt": text}, timeout=60)
    return reply.json()["tokens"]


def plain_text(url: str, prompt: str, max_tokens: int) -> str:
    """A non-streamed greedy completion's text through the OpenAI client."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    reply = client.completions.create(
        model="default", prompt=prompt, max_tokens=max_tokens, temperature=0
    )
    return reply.choices[0].text


def streamed(url: str, prompt: str, max_tokens: int) -> str:
    """A streamed greedy completion's text."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    chunks = client.completions.create(
        model="default", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
    )
    return "".join(c.choices[0].text for c in chunks if c.choices)


def test_64_concurrent_requests_with_aborts_stay_exact_and_leave_nothing_behind(
    plain_url, bastion_url
):
    idle = used_tokens(bastion_url)
    prompts = [f"x{i} = [{i}, {i + 1}," for i in range(64)]
    batch = [{"prompt": p, "max_tokens": 12} for p in prompts[:48]]
    expected = run_all(plain_url, batch)
    jobs = [partial(complete, bastion_url, prompt=p, max_tokens=12) for p in prompts[:40]]
    jobs += [partial(streamed, bastion_url, p, 12) for p in prompts[40:48]]
    jobs += [partial(stream_then_abort, bastion_url, p, chunks=2) for p in prompts[48:]]
    results = all_at_once(jobs)
    assert_all_same(plain_url, batch[:40], [results[i] for i in range(40)], expected[:40])
    for i in range(40, 48):  # streamed through the OpenAI client: compare as token ids
        got = tokens(plain_url, results[i])
        want = tokens(plain_url, plain_text(plain_url, prompts[i], 12))
        assert_same_greedy(plain_url, prompts[i], (got, "length"), (want, "length"))
    assert used_tokens(bastion_url) == idle
