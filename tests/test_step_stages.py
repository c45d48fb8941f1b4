"""The step decomposition puts each sampled scheduler stack in the stage it was in."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from step_decomposition import summarise, tree_over_chain
from step_stages import (
    DFLASH_LINES,
    STAGES,
    classify,
    parse_collapsed,
    stage_samples,
)

LOOP = [
    "<module> (<string>:1)",
    "run_scheduler_process (scheduler.py:6368)",
    "Scheduler.event_loop_overlap (scheduler.py:2109)",
    "Scheduler.run_batch (scheduler.py:4704)",
]
STEP = [
    *LOOP,
    "BastionWorker.forward_batch_generation (sglang_bastion/worker.py:228)",
    "BastionWorker._tree_step (sglang_bastion/worker.py:293)",
]
FORWARD = ["TpModelWorker.forward_batch_generation (tp_worker.py:675)", "ModelRunner.forward (x:1)"]


def dflash(line: int) -> list[str]:
    """A sample of DFLASH's forward method at ``line``, inside a model call."""
    outer = f"DFlashWorkerV2.forward_batch_generation (speculative/dflash_worker_v2.py:{line})"
    return [*LOOP, outer, "f (x:1)"]


@pytest.mark.parametrize("target_pass", [
    "BastionWorker._verify (sglang_bastion/worker.py:570)",  # a tree verify
    "BastionWorker._decode_roots (sglang_bastion/worker.py:950)",  # a plain step's decode
])  # fmt: skip
def test_a_target_pass_counts_as_the_verify_forward_and_its_logits_as_target_tokens(target_pass):
    verify = [*STEP, "BastionWorker._verify_trees (sglang_bastion/worker.py:520)", target_pass]
    assert classify([*verify, *FORWARD]) == "verify forward"
    logits = "BastionWorker._process_logits (sglang_bastion/worker.py:600)"
    assert classify([*verify, logits, "apply (x:1)"]) == "target tokens and acceptance"


def test_a_bastion_sample_takes_its_deepest_stage_marker():
    head = "BastionWorker._draft_head (sglang_bastion/worker.py:470)"
    draft = [*STEP, "BastionWorker._draft_marginals (sglang_bastion/worker.py:460)"]
    assert classify([*draft, head, "draft_head_topk (kernels/draft_head.py:9)"]) == "draft head"
    assert classify([*STEP, "accept (sglang_bastion/tree/acceptance.py:80)"]) == (
        "target tokens and acceptance"
    )
    assert classify([*STEP, "decide (sglang_bastion/controller.py:300)"]) == "decision"
    assert classify([*STEP, "BastionStats.add_step (sglang_bastion/stats.py:49)"]) == (
        "other step work"
    )


def test_the_kv_plan_counts_as_the_pass_it_plans():
    plan = "BastionWorker._plan (sglang_bastion/worker.py:480)"
    draft = [*STEP, "BastionWorker._draft_marginals (sglang_bastion/worker.py:460)", plan]
    verify = [*STEP, "BastionWorker._verify (sglang_bastion/worker.py:570)", plan]
    assert classify(draft) == "draft pass"
    assert classify(verify) == "verify inputs"


@pytest.mark.parametrize(
    "line, stage",
    [(2400, "prefill"), (2688, "draft pass"), (2803, "draft head"), (2830, "verify inputs"),
     (2875, "verify forward"), (2928, "target tokens and acceptance"),
     (2986, "KV and draft-KV writes"), (2997, "other step work")],
)  # fmt: skip
def test_dflash_samples_are_staged_by_the_line_of_its_forward_method(line, stage):
    assert classify(dflash(line)) == stage


