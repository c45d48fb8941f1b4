"""BASTION core demo: best-first trees and the budget controller on real drafter marginals.

python benchmarks/core_demo.py [--quick] [--gpu H100-SXM] [--output-md PATH] [--output-json PATH]

Drafter: a byte-level n-gram model of the Python standard library's own sources that, like a
DFlash block-diffusion drafter, gives position-wise marginals q_1..q_D of the next D bytes
conditioned only on the validated context (its last ``--order`` bytes, backing off to shorter
contexts), never on drafted bytes. Target: held-out stdlib files (never counted), greedy, so
the target token is the true next byte. The demo builds chain (DFlash) and best-first trees,
verifies them with ``accept_path``, compares acceptance with the surrogate A_hat, and runs the
budget controller with a roofline cost model of a named GPU and target.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from common import RESULTS, machine, markdown_table
from tqdm import tqdm

from sglang_bastion.budget import HARDWARE, Hardware, LatencyModel, ModelShape, cost_vector_ms
from sglang_bastion.controller import per_request_sizes, uniform_width
from sglang_bastion.tree import TreeBatch, accept_path, build_trees
from training.corpus import split_files, stdlib_files

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 256  # byte-level tokens


@dataclass(frozen=True)
class Corpus:
    """Files concatenated as bytes, with each byte's file boundaries."""

    data: np.ndarray  # [T] uint8
    file_start: np.ndarray  # [T] int64: offset of the first byte of this byte's file
    file_end: np.ndarray  # [T] int64: offset one past the last byte of this byte's file
    num_files: int


def load_corpus(root: Path, names: list[str], cap_bytes: int) -> Corpus:
    """The named files concatenated in order until ``cap_bytes`` (the last one truncated)."""
    chunks, total = [], 0
    for name in names:
        if total >= cap_bytes:
            break
        text = (root / name).read_bytes()[: cap_bytes - total]
        if text:
            chunks.append(np.frombuffer(text, dtype=np.uint8))
            total += len(text)
    lengths = np.array([len(c) for c in chunks], dtype=np.int64)  # [F]
    ends = np.cumsum(lengths)  # [F]
    return Corpus(
        data=np.concatenate(chunks),
        file_start=np.repeat(ends - lengths, lengths),
        file_end=np.repeat(ends, lengths),
        num_files=len(chunks),
    )


def context_codes(data: np.ndarray, positions: np.ndarray, order: int) -> np.ndarray:
    """[P] int64 code of the ``order`` bytes ending at each position (0 for order 0)."""
    codes = np.zeros(len(positions), dtype=np.int64)  # [P]
    for i in range(order):
        back = np.clip(positions - i, 0, None)
        codes |= data[back].astype(np.int64) << (8 * i)
    return codes


class NgramDrafter:
    """q_k(x | last ``order`` validated bytes), k = 1..D, with back-off and add-eps smoothing.

    Counts are gathered only for the contexts the demo queries (one table row per distinct
    context and order), which keeps memory small; the marginals are those of the full table.
    """

    def __init__(
        self,
        train: Corpus,
        queries: Corpus,
        positions: np.ndarray,
        *,
        depth: int,
        order: int,
        eps: float,
        min_count: int,
        progress: bool = False,
    ) -> None:
        """Count the D bytes after every training occurrence of every queried context."""
        self.depth, self.order, self.eps, self.min_count = depth, order, eps, min_count
        self.tables: list[torch.Tensor] = []  # per order: [U_o, D, V] int32 counts
        self.rows: list[torch.Tensor] = []  # per order: [P] long, each query's table row
        all_train = np.arange(len(train.data), dtype=np.int64)  # [T]
        for o in tqdm(range(order + 1), desc="counting", unit="order", disable=not progress):
            uniq, inverse = np.unique(
                context_codes(queries.data, positions, o), return_inverse=True
            )  # [U], [P]
            codes = context_codes(train.data, all_train, o)  # [T]
            slot = np.minimum(np.searchsorted(uniq, codes), len(uniq) - 1)  # [T]
            hit = (uniq[slot] == codes) & (all_train - o + 1 >= train.file_start)
            at, row = all_train[hit], slot[hit]  # [H]: training positions with a queried context
            counts = np.zeros((len(uniq), depth, VOCAB), dtype=np.int32)  # [U, D, V]
            for k in range(1, depth + 1):
                ok = at + k < train.file_end[at]
                key = row[ok] * VOCAB + train.data[at[ok] + k]
                counts[:, k - 1] = np.bincount(key, minlength=len(uniq) * VOCAB).reshape(-1, VOCAB)
            self.tables.append(torch.from_numpy(counts))
            self.rows.append(torch.from_numpy(inverse.reshape(-1)))

    def marginals(self, index: torch.Tensor) -> torch.Tensor:
        """[B, D, V] float32 marginals of the queried positions ``index`` (indices, [B])."""
        counts = self.tables[0][self.rows[0][index]]  # [B, D, V]: order 0, always seen
        for o in range(1, self.order + 1):
            longer = self.tables[o][self.rows[o][index]]  # [B, D, V]
            seen = longer.sum(dim=-1, keepdim=True) >= self.min_count  # [B, D, 1]
            counts = torch.where(seen, longer, counts)
        counts = counts.float() + self.eps
        return counts / counts.sum(dim=-1, keepdim=True)


