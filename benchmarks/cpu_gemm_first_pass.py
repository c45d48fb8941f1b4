"""What a linear layer's first pass at a row count it has not met costs on this CPU.

A packed verify pass has as many rows as the batch's verify tokens in all. Where the CPU's
matmul kernels are compiled per shape (oneDNN's bfloat16 kernels on AMX and AVX512-BF16
hosts), the first pass at each new row count pays the compile; where they are not (float32,
or bfloat16 on a host without those instructions), it costs what any pass costs. This script
times `torch.nn.Linear` at the shipped pairs' shapes over row counts it has not met, then over
the same row counts again, in both dtypes (one thread, as the CPU servers run):

    OMP_NUM_THREADS=1 python benchmarks/cpu_gemm_first_pass.py \\
        --out benchmarks/results/cpu_gemm_first_pass.md
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from cpu_gemm_rows import SHAPES, report

DTYPES = (torch.bfloat16, torch.float32)


def sweep_ms(layer: torch.nn.Linear, rows: range) -> float:
    """Mean ms of one ``layer`` pass per row count in ``rows``, each met once here."""
    x = torch.randn(rows.stop, layer.in_features, dtype=layer.weight.dtype)  # [M, in]
    with torch.inference_mode():
        start = time.perf_counter()
        for m in rows:
            layer(x[:m])
        return (time.perf_counter() - start) / len(rows) * 1e3


def table(first: int, count: int) -> str:
    """The Markdown table: ms per pass at new row counts, at the same ones again, the ratio."""
    lines = [
        "| layer | dtype | rows | first pass ms | again ms | first / again |",
        "|---|---|---|---|---|---|",
    ]
    rows = range(first, first + count)
    for name, fan_in, fan_out in SHAPES:
        for dtype in DTYPES:
            layer = torch.nn.Linear(fan_in, fan_out, bias=False).to(dtype)
            with torch.inference_mode():
                layer(torch.randn(1, fan_in, dtype=dtype))  # the layer's own first call
            new, again = sweep_ms(layer, rows), sweep_ms(layer, rows)
            dt = str(dtype).removeprefix("torch.")
            lines.append(
                f"| {name} | {dt} | {rows.start}-{rows.stop - 1} | {new:.3f} | {again:.3f} "
                f"| {new / again:.1f}x |"
            )
    return "\n".join(lines)


def main() -> None:
    """Time the shapes and print (or write) the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--first", type=int, default=200, help="the first row count timed")
    parser.add_argument("--count", type=int, default=50, help="row counts timed, one apart")
    parser.add_argument("--out", type=Path, help="write the Markdown here too")
    args = parser.parse_args()
    torch.set_num_threads(1)
    report(
        "A linear layer's first pass at a new row count on this CPU",
        f"cpu_gemm_first_pass.py --first {args.first} --count {args.count}",
        "Each row is one process's first sweep over the row counts, then a second sweep over "
        "the same ones: the mean ms per pass. Layers of one shape share their compiled "
        "kernels: MLP down (768 -> 256) meets the row counts the drafter fc of the same shape "
        "compiled before it.",
        table(args.first, args.count),
        args.out,
    )


if __name__ == "__main__":
    main()
