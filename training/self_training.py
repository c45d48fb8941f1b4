"""Self-training of the target on its own loop-free greedy continuations.

A 5M-parameter target at 4 nats per token of code is unsure of almost every token it writes
(after unlikelihood against its loops, the probability of its own greedy token averages 0.1),
so no drafter can follow its greedy path far. Large models are sure of most of what they
write. Self-training closes that gap the way it works for real models (Xie et al. 2020,
"Self-training with Noisy Student"; He et al. 2020, "Revisiting Self-Training for Neural
Sequence Generation"): in each round the target continues training prompts greedily, the
continuations that copy a run of tokens from one period back are dropped, and the target is
trained on the rest, beside next-token loss on real text and unlikelihood against its current
loops (`training.unlikelihood`). It grows sure of what it writes while its greedy output stays
free of loops, and real text keeps it a model of its corpus.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import Qwen3ForCausalLM

from training.schedule import cosine_lr
from training.target import greedy
from training.unlikelihood import Continuations, repeat_mask, unlikelihood_loss, windows


def loop_free_continuations(
    model: Qwen3ForCausalLM, prompts: torch.Tensor, continuation: int, run: int
) -> torch.Tensor:
    """[S, P + C] the prompts' greedy continuations that copy no run of ``run`` tokens."""
    model.eval()
    rows = torch.cat([greedy(model, chunk, continuation) for chunk in prompts.split(64)])
    return rows[~repeat_mask(rows, prompts.shape[1], run).any(1)]


def continuation_loss(model: Qwen3ForCausalLM, rows: torch.Tensor, prompt_len: int):
    """Mean next-token loss of ``rows``' continuation tokens (their prompts are context)."""
    logits = model(input_ids=rows[:, :-1]).logits[:, prompt_len - 1 :].float()  # [b, C, V]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, prompt_len:].reshape(-1))


def train_self(
    model: Qwen3ForCausalLM,
    stream: torch.Tensor,
    gen: torch.Generator,
    *,
    rounds: int,
    steps: int,
    lr: float,
    prompts: int,
    real_share: float,
    draw: Continuations,
    log: list[dict],
) -> Qwen3ForCausalLM:
    """``model`` self-trained for ``rounds`` rounds of ``steps`` steps (module docstring).

    ``prompts``: training prompts continued per round; ``real_share``: the weight of real
    text's next-token loss against the loss on the model's own continuations.
    """
    prompt_len, continuation, run = draw.prompt_len, draw.continuation, draw.run
    batch, refresh, seq_len = draw.batch, draw.refresh, draw.seq_len
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    for round_ in range(rounds):
        own = loop_free_continuations(
            model, windows(stream, prompts, prompt_len, gen), continuation, run
        )  # [S, P + C]
        if not len(own):
            raise RuntimeError(
                f"self-training round {round_ + 1}: every greedy continuation loops; train "
                "the target with more unlikelihood steps first (recipe unlikelihood_steps)"
            )
        bar = tqdm(range(steps), desc=f"target self-training {round_ + 1}/{rounds}", unit="step")
        for step in bar:
            if step % refresh == 0:  # the model's loops as it is now
                model.eval()
                starts = windows(stream, batch * refresh, prompt_len, gen)
                pool = greedy(model, starts, continuation)  # [batch * refresh, P + C]
                marks = repeat_mask(pool, prompt_len, run)
            model.train()
            for group in opt.param_groups:
                group["lr"] = cosine_lr(step, steps, lr, warmup=10)
            mine = own[torch.randint(len(own), (batch,), generator=gen)]
            text = windows(stream, batch, seq_len, gen)
            self_loss = continuation_loss(model, mine, prompt_len)
            nll = model(input_ids=text, labels=text).loss
            rows = slice((step % refresh) * batch, (step % refresh + 1) * batch)
            ul = unlikelihood_loss(model, pool[rows], marks[rows])
            ((1 - real_share) * self_loss + real_share * nll + ul).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            bar.set_postfix(own=f"{self_loss.item():.3f}", nll=f"{nll.item():.3f}")
            if step % 40 == 0 or step == steps - 1:
                log.append({
                    "stage": "self-training", "round": round_, "step": step, "kept": len(own),
                    "own": round(self_loss.item(), 4), "loss": round(nll.item(), 4),
                    "unlikelihood": round(ul.item(), 4),
                })  # fmt: skip
    return model.eval()