def true_path(trees: TreeBatch, truth: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, N] on-truth mask and greedy target tokens of every node (-1 off the true path).

    ``truth`` is [B, D+2]: the root byte and the D+1 bytes that follow it in the held-out text.
    A node is on the true path when its path spells the text; the target token there is the
    next true byte. Elsewhere it is -1, which no drafted token equals, so nothing below a wrong
    token can be accepted.
    """
    batch, nodes = trees.token_ids.shape
    depth = truth.shape[1] - 2
    parent = trees.parents.clamp(min=0)  # [B, N]
    token_ok = trees.token_ids == truth.gather(1, trees.depths)  # [B, N]
    token_ok &= (trees.parents >= 0) & trees.real_mask()
    is_root = (torch.arange(nodes) == 0).expand(batch, nodes)  # [B, N]
    on_truth = is_root.clone()
    for _ in range(depth):  # one more level of the true path settles per round
        on_truth = is_root | (token_ok & on_truth.gather(1, parent))
    next_byte = truth.gather(1, (trees.depths + 1).clamp(max=depth + 1))  # [B, N]
    return on_truth, torch.where(on_truth, next_byte, -1)


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson correlation of two samples (nan if either is constant)."""
    if x.std() == 0 or y.std() == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


@dataclass(frozen=True)
class HeldOut:
    """Sampled held-out steps: the root positions and the true text after each."""

    positions: np.ndarray  # [P] int64: root offsets in the held-out corpus
    truth: torch.Tensor  # [P, D+2] long: the root byte and the D+1 true bytes after it
    num_files: int


def sample_steps(held: Corpus, steps: int, depth: int, order: int, seed: int) -> HeldOut:
    """``steps`` distinct roots with a full context and D+1 true bytes after, in text order."""
    t_all = np.arange(len(held.data), dtype=np.int64)  # [T]
    valid = (t_all - order + 1 >= held.file_start) & (t_all + depth + 1 < held.file_end)
    steps = min(steps, int(valid.sum()))
    rng = np.random.default_rng(seed)
    positions = np.sort(rng.choice(t_all[valid], size=steps, replace=False))  # [P]
    truth = held.data[positions[:, None] + np.arange(depth + 2)]  # [P, D+2]
    return HeldOut(positions, torch.from_numpy(truth.astype(np.int64)), held.num_files)


