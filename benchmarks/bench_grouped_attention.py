"""The attention of a ragged tree verify on this CPU: one padded batch against `query_groups`.

    OMP_NUM_THREADS=1 python benchmarks/bench_grouped_attention.py [--repeats 30]

One layer of `bastion_cpu`'s verify attention at the tiny pair's heads (4 query heads, 2 KV
heads, head dim 64), every request with 256 cached tokens, for trees of the sizes a
batch-global budget gives: each call builds the tree's visibility mask and attends, either
once over the batch padded to its deepest tree or once per group of `query_groups`, each
padded to its own deepest. Medians of ``--repeats`` calls, in float32 as the backend attends;
results in benchmarks/results/grouped_attention_cpu.{json,md}.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from common import median_us, write_results

from sglang_bastion.cpu_attention import kernels
from sglang_bastion.cpu_attention.plan import query_groups

HEADS, KV_HEADS, HEAD_DIM, PREFIX = 4, 2, 64, 256
CASES = {  # name: tree sizes of the batch (query tokens per request)
    "15 x 8, one of 32": [8] * 15 + [32],
    "12 x 4, four of 24": [4] * 12 + [24] * 4,
    "16 of 6-8": [6, 7, 8, 8] * 4,
    "44 x 6, four of 32": [6] * 44 + [32] * 4,
    "24 roots, 24 x 12": [1] * 24 + [12] * 24,
}


def attend_padded(sizes: list[int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """One layer's verify attention over requests of query ``sizes``, padded to the deepest."""
    query_lens = torch.tensor(sizes)  # [B]
    width = int(query_lens.max())
    prefix = torch.full_like(query_lens, PREFIX)
    tree = torch.ones(len(sizes), width, width, dtype=torch.bool).tril()  # [B, Q, Q]: a chain
    visible = kernels.visibility(
        prefix, query_lens, width, PREFIX + width, causal=True, draft_mask=tree
    )
    kernels.attend(
        q[: len(sizes), :width], k[: len(sizes), : PREFIX + width],
        v[: len(sizes), : PREFIX + width], mask=kernels.additive_mask(visible),
        is_causal=True, scale=HEAD_DIM**-0.5,
    )  # fmt: skip


def attend_grouped(sizes: list[int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """The same attention, once per group of `query_groups` (one padded batch where none)."""
    for rows in query_groups(sizes, PREFIX + max(sizes)) or [list(range(len(sizes)))]:
        attend_padded([sizes[r] for r in rows], q, k, v)


def main() -> None:
    """Time every case both ways and write the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default results/)")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for name, sizes in CASES.items():
        batch, width = len(sizes), max(sizes)
        q = torch.randn(batch, width, HEADS, HEAD_DIM)  # [B, Q, H, D]
        k = torch.randn(batch, PREFIX + width, KV_HEADS, HEAD_DIM)  # [B, S, Hkv, D]
        v = torch.randn_like(k)
        padded = median_us(lambda s=sizes, q=q, k=k, v=v: attend_padded(s, q, k, v), args.repeats)
        grouped = median_us(lambda s=sizes, q=q, k=k, v=v: attend_grouped(s, q, k, v), args.repeats)
        rows.append({
            "trees": name, "B": batch, "T": sum(sizes), "deepest": width,
            "groups": len(query_groups(sizes, PREFIX + width)) or 1, "padded_ms": padded / 1e3,
            "grouped_ms": grouped / 1e3, "padded_over_grouped": padded / grouped,
        })  # fmt: skip
        print(rows[-1], flush=True)
    columns = ["trees", "B", "T", "deepest", "groups", "padded_ms", "grouped_ms",
               "padded_over_grouped"]  # fmt: skip
    title = "One layer of a ragged tree verify's attention on this CPU: padded or in groups"
    print(write_results("grouped_attention_cpu", rows, columns, title, args.out))


if __name__ == "__main__":
    main()
