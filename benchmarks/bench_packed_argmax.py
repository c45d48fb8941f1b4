"""What the target's tokens of a packed verify pass cost: unpacked to B * W rows, or packed.

A packed pass verifies T tokens, each request's own tree, but a batch has one verify width W,
its widest tree's. Unpacking the [T, V] logits to [B * W, V] before the argmax makes every
request pay the widest tree's rows; `packed_argmax` takes the argmax on the T rows and
scatters the tokens alone. This script times both at the tiny pair's vocabulary, a batch of
48 and T = 288 (6 tokens a request), for W from 8 to 32, in both dtypes (one thread, as the
CPU servers run):

    OMP_NUM_THREADS=1 python benchmarks/bench_packed_argmax.py \\
        --out benchmarks/results/packed_argmax_cpu.md
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import ROOT  # noqa: F401  (puts the repository on sys.path)
from cpu_gemm_rows import report

from sglang_bastion.tree.ragged import packed_argmax, unpack_rows

WIDTHS = (8, 12, 16, 24, 32)
DTYPES = (torch.float32, torch.bfloat16)


def median_ms(run: Callable[[], object], repeats: int) -> float:
    """Median ms of ``run()`` over ``repeats`` calls, after two untimed ones."""
    for _ in range(2):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def unpacked_argmax(logits: torch.Tensor, rows: torch.Tensor, padded: int) -> torch.Tensor:
    """[padded] the argmax of ``logits`` [T, V] after unpacking them to ``padded`` rows."""
    return unpack_rows(logits, rows, padded).argmax(dim=-1)


def table(batch: int, total: int, vocab: int, repeats: int) -> str:
    """The Markdown table: ms per step unpacked then argmax, packed argmax, their ratio."""
    lines = [
        "| dtype | W | unpack + argmax ms | packed argmax ms | unpacked / packed |",
        "|---|---|---|---|---|",
    ]
    generator = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        logits = torch.randn(total, vocab, generator=generator).to(dtype)  # [T, V]
        for width in WIDTHS:
            rows = torch.randperm(batch * width, generator=generator)[:total].sort().values  # [T]
            padded = batch * width
            unpacked = median_ms(functools.partial(unpacked_argmax, logits, rows, padded), repeats)
            packed = median_ms(functools.partial(packed_argmax, logits, rows, padded), repeats)
            dt = str(dtype).removeprefix("torch.")
            lines.append(
                f"| {dt} | {width} | {unpacked:.2f} | {packed:.2f} | {unpacked / packed:.1f}x |"
            )
    return "\n".join(lines)


def main() -> None:
    """Time both ways and print (or write) the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=48, help="B: requests in the pass")
    parser.add_argument("--tokens", type=int, default=288, help="T: packed verify tokens")
    parser.add_argument("--vocab", type=int, default=4096, help="V: the target's vocabulary")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per cell")
    parser.add_argument("--out", type=Path, help="write the Markdown here too")
    args = parser.parse_args()
    torch.set_num_threads(1)
    report(
        "The target's tokens of a packed verify pass on this CPU",
        f"bench_packed_argmax.py --batch {args.batch} --tokens {args.tokens} "
        f"--vocab {args.vocab} --repeats {args.repeats}",
        f"Medians of {args.repeats} calls. B = {args.batch}, T = {args.tokens}, "
        f"V = {args.vocab} (the tiny pair's).",
        table(args.batch, args.tokens, args.vocab, args.repeats),
        args.out,
    )


if __name__ == "__main__":
    main()
