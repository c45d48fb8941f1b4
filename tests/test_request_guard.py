"""The request guard names what would kill the server, and lets every servable request pass."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_bastion.request_guard import refuse_request_killers, request_problem

V = 4096


@pytest.mark.parametrize(
    ("ids", "top", "reason"),
    [
        ([], None, "prompt is empty"),
        ([1, V], None, f"outside the vocabulary ({V})"),
        ([-1, 5], None, "outside the vocabulary (-1)"),
        ([3], V + 1, f"top_logprobs_num={V + 1} exceeds the vocabulary size {V}"),
    ],
)
def test_each_request_killer_is_named_with_its_fix(ids, top, reason):
    assert reason in request_problem(ids, top, V)


def test_servable_requests_pass():
    assert request_problem([0, V - 1], V, V) is None
    assert request_problem(None, None, V) is None  # a prompt given as embeddings


def manager(algorithm: str) -> SimpleNamespace:
    """What the hook reads from SGLang's TokenizerManager."""
    return SimpleNamespace(
        server_args=SimpleNamespace(speculative_algorithm=algorithm),
        model_config=SimpleNamespace(vocab_size=V),
    )


def request(**fields: object) -> SimpleNamespace:
    """A generate request's fields that the hook reads."""
    defaults = {"sampling_params": {}, "input_embeds": None, "return_logprob": False}
    return SimpleNamespace(**{**defaults, **fields})


def test_the_hook_raises_the_reason_as_a_value_error_for_bastion_servers():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        refuse_request_killers(None, manager("BASTION"), request(), [V + 7])


def test_a_large_top_logprobs_num_counts_only_when_logprobs_are_asked_for():
    asked = request(return_logprob=True, top_logprobs_num=V + 1)
    with pytest.raises(ValueError, match="top_logprobs_num"):
        refuse_request_killers(None, manager("BASTION"), asked, [1])
    refuse_request_killers(None, manager("BASTION"), request(top_logprobs_num=V + 1), [1])


def test_other_servers_are_left_as_sglang_made_them():
    assert refuse_request_killers(None, manager("DFLASH"), request(), []) is None
