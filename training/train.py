"""Train a target/drafter pair from scratch on the standard library's code.

python -m training.train [--recipe tiny|b16] [--out DIR] [--seed 0] [--quick]

One command, deterministic from ``--seed`` on a given machine kind (bfloat16 autocast on two
CPU cores). Two recipes:

- ``tiny`` (``training/pair``, about 15 minutes): a 4-layer target (5.2M parameters) on the
  first 12M characters of the training files, a block-8 drafter on greedy continuations;
- ``b16`` (``training/pair-b16``, about 70 minutes): the tiny pair's target fine-tuned over every
  training file with unlikelihood against its greedy loops (``training.unlikelihood``),
  self-trained on its loop-free continuations (``training.self_training``), and a block-16
  drafter on greedy and temperature-1 continuations.

Four stages:

1. tokenizer: byte-level BPE (4096 tokens) on the training files, chat template, mask token;
2. target: a Qwen3 causal LM trained on the training files (for ``b16``: next-token loss on
   them plus unlikelihood on the tokens of its own greedy continuations that copy the stretch
   just before them);
3. distillation data: the target's own continuations of prompts cut from the training files
   (greedy, and for ``b16`` also sampled at temperature 1), so the drafter learns what the
   target says, its distribution and not only its argmax;
4. drafter: a 2-layer DFlash drafter (taps after three target layers), trained with the DFlash
   objective on the target's frozen hidden states: from the context features of every token
   before an anchor p and the block [x_p, MASK x (L-1)], predict x_{p+1..p+L-1} at all masked
   positions in one non-causal pass (cross-entropy through the target's LM head, weighted
   towards early positions). Its layers start as copies of the target's last two.

The target's and drafter's directories (in the formats SGLang loads) and ``training.json``
(the recipe, losses and stage times) go under ``--out``. Held-out files are never read.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch.nn import functional as F
from tqdm import tqdm
from transformers import PreTrainedTokenizerBase, Qwen3ForCausalLM

from training.corpus import read_texts, split_files, stdlib_files, stdlib_root
from training.drafter import DFlashDrafter
from training.formats import (
    MASK_TOKEN,
    Qwen3Shape,
    drafter_config,
    qwen3_config,
    save_model,
    train_tokenizer,
)
from training.schedule import cosine_lr
from training.self_training import train_self
from training.target import features, greedy, load_target, new_target, sample
from training.unlikelihood import Continuations, train_unlikelihood, windows

HELD_OUT_PERCENT = 10
TRAINING = Path(__file__).resolve().parent
TARGET_SHAPE = Qwen3Shape(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, intermediate=768)


@dataclass(frozen=True)
class Recipe:
    """Every size and step count of one training run (the defaults: the tiny pair)."""

    vocab: int = 4096
    target: Qwen3Shape = TARGET_SHAPE
    drafter_layers: int = 2
    block_size: int = 8
    taps: tuple[int, ...] = (0, 1, 2)
    corpus_chars: int = 12_000_000
    seq_len: int = 256
    target_steps: int = 800
    target_batch: int = 16
    target_lr: float = 2e-3
    distill_sequences: int = 2048
    prompt_len: int = 64
    continuation: int = 192
    drafter_steps: int = 1600
    drafter_batch: int = 8
    anchors: int = 24
    drafter_lr: float = 1.5e-3
    decay: float = 4.0  # loss weight of block position k: exp(-(k - 1) / decay)
    sampled_share: float = 0.0  # share of distillation continuations sampled at temperature 1
    cache_features: bool = False  # the target's features of the distillation data kept once
    bf16: bool = True  # bfloat16 autocast (fast only on CPUs with native bfloat16 matmuls)
    threads: int = 2
    init_from: str = ""  # a pair under training/ whose tokenizer and target this one starts from
    unlikelihood_steps: int = 0  # steps of unlikelihood fine-tuning against greedy loops
    unlikelihood_lr: float = 5e-4
    unlikelihood_run: int = 12  # a continuation token copying this many tokens one period back
    unlikelihood_batch: int = 8  # rows of real text and of greedy continuations per step
    unlikelihood_refresh: int = 4  # steps between fresh greedy continuations
    self_rounds: int = 0  # rounds of self-training on the target's loop-free continuations
    self_steps: int = 120  # steps per round
    self_lr: float = 3e-4
    self_prompts: int = 512  # prompts continued per round (those that loop are dropped)
    self_continuation: int = 128  # tokens of each continuation
    self_real_share: float = 0.5  # weight of real text's next-token loss (the rest: own text)

    def quick(self) -> Recipe:
        """A few steps of everything, to check the pipeline (not a usable pair)."""
        small = {"corpus_chars": 400_000, "seq_len": 128, "target_steps": 2, "target_batch": 4}
        small |= {"distill_sequences": 8, "continuation": 32, "drafter_steps": 2, "anchors": 4}
        small |= {"unlikelihood_steps": min(self.unlikelihood_steps, 2), "unlikelihood_refresh": 1}
        small |= {"self_rounds": min(self.self_rounds, 1), "self_steps": 2, "self_prompts": 8}
        small |= {"self_continuation": 32}
        return Recipe(**{**asdict(self), **small, "target": self.target})


RECIPES = {
    "tiny": Recipe(),
    # The tiny target fine-tuned over every training file in float32 (this project's CPU has
    # no native bfloat16 matmuls) with unlikelihood against its greedy loops, self-trained on
    # its loop-free continuations until it is sure of what it writes, then a block-16
    # drafter on greedy and sampled continuations.
    "b16": Recipe(
        block_size=16,
        corpus_chars=40_000_000,
        target_steps=0,
        unlikelihood_steps=450,
        unlikelihood_lr=6e-4,
        self_rounds=8,
        distill_sequences=2048,
        drafter_steps=1800,
        anchors=16,
        decay=7.0,
        sampled_share=0.25,
        cache_features=True,
        bf16=False,
        init_from="pair",
    ),
}
PAIR_DIRS = {"tiny": "pair", "b16": "pair-b16"}


def autocast(recipe: Recipe) -> torch.autocast:
    """The recipe's autocast context: bfloat16 or off."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=recipe.bf16)


