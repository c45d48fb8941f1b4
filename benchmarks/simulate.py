"""Replay BASTION step traces under other controller policies and latency profiles.

python benchmarks/simulate.py TRACE.jsonl [...] (--profile PROFILE.json | --gpu H100-SXM
    --config qwen3-8b-config.json [--t-aux-ms 2]) [--sizes 4 8 16 32 64] [--out DIR]

A trace (``SGLANG_BASTION_TRACE``, see sglang_bastion/trace.py) holds, for every decode step
and request, the drafter's top-K marginals, the tree size the server chose and the tokens it
emitted. At temperature 0 a request's emitted tokens, step after step, are its committed
greedy continuation, so for any other tree built from the same marginals the accepted length
is known exactly: the deepest node whose path spells the continuation (up to the tokens the
trace holds). The simulator rebuilds the trees, applies a policy (fixed N, or the adaptive
controller in static / ema / ema_calib mode with uniform, ragged or batch-global sizes, the
last priced as a packed pass over its total tokens) and prices each step
with the latency model: expected throughput = sum of accepted tokens / sum of predicted cycle
times, reported per effective batch size beside the oracle (the best fixed N in hindsight).

A server also spends time between decode steps (scheduling, prefill of arriving requests,
output processing; on a small CPU the tokenizer, detokenizer and HTTP share the cores). The
trace's step start times measure that time: each step's gap is the next step's start minus
this step's end (gaps over ``--idle-gap-s`` are the server waiting for clients and are left
out). Expected *server* throughput adds each step's recorded gap to the policy's predicted
cycle: the gap is taken as the same whatever tree the policy chose.

Replaying the policy that produced the trace must give its recorded acceptance exactly; the
report says whether it does. Steps are priced one at a time with the batch as recorded (a
policy that finishes requests sooner would change later batches: not modelled). Sampled
(temperature > 0) steps are skipped: their acceptance depends on the target's random draws.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from common import RESULTS, machine, markdown_table

from sglang_bastion.budget import Hardware, LatencyModel, ModelShape, load_profile
from sglang_bastion.controller import Controller
from sglang_bastion.trace import read_trace
from sglang_bastion.tree import TreeBatch, accept_path, build_trees

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Step:
    """One traced step's greedy requests, ready to rebuild and replay."""

    probs: torch.Tensor  # [b, D, V'] dense marginals over the step's compact vocabulary
    vocab: torch.Tensor  # [V'] real token id of each compact id
    roots: torch.Tensor  # [b] compact ids of the roots (the vocabulary includes them)
    truth: torch.Tensor  # [b, D+1] real continuation after the root, -1 where unknown
    context_lens: torch.Tensor  # [b]
    batch_size: int  # the recorded batch (greedy or not): what the pass costs
    recorded_sizes: torch.Tensor  # [b]
    recorded_accept: torch.Tensor  # [b] emitted tokens (accepted drafts + bonus)
    recorded_width: int
    cycle_ms: float | None
    gap_ms: float | None  # server time from this step's end to the next step's start
    budget: torch.Tensor  # [b] tokens each request could still emit (a huge number if unknown)
    overhead_ms: float = 0.0  # the measured step overhead the producing controller priced


def load_steps(paths: list[Path], idle_gap_s: float = 1.0) -> tuple[dict, list[Step]]:
    """(first header, greedy steps) of the traces, with every request's continuation."""
    header, records = None, []
    for path in paths:
        head, steps = read_trace(path)
        header = header or head
        records.append(steps)
    steps_out = []
    for steps in records:
        streams: dict[str, list[int]] = defaultdict(list)
        offsets = []
        for record in steps:  # continuation = everything each request emitted from then on
            offsets.append([len(streams[r]) for r in record["rids"]])
            for rid, emitted in zip(record["rids"], record["emitted"], strict=True):
                streams[rid] += emitted
        gaps = step_gaps(steps, idle_gap_s)
        for record, offset, gap in zip(steps, offsets, gaps, strict=True):
            step = _step(record, offset, streams, gap)
            if step is not None:
                steps_out.append(step)
    return header, steps_out