def test_the_dflash_line_ranges_are_those_of_the_pinned_sglang():
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    source, first = inspect.getsourcelines(DFlashWorkerV2.forward_batch_generation)
    at = {first + i: text for i, text in enumerate(source)}
    assert first == DFLASH_LINES[0][0]
    assert "Draft a fixed block" in at[2488] and "draft_model_runner.forward" in at[2688]
    assert "Target verify" in at[2819] and "target_worker.forward_batch_generation" in at[2875]
    assert "Materialize committed" in at[2975] and "_make_next_draft_input_decode" in at[2997]


def test_without_speculation_the_step_is_sglangs_decode_forward_and_sampling():
    plain = [*LOOP, "TpModelWorker.forward_batch_generation (tp_worker.py:675)"]
    run = ["ModelRunner._forward_raw (model_runner.py:2063)", "EagerRunner.execute (e.py:226)"]
    assert classify([*plain, "ModelRunner.forward (m.py:1)", *run]) == "verify forward"
    extend = "EagerRunner._execute_extend (runner/eager_runner.py:328)"
    assert classify([*plain, "ModelRunner.forward (m.py:1)", *run, extend]) == "prefill"
    assert classify([*plain, "ModelRunner.sample (m.py:2)"]) == "target tokens and acceptance"


def test_samples_outside_the_decode_step_are_the_schedulers_or_the_prefills():
    assert classify([*LOOP[:3], "Scheduler.get_next_batch_to_run (scheduler.py:1)"]) == (
        "scheduler"
    )
    assert classify([*LOOP, "BastionWorker.forward_batch_generation (w.py:1)", "x (y:1)"]) == (
        "prefill"
    )


def test_threads_other_than_the_schedulers_loop_are_left_out():
    helper = ["Thread._bootstrap (threading.py:1)", "recv (zmq.py:1)"]
    assert classify(helper) is None
    counts = stage_samples([(helper, 7), ([*LOOP, "x (y:1)"], 3)])
    assert counts == {"scheduler": 3}


def test_collapsed_stacks_keep_frames_with_spaces_and_their_counts():
    text = "a (x.py:1);Class.f <locals> (y.py:2) 12\nmalformed\nb (z.py:3) 4\n"
    assert parse_collapsed(text) == [(["a (x.py:1)", "Class.f <locals> (y.py:2)"], 12),
                                     (["b (z.py:3)"], 4)]  # fmt: skip


def cell(method: str, c: int, **ms: float) -> dict:
    """A measured cell of 100 steps at 1000 samples per second with ``ms`` per step."""
    samples = {s: 0 for s in STAGES} | {s.replace("_", " "): 1000 * v for s, v in ms.items()}
    return {"method": method, "C": c, "steps": 1000, "wall_s": 10.0, "rate": 1000,
            "samples": samples}  # fmt: skip


def test_the_tree_is_compared_with_the_chain_stage_by_stage():
    rows = summarise([
        cell("dflash", 16, draft_pass=2.0, verify_forward=10.0),
        cell("bastion-8", 16, draft_pass=2.0, draft_head=0.5, verify_forward=10.5, decision=0.1),
    ])  # fmt: skip
    assert rows[1]["step"] == pytest.approx(13.1) and rows[0]["steps_per_s"] == 100
    (ratio,) = tree_over_chain(rows, "bastion-8", "dflash")
    assert ratio["preparation"] == pytest.approx(0.25)
    assert ratio["verification"] == pytest.approx(0.05)
    assert ratio["decision_share"] == pytest.approx(0.1 / 13.1)


def test_a_slower_host_for_the_tree_is_divided_out_by_the_draft_pass_both_run():
    rows = summarise([
        cell("dflash", 1, draft_pass=2.0, verify_forward=10.0),
        cell("bastion-8", 1, draft_pass=2.2, verify_forward=11.0),  # all 10% slower
    ])  # fmt: skip
    (ratio,) = tree_over_chain(rows, "bastion-8", "dflash")
    assert ratio["verification"] == pytest.approx(0.1)
    assert ratio["verification_at_equal_drift"] == pytest.approx(0.0)
    assert ratio["preparation_at_equal_drift"] == pytest.approx(0.0)
