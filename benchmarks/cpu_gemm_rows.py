"""What one more token costs a linear layer on this CPU, in bfloat16 and in float32.

A verify pass of W tokens per request and a drafter pass of a block run every linear layer
over W (or block) rows. On a GPU those passes are memory-bound: a few rows cost about what one
does. This script times `torch.nn.Linear` at the shipped pairs' shapes for 1 to 256 rows in
both dtypes (one thread, as the CPU servers run), and writes the medians as a Markdown table:

    OMP_NUM_THREADS=1 python benchmarks/cpu_gemm_rows.py --out benchmarks/results/cpu_gemm_rows.md
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from sglang_bastion.budget.identity import cpu_bf16_flags, cpu_model

# (name, in features, out features) of the shipped pairs (hidden 256, MLP 768, vocab 4096,
# a drafter reading 3 target layers)
SHAPES = (
    ("drafter fc (3 x 256 -> 256)", 768, 256),
    ("MLP gate+up (256 -> 2 x 768)", 256, 1536),
    ("MLP down (768 -> 256)", 768, 256),
    ("LM head (256 -> 4096)", 256, 4096),
)
ROWS = (1, 4, 16, 64, 256)
DTYPES = (torch.bfloat16, torch.float32)


def pass_ms(layer: torch.nn.Linear, rows: int, repeats: int, rounds: int) -> float:
    """Median over ``rounds`` of the mean time of one ``layer`` pass over ``rows`` rows, ms."""
    x = torch.randn(rows, layer.in_features, dtype=layer.weight.dtype)  # [M, in]
    times = []
    with torch.inference_mode():
        for _ in range(3):
            layer(x)
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(repeats):
                layer(x)
            times.append((time.perf_counter() - start) / repeats * 1e3)
    return statistics.median(times)


def table(repeats: int, rounds: int) -> str:
    """The Markdown table: ms per pass in each dtype at each row count, and their ratio."""
    lines = [
        "| layer | rows | bfloat16 ms | float32 ms | bf16 / fp32 | bf16 ms per row |",
        "|---|---|---|---|---|---|",
    ]
    for name, fan_in, fan_out in SHAPES:
        layers = {dt: torch.nn.Linear(fan_in, fan_out, bias=False).to(dt) for dt in DTYPES}
        for rows in ROWS:
            bf16, fp32 = (pass_ms(layers[dt], rows, repeats, rounds) for dt in DTYPES)
            lines.append(
                f"| {name} | {rows} | {bf16:.3f} | {fp32:.3f} | {bf16 / fp32:.1f}x "
                f"| {bf16 / rows:.3f} |"
            )
    return "\n".join(lines)


def main() -> None:
    """Time the shapes and print (or write) the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="passes per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (the median is kept)")
    parser.add_argument("--out", type=Path, help="write the Markdown here too")
    args = parser.parse_args()
    torch.set_num_threads(1)
    report(
        "One linear layer's pass on this CPU, by rows and dtype",
        f"cpu_gemm_rows.py --repeats {args.repeats} --rounds {args.rounds}",
        "Medians of the rounds.",
        table(args.repeats, args.rounds),
        args.out,
    )


def report(title: str, command: str, note: str, body: str, out: Path | None) -> None:
    """Print a result table under its title, command and host, and write it to ``out``."""
    text = (
        f"# {title}\n\n"
        f"Command: `OMP_NUM_THREADS=1 python benchmarks/{command}`\n\n"
        f"Host: {cpu_model()}, torch {torch.__version__}, one thread; bfloat16 instructions "
        f"in /proc/cpuinfo: {cpu_bf16_flags()}. {note}\n\n{body}\n"
    )
    print(text)
    if out is not None:
        out.write_text(text)


if __name__ == "__main__":
    main()
