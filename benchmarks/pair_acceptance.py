"""Acceptance of the shipped tiny pair on held-out code at temperature 0: chain vs trees.

python benchmarks/pair_acceptance.py [--pair training/pair] [--prompts 64] [--new-tokens 160]
    [--sizes 16 32 64] [--top-k 8] [--quick]

At temperature 0 the committed text is the target's greedy continuation whatever is drafted,
so speculative decoding can be replayed exactly offline: the target continues held-out
prompts greedily once; at every step the drafter (``training.drafter``, the
same computation as SGLang's DFlash model) drafts a block from the context features of all
committed tokens, trees are built from its marginals, the accepted path is the deepest node
whose path spells the continuation, and the next step starts after the bonus token. Reports
the average acceptance length (accepted drafts + bonus per step) of the DFlash chain (top-1)
and of best-first trees of N nodes, and how well A_hat(N) predicts each step's acceptance
(Pearson correlation, and a binned table: the paper's Figure 9).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from common import RESULTS, machine, markdown_table
from core_demo import calibration_table, pearson, true_path
from tqdm import tqdm
from transformers import AutoTokenizer

from sglang_bastion.tree import accept_path, build_trees
from training.corpus import read_texts, split_files, stdlib_files, stdlib_root
from training.drafter import DFlashDrafter
from training.target import features, greedy, load_target
from training.train import HELD_OUT_PERCENT, token_stream

ROOT = Path(__file__).resolve().parent.parent


def display(path: Path) -> str:
    """``path`` relative to the repository when it is inside it."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def held_out_prompts(tokenizer, count: int, length: int, seed: int) -> torch.Tensor:
    """[count, length] token windows cut at random from the held-out files."""
    root = stdlib_root()
    _, held = split_files(stdlib_files(root), HELD_OUT_PERCENT)
    stream = token_stream(tokenizer, read_texts(root, held, 2_000_000))
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(len(stream) - length, (count,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


@torch.no_grad()
def block_marginals(target, drafter: DFlashDrafter, seqs: torch.Tensor, first: int) -> torch.Tensor:
    """[b, A, B-1, V] the drafter's marginals for every anchor p in first..T-B."""
    b, length = seqs.shape
    block = drafter.block_size
    _, feats = features(target, seqs, drafter.target_layer_ids)
    anchors = torch.arange(first, length - block + 1).expand(b, -1)  # [b, A]
    block_ids = torch.full((b, anchors.shape[1], block), drafter.mask_token_id)
    block_ids[..., 0] = seqs.gather(1, anchors)
    embeds = target.model.embed_tokens(block_ids)
    hidden = drafter(drafter.context(feats), embeds, anchors)  # [b, A, B, H]
    return torch.softmax(target.lm_head(hidden[:, :, 1:]).float(), -1)


def replay(
    seqs: torch.Tensor, probs: torch.Tensor, first: int, top_k: int, max_nodes: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per step: (accepted drafts + bonus, A_hat) replaying decoding with trees of max_nodes."""
    b, length = seqs.shape
    depth = probs.shape[2]
    pos = torch.full((b,), first)  # [b]: each sequence's current bonus position
    realised, predicted = [], []
    rows = torch.arange(b)
    while True:
        live = pos + depth + 1 < length  # a full block of truth after the bonus
        if not live.any():
            break
        idx, p = rows[live], pos[live]
        trees = build_trees(probs[idx, p - first], seqs[idx, p], top_k=top_k, max_nodes=max_nodes)
        truth = seqs[idx.unsqueeze(1), p.unsqueeze(1) + torch.arange(depth + 2)]  # [b', D+2]
        _, target_tokens = true_path(trees, truth)
        _, accepted, _ = accept_path(trees, target_tokens)
        scores = torch.where(trees.real_mask(), trees.log_scores.exp(), 0.0)
        realised.append((accepted + 1).numpy())
        predicted.append(scores.sum(1).numpy())
        pos[live] = p + accepted + 1
    return np.concatenate(realised), np.concatenate(predicted)


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", type=Path, default=ROOT / "training" / "pair")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=160)
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="8 prompts, 48 new tokens")
    parser.add_argument("--out", type=Path, default=RESULTS / "tiny_pair_acceptance.json")
    return parser.parse_args()


def main() -> None:
    """Measure, print and record the acceptance table."""
    args = parse_args()
    if args.quick:
        args.prompts, args.new_tokens = 8, 48
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.pair / "target")
    target = load_target(args.pair / "target")
    drafter = DFlashDrafter.load(args.pair / "drafter").eval()
    prompts = held_out_prompts(tokenizer, args.prompts, args.prompt_len, args.seed)
    seqs = torch.cat([greedy(target, chunk, args.new_tokens) for chunk in prompts.split(16)])
    probs = torch.cat(
        [block_marginals(target, drafter, chunk, args.prompt_len) for chunk in seqs.split(8)]
    )
    rows, bins = [], {}
    chain_len = None
    settings = [("chain (DFLASH, top-1)", 1, drafter.block_size)]
    settings += [(f"tree N={n}", args.top_k, n) for n in args.sizes]
    for name, top_k, nodes in tqdm(settings, desc="replay"):
        realised, a_hat = replay(seqs, probs, args.prompt_len, top_k, nodes)
        mean = float(realised.mean())
        chain_len = chain_len or mean
        rows.append({
            "method": name, "top_k": top_k, "max_nodes": nodes, "steps": len(realised),
            "accept_len": mean, "vs chain": mean / chain_len,
            "mean A_hat": float(a_hat.mean()), "pearson(A_hat, accepted)": pearson(a_hat, realised),
        })  # fmt: skip
        if top_k > 1:
            bins[name] = calibration_table(realised, a_hat)
    columns = list(rows[0])
    print(markdown_table(rows, columns))
    meta = machine()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": meta, "rows": rows, "bins": bins}, indent=2) + "\n")
    md = [
        "# Tiny pair acceptance on held-out code (temperature 0)",
        "",
        f"Command: `python {meta['command']}`",
        "",
        f"Pair: `{display(args.pair)}` (block {drafter.block_size}); {args.prompts} held-out "
        f"prompts of {args.prompt_len} tokens, {args.new_tokens} greedy tokens each; "
        f"K={args.top_k}. "
        f"Machine: {meta['cpu']}, torch {meta['torch']}, {meta['date']}.",
        "",
        markdown_table(rows, columns),
        "",
    ]
    for name, table in bins.items():
        md += [
            f"## A_hat vs realised acceptance, {name}",
            "",
            markdown_table(table, list(table[0])),
            "",
        ]
    args.out.with_suffix(".md").write_text("\n".join(md))


if __name__ == "__main__":
    main()
