"""Refuse, with HTTP 400, the single requests that would otherwise take the whole server down.

SGLang 0.5.23 checks a request's length in ``TokenizerManager._validate_one_request`` before
the scheduler sees it, but not its token ids or its logprob count: an empty prompt, an input
id outside the vocabulary (negative, or at or above its size) or ``top_logprobs_num`` above
the vocabulary size reaches the model's forward pass and kills the scheduler, and with it
every other client's request. This plugin hook runs right after that check, in the HTTP
server's process: a ``ValueError`` raised there is SGLang's own 400 reply, with the message.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

VALIDATE_HOOK = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"


def request_problem(
    input_ids: Sequence[int] | None, top_logprobs_num: int | None, vocab_size: int
) -> str | None:
    """Why a tokenised generate request cannot be served, naming the fix; None if it can."""
    if input_ids is not None and len(input_ids) == 0:
        return "the prompt is empty (zero tokens): send at least one token of text or input_ids"
    if input_ids is not None:
        bad = [int(i) for i in input_ids if not 0 <= int(i) < vocab_size]
        if bad:
            shown = ", ".join(str(i) for i in bad[:5]) + (", ..." if len(bad) > 5 else "")
            return (
                f"input_ids holds {len(bad)} token id(s) outside the vocabulary ({shown}): "
                f"every id must be in [0, {vocab_size - 1}]"
            )
    if top_logprobs_num is not None and int(top_logprobs_num) > vocab_size:
        return (
            f"top_logprobs_num={top_logprobs_num} exceeds the vocabulary size {vocab_size}: "
            f"ask for at most {vocab_size}"
        )
    return None


def refuse_request_killers(
    result: None, manager: Any, obj: Any, input_ids: list[int] | None, *args: Any, **kwargs: Any
) -> None:
    """SGLang hook (after ``_validate_one_request``): raise ValueError for a request killer."""
    server_args = getattr(manager, "server_args", None)
    if str(getattr(server_args, "speculative_algorithm", "")).upper() != "BASTION":
        return result
    if not hasattr(obj, "sampling_params") or getattr(obj, "input_embeds", None) is not None:
        return result  # embedding requests, or prompts given as embeddings: no ids to check
    top = getattr(obj, "top_logprobs_num", None) if getattr(obj, "return_logprob", False) else None
    problem = request_problem(input_ids, top, int(manager.model_config.vocab_size))
    if problem is not None:
        raise ValueError(problem)
    return result
