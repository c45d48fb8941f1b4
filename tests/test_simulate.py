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


def write_fake_trace(path: Path, requests: int, nodes: int, seed: int) -> int:
    """A greedy trace as a fixed-N server would write it; the number of steps."""
    gen = torch.Generator().manual_seed(seed)
    streams = torch.randint(0, VOCAB, (requests, 400), generator=gen)  # greedy continuations
    header = {"top_k": TOP_K, "max_nodes": nodes, "block_size": DEPTH + 1,
              "controller": {"mode": "fixed", "layout": "uniform", "max_nodes": nodes}}  # fmt: skip
    writer = TraceWriter(path, max_steps=10_000, header=header)
    pos = torch.zeros(requests, dtype=torch.long)
    steps = 0
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
            "predicted_verify_ms": None, "verify_ms": 1.0, "cycle_ms": 2.0,
        })  # fmt: skip
        pos += lens
        steps += 1
    return steps


def test_the_trace_reads_back_what_was_written(tmp_path):
    steps = write_fake_trace(tmp_path / "t.jsonl", requests=2, nodes=8, seed=0)
    header, records = read_trace(tmp_path / "t.jsonl")
    assert header["max_nodes"] == 8 and len(records) == steps


@pytest.mark.parametrize("nodes", [4, 16])
def test_replaying_the_recording_policy_reproduces_every_steps_acceptance(tmp_path, nodes):
    write_fake_trace(tmp_path / "t.jsonl", requests=3, nodes=nodes, seed=nodes)
    _, steps = simulate.load_steps([tmp_path / "t.jsonl"])
    recorder = simulate.LiveBudget("fixed", nodes)
    for step in steps:
        accept, _, _ = simulate.replay(step, TOP_K, recorder)
        assert torch.equal(accept, step.recorded_accept)


def test_bigger_trees_accept_at_least_as_much_as_smaller_ones(tmp_path):
    write_fake_trace(tmp_path / "t.jsonl", requests=3, nodes=32, seed=3)
    _, steps = simulate.load_steps([tmp_path / "t.jsonl"])
    for step in steps:
        small, _, _ = simulate.replay(step, TOP_K, simulate.LiveBudget("fixed", 4))
        big, _, _ = simulate.replay(step, TOP_K, simulate.LiveBudget("fixed", 32))
        assert bool((big >= small).all())


def test_the_report_counts_the_exact_match_and_names_the_oracle(tmp_path):
    write_fake_trace(tmp_path / "t.jsonl", requests=2, nodes=16, seed=5)
    header, steps = simulate.load_steps([tmp_path / "t.jsonl"])
    model = simulate.LatencyModel.uncalibrated(
        simulate.ModelShape.from_config_file(simulate.ROOT / "tests/data/qwen3-8b-config.json"),
        simulate.Hardware.lookup("H100-SXM"),
        t_aux_ms=2.0,
    )
    rows, check = simulate.simulate(steps, header, model, [4, 8, 16], ["static"])
    assert check["equal"] == check["steps"] == len(steps)
    fixed = [r for r in rows if r["policy"].startswith("fixed")]
    best = max(fixed, key=lambda r: r["speedup vs AR"])
    assert all(r["oracle N"] == best["policy"].removeprefix("fixed N=") for r in rows)
    assert best["vs oracle fixed"] == 1.0
