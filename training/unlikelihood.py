"""Unlikelihood fine-tuning of the target against its own greedy loops.

A small language model's greedy continuations fall into loops: a stretch of tokens copied
from just before it, over and over (Holtzman et al. 2020). Large models rarely do, and a pair
whose target loops is easy to draft for, so it overstates what a tree wins. Sequence-level
unlikelihood training (Welleck et al. 2020, "Neural Text Generation with Unlikelihood
Training") removes the loops at their source: the target continues training prompts
greedily, and every continuation token that extends a run of ``run`` or more tokens equal to
the tokens one period earlier gets the loss -log(1 - p(token)), beside the usual
next-token loss on real text. The target stays a language model of its corpus; it only learns
that copying the stretch it has just written is unlikely.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm import tqdm
from transformers import Qwen3ForCausalLM

from training.schedule import cosine_lr
from training.target import greedy

MAX_PERIOD = 64  # the longest period a loop is looked for at (the acceptance benchmark's)


def repeat_mask(seqs: torch.Tensor, first: int, run: int, max_period: int = MAX_PERIOD):
    """[b, T] whether token t >= ``first`` ends a run of >= ``run`` tokens equal to those one
    period p <= ``max_period`` earlier."""
    b, length = seqs.shape
    mask = torch.zeros(b, length, dtype=torch.bool)
    for period in range(1, min(max_period, length - 1) + 1):
        same = torch.zeros(b, length + 1, dtype=torch.long)  # [b, T+1], a leading zero
        same[:, 1 + period :] = (seqs[:, period:] == seqs[:, :-period]).long()
        counts = same.cumsum(1)  # counts[:, t+1]: equal positions up to t
        ends = torch.zeros(b, length, dtype=torch.bool)
        ends[:, run - 1 :] = (counts[:, run:] - counts[:, :-run]) >= run
        mask |= ends
    mask[:, :first] = False
    return mask


def unlikelihood_loss(model: Qwen3ForCausalLM, seqs: torch.Tensor, mask: torch.Tensor):
    """Mean of -log(1 - p(token)) over the tokens of ``seqs`` that ``mask`` marks."""
    logits = model(input_ids=seqs).logits[:, :-1].float()  # [b, T-1, V]
    p = torch.softmax(logits, -1).gather(-1, seqs[:, 1:, None])[..., 0]  # [b, T-1]
    marked = mask[:, 1:]
    penalty = -torch.log1p(-p.clamp(max=1 - 1e-6))
    return (penalty * marked).sum() / marked.sum().clamp(min=1)


def windows(stream: torch.Tensor, count: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """[count, length] random windows of ``stream``."""
    starts = torch.randint(len(stream) - length, (count,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


@dataclass(frozen=True)
class Continuations:
    """How a stage draws the target's greedy continuations and its rows of real text."""

    prompt_len: int  # P: tokens of each training prompt
    continuation: int  # C: greedy tokens after it
    run: int  # a continuation token copying this many tokens one period back is a loop
    batch: int  # rows of real text and of continuations per step
    refresh: int  # steps between fresh continuations of the model as it is then
    seq_len: int  # tokens of each row of real text


def train_unlikelihood(
    model: Qwen3ForCausalLM,
    stream: torch.Tensor,
    gen: torch.Generator,
    *,
    steps: int,
    lr: float,
    draw: Continuations,
    log: list[dict],
) -> Qwen3ForCausalLM:
    """``model`` fine-tuned by next-token loss on ``stream`` plus unlikelihood on its loops."""
    prompt_len, continuation, run = draw.prompt_len, draw.continuation, draw.run
    batch, refresh, seq_len = draw.batch, draw.refresh, draw.seq_len
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    pool = marks = None
    bar = tqdm(range(steps), desc="target unlikelihood", unit="step")
    for step in bar:
        if step % refresh == 0:  # fresh greedy continuations of the model as it is now
            model.eval()
            pool = greedy(model, windows(stream, batch * refresh, prompt_len, gen), continuation)
            # pool: [R, P + C]
            marks = repeat_mask(pool, prompt_len, run)  # [R, P + C]
        model.train()
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, steps, lr, warmup=10)
        text = windows(stream, batch, seq_len, gen)
        rows = torch.randint(len(pool), (batch,), generator=gen)
        nll = model(input_ids=text, labels=text).loss
        ul = unlikelihood_loss(model, pool[rows], marks[rows])
        (nll + ul).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        bar.set_postfix(nll=f"{nll.item():.3f}", ul=f"{ul.item():.3f}")
        if step % 50 == 0 or step == steps - 1:
            row = {"stage": "unlikelihood", "step": step, "loss": round(nll.item(), 4)}
            log.append(row | {"unlikelihood": round(ul.item(), 4)})
    return model.eval()
