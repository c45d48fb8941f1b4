"""Acceptance of the shipped trained pairs on held-out code at temperature 0 and 1: chain vs trees.

python benchmarks/pair_acceptance.py [--pairs training/pair training/pair-b16]
    [--temperatures 0 1] [--prompts 64] [--new-tokens 160] [--sizes 16 32 64] [--top-k 8]
    [--quick]

Speculative decoding is replayed exactly offline. The target continues held-out prompts once,
greedily at temperature 0 and by ancestral sampling at temperature 1. Acceptance walks each
tree with the target's own tokens (``sglang_bastion.tree.accept_path``), one fresh target draw
per visited node, so coupling those draws to the pre-drawn continuation leaves the emitted text
distributed as the server's: the accepted path is the deepest node whose path spells the
continuation, and the next step starts after the bonus token. At every step the drafter
(``training.drafter``, the same computation as SGLang's DFlash model) drafts a block from the
context features of all committed tokens, and trees are built from its marginals.

Per pair and temperature it reports the average acceptance length (accepted drafts + bonus per
step) of the DFlash chain (top-1) and of best-first trees of N nodes, the share of steps that
accept the whole block, how often the accepted path leaves the top-1 chain (a lower-ranked
sibling accepted), how often the drafter's top-1 is right one level below an accepted top-1
token vs below an accepted sibling, how well A_hat(N) predicts each step's acceptance (Pearson
r and a binned table: the paper's Figure 9), the share of continuations that fall into a
loop (see ``loops``) and their repeated 4-grams (``seq_rep``), each beside the held-out code's
own, and the target's mean probability of its own next token (how sure it is of what it says).
One Markdown + JSON file per pair goes to ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import numpy as np
import torch
from common import RESULTS, ROOT, machine, markdown_table
from core_demo import calibration_table, pearson, true_path
from tqdm import tqdm
from transformers import AutoTokenizer

from sglang_bastion.tree import accept_path, build_trees
from training.corpus import read_texts, split_files, stdlib_files, stdlib_root
from training.drafter import DFlashDrafter
from training.target import features, greedy, load_target, sample
from training.train import HELD_OUT_PERCENT, token_stream

LOOP_SPAN = 16  # a loop: a span of at least this many tokens repeated back to back
LOOP_WINDOW = 128  # continuation tokens checked for a loop
RESULT_NAMES = {"pair": "tiny_pair", "pair-b16": "pair_b16"}


def display(path: Path) -> str:
    """``path`` relative to the repository when it is inside it."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


@functools.cache
def held_out_stream(tokenizer_path: str) -> torch.Tensor:
    """[T] the held-out files' tokens under the tokenizer saved at ``tokenizer_path``."""
    root = stdlib_root()
    _, held = split_files(stdlib_files(root), HELD_OUT_PERCENT)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    return token_stream(tokenizer, read_texts(root, held, 2_000_000))