def step_gaps(records: list[dict], idle_gap_s: float) -> list[float | None]:
    """Per step record, ms from its end to the next step's start (None: unknown or idle)."""
    gaps: list[float | None] = []
    for record, following in zip(records, [*records[1:], None], strict=True):
        start, cycle = record.get("started_s"), record.get("cycle_ms")
        if following is None or None in (start, cycle, following.get("started_s")):
            gaps.append(None)
            continue
        gap_s = following["started_s"] - start - cycle / 1e3
        gaps.append(gap_s * 1e3 if 0 <= gap_s <= idle_gap_s else None)
    return gaps


def _step(
    record: dict, offset: list[int], streams: dict[str, list[int]], gap_ms: float | None = None
) -> Step | None:
    """The greedy part of one step record (None when it has no greedy request, or drafted
    nothing: a plain step has no drafts to replay, and a sampled probe drafted for a few)."""
    keep = [i for i, t in enumerate(record["temperatures"]) if t == 0.0]
    if not keep or not record.get("drafted", True) or record.get("sampled", False):
        return None
    ids = torch.tensor([record["topk_ids"][i] for i in keep])  # [b, D, K]
    values = torch.tensor([record["topk_probs"][i] for i in keep], dtype=torch.float32)
    depth = ids.shape[1]
    roots = torch.tensor([record["root_tokens"][i] for i in keep])
    vocab, compact = torch.unique(torch.cat([ids.flatten(), roots]), return_inverse=True)
    probs = torch.zeros(len(keep), depth, len(vocab))  # [b, D, V']
    probs.scatter_(2, compact[: ids.numel()].view(ids.shape), values)
    truth = torch.full((len(keep), depth + 1), -1)
    for row, i in enumerate(keep):
        stream = streams[record["rids"][i]][offset[i] : offset[i] + depth + 1]
        truth[row, : len(stream)] = torch.tensor(stream)
    return Step(
        probs=probs,
        vocab=vocab,
        roots=compact[ids.numel() :],
        truth=truth,
        context_lens=torch.tensor([record["context_lens"][i] for i in keep]),
        batch_size=len(record["rids"]),
        recorded_sizes=torch.tensor([record["sizes"][i] for i in keep]),
        recorded_accept=torch.tensor([len(record["emitted"][i]) for i in keep]),
        recorded_width=int(record["width"]),
        cycle_ms=record.get("cycle_ms"),
        gap_ms=gap_ms,
        budget=torch.tensor([_budget(record, i) for i in keep]),
        overhead_ms=record.get("overhead_ms") or 0.0,
    )


def _budget(record: dict, i: int) -> int:
    """Tokens request ``i`` of a step record could still emit (older traces: no limit)."""
    budgets = record.get("budgets")
    value = budgets[i] if budgets else None
    return 2**31 if value is None else value