def copy_tokenizer(source: Path, out: Path) -> int:
    """Copy the tokenizer files of the target at ``source`` into ``out``; its size."""
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(source.iterdir()):
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            shutil.copyfile(f, out / f.name)
    return len(AutoTokenizer.from_pretrained(out))


def token_stream(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> torch.Tensor:
    """[T] every text's tokens, each followed by the end-of-text token."""
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids: list[int] = []
    for text in texts:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
    return torch.tensor(ids, dtype=torch.long)


def train_target(
    recipe: Recipe, stream: torch.Tensor, gen: torch.Generator, log: list[dict]
) -> Qwen3ForCausalLM:
    """The target trained by next-token prediction on random windows of ``stream``."""
    model = new_target(
        recipe.target, recipe.vocab, seed=int(torch.randint(1 << 30, (1,), generator=gen))
    )
    if recipe.init_from:
        start = load_target(TRAINING / recipe.init_from / "target")
        model.load_state_dict(start.state_dict())
    opt = torch.optim.AdamW(
        model.parameters(), lr=recipe.target_lr, weight_decay=0.1, betas=(0.9, 0.95)
    )
    model.train()
    bar = tqdm(range(recipe.target_steps), desc="target", unit="step")
    for step in bar:
        starts = torch.randint(
            len(stream) - recipe.seq_len - 1, (recipe.target_batch,), generator=gen
        )
        batch = torch.stack([stream[s : s + recipe.seq_len] for s in starts.tolist()])
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, recipe.target_steps, recipe.target_lr)
        with autocast(recipe):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if step % 50 == 0 or step == recipe.target_steps - 1:
            log.append({"stage": "target", "step": step, "loss": round(loss.item(), 4)})
    return model.eval()


@torch.no_grad()
def distill_data(
    recipe: Recipe, model: Qwen3ForCausalLM, stream: torch.Tensor, gen: torch.Generator
) -> torch.Tensor:
    """[S, P + C] prompts from ``stream`` followed by the target's own continuations.

    The first ``1 - sampled_share`` of the rows are greedy, the rest sampled at temperature 1.
    """
    prompts = windows(stream, recipe.distill_sequences, recipe.prompt_len, gen)  # [S, P]
    num_greedy = round(len(prompts) * (1 - recipe.sampled_share))
    seed = int(torch.randint(1 << 30, (1,), generator=gen)) if num_greedy < len(prompts) else 0
    greedy_rows, sampled_rows = prompts[:num_greedy], prompts[num_greedy:]
    chunks = [(chunk, True) for chunk in greedy_rows.split(64) if len(chunk)]
    chunks += [(chunk, False) for chunk in sampled_rows.split(64) if len(chunk)]
    out = []
    for i, (chunk, is_greedy) in enumerate(tqdm(chunks, desc="distillation data", unit="batch")):
        with autocast(recipe):
            if is_greedy:
                out.append(greedy(model, chunk, recipe.continuation))
            else:
                out.append(sample(model, chunk, recipe.continuation, seed=seed + i))
    return torch.cat(out)