def held_out_prompts(tokenizer, count: int, length: int, seed: int) -> torch.Tensor:
    """[count, length] token windows cut at random from the held-out files."""
    stream = held_out_stream(tokenizer.name_or_path)
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(len(stream) - length, (count,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


def loops(tokens: np.ndarray, span: int = LOOP_SPAN, max_period: int = 64) -> bool:
    """Whether ``tokens`` holds a loop: for some period p <= ``max_period``, a stretch of
    max(p, span) tokens equals the p tokens after it shifted by p (for p >= span: a p-token
    span immediately followed by itself; for p < span: a p-cycle running span + p tokens)."""
    for period in range(1, min(max_period, len(tokens) // 2) + 1):
        same = np.concatenate([[0], (tokens[:-period] == tokens[period:]).astype(np.int64)])
        run = max(period, span)
        # a run of ``run`` equal positions: the cumulative count rises by ``run`` over it
        counts = np.cumsum(same)
        if len(counts) > run and (counts[run:] - counts[:-run]).max() >= run:
            return True
    return False


def seq_rep(tokens: np.ndarray, n: int = 4) -> float:
    """The share of ``tokens``' n-grams that repeat an earlier one (seq-rep-n, Welleck et al.)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return 1 - len(set(grams)) / max(1, len(grams))


@torch.no_grad()
def own_token_probability(target, seqs: torch.Tensor, first: int) -> float:
    """The target's mean probability of each of its own tokens after position ``first``."""
    probs = []
    for chunk in seqs.split(16):
        logits = target(input_ids=chunk).logits[:, first - 1 : -1].float()  # [b, C, V]
        probs.append(torch.softmax(logits, -1).gather(-1, chunk[:, first:, None])[..., 0])
    return float(torch.cat(probs).mean())


def repetition(windows: np.ndarray) -> dict[str, float]:
    """The loop share and mean seq-rep-4 of rows of continuation tokens."""
    return {
        "loop share": float(np.mean([loops(row) for row in windows])),
        "seq-rep-4": float(np.mean([seq_rep(row) for row in windows])),
    }


@torch.no_grad()
def block_marginals(target, drafter: DFlashDrafter, seqs: torch.Tensor, first: int) -> torch.Tensor:
    """[b, A, L-1, V] the drafter's marginals for every anchor p in first..T-L (L: block)."""
    b, length = seqs.shape
    block = drafter.block_size
    _, feats = features(target, seqs, drafter.target_layer_ids)
    anchors = torch.arange(first, length - block + 1).expand(b, -1)  # [b, A]
    block_ids = torch.full((b, anchors.shape[1], block), drafter.mask_token_id)
    block_ids[..., 0] = seqs.gather(1, anchors)
    embeds = target.model.embed_tokens(block_ids)
    hidden = drafter(drafter.context(feats), embeds, anchors)  # [b, A, L, H]
    return torch.softmax(target.lm_head(hidden[:, :, 1:]).float(), -1)


def truth_ranks(seqs: torch.Tensor, probs: torch.Tensor, first: int) -> torch.Tensor:
    """[b, A, D] the rank of the true token in each marginal (0: the drafter's top-1)."""
    _, num, depth, _ = probs.shape
    idx = first + 1 + torch.arange(num).unsqueeze(1) + torch.arange(depth)  # [A, D]
    truth = seqs[:, idx.clamp(max=seqs.shape[1] - 1)]  # [b, A, D]
    p_true = probs.gather(3, truth.unsqueeze(-1))  # [b, A, D, 1]
    return (probs > p_true).sum(-1)


def replay(
    seqs: torch.Tensor, probs: torch.Tensor, first: int, top_k: int, max_nodes: int
) -> dict[str, np.ndarray]:
    """Per step: accepted drafts, A_hat and the true tokens' ranks, replaying trees of N nodes."""
    b, length = seqs.shape
    depth = probs.shape[2]
    ranks = truth_ranks(seqs, probs, first)
    pos = torch.full((b,), first)  # [b]: each sequence's current bonus position
    accepted_all, predicted, step_ranks = [], [], []
    rows = torch.arange(b)
    while True:
        live = pos + depth + 1 < length  # a full block of truth after the bonus
        if not live.any():
            break
        idx, p = rows[live], pos[live]
        trees = build_trees(probs[idx, p - first], seqs[idx, p], top_k=top_k, max_nodes=max_nodes)
        truth = seqs[idx.unsqueeze(1), p.unsqueeze(1) + torch.arange(depth + 2)]  # [b', D+2]
        _, target_tokens = true_path(trees, truth)
        _, accepted, _ = accept_path(trees, target_tokens, max_depth=depth)
        scores = torch.where(trees.real_mask(), trees.log_scores.exp(), 0.0)
        accepted_all.append(accepted.numpy())
        predicted.append(scores.sum(1).numpy())
        step_ranks.append(ranks[idx, p - first].numpy())
        pos[live] = p + accepted + 1
    return {
        "accepted": np.concatenate(accepted_all),
        "a_hat": np.concatenate(predicted),
        "ranks": np.concatenate(step_ranks),  # [steps, D]
    }


def path_stats(accepted: np.ndarray, ranks: np.ndarray, depth: int) -> dict[str, float]:
    """Whole-block share, sibling share, and top-1 accuracy below top-1 vs sibling tokens."""
    levels = np.arange(depth)
    on_path = levels < accepted[:, None]  # [steps, D]: depth d+1 accepted
    sibling = on_path & (ranks > 0)
    below = on_path[:, :-1]  # an accepted token with a level below it
    right = ranks[:, 1:] == 0  # [steps, D-1]: the top-1 is right one level below
    after_top1, after_sibling = below & ~sibling[:, :-1], below & sibling[:, :-1]
    return {
        "whole block": float((accepted == depth).mean()),
        "steps w/ sibling": float(sibling.any(1).mean()),
        "sibling share of accepted": float(sibling.sum() / max(1, on_path.sum())),
        "top-1 right below top-1": float(right[after_top1].mean()) if after_top1.any() else None,
        "top-1 right below sibling": (
            float(right[after_sibling].mean()) if after_sibling.any() else None
        ),
    }


def continuations(target, prompts: torch.Tensor, new_tokens: int, temperature: float, seed: int):
    """[b, P + new_tokens] the target's greedy (temperature 0) or sampled continuations."""
    if temperature == 0:
        return torch.cat([greedy(target, chunk, new_tokens) for chunk in prompts.split(16)])
    if temperature != 1:
        raise ValueError(f"temperature must be 0 or 1, got {temperature}")
    chunks = prompts.split(16)
    return torch.cat([sample(target, c, new_tokens, seed=seed + i) for i, c in enumerate(chunks)])


def measure_pair(pair: Path, temperature: float, args: argparse.Namespace) -> dict:
    """The acceptance rows, calibration bins and loop share of one pair at one temperature."""
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(pair / "target")
    target = load_target(pair / "target")
    drafter = DFlashDrafter.load(pair / "drafter").eval()
    prompts = held_out_prompts(tokenizer, args.prompts, args.prompt_len, args.seed)
    seqs = continuations(target, prompts, args.new_tokens, temperature, args.seed)
    window = seqs[:, args.prompt_len : args.prompt_len + LOOP_WINDOW].numpy()
    repeats = repetition(window)
    held_out = held_out_prompts(tokenizer, args.prompts, args.prompt_len + LOOP_WINDOW, args.seed)
    held_out_repeats = repetition(held_out[:, args.prompt_len :].numpy())
    own_probability = own_token_probability(target, seqs, args.prompt_len)
    probs = torch.cat(
        [block_marginals(target, drafter, chunk, args.prompt_len) for chunk in seqs.split(4)]
    )
    depth = drafter.block_size - 1
    rows, bins = [], {}
    chain_len = None
    settings = [("chain (DFLASH, top-1)", 1, drafter.block_size)]
    settings += [(f"tree N={n}", args.top_k, n) for n in args.sizes]
    for name, top_k, nodes in tqdm(settings, desc=f"{pair.name} T={temperature:g}"):
        step = replay(seqs, probs, args.prompt_len, top_k, nodes)
        realised = step["accepted"] + 1
        mean = float(realised.mean())
        chain_len = chain_len or mean
        rows.append({
            "method": name, "top_k": top_k, "max_nodes": nodes, "steps": len(realised),
            "accept_len": mean, "of block": mean / drafter.block_size, "vs chain": mean / chain_len,
            "mean A_hat": float(step["a_hat"].mean()),
            "pearson(A_hat, accepted)": pearson(step["a_hat"], realised),
            **path_stats(step["accepted"], step["ranks"], depth),
        })  # fmt: skip
        if top_k > 1:
            bins[name] = calibration_table(realised, step["a_hat"])
    return {
        "temperature": temperature,
        "block_size": drafter.block_size,
        "loop_share": repeats["loop share"],
        "seq_rep_4": repeats["seq-rep-4"],
        "held_out_text": held_out_repeats,
        "own_token_probability": own_probability,
        "rows": rows,
        "bins": bins,
    }


def write_pair(pair: Path, results: list[dict], args: argparse.Namespace) -> Path:
    """Record one pair's tables as ``benchmarks/results/<name>_acceptance.{json,md}``."""
    meta = machine()
    name = RESULT_NAMES.get(pair.name, pair.name.replace("-", "_"))
    out = args.out_dir / f"{name}_acceptance.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": meta, "pair": display(pair), "results": results},
                              indent=2) + "\n")  # fmt: skip
    block = results[0]["block_size"]
    md = [
        f"# Trained pair `{display(pair)}`: acceptance on held-out code",
        "",
        f"Command: `python {meta['command']}`",
        "",
        f"Block {block}; {args.prompts} held-out prompts of {args.prompt_len} tokens, "
        f"{args.new_tokens} target tokens each; K={args.top_k}. Acceptance walks each tree with "
        "the target's own tokens (exact offline replay). Machine: "
        f"{meta['cpu']}, torch {meta['torch']}, {meta['date']}.",
        "",
        "Columns: `accept_len` accepted drafts + bonus per step, `of block` that / block, "
        "`whole block` share of steps accepting all drafts, `steps w/ sibling` share of steps "
        "whose accepted path holds a token that is not the drafter's top-1 at its depth, "
        "`sibling share of accepted` such tokens among accepted drafts, `top-1 right below "
        "top-1 / sibling` how often the drafter's top-1 is the true token one level below an "
        "accepted top-1 token / an accepted lower-ranked sibling.",
        "",
    ]
    for result in results:
        temperature = result["temperature"]
        columns = list(result["rows"][0])
        md += [
            f"## Temperature {temperature:g}",
            "",
            f"Continuations that fall into a loop (within their first {LOOP_WINDOW} tokens, a "
            f"span of at least {LOOP_SPAN} tokens repeated back to back): "
            f"{result['loop_share']:.1%} (the held-out code's own next {LOOP_WINDOW} tokens: "
            f"{result['held_out_text']['loop share']:.1%}). Repeated 4-grams within a "
            f"continuation (seq-rep-4): {result['seq_rep_4']:.3f} (held-out code: "
            f"{result['held_out_text']['seq-rep-4']:.3f}). The target's mean probability of its "
            f"own next token: {result['own_token_probability']:.3f}.",
            "",
            markdown_table(result["rows"], columns),
            "",
        ]
        for setting, table in result["bins"].items():
            md += [
                f"### A_hat vs realised acceptance, {setting}, T={temperature:g}",
                "",
                markdown_table(table, list(table[0])),
                "",
            ]
    out.with_suffix(".md").write_text("\n".join(md))
    return out


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_pairs = [ROOT / "training" / "pair", ROOT / "training" / "pair-b16"]
    parser.add_argument("--pairs", type=Path, nargs="+", default=default_pairs)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=160)
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="8 prompts, 48 new tokens")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared CPU)")
    return parser.parse_args()


def main() -> None:
    """Measure, print and record the acceptance tables of every pair."""
    args = parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        args.prompts, args.new_tokens = 8, 48
    for pair in args.pairs:
        results = []
        for temperature in args.temperatures:
            result = measure_pair(pair, temperature, args)
            results.append(result)
            print(f"{display(pair)}, T={temperature:g}: loop share {result['loop_share']:.1%}")
            print(markdown_table(result["rows"], list(result["rows"][0])))
        print(f"wrote {display(write_pair(pair, results, args))}")


if __name__ == "__main__":
    main()
