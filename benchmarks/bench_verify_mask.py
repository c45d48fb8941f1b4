"""A tree verify's mask on this CPU: SGLang's flat layout with its prefix columns, or the tree
blocks alone (what BASTION's worker gives ``bastion_cpu``).

    OMP_NUM_THREADS=1 python benchmarks/bench_verify_mask.py [--repeats 30]

Per step the worker builds the verify inputs of every tree at the batch's width W
(`verify_inputs`), packs each request's first n_b nodes where the pass is ragged
(`pack_ragged`), and ``bastion_cpu`` reads the [B, W, W] tree blocks back out of the flat mask
(`kernels.draft_block_mask`). With the prefix columns the mask holds sum_b n_b (prefix_b +
n_b) entries, every prefix one True; draft-only it holds sum_b n_b^2. Trees are best-first
trees of the sizes a batch-global budget gives, every request with ``--prefix`` cached tokens.
Medians of ``--repeats`` calls of the three together; results in
benchmarks/results/verify_mask_cpu.{json,md}.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from common import median_us, write_results

from sglang_bastion.cpu_attention import kernels
from sglang_bastion.cpu_attention.kernels import DraftMaskLayout
from sglang_bastion.tree import TreeBatch, build_trees
from sglang_bastion.tree.ragged import pack_ragged
from sglang_bastion.tree.verify_inputs import verify_inputs

CASES = {  # name: (tree sizes of the batch, the width W its trees are built at)
    "1 x 16, W 16": ([16], 16),
    "16 x 8, W 8 (padded)": ([8] * 16, 8),
    "16 of 1-12, W 12 (ragged)": ([1, 4, 6, 8, 9, 10, 12, 8] * 2, 12),
    "48 of 1-24, W 24 (ragged)": ([1, 4, 6, 8, 9, 10, 12, 24] * 6, 24),
}


def step_mask(
    sizes: list[int], width: int, trees: TreeBatch, prefix: torch.Tensor, draft_only: bool
) -> int:
    """The worker's verify mask and the backend's read of it; the flat mask's length."""
    ragged = len(set(sizes)) > 1
    tail = 0 if ragged or draft_only else len(sizes) * width * width
    verify = verify_inputs(
        trees, prefix, prefix, kernels=True, mask_tail=tail, draft_only=draft_only
    )
    mask = verify.custom_mask
    lens = torch.full_like(prefix, width)
    if ragged:
        mask = pack_ragged(verify, sizes, prefix, width, draft_only).custom_mask
        lens = torch.tensor(sizes)
    layout = DraftMaskLayout.DRAFT_ONLY if draft_only else DraftMaskLayout.WITH_PREFIX
    kernels.draft_block_mask(mask, prefix, lens, int(lens.max()), layout)
    return mask.numel()


def main() -> None:
    """Time every case both ways and write the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--prefix", type=int, default=256, help="cached tokens per request")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default results/)")
    args = parser.parse_args()
    rows = []
    for name, (sizes, width) in CASES.items():
        batch = len(sizes)
        logits = torch.randn(batch, 7, 512, generator=torch.Generator().manual_seed(0))
        probs = torch.softmax(3.0 * logits, dim=-1)  # [B, D, V]: peaked drafter marginals
        trees = build_trees(probs, torch.zeros(batch, dtype=torch.long), top_k=8, max_nodes=width)
        trees = trees.truncate(torch.tensor(sizes)).narrow(width)
        prefix = torch.full((batch,), args.prefix)
        times, lengths = {}, {}
        for draft_only in (False, True):
            key = "draft_only" if draft_only else "with_prefix"

            def call(d=draft_only, s=sizes, w=width, t=trees, p=prefix) -> int:
                return step_mask(s, w, t, p, d)

            lengths[key] = call()
            times[key] = median_us(call, args.repeats)
        rows.append({
            "trees": name, "B": batch, "T": sum(sizes),
            "with_prefix_entries": lengths["with_prefix"],
            "draft_only_entries": lengths["draft_only"],
            "with_prefix_ms": times["with_prefix"] / 1e3,
            "draft_only_ms": times["draft_only"] / 1e3,
            "speedup": times["with_prefix"] / times["draft_only"],
        })  # fmt: skip
        print(rows[-1], flush=True)
    columns = ["trees", "B", "T", "with_prefix_entries", "draft_only_entries", "with_prefix_ms",
               "draft_only_ms", "speedup"]  # fmt: skip
    title = "A tree verify's mask on this CPU: with its prefix columns or the tree blocks alone"
    print(write_results("verify_mask_cpu", rows, columns, title, args.out))


if __name__ == "__main__":
    main()