def measure_acceptance(
    drafter: NgramDrafter,
    steps: HeldOut,
    configs: list[tuple[str, int, int]],
    batch: int,
    depth: int,
) -> tuple[dict[tuple[str, int, int], tuple[np.ndarray, np.ndarray]], TreeBatch]:
    """Per tree config, per-step (realised accepted length, A_hat); and the last config's trees."""
    accepted: dict = {c: [] for c in configs}  # per batch: [B] accepted + bonus
    predicted: dict = {c: [] for c in configs}  # per batch: [B] A_hat of the whole tree
    kept = []  # the last config's trees, for the controller
    batches = range(0, len(steps.positions), batch)
    for lo in tqdm(batches, desc="trees", unit="batch", disable=len(batches) < 8):
        index = torch.arange(lo, min(lo + batch, len(steps.positions)))  # [B]
        probs = drafter.marginals(index)  # [B, D, V]
        truth = steps.truth[index]  # [B, D+2]
        for config in configs:
            _, top_k, nodes = config
            trees = build_trees(probs, truth[:, 0], top_k=top_k, max_nodes=nodes)
            _, targets = true_path(trees, truth)
            _, num_accepted, bonus = accept_path(trees, targets, max_depth=depth)
            # Exactness: the emitted bytes are the held-out text itself.
            assert torch.equal(bonus, truth.gather(1, (num_accepted + 1).unsqueeze(1))[:, 0])
            accepted[config].append(num_accepted + 1)
            predicted[config].append(trees.surrogate()[:, -1])
        kept.append(trees)
    fields = ("token_ids", "parents", "depths", "log_scores", "num_nodes")
    largest = TreeBatch(**{f: torch.cat([getattr(t, f) for t in kept]) for f in fields})
    results = {
        c: (torch.cat(accepted[c]).double().numpy(), torch.cat(predicted[c]).double().numpy())
        for c in configs
    }
    return results, largest


def calibration_table(realised: np.ndarray, a_hat: np.ndarray, bins: int = 5) -> list[dict]:
    """Mean realised accepted length per A_hat quantile bin (the paper's Figure 9 as a table)."""
    edges = np.quantile(a_hat, np.linspace(0, 1, bins + 1))  # [bins+1]
    which = np.clip(np.searchsorted(edges, a_hat, side="right") - 1, 0, bins - 1)  # [P]
    return [
        {
            "A_hat bin": f"{q + 1}: {edges[q]:.2f}-{edges[q + 1]:.2f}",
            "steps": int((which == q).sum()),
            "mean A_hat": float(a_hat[which == q].mean()),
            "mean accept_len": float(realised[which == q].mean()),
        }
        for q in range(bins)
        if (which == q).any()
    ]


