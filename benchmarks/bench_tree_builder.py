"""The tree build's CPU path (the compiled merge) against its per-request heap reference.

python benchmarks/bench_tree_builder.py [--quick] [--output-json PATH]

Both builders get the same top-K marginals (softmax of 2 * randn, fixed seed, D = 15, K = 8,
V = 300) and must return the same trees before they are timed. The heap reference is
DDTree's method (`build_trees_reference`), the compiled merge what `build_trees_from_top_k`
runs on CPU tensors. Calls alternate, after a warm-up, and the table reports the medians.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import markdown_table, write_results

from sglang_bastion.tree.builder import build_trees_compiled, build_trees_reference

DEPTH, TOP_K, VOCAB = 15, 8, 300
COLUMNS = ["B", "N", "compiled_us", "heap_us", "speedup"]
FIELDS = ("token_ids", "parents", "depths", "log_scores", "num_nodes")


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


def check_same_trees(top: tuple[torch.Tensor, torch.Tensor], roots: torch.Tensor, n: int) -> None:
    """Both builders give every request the same tree (the marginals are tie-free)."""
    heap = build_trees_reference(*top, roots, max_nodes=n)
    compiled = build_trees_compiled(*top, roots, max_nodes=n)
    for name in FIELDS:
        assert torch.equal(getattr(compiled, name), getattr(heap, name)), name


def repeat_count(batch: int, quick: bool) -> int:
    """Timed calls per builder: fewer where one call is slow, so every size takes similar time."""
    return 5 if quick else max(30, 400 // batch)


def repeats_note(quick: bool) -> str:
    """The repeat counts, as the results note states them."""
    return ", ".join(f"{repeat_count(b, quick)} (B={b})" for b in (1, 8, 64))


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
        top = probs.topk(TOP_K, dim=-1)  # [B, D, K] each
        roots = torch.zeros(batch, dtype=torch.long)
        check_same_trees(top, roots, max_nodes)
        compiled_us, heap_us = interleaved_medians(
            [
                lambda t=top, r=roots, n=max_nodes: build_trees_compiled(*t, r, max_nodes=n),
                lambda t=top, r=roots, n=max_nodes: build_trees_reference(*t, r, max_nodes=n),
            ],
            repeats=repeat_count(batch, args.quick),
            warmup=2 if args.quick else 10,
        )
        rows.append(
            {
                "B": batch,
                "N": max_nodes,
                "compiled_us": compiled_us,
                "heap_us": heap_us,
                "speedup": heap_us / compiled_us,
            }
        )
    print(markdown_table(rows, COLUMNS))
    if not args.quick or args.output_json:
        path = write_results(
            "tree_builder_cpu",
            rows,
            COLUMNS,
            f"compiled tree build vs its heap reference (CPU, D={DEPTH}, K={TOP_K}, V={VOCAB})",
            args.output_json,
        )
        slower = [f"B={r['B']} N={r['N']}" for r in rows if r["speedup"] < 1]
        with path.with_suffix(".md").open("a") as md:
            md.write(
                f"\nMicroseconds per call: medians of {repeats_note(args.quick)} calls of each "
                "builder taken in turn, after a warm-up, on the same top-K inputs; both are "
                "first checked to give the same trees. `compiled_us` is the C merge the server "
                "runs on CPU, `heap_us` the per-request heap (DDTree's method, the tests' "
                "reference), speedup heap_us / compiled_us. Heap faster at: "
                f"{', '.join(slower) or 'none'}.\n"
            )
        print(f"wrote {path} and {path.with_suffix('.md')}")


if __name__ == "__main__":
    main()