def accepted_lengths(trees: TreeBatch, vocab: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """[b] accepted drafts + bonus of each tree against the continuation ``truth``."""
    depth = truth.shape[1] - 1
    # The target's token at a node is the continuation at the node's depth, wherever it is:
    # only nodes whose whole path matches are ever reached, and there it is exact.
    target = truth.gather(1, trees.depths.clamp(max=depth))  # [b, N]
    compact_target = torch.searchsorted(vocab, target.clamp(min=0))
    hit = (compact_target < len(vocab)) & (
        vocab[compact_target.clamp(max=len(vocab) - 1)] == target
    )
    target_ids = torch.where(hit & (target >= 0), compact_target, -1)
    _, accepted, _ = accept_path(trees, target_ids, max_depth=depth)
    return accepted + 1


def replay(step: Step, top_k: int, policy: Controller) -> tuple[torch.Tensor, float, float | None]:
    """(accept lengths [b], verified tokens per request, predicted cycle ms) of a policy on
    one step: the verify width, or the mean size where the pass packs trees unpadded."""
    trees = build_trees(step.probs, step.roots, top_k=top_k, max_nodes=policy.max_nodes)
    decision = policy.decide(trees, step.context_lens)
    trees = trees.truncate(decision.sizes).narrow(decision.width)
    packed = decision.ragged
    tokens = decision.width if packed is None else sum(packed) / len(packed)
    return (
        accepted_lengths(trees, step.vocab, step.truth),
        tokens,
        decision.predicted_cycle_ms,
    )


def latency_model(args: argparse.Namespace) -> LatencyModel:
    """The measured profile's model, or a bare roofline for a named GPU and target config."""
    if args.profile:
        profile = load_profile(args.profile)
        shape_config = json.loads(Path(args.config).read_text()) if args.config else None
        if shape_config is None:
            raise SystemExit("--config (the target's config.json) is needed with --profile")
        return LatencyModel.from_profile(profile, ModelShape.from_hf_config(shape_config))
    shape = ModelShape.from_config_file(args.config)
    return LatencyModel.uncalibrated(shape, Hardware.lookup(args.gpu), t_aux_ms=args.t_aux_ms)


@dataclass
class _Spent:
    """The producing policy's kept tokens and cycle milliseconds, summed over the steps."""

    tokens: float = 0.0
    predicted_ms: float = 0.0  # the profile's cycles
    recorded_ms: float = 0.0  # the worker's recorded cycles
    gap_tokens: float = 0.0  # over the steps whose gap to the next step is known:
    predicted_gap_ms: float = 0.0  # predicted cycle + gap
    recorded_gap_ms: float = 0.0  # recorded cycle + gap


@dataclass
class _Tally:
    """One policy's kept tokens and priced milliseconds over some steps."""

    tokens: float = 0.0
    ms: float = 0.0  # each step's share of its predicted cycle (plus the gap, for the server)
    request_steps: int = 0
    nodes: float = 0.0  # verified tokens per request (the width, if padded) x requests, summed


def simulate(
    steps: list[Step], header: dict, model: LatencyModel, sizes: list[int], modes: list[str],
    cycle_scale: float = 1.0,
) -> tuple[list[dict], dict]:  # fmt: skip
    """Rows per (policy, batch size) and the exactness check of the producing policy.

    ``cycle_scale`` multiplies every predicted cycle: the observed / predicted ratio of a
    server's steps (what the EMA modes learn online), e.g. from another trace's report.
    """
    top_k, n_max = int(header["top_k"]), int(header["max_nodes"])
    policies = {f"fixed N={n}": Controller("fixed", n) for n in sizes if n <= n_max}
    for mode in modes:
        for layout in ("uniform", "ragged"):
            policies[f"{mode} {layout}"] = Controller(mode, n_max, layout, model)
        # The batch-global budget, priced as a packed pass over its total tokens.
        policies[f"{mode} global"] = Controller(mode, n_max, "global", model, packs_ragged=True)
    produced = header["controller"]
    check = {"policy": f"{produced['mode']} (N={produced['max_nodes']})", "steps": 0, "equal": 0}
    spent = _Spent()  # the producing policy's tokens and milliseconds
    recorder = producing_policy(produced, model)
    totals: dict[tuple[str, int], _Tally] = defaultdict(_Tally)  # (policy, batch size)
    server: dict[str, _Tally] = defaultdict(_Tally)  # policy, with the gaps between steps
    for step in steps:
        share = len(step.roots) / step.batch_size  # the greedy requests' part of the step
        context = float(step.context_lens.float().mean())
        if recorder is not None:
            recorder.overhead_ms = {len(step.roots): step.overhead_ms}  # as the server priced it
            got, verified, _ = replay(step, top_k, recorder)
            check["steps"] += 1
            check["equal"] += int(torch.equal(got, step.recorded_accept))
            width = step.recorded_width if recorder.layout != "global" else verified
            predicted = float(model.cycle_ms(step.batch_size, width, context)) * cycle_scale
            tokens = float(step.recorded_accept.clamp(max=step.budget).sum())  # what was kept
            spent.tokens += tokens
            spent.predicted_ms += predicted * share
            spent.recorded_ms += (step.cycle_ms or 0.0) * share
            if step.gap_ms is not None and step.cycle_ms is not None:
                spent.gap_tokens += tokens
                spent.predicted_gap_ms += (predicted + step.gap_ms) * share
                spent.recorded_gap_ms += (step.cycle_ms + step.gap_ms) * share
        for name, policy in policies.items():
            accept, width, _ = replay(step, top_k, policy)
            cycle = float(model.cycle_ms(step.batch_size, width, context)) * cycle_scale
            cell = totals[(name, step.batch_size)]
            cell.tokens += float(accept.sum())
            cell.ms += cycle * share  # this step's share of the cycle
            cell.request_steps += len(accept)
            cell.nodes += width * len(accept)
            if step.gap_ms is not None:
                served = server[name]
                served.tokens += float(accept.clamp(max=step.budget).sum())  # what is kept
                served.ms += (cycle + step.gap_ms) * share
    if spent.predicted_ms and spent.recorded_ms:
        check["predicted_tok_s"] = 1e3 * spent.tokens / spent.predicted_ms
        # from the worker's step times
        check["recorded_tok_s"] = 1e3 * spent.tokens / spent.recorded_ms
    if spent.predicted_gap_ms and spent.recorded_gap_ms:
        check["predicted_server_tok_s"] = 1e3 * spent.gap_tokens / spent.predicted_gap_ms
        # the trace's own clock
        check["recorded_server_tok_s"] = 1e3 * spent.gap_tokens / spent.recorded_gap_ms
    check["server_tok_s"] = {name: 1e3 * t.tokens / t.ms for name, t in server.items() if t.ms}
    rows = []
    for (name, batch), tally in sorted(totals.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        tokens, ms, count, nodes = tally.tokens, tally.ms, tally.request_steps, tally.nodes
        ar_ms = model.ar_ms(batch)
        rows.append({
            "batch": batch, "policy": name, "request-steps": int(count),
            "accept_len": tokens / count, "mean width": nodes / count,
            "tokens/ms per request": tokens / ms / batch if ms else float("nan"),
            "speedup vs AR": (tokens / count) * ar_ms / (ms / count) if ms else float("nan"),
        })  # fmt: skip
    for batch in sorted({r["batch"] for r in rows}):
        fixed = [r for r in rows if r["batch"] == batch and r["policy"].startswith("fixed")]
        best = max(fixed, key=lambda r: r["speedup vs AR"]) if fixed else None
        for r in rows:
            if r["batch"] == batch and best is not None:
                r["vs oracle fixed"] = r["speedup vs AR"] / best["speedup vs AR"]
                r["oracle N"] = best["policy"].removeprefix("fixed N=")
    return rows, check


def producing_policy(produced: dict, model: LatencyModel) -> Controller | None:
    """The trace's own policy, when its decisions can be replayed (fixed, or static)."""
    if produced["mode"] == "fixed":
        return Controller("fixed", int(produced["max_nodes"]))
    if produced["mode"] == "static":  # exact when the replay uses the server's profile
        # (and each step's measured overhead, which the trace records and `simulate` sets)
        return Controller(
            "static", int(produced["max_nodes"]), produced["layout"], model,
            packs_ragged=bool(produced.get("packs_ragged")),
        )  # fmt: skip
    return None  # ema modes depend on the observed times of every earlier step


def throughput_line(check: dict, measured_tok_s: float | None) -> str:
    """The producing policy's predicted throughput against what the server did."""
    if "predicted_tok_s" not in check:
        return "Throughput: the trace has no step times for the producing policy."
    line = (
        f"Throughput of the producing policy: predicted {check['predicted_tok_s']:.1f} tok/s, "
        f"worker step times {check['recorded_tok_s']:.1f} tok/s "
        f"(predicted/recorded {check['predicted_tok_s'] / check['recorded_tok_s']:.3f})"
    )
    if "predicted_server_tok_s" in check:
        line += (
            f"; with the recorded gaps between steps, predicted server throughput "
            f"{check['predicted_server_tok_s']:.1f} tok/s (the trace's own clock: "
            f"{check['recorded_server_tok_s']:.1f})"
        )
    if measured_tok_s:
        predicted = check.get("predicted_server_tok_s", check["predicted_tok_s"])
        ratio = predicted / measured_tok_s
        line += f", server output {measured_tok_s:.1f} tok/s (predicted/measured {ratio:.3f})"
    return line + "."


def plot(rows: list[dict], out: Path) -> None:
    """Speedup vs N per batch size with the adaptive points (the paper's Figure 6 shape)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for batch in sorted({r["batch"] for r in rows}):
        fixed = [r for r in rows if r["batch"] == batch and r["policy"].startswith("fixed")]
        xs = [int(r["policy"].removeprefix("fixed N=")) for r in fixed]
        line = ax.plot(xs, [r["speedup vs AR"] for r in fixed], marker="o", label=f"batch {batch}")
        for r in rows:
            if r["batch"] == batch and r["policy"] == "static uniform":
                ax.scatter([r["mean width"]], [r["speedup vs AR"]], marker="*", s=160,
                           color=line[0].get_color(), edgecolors="black", zorder=3)  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree size N (fixed); star: adaptive (static, uniform) at its mean width")
    ax.set_ylabel("predicted speedup over autoregressive")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", type=Path, nargs="+")
    parser.add_argument("--profile", type=Path, help="a measured latency profile")
    parser.add_argument("--gpu", default="H100-SXM", help="roofline hardware without a profile")
    parser.add_argument("--config", type=Path, help="the target's config.json (model shape)")
    parser.add_argument("--t-aux-ms", type=float, default=2.0, help="T_aux without a profile")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    parser.add_argument("--modes", nargs="+", default=["static", "ema", "ema_calib"])
    parser.add_argument("--measured-tok-s", type=float, help="the server's measured output tok/s")
    parser.add_argument(
        "--cycle-scale", type=float, default=1.0,
        help="multiply predicted cycles (a server's observed / predicted step time)",
    )  # fmt: skip
    parser.add_argument(
        "--idle-gap-s", type=float, default=1.0,
        help="a gap between steps longer than this is the server idling, not overhead",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS / "simulate")
    return parser.parse_args()


def main() -> None:
    """Replay, print and record."""
    args = parse_args()
    if args.config is None:
        args.config = ROOT / "tests/data/qwen3-8b-config.json"
    header, steps = load_steps(args.traces, args.idle_gap_s)
    model = latency_model(args)
    modes = (
        args.modes if args.profile else [m for m in args.modes if m != "ema_calib"] or ["static"]
    )
    rows, check = simulate(steps, header, model, args.sizes, modes, args.cycle_scale)
    check["cycle_scale"] = args.cycle_scale
    args.out.mkdir(parents=True, exist_ok=True)
    columns = ["batch", "policy", "request-steps", "accept_len", "mean width",
               "speedup vs AR", "vs oracle fixed", "oracle N"]  # fmt: skip
    table = markdown_table(rows, columns)
    print(table)
    server_rows = [{"policy": name, "predicted server tok/s": tok_s}
                   for name, tok_s in check["server_tok_s"].items()]  # fmt: skip
    server_table = markdown_table(server_rows, ["policy", "predicted server tok/s"])
    if server_rows:
        print(server_table)
    throughput = throughput_line(check, args.measured_tok_s)
    print(f"exactness: replaying {check['policy']} reproduces {check['equal']}/{check['steps']} "
          f"recorded steps' acceptance. {throughput}")  # fmt: skip
    check["measured_tok_s"] = args.measured_tok_s
    meta = machine()
    source = f"profile {args.profile}" if args.profile else f"roofline {args.gpu} + {args.config}"
    (args.out / "simulate.json").write_text(
        json.dumps({"machine": meta, "latency": source, "check": check, "rows": rows}, indent=2)
    )
    md = ["# Controller simulator", "", f"Command: `python {meta['command']}`", "",
          f"Traces: {', '.join(map(str, args.traces))}; latency: {source}.", "",
          f"Exactness: replaying the producing policy ({check['policy']}) reproduces "
          f"{check['equal']} of {check['steps']} recorded steps' acceptance.", "",
          throughput, "", table, ""]  # fmt: skip
    if server_rows:
        md += ["Every policy's expected server throughput over the steps with a known gap:", "",
               server_table, ""]  # fmt: skip
    (args.out / "simulate.md").write_text("\n".join(md))
    plot(rows, args.out / "simulate.png")


if __name__ == "__main__":
    main()
