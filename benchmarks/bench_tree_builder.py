"""Batched `build_trees` against the per-request heap builder (DDTree's method), on CPU.

python benchmarks/bench_tree_builder.py [--quick] [--output-json PATH]

Both builders get the same marginals (softmax of 2 * randn, fixed seed) at D = 15, K = 8,
V = 300 and return the same TreeBatch; their A_hat curves are checked equal before timing.
`build_trees` takes its CPU path (the compiled merge where it was built); the torch pools it
would take with ``SGLANG_BASTION_DISABLE_KERNELS=1`` are timed beside it. Calls alternate,
after a warm-up, and the table reports the medians.
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
from sglang_bastion.tree.builder import _build, _choose_groups, _choose_strategy, _strategy_for

DEPTH, TOP_K, VOCAB = 15, 8, 300
COLUMNS = ["B", "N", "path", "batched_us", "torch_pools_us", "heap_us", "speedup"]


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
    """All three builders give every request the same node count and the same A_hat curve."""
    heap = heap_build_trees(probs, roots, top_k=TOP_K, max_nodes=max_nodes)
    for ours in (
        build_trees(probs, roots, top_k=TOP_K, max_nodes=max_nodes),
        torch_pools(probs, roots, max_nodes),
    ):
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


def path_name(probs: torch.Tensor, roots: torch.Tensor, max_nodes: int) -> str:
    """Which exact path `build_trees` takes at this size (see the builder's docstring)."""
    strategy = _strategy_for(probs, roots, DEPTH, TOP_K, max_nodes)
    grouped = _choose_groups(probs.shape[0] * DEPTH, VOCAB, TOP_K, probs.device) > 0
    return strategy + (" + grouped top-K" if grouped else "")


def torch_pools(probs: torch.Tensor, roots: torch.Tensor, max_nodes: int) -> object:
    """`build_trees` on the torch pools it takes with the compiled kernels disabled."""
    strategy = _choose_strategy(DEPTH, TOP_K, max_nodes)
    groups = _choose_groups(probs.shape[0] * DEPTH, VOCAB, TOP_K, probs.device)
    return _build(probs, roots, TOP_K, max_nodes, strategy, groups)


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
        batched_us, torch_us, heap_us = interleaved_medians(
            [
                lambda p=probs, r=roots, n=max_nodes: build_trees(p, r, top_k=TOP_K, max_nodes=n),
                lambda p=probs, r=roots, n=max_nodes: torch_pools(p, r, n),
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
                "path": path_name(probs, roots, max_nodes),
                "batched_us": batched_us,
                "torch_pools_us": torch_us,
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
                "first checked to give every request the same A_hat curve. `batched_us` is "
                "`build_trees` as dispatched (path column), `torch_pools_us` the torch pools it "
                "uses with SGLANG_BASTION_DISABLE_KERNELS=1, and speedup is heap_us / "
                "batched_us. Heap faster at: "
                f"{', '.join(slower) or 'none'}.\n"
            )
        print(f"wrote {path} and {path.with_suffix('.md')}")


if __name__ == "__main__":
    main()
