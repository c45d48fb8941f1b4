"""Requests where every sampling parameter changes the shipped pair's greedy output, and how
two servers' greedy outputs are compared under them.

Shared by the exactness server tests (``test_server_exact_sampling``, ``test_server_overlap``).
"""

from __future__ import annotations

import requests
from server_utils import tied_tokens

PROMPTS = [
    "def add(a, b):\n",
    "import os\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n",
]
LENGTH = 32
# Token 15 comes out of the plain target within the first ten tokens of every prompt, token
# 11 soon after: as a stop token it cuts the output early, unless min_new_tokens holds it back.
# Held back, 15 is later only a near second to the diverged output's tokens (which of them
# wins moved with the host's bfloat16 kernels), so the min_new_tokens case raises it by a
# logit bias: once the output is long enough, 15 comes out within a few tokens.
CASES = {
    "frequency_penalty": {"frequency_penalty": 1.0},
    "presence_penalty": {"presence_penalty": 1.2},
    "negative presence_penalty": {"presence_penalty": -1.5},
    "repetition_penalty": {"repetition_penalty": 1.6},
    "min_new_tokens": {"min_new_tokens": 14, "stop_token_ids": [15], "logit_bias": {"15": 4.0}},
    "stop_token_ids": {"stop_token_ids": [15]},
    "logit_bias": {"logit_bias": {"15": -100.0, "11": 4.0}},
    "stop string": {"stop": ["\n"]},  # cut by the scheduler inside an accepted path
    "all penalties": {
        "frequency_penalty": 0.4, "presence_penalty": 0.3, "repetition_penalty": 1.2,
        "min_new_tokens": 10, "stop_token_ids": [11],
    },
}  # fmt: skip


def top_at(url: str, request: dict, at: int, n: int = 4) -> list[tuple[float, int]]:
    """The plain server's ``n`` best (logprob, id) for output token ``at`` under the request's
    own parameters (its logprobs are those of the penalised distribution it draws from)."""
    params = {k: v for k, v in request.items() if k not in ("prompt", "max_tokens")}
    body = {
        "text": request["prompt"],
        "sampling_params": {"max_new_tokens": at + 1, "temperature": 0, **params},
        "return_logprob": True,
        "top_logprobs_num": n,
    }
    reply = requests.post(f"{url}/generate", json=body, timeout=600).json()
    return [(float(lp), int(t)) for lp, t, *_ in reply["meta_info"]["output_top_logprobs"][at]]


def assert_all_same(url: str, requests_: list[dict], got: list, want: list) -> None:
    """Equal greedy outputs, except after a numerical tie of the plain server's best tokens.

    As in ``server_utils.assert_same_greedy``, but the tie is read from the request's own
    penalised distribution: in bfloat16 on a CPU the plain server's choice at such a tie
    (two tokens, or three, within rounding) depends on its batch (its overlapped and
    synchronous schedules differ there too).
    """
    assert len(got) == len(want) == len(requests_)
    for request, one, other in zip(requests_, got, want, strict=True):
        if one == other:
            continue
        pairs = enumerate(zip(one[0], other[0], strict=False))
        at = next((i for i, (a, b) in pairs if a != b), min(len(one[0]), len(other[0])))
        top = top_at(url, request, at)
        # one bfloat16 step at logits between 8 and 16 is 1/16
        assert {one[0][at], other[0][at]} <= tied_tokens(top, 0.07), (
            f"outputs differ at token {at} where the target is not tied: best {top}; "
            f"got {one}, want {other}; request {request}"
        )


def batch(params: dict, prompts: list[str] = PROMPTS) -> list[dict]:
    """Every prompt with ``params``."""
    return [{"prompt": p, "max_tokens": LENGTH, **params} for p in prompts]
