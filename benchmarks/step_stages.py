"""Which stage of a speculative decode step a sampled scheduler stack was in (Table 3's split).

The stacks are py-spy's collapsed ("raw") samples of an SGLang scheduler process: one line per
distinct stack, frames from the root to the leaf separated by ``;``, then the sample count.
Each frame reads ``Class.function (path:line)``.

Without speculation the step is SGLang's own decode (``TpModelWorker.forward_batch_generation``;
its forward counts as the verify forward, its sampling as the target tokens). BASTION's step is
split by the deepest frame of its own code that names a stage (the worker's
methods, the tree and controller modules). SGLang's DFLASH worker does its whole decode step in
one method, ``DFlashWorkerV2.forward_batch_generation``: its stages are the line ranges of that
method in sglang 0.5.23 (pinned), the same cut its own comments make ("1) Draft a fixed block",
"2) Target verify", "3) Materialize committed verify-input tokens into draft KV cache").
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable

STAGES = (
    "draft pass",  # the drafter's block forward and its inputs
    "draft head",  # BASTION's full-vocabulary top-K; DFLASH's argmax
    "tree build",
    "verify inputs",  # ids, positions, the mask, the KV plan, attention metadata
    "verify forward",  # the target's forward over every tree (DFLASH: its chain)
    "target tokens and acceptance",  # logits processing, grammar, sampling, the accept walk
    "KV and draft-KV writes",
    "decision",  # the budget controller and its acceptance learning
    "other step work",
    "scheduler",  # the scheduler's own host work between decode steps
    "prefill",  # prefill and idle batches, outside the decode step
)
OUTSIDE_THE_STEP = ("scheduler", "prefill")
STEP_STAGES = tuple(s for s in STAGES if s not in OUTSIDE_THE_STEP)  # the decode step proper
PREPARATION = ("draft pass", "draft head", "tree build", "verify inputs")
VERIFICATION = ("verify forward", "target tokens and acceptance", "KV and draft-KV writes")
FRAME = re.compile(r"^(?P<name>.*) \((?P<path>[^()]*?):(?P<line>\d+)\)$")
SCHEDULER_ROOT = "run_scheduler_process"  # the scheduler's main thread (not its helpers)
BASTION_STEP = "BastionWorker._tree_step"
BASTION_FORWARD = "BastionWorker.forward_batch_generation"
DFLASH_FORWARD = "DFlashWorkerV2.forward_batch_generation"
PLAIN_FORWARD = "TpModelWorker.forward_batch_generation"  # no speculation: the step itself
# Without speculation: (function name, stage); of those a stack holds, the last listed wins.
PLAIN_MARKERS = (
    ("ForwardBatch.init_new", "verify inputs"),
    ("ModelRunner.forward", "verify forward"),
    ("EagerRunner._execute_extend", "prefill"),
    ("ModelRunner.sample", "target tokens and acceptance"),
)
# (function name, path suffix or "", stage, the stage it must be inside or None)
BASTION_MARKERS = (
    ("BastionWorker._draft_marginals", "", "draft pass", None),
    ("BastionWorker._draft_head", "", "draft head", None),
    ("build_trees_from_top_k", "", "tree build", None),
    ("TreeBatch.roots", "", "tree build", None),
    ("verify_inputs", "", "verify inputs", None),
    ("BastionWorker._verify", "", "verify forward", None),
    ("BastionWorker._decode_roots", "", "verify forward", None),  # a plain step's decode
    ("DFlashVerifyInput.prepare_for_verify", "", "verify inputs", "verify forward"),
    ("BastionWorker._plan", "", "verify inputs", "verify forward"),
    ("init_forward_metadata", "", "verify inputs", "verify forward"),
    ("full_vocabulary", "", "target tokens and acceptance", None),
    ("build_grammar_vocab_mask", "", "target tokens and acceptance", None),
    ("GrammarMask.apply", "", "target tokens and acceptance", None),
    ("BastionWorker._process_logits", "", "target tokens and acceptance", None),
    ("BastionWorker._target_tokens", "", "target tokens and acceptance", None),
    ("accept", "tree/acceptance.py", "target tokens and acceptance", None),
    ("compute_spec_logprobs", "", "target tokens and acceptance", None),
    ("BastionWorker._commit_penalties", "", "target tokens and acceptance", None),
    ("BastionWorker._keep_accepted_kv", "", "KV and draft-KV writes", None),
    ("BastionWorker._write_draft_features", "", "KV and draft-KV writes", None),
    ("", "sglang_bastion/controller.py", "decision", None),
    ("", "sglang_bastion/acceptance_scale.py", "decision", None),
    ("", "sglang_bastion/budget/", "decision", None),
    ("TreeBatch.truncate", "", "decision", None),
    ("TreeBatch.narrow", "", "decision", None),
)
# DFlashWorkerV2.forward_batch_generation's lines in sglang 0.5.23: (first line, stage).
DFLASH_LINES = (
    (2336, "prefill"),  # prefill and idle batches
    (2479, "draft pass"),  # block buffers, embeddings, the KV plan, the draft forward (2688)
    (2691, "draft head"),  # the greedy draft tokens from the LM head
    (2814, "verify inputs"),  # grammar chain, DFlashVerifyInput, prepare_for_verify
    (2875, "verify forward"),  # target_worker.forward_batch_generation
    (2885, "target tokens and acceptance"),  # logits, grammar mask, _accept_block, logprobs
    (2975, "KV and draft-KV writes"),  # _append_target_hidden_to_draft_kv_by_loc
    (2997, "other step work"),  # the next draft input, the result
)


def parse_collapsed(text: str) -> list[tuple[list[str], int]]:
    """py-spy raw output as (frames root to leaf, samples) pairs."""
    stacks = []
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks.append((stack.split(";"), int(count)))
    return stacks


def frame_parts(frame: str) -> tuple[str, str, int]:
    """(function name, path, line) of one frame ('' and 0 where py-spy gave none)."""
    match = FRAME.match(frame)
    if match is None:
        return frame, "", 0
    return match["name"], match["path"], int(match["line"])


def bastion_stage(frames: list[str]) -> str:
    """The stage of a sample inside ``BastionWorker._tree_step``: its deepest stage marker."""
    stage = "other step work"
    for frame in frames:
        name, path, _ = frame_parts(frame)
        for marker, suffix, marked, inside in BASTION_MARKERS:
            if (marker and name != marker) or (suffix and suffix not in path):
                continue
            if inside is None or stage == inside:
                stage = marked
            break
    return stage


def dflash_stage(line: int) -> str:
    """The stage of DFLASH's forward method executing ``line``."""
    stage = "prefill"
    for first, name in DFLASH_LINES:
        if line >= first:
            stage = name
    return stage


def classify(frames: list[str]) -> str | None:
    """The stage one sampled stack was in; None for threads other than the scheduler's loop."""
    if not any(frame_parts(f)[0] == SCHEDULER_ROOT for f in frames):
        return None
    names = [frame_parts(f)[0] for f in frames]
    if BASTION_STEP in names:
        return bastion_stage(frames[names.index(BASTION_STEP) + 1 :])
    if BASTION_FORWARD in names:
        return "prefill"
    if DFLASH_FORWARD in names:
        outer = frames[names.index(DFLASH_FORWARD)]
        return dflash_stage(frame_parts(outer)[2])
    if PLAIN_FORWARD in names:
        found = [stage for marker, stage in PLAIN_MARKERS if marker in names]
        return found[-1] if found else "other step work"
    return "scheduler"


def stage_samples(stacks: Iterable[tuple[list[str], int]]) -> Counter:
    """Samples per stage of the scheduler's main thread."""
    counts: Counter = Counter()
    for frames, count in stacks:
        stage = classify(frames)
        if stage is not None:
            counts[stage] += count
    return counts