def controller_table(
    model: LatencyModel,
    trees: TreeBatch,
    truth: torch.Tensor,
    chain_len: float,
    batch_sizes: list[int],
    context: float,
    depth: int,
) -> list[dict]:
    """Chosen sizes and roofline-predicted speedups (on measured acceptance) per batch size."""
    on_truth, targets = true_path(trees, truth)
    # Realised accepted length of each tree's first n nodes: 1 + deepest on-truth node so far.
    curve = 1 + torch.cummax(torch.where(on_truth, trees.depths, 0), dim=1).values  # [P, N]
    rows = []
    for batch in batch_sizes:
        cost = cost_vector_ms(model, batch, trees.max_nodes, context)  # [N]: C(n), n = 1..N
        ar_ms = model.ar_ms(batch)
        chain_ms = float(model.cycle_ms(batch, depth + 1, context))
        chain_speedup = chain_len * ar_ms / chain_ms
        chosen = per_request_sizes(trees, cost, ar_ms)  # [P]
        _, num_accepted, _ = accept_path(trees.truncate(chosen), targets, max_depth=depth)
        assert torch.equal(num_accepted + 1, curve.gather(1, (chosen - 1).unsqueeze(1))[:, 0])
        mean_size = float(chosen.double().mean())
        request_len = float((num_accepted + 1).double().mean())
        # A ragged batch costs its total token count: the batch at the mean size per request.
        request_ms = float(model.cycle_ms(batch, mean_size, context))
        request_speedup = request_len * ar_ms / request_ms
        width = int(uniform_width(trees, cost))
        uniform_len = float(curve[:, width - 1].double().mean())
        uniform_speedup = uniform_len * ar_ms / float(cost[width - 1])
        rows.append(
            {
                "batch": batch,
                "L_AR ms": ar_ms,
                "C(chain) ms": chain_ms,
                "chain speedup": chain_speedup,
                "per-req mean N": mean_size,
                "per-req accept_len": request_len,
                "per-req speedup": request_speedup,
                "per-req vs chain": request_speedup / chain_speedup,
                "uniform W": width,
                "uniform accept_len": uniform_len,
                "uniform speedup": uniform_speedup,
                "uniform vs chain": uniform_speedup / chain_speedup,
            }
        )
    return rows


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="1 MB of text, 512 steps: a few seconds")
    add("--seed", type=int, default=0, help="seed of the held-out step sampling")
    add("--depth", type=int, default=7, help="draft block length D")
    add("--order", type=int, default=3, help="n-gram context length c in bytes (0-7)")
    add("--min-count", type=int, default=2, help="back off when a context is seen fewer times")
    add("--eps", type=float, default=0.01, help="add-eps smoothing per byte")
    add("--top-k", type=int, default=8, help="K of the best-first trees")
    add("--sizes", type=int, nargs="+", default=[4, 8, 16, 32, 64], help="best-first N")
    add("--batch", type=int, default=256, help="steps per build_trees call")
    add("--steps", type=int, default=None, help="held-out steps (default 8192, quick 512)")
    add("--train-mb", type=float, default=None, help="training text (default 4, quick 1)")
    add("--held-out-mb", type=float, default=None, help="held-out text (default 2, quick 0.5)")
    add("--held-out-percent", type=int, default=20, help="share of files held out")
    add("--config", type=Path, default=ROOT / "tests/data/qwen3-8b-config.json", help="target")
    add("--gpu", default="H100-SXM", help=f"roofline hardware: {', '.join(HARDWARE)}")
    add("--context", type=float, default=1024, help="prefix length in tokens for the costs")
    add("--t-aux-ms", type=float, default=0.5, help="assumed drafting + tree cost per cycle")
    add("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64], help="for the costs")
    add("--output-md", type=Path, default=None, help="default results/core_demo_cpu.md")
    add("--output-json", type=Path, default=None, help="also write the tables as JSON")
    args = parser.parse_args()
    if not 0 <= args.order <= 7:
        parser.error("--order must be in [0, 7]")
    args.steps = args.steps or (512 if args.quick else 8192)
    args.train_mb = args.train_mb or (1.0 if args.quick else 4.0)
    args.held_out_mb = args.held_out_mb or (0.5 if args.quick else 2.0)
    if args.output_md is None and not args.quick:  # --quick keeps the recorded results
        args.output_md = RESULTS / "core_demo_cpu.md"
    return args


def main() -> None:
    """Run the demo, print the report and write it."""
    args = parse_args()
    start = time.perf_counter()
    torch.manual_seed(args.seed)
    depth = args.depth

    # 1. Real text, split into train / held-out files by name hash; the n-gram drafter.
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train_names, held_names = split_files(stdlib_files(stdlib), args.held_out_percent)
    train = load_corpus(stdlib, train_names, int(args.train_mb * 2**20))
    held = load_corpus(stdlib, held_names, int(args.held_out_mb * 2**20))
    steps = sample_steps(held, args.steps, depth, args.order, args.seed)
    print(
        f"stdlib {stdlib}: {len(train_names)} train / {len(held_names)} held-out files; "
        f"counting {len(train.data) / 2**20:.1f} MB of {train.num_files} train files for "
        f"{len(steps.positions)} steps in {held.num_files} held-out files",
        file=sys.stderr,
        flush=True,
    )
    drafter = NgramDrafter(
        train,
        held,
        steps.positions,
        depth=depth,
        order=args.order,
        eps=args.eps,
        min_count=args.min_count,
        progress=not args.quick,
    )
    count_s = time.perf_counter() - start

    # 2. Chain and best-first trees verified against the held-out continuation.
    configs = [("chain (DFlash)", 1, depth + 1)]
    configs += [("best-first", args.top_k, n) for n in sorted(args.sizes)]
    results, largest = measure_acceptance(drafter, steps, configs, args.batch, depth)
    chain_len = float(results[configs[0]][0].mean())
    acceptance = []
    for config in configs:
        realised, a_hat = results[config]
        acceptance.append(
            {
                "tree": config[0],
                "K": config[1],
                "N": config[2],
                "accept_len": float(realised.mean()),
                "A_hat": float(a_hat.mean()),
                "pearson_r": pearson(a_hat, realised),
                "vs_chain": float(realised.mean()) / chain_len,
            }
        )
    calibration = calibration_table(*results[configs[-1]])
    tree_s = time.perf_counter() - start - count_s

    # 3. The controller on the largest trees, with roofline costs of the named target and GPU.
    shape = ModelShape.from_config_file(args.config)
    hardware = Hardware.lookup(args.gpu)
    model = LatencyModel.uncalibrated(shape, hardware, t_aux_ms=args.t_aux_ms)
    controller = controller_table(
        model, largest, steps.truth, chain_len, args.batch_sizes, args.context, depth
    )
    total_s = time.perf_counter() - start

    # 4. Report.
    meta = machine()
    target = args.config.stem.removesuffix("-config")
    report = [
        "# BASTION core demo: trees and budget controller on real n-gram marginals (CPU)",
        "",
        "- **Acceptance is measured** on real text: held-out Python stdlib files, never counted "
        "by the drafter; greedy target = the true next byte.",
        f"- **Latency is a roofline prediction** for {target} ({args.config.name}) on "
        f"{hardware.name}: uncalibrated, nothing timed; context {args.context:g}, assumed "
        f"T_aux {args.t_aux_ms:g} ms. Speedups apply that prediction to the measured acceptance.",
        "",
        f"Command: `python {meta['command']}`",
        "",
        f"Machine: {meta['cpu']}, {meta['threads']} torch threads, torch {meta['torch']}, "
        f"Python {meta['python']}, {meta['date']}",
        "",
        f"Drafter: byte-level (V={VOCAB}) order-{args.order} n-gram with back-off (min count "
        f"{args.min_count}, eps {args.eps:g}), {len(train.data) / 2**20:.1f} MB of "
        f"{train.num_files} train files; D={depth} position-wise marginals conditioned only on "
        f"the validated context. Held-out: {len(steps.positions)} steps in {held.num_files} "
        f"files ({args.held_out_percent}% of {len(train_names) + len(held_names)} stdlib files "
        f"held out by name hash), seed {args.seed}.",
        "",
        "## Acceptance on held-out text",
        "",
        "accept_len: accepted drafted bytes + 1 bonus, mean per step. A_hat: the whole tree's "
        "surrogate (`trees.surrogate()`). pearson_r: correlation of A_hat and accept_len over "
        "steps (the paper's Figure 9).",
        "",
        markdown_table(acceptance, list(acceptance[0])),
        "",
        f"## Surrogate calibration (best-first, N={configs[-1][2]}, A_hat quintiles)",
        "",
        markdown_table(calibration, list(calibration[0])),
        "",
        f"## Budget controller: {target} on {hardware.name} (roofline prediction)",
        "",
        f"Trees: the best-first N={largest.max_nodes} trees above (sizes capped there). per-req: "
        "`per_request_sizes` (first drop of A_hat(n) L_AR / C(n)), the batch costed at the mean "
        "size; uniform: `uniform_width`, one W for the batch. speedup = accept_len x L_AR / "
        f"cycle cost; chain: the {depth + 1}-token DFlash chain under the same costs.",
        "",
        markdown_table(controller, list(controller[0])),
        "",
        f"Run time: {total_s:.1f} s (data and counting {count_s:.1f} s, trees {tree_s:.1f} s).",
        "",
    ]
    text = "\n".join(report)
    print(text)
    if args.output_md:
        args.output_md.parent.mkdir(parents=True, exist_ok=True)
        args.output_md.write_text(text)
        print(f"wrote {args.output_md}", file=sys.stderr)
    if args.output_json:
        payload = {
            "machine": meta,
            "acceptance": acceptance,
            "calibration": calibration,
            "controller": controller,
            "seconds": total_s,
        }
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.output_json}", file=sys.stderr)


if __name__ == "__main__":
    main()
