"""The draft head on CPU: top-K draft marginals from the drafter's hidden rows, per decode step.

python benchmarks/bench_draft_head.py [--output-json PATH]

Uses the trained pair's own LM head (`training/pair/target`, V = 4096, H = 256, bf16) and
hidden rows scaled like the final RMSNorm's output (unit RMS times the norm's weight): the
tiny pair's logits spread over about 7 nats. ``peaked`` rows are the same times 15 (about
100 nats, as a confident large model's are), where exp(x - max) falls below float32's normal
range for most of the vocabulary. Rows = batch x 7 draft positions (block 8). Times, one
thread, calls interleaved, medians:

- ``draft_head_us``: `sglang_bastion.kernels.draft_head_topk` as the worker calls it (GEMM in
  the head's dtype, log-sum-exp clamped at e^-80);
- ``float32_head_us``: the formulation it replaced, a float32 copy of the head every call,
  a float32 GEMM and ``torch.logsumexp`` (whose subnormal exponentials are slow on CPUs);
- ``torch_lse_us``: the head's-dtype GEMM with ``torch.logsumexp``, which isolates the clamp.

``same_ids`` is the share of rows whose K token ids agree between the two, and
``max_prob_diff`` the largest probability difference (bf16 logits against float32 ones).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from bench_tree_builder import interleaved_medians
from common import markdown_table, write_results
from safetensors.torch import load_file

from sglang_bastion.kernels import draft_head_topk

PAIR = Path(__file__).resolve().parent.parent / "training" / "pair" / "target"
TOP_K, POSITIONS = 4, 7
COLUMNS = ["rows_kind", "batch", "rows", "draft_head_us", "float32_head_us", "torch_lse_us",
           "speedup", "same_ids", "max_prob_diff", "logit_spread"]  # fmt: skip


def torch_lse_head(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K probabilities of [R, V] logits with torch.logsumexp as the normaliser."""
    logits = logits.float()
    values, ids = logits.topk(top_k, dim=1)
    return torch.exp(values - torch.logsumexp(logits, dim=1, keepdim=True)), ids


def float32_head(hidden: torch.Tensor, weight: torch.Tensor, top_k: int):
    """The replaced formulation: float32 head copy, float32 GEMM, torch.logsumexp."""
    return torch_lse_head(hidden.float() @ weight.float().T, top_k)


def main() -> None:
    """Time both formulations at batch 1, 4 and 16 and record the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the CPU servers run (OMP_NUM_THREADS=1)
    weights = load_file(PAIR / "model.safetensors")
    head, norm = weights["lm_head.weight"], weights["model.norm.weight"].float()
    vocab = head.shape[0]
    generator = torch.Generator().manual_seed(0)
    rows_out = []
    for kind, scale in (("pair", 1.0), ("peaked", 15.0)):
        for batch in (1, 4, 16):
            rows = batch * POSITIONS
            hidden = torch.randn(rows, head.shape[1], generator=generator) * norm * scale  # [R, H]
            ours = draft_head_topk(hidden, head, vocab, TOP_K)
            old = float32_head(hidden, head, TOP_K)
            logits = hidden.float() @ head.float().T
            times = interleaved_medians(
                [lambda h=hidden: draft_head_topk(h, head, vocab, TOP_K),
                 lambda h=hidden: float32_head(h, head, TOP_K),
                 lambda h=hidden: torch_lse_head(h.to(head.dtype) @ head.T, TOP_K)],
                repeats=200, warmup=20,
            )  # fmt: skip
            rows_out.append({
                "rows_kind": kind, "batch": batch, "rows": rows,
                "draft_head_us": times[0], "float32_head_us": times[1], "torch_lse_us": times[2],
                "speedup": times[1] / times[0],
                "same_ids": float((ours[1] == old[1]).all(dim=1).float().mean()),
                "max_prob_diff": f"{float((ours[0] - old[0]).abs().max()):.1e}",
                "logit_spread": float((logits.max(1).values - logits.min(1).values).mean()),
            })  # fmt: skip
    print(markdown_table(rows_out, COLUMNS))
    path = write_results(
        "draft_head_cpu", rows_out, COLUMNS,
        f"Draft head on CPU (tiny pair's LM head: V={vocab}, H={head.shape[1]}, bf16, K={TOP_K})",
        args.output_json,
    )  # fmt: skip
    print(f"results: {path}")


if __name__ == "__main__":
    main()