@torch.no_grad()
def context_features(recipe: Recipe, target: Qwen3ForCausalLM, data: torch.Tensor) -> torch.Tensor:
    """[S, T, taps*H] the target's context features of every distillation row."""
    out = []
    for chunk in tqdm(data.split(32), desc="target features", unit="batch"):
        with autocast(recipe):
            out.append(features(target, chunk, list(recipe.taps))[1].float())
    return torch.cat(out)


def drafter_from_target(recipe: Recipe, target: Qwen3ForCausalLM, mask_id: int) -> DFlashDrafter:
    """A drafter whose layers start as copies of the target's last layers."""
    shape = Qwen3Shape(**{**asdict(recipe.target), "layers": recipe.drafter_layers})
    cfg = drafter_config(
        shape, recipe.vocab, block_size=recipe.block_size, num_target_layers=recipe.target.layers,
        mask_token_id=mask_id, target_layer_ids=recipe.taps,
    )  # fmt: skip
    drafter = DFlashDrafter(cfg)
    source = target.model.layers[-recipe.drafter_layers :]
    for mine, theirs in zip(drafter.layers, source, strict=True):
        mine.load_state_dict(theirs.state_dict())
    return drafter


def block_loss(
    recipe: Recipe,
    drafter: DFlashDrafter,
    target,
    seqs: torch.Tensor,
    gen: torch.Generator,
    feats: torch.Tensor | None = None,
) -> torch.Tensor:
    """The DFlash objective on random anchors in the continuation part of ``seqs``.

    ``feats`` are the target's context features of ``seqs`` when cached; else computed here.
    """
    b, length = seqs.shape
    block = recipe.block_size
    if feats is None:
        with torch.no_grad(), autocast(recipe):
            _, feats = features(target, seqs, list(recipe.taps))
    low, high = recipe.prompt_len, length - block
    anchors = torch.randint(low, high + 1, (b, recipe.anchors), generator=gen)  # [b, A]
    idx = anchors.unsqueeze(-1) + torch.arange(block)  # [b, A, B]
    labels = seqs.gather(1, idx.view(b, -1)).view(b, recipe.anchors, block)
    block_ids = torch.full_like(labels, drafter.mask_token_id)
    block_ids[..., 0] = labels[..., 0]
    embed = target.model.embed_tokens
    with autocast(recipe):
        ctx = drafter.context(feats.float())
        hidden = drafter(ctx, embed(block_ids).detach(), anchors)  # [b, A, B, H]
        logits = target.lm_head(hidden[:, :, 1:])  # [b, A, B-1, V]
    ce = F.cross_entropy(logits.float().flatten(0, 2), labels[..., 1:].flatten(), reduction="none")
    weights = torch.exp(-torch.arange(block - 1, dtype=torch.float32) / recipe.decay)
    ce = ce.view(b, recipe.anchors, block - 1)
    return (ce * weights).sum(-1).mean() / weights.sum()


def train_drafter(
    recipe: Recipe,
    drafter: DFlashDrafter,
    target: Qwen3ForCausalLM,
    data: torch.Tensor,
    gen: torch.Generator,
    log: list[dict],
) -> DFlashDrafter:
    """The drafter trained on the distillation data with the target frozen."""
    for p in target.parameters():
        p.requires_grad_(False)
    cache = context_features(recipe, target, data) if recipe.cache_features else None
    opt = torch.optim.AdamW(
        drafter.parameters(), lr=recipe.drafter_lr, weight_decay=0.01, betas=(0.9, 0.95)
    )
    drafter.train()
    bar = tqdm(range(recipe.drafter_steps), desc="drafter", unit="step")
    for step in bar:
        rows = torch.randint(len(data), (recipe.drafter_batch,), generator=gen)
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, recipe.drafter_steps, recipe.drafter_lr)
        feats = None if cache is None else cache[rows]
        loss = block_loss(recipe, drafter, target, data[rows], gen, feats)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if step % 50 == 0 or step == recipe.drafter_steps - 1:
            log.append({"stage": "drafter", "step": step, "loss": round(loss.item(), 4)})
    return drafter.eval()


