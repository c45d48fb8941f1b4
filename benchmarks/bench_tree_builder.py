"""Batched `build_trees` against the per-request heap builder (DDTree's method), on CPU.

python benchmarks/bench_tree_builder.py [--quick] [--output-json PATH]

Both builders get the same marginals (softmax of 2 * randn, fixed seed) at D = 15, K = 8,
V = 300 and return the same TreeBatch; their A_hat curves are checked equal before timing.
Calls of the two alternate, after a warm-up, and the table reports the medians.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import markdown_table, write_results
from heap_builder import heap_build_trees

from sglang_bastion.tree import build_trees
from sglang_bastion.tree.builder import _choose_groups, _choose_strategy

DEPTH, TOP_K, VOCAB = 15, 8, 300
COLUMNS = ["B", "N", "path", "batched_us", "heap_us", "speedup"]


def interleaved_medians(fns: list[Callable[[], object]], repeats: int, warmup: int) -> list[float]:
    """Median wall time of each function in microseconds, the calls taken in turn."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, acc in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - start)
    return [statistics.median(acc) * 1e6 for acc in times]


def check_same_trees(probs: torch.Tensor, roots: torch.Tensor, max_nodes: int) -> None:
    """Both builders give every request the same node count and the same A_hat curve."""
    ours = build_trees(probs, roots, top_k=TOP_K, max_nodes=max_nodes)
    heap = heap_build_trees(probs, roots, top_k=TOP_K, max_nodes=max_nodes)
    ours.check()
    assert torch.equal(ours.num_nodes, heap.num_nodes)
    torch.testing.assert_close(
        ours.surrogate().double(), heap.surrogate().double(), rtol=1e-5, atol=1e-6
    )


def repeat_count(batch: int, quick: bool) -> int:
    """Timed calls per builder: fewer where one call is slow, so every size takes similar time."""
    return 5 if quick else max(30, 400 // batch)


def repeats_note(quick: bool) -> str:
    """The repeat counts, as the results note states them."""
    return ", ".join(f"{repeat_count(b, quick)} (B={b})" for b in (1, 8, 64))


def path_name(batch: int, max_nodes: int) -> str:
    """Which exact path `build_trees` takes at this size (see the builder's docstring)."""
    strategy = _choose_strategy(DEPTH, TOP_K, max_nodes)
    grouped = _choose_groups(batch * DEPTH, VOCAB, TOP_K, torch.device("cpu")) > 0
    return strategy + (" + grouped top-K" if grouped else "")


def main() -> None:
    """Time both builders at every size and record the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two small sizes (smoke test)")
    parser.add_argument("--output-json", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        sizes = [(1, 16), (8, 64)]
    else:
        sizes = [(b, n) for b in (1, 8, 64) for n in (16, 64, 256)]
    rows = []
    for batch, max_nodes in sizes:
        torch.manual_seed(0)
        probs = torch.softmax(2 * torch.randn(batch, DEPTH, VOCAB), dim=-1)
        roots = torch.zeros(batch, dtype=torch.long)
        check_same_trees(probs, roots, max_nodes)
        repeats = repeat_count(batch, args.quick)
        batched_us, heap_us = interleaved_medians(
            [
                lambda p=probs, r=roots, n=max_nodes: build_trees(p, r, top_k=TOP_K, max_nodes=n),
                lambda p=probs, r=roots, n=max_nodes: heap_build_trees(
                    p, r, top_k=TOP_K, max_nodes=n
                ),
            ],
            repeats=repeats,
            warmup=2 if args.quick else 10,
        )
        rows.append(
            {
                "B": batch,
                "N": max_nodes,
                "path": path_name(batch, max_nodes),
                "batched_us": batched_us,
                "heap_us": heap_us,
                "speedup": heap_us / batched_us,
            }
        )
    print(markdown_table(rows, COLUMNS))
    if not args.quick or args.output_json:
        path = write_results(
            "tree_builder_cpu",
            rows,
            COLUMNS,
            f"build_trees vs the per-request heap builder (CPU, D={DEPTH}, K={TOP_K}, V={VOCAB})",
            args.output_json,
        )
        slower = [f"B={r['B']} N={r['N']}" for r in rows if r["speedup"] < 1]
        with path.with_suffix(".md").open("a") as md:
            md.write(
                f"\nMicroseconds per call: medians of {repeats_note(args.quick)} calls of each "
                "builder taken in turn, after a warm-up, on the same inputs; both builders are "
                "first checked to give every request the same A_hat curve. Heap faster at: "
                f"{', '.join(slower) or 'none'}.\n"
            )
        print(f"wrote {path} and {path.with_suffix('.md')}")


if __name__ == "__main__":
    main()
