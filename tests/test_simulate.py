"""The trace-driven controller simulator replays what a server recorded, exactly."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from sglang_bastion.trace import TraceWriter, read_trace
from sglang_bastion.tree import accept_path, build_trees

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import simulate

DEPTH, TOP_K, VOCAB = 7, 4, 40


def true_accept(trees, truth: torch.Tensor) -> torch.Tensor:
    """[b] accepted drafts + bonus of trees against continuations [b, D+1] (a reference)."""
    target = truth.gather(1, trees.depths.clamp(max=truth.shape[1] - 1))
    _, accepted, _ = accept_path(trees, target, max_depth=truth.shape[1] - 1)
    return accepted + 1


def write_fake_trace(
    path: Path, requests: int, nodes: int, seed: int, gap_ms: float = 3.0, idle_after: int = -1,
    budget: int | None = None,
) -> int:  # fmt: skip
    """A greedy trace as a fixed-N server would write it; the number of steps.

    Steps take 2 ms and ``gap_ms`` pass between them, except 5 s of idling after step
    ``idle_after``.
    """
    gen = torch.Generator().manual_seed(seed)
    streams = torch.randint(0, VOCAB, (requests, 400), generator=gen)  # greedy continuations
    header = {"top_k": TOP_K, "max_nodes": nodes, "block_size": DEPTH + 1,
              "controller": {"mode": "fixed", "layout": "uniform", "max_nodes": nodes}}  # fmt: skip
    writer = TraceWriter(path, max_steps=10_000, header=header)
    pos = torch.zeros(requests, dtype=torch.long)
    steps, clock_s = 0, 100.0
    while bool((pos + 2 * DEPTH < streams.shape[1]).all()):
        truth = streams.gather(1, pos.unsqueeze(1) + 1 + torch.arange(DEPTH + 1))  # [b, D+1]
        logits = torch.randn(requests, DEPTH, VOCAB, generator=gen)
        logits.scatter_add_(2, truth[:, :DEPTH].unsqueeze(2), torch.full((requests, DEPTH, 1), 3.0))
        probs = torch.softmax(logits, -1)  # the drafter often right, not always
        roots = streams.gather(1, pos.unsqueeze(1)).squeeze(1)
        trees = build_trees(probs, roots, top_k=TOP_K, max_nodes=nodes)
        lens = true_accept(trees, truth)
        values, ids = probs.topk(TOP_K, -1)
        writer.record({
            "step": steps, "rids": [f"r{i}" for i in range(requests)],
            "context_lens": (pos + 10).tolist(), "temperatures": [0.0] * requests,
            "topk_ids": ids.tolist(), "topk_probs": values.tolist(), "root_tokens": roots.tolist(),
            "sizes": trees.num_nodes.tolist(), "width": nodes,
            "emitted": [t[:n] for t, n in zip(truth.tolist(), lens.tolist(), strict=True)],
            "predicted_verify_ms": None, "verify_ms": 1.0, "cycle_ms": 2.0, "started_s": clock_s,
            "budgets": [budget] * requests,
        })  # fmt: skip
        clock_s += (2.0 + gap_ms) / 1e3 + (5.0 if steps == idle_after else 0.0)
        pos += lens
        steps += 1
    return steps


def h100_model(t_aux_ms: float = 0.0) -> simulate.LatencyModel:
    """Qwen3-8B on the bare H100 roofline (no profile)."""
    return simulate.LatencyModel.uncalibrated(
        simulate.ModelShape.from_config_file(simulate.ROOT / "tests/data/qwen3-8b-config.json"),
        simulate.Hardware.lookup("H100-SXM"),
        t_aux_ms=t_aux_ms,
    )


def test_the_trace_reads_back_what_was_written(tmp_path):
    steps = write_fake_trace(tmp_path / "t.jsonl", requests=2, nodes=8, seed=0)
    header, records = read_trace(tmp_path / "t.jsonl")
    assert header["max_nodes"] == 8 and len(records) == steps


@pytest.mark.parametrize("nodes", [4, 16])
def test_replaying_the_recording_policy_reproduces_every_steps_acceptance(tmp_path, nodes):
    write_fake_trace(tmp_path / "t.jsonl", requests=3, nodes=nodes, seed=nodes)
    _, steps = simulate.load_steps([tmp_path / "t.jsonl"])
    recorder = simulate.Controller("fixed", nodes)
    for step in steps:
        accept, _, _ = simulate.replay(step, TOP_K, recorder)
        assert torch.equal(accept, step.recorded_accept)


def test_bigger_trees_accept_at_least_as_much_as_smaller_ones(tmp_path):
    write_fake_trace(tmp_path / "t.jsonl", requests=3, nodes=32, seed=3)
    _, steps = simulate.load_steps([tmp_path / "t.jsonl"])
    for step in steps:
        small, _, _ = simulate.replay(step, TOP_K, simulate.Controller("fixed", 4))
        big, _, _ = simulate.replay(step, TOP_K, simulate.Controller("fixed", 32))
        assert bool((big >= small).all())


def test_the_report_counts_the_exact_match_and_names_the_oracle(tmp_path):
    write_fake_trace(tmp_path / "t.jsonl", requests=2, nodes=16, seed=5)
    header, steps = simulate.load_steps([tmp_path / "t.jsonl"])
    model = h100_model(t_aux_ms=2.0)
    rows, check = simulate.simulate(steps, header, model, [4, 8, 16], ["static"])
    assert check["equal"] == check["steps"] == len(steps)
    fixed = [r for r in rows if r["policy"].startswith("fixed")]
    best = max(fixed, key=lambda r: r["speedup vs AR"])
    assert all(r["oracle N"] == best["policy"].removeprefix("fixed N=") for r in rows)
    assert best["vs oracle fixed"] == 1.0


def test_the_global_budget_is_priced_by_the_tokens_it_verifies(tmp_path):
    write_fake_trace(tmp_path / "t.jsonl", requests=3, nodes=16, seed=7)
    _, steps = simulate.load_steps([tmp_path / "t.jsonl"])
    model = h100_model()
    policy = simulate.Controller("static", 16, "global", model, packs_ragged=True)
    for step in steps[:5]:
        accept, tokens, cycle = simulate.replay(step, TOP_K, policy)
        decision = policy.decide(
            simulate.build_trees(step.probs, step.roots, top_k=TOP_K, max_nodes=16),
            step.context_lens,
        )
        assert tokens == sum(decision.ragged) / 3 and accept.shape == (3,)
        bucket = round(float(step.context_lens.float().mean()) / 16) * 16  # priced in buckets
        priced = float(model.cycle_ms(3, torch.tensor(tokens, dtype=torch.float64), bucket))
        assert cycle == pytest.approx(priced)


def test_a_steps_gap_runs_from_its_end_to_the_next_start_and_idling_is_left_out(tmp_path):
    steps = write_fake_trace(tmp_path / "t.jsonl", requests=2, nodes=8, seed=1, idle_after=2)
    _, loaded = simulate.load_steps([tmp_path / "t.jsonl"], idle_gap_s=1.0)
    gaps = [step.gap_ms for step in loaded]
    assert len(gaps) == steps
    assert gaps[2] is None and gaps[-1] is None  # idle, and no next step
    assert all(g == pytest.approx(3.0) for i, g in enumerate(gaps) if i not in (2, steps - 1))


def test_server_throughput_adds_each_steps_gap_to_the_policys_predicted_cycle(tmp_path):
    write_fake_trace(tmp_path / "t.jsonl", requests=2, nodes=16, seed=7, gap_ms=4.0)
    header, steps = simulate.load_steps([tmp_path / "t.jsonl"])
    model = h100_model(t_aux_ms=2.0)
    _, check = simulate.simulate(steps, header, model, [4, 16], ["static"])
    timed = [s for s in steps if s.gap_ms is not None]
    tokens = sum(float(s.recorded_accept.sum()) for s in timed)
    cycles = [float(model.cycle_ms(2, 16, float(s.context_lens.float().mean()))) for s in timed]
    ms = sum(cycles) + 4.0 * len(timed)
    assert check["predicted_server_tok_s"] == pytest.approx(1e3 * tokens / ms)
    assert check["recorded_server_tok_s"] == pytest.approx(1e3 * tokens / (len(timed) * 6.0))
    assert check["server_tok_s"]["fixed N=16"] == pytest.approx(check["predicted_server_tok_s"])


def test_tokens_past_a_requests_budget_do_not_count_towards_server_throughput(tmp_path):
    for budget in (None, 2):
        write_fake_trace(tmp_path / f"{budget}.jsonl", requests=2, nodes=16, seed=9, budget=budget)
    model = h100_model()
    checks = {}
    for budget in (None, 2):
        header, steps = simulate.load_steps([tmp_path / f"{budget}.jsonl"])
        _, checks[budget] = simulate.simulate(steps, header, model, [16], ["static"])
        kept = sum(float(s.recorded_accept.clamp(max=budget or 10**9).sum()) for s in steps[:-1])
        assert checks[budget]["recorded_server_tok_s"] == pytest.approx(
            1e3 * kept / ((len(steps) - 1) * 5.0)
        )
    assert checks[2]["equal"] == checks[2]["steps"]  # acceptance itself is not capped
    assert checks[2]["predicted_server_tok_s"] < checks[None]["predicted_server_tok_s"]


def test_a_plain_step_record_has_no_drafts_to_replay(tmp_path):
    write_fake_trace(tmp_path / "t.jsonl", requests=2, nodes=8, seed=0)
    _, records = read_trace(tmp_path / "t.jsonl")
    plain = {**records[0], "drafted": False, "plain": True, "topk_ids": [[], []],
             "topk_probs": [[], []], "sizes": [1, 1], "width": 1}  # fmt: skip
    streams = {"r0": [1] * 20, "r1": [2] * 20}
    assert simulate._step(plain, [0, 0], streams) is None
    assert simulate._step(records[0], [0, 0], streams) is not None