def train_pair(out: Path, recipe: Recipe, seed: int) -> dict:
    """Train tokenizer, target and drafter into ``out``/{target,drafter}; a summary."""
    from transformers import AutoTokenizer

    torch.manual_seed(seed)
    random.seed(seed)
    torch.set_num_threads(recipe.threads)
    gen = torch.Generator().manual_seed(seed)
    times: dict[str, float] = {}
    log: list[dict] = []
    root = stdlib_root()
    train_names, held_names = split_files(stdlib_files(root), HELD_OUT_PERCENT)
    texts = read_texts(root, train_names, recipe.corpus_chars)
    target_dir, drafter_dir = out / "target", out / "drafter"

    start = time.perf_counter()
    if recipe.init_from:
        vocab = copy_tokenizer(TRAINING / recipe.init_from / "target", target_dir)
    else:
        vocab = train_tokenizer(texts, target_dir, recipe.vocab)
    assert vocab == recipe.vocab, f"tokenizer has {vocab} tokens, the recipe {recipe.vocab}"
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    stream = token_stream(tokenizer, texts)
    times["tokenizer_s"] = time.perf_counter() - start

    start = time.perf_counter()
    target = train_target(recipe, stream, gen, log)
    draw = Continuations(
        prompt_len=recipe.prompt_len, continuation=recipe.continuation,
        run=recipe.unlikelihood_run, batch=recipe.unlikelihood_batch,
        refresh=recipe.unlikelihood_refresh, seq_len=recipe.seq_len,
    )  # fmt: skip
    if recipe.unlikelihood_steps:
        target = train_unlikelihood(
            target, stream, gen, steps=recipe.unlikelihood_steps, lr=recipe.unlikelihood_lr,
            draw=draw, log=log,
        )  # fmt: skip
    if recipe.self_rounds:
        target = train_self(
            target, stream, gen, rounds=recipe.self_rounds, steps=recipe.self_steps,
            lr=recipe.self_lr, prompts=recipe.self_prompts, real_share=recipe.self_real_share,
            draw=replace(draw, continuation=recipe.self_continuation), log=log,
        )  # fmt: skip
    save_model(target_dir, qwen3_config(recipe.target, vocab), target.state_dict())
    times["target_s"] = time.perf_counter() - start

    start = time.perf_counter()
    data = distill_data(recipe, target, stream, gen)
    times["distill_s"] = time.perf_counter() - start

    start = time.perf_counter()
    drafter = drafter_from_target(recipe, target, tokenizer.convert_tokens_to_ids(MASK_TOKEN))
    drafter = train_drafter(recipe, drafter, target, data, gen, log)
    save_model(drafter_dir, drafter.config, drafter.state_dict())
    times["drafter_s"] = time.perf_counter() - start

    summary = {
        "command": " ".join(["python -m training.train", *sys.argv[1:]]),
        "seed": seed,
        "recipe": asdict(recipe),
        "train_files": len(train_names),
        "held_out_files": len(held_names),
        "train_tokens": len(stream),
        "target_params": sum(p.numel() for p in target.parameters()),
        "drafter_params": sum(p.numel() for p in drafter.parameters()),
        "times_s": {k: round(v, 1) for k, v in times.items()},
        "log": log,
    }
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="tiny")
    parser.add_argument("--out", type=Path, help="default: training/pair (tiny), pair-b16 (b16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a few steps (pipeline check)")
    return parser.parse_args()


def main() -> None:
    """Train the pair and print where it went."""
    args = parse_args()
    recipe = RECIPES[args.recipe].quick() if args.quick else RECIPES[args.recipe]
    args.out = args.out or TRAINING / PAIR_DIRS[args.recipe]
    summary = train_pair(args.out, recipe, args.seed)
    print(json.dumps({k: v for k, v in summary.items() if k != "log"}, indent=2))
    print(f"target: {args.out / 'target'}\ndrafter: {args.out / 'drafter'}")


if __name__ == "__main__":
    main()
