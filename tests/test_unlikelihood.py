"""Unlikelihood fine-tuning: which continuation tokens it penalises, and what the loss does."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from training.formats import Qwen3Shape
from training.target import new_target
from training.unlikelihood import repeat_mask, unlikelihood_loss

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from pair_acceptance import loops

FRESH = torch.randperm(1000, generator=torch.Generator().manual_seed(0))[:200]  # no repeats


def test_a_copied_stretch_is_marked_from_its_run_th_token_on():
    span = FRESH[:20]
    seq = torch.cat([FRESH[100:110], span, span, FRESH[130:140]]).unsqueeze(0)
    marks = repeat_mask(seq, first=0, run=12)[0]
    second = 10 + 20  # where the copy starts
    assert marks.nonzero().flatten().tolist() == list(range(second + 11, second + 20))


def test_text_without_repeats_has_no_marks():
    assert not repeat_mask(FRESH[:150].unsqueeze(0), first=0, run=12).any()


def test_the_prompt_is_never_marked():
    cycle = FRESH[:4].repeat(20).unsqueeze(0)  # period 4 from the start
    marks = repeat_mask(cycle, first=40, run=12)[0]
    assert not marks[:40].any() and marks[40:].all()


def test_every_loop_the_benchmark_counts_is_marked():
    rng = np.random.default_rng(0)
    for _ in range(200):
        period, start = int(rng.integers(1, 65)), int(rng.integers(0, 40))
        length = int(rng.integers(0, 2 * period + 16))
        body = FRESH[100 : 100 + period].repeat(length // period + 2)[: period + length]
        seq = torch.cat([FRESH[:start], body, FRESH[180:190]]).unsqueeze(0)
        if loops(seq[0].numpy()):
            assert repeat_mask(seq, first=0, run=12).any()


def tiny_model():
    shape = Qwen3Shape(hidden=32, layers=1, heads=2, kv_heads=1, head_dim=16, intermediate=64)
    return new_target(shape, vocab=64, seed=0)


def test_a_step_on_the_loss_makes_the_marked_tokens_less_likely():
    model = tiny_model()
    seq = torch.randint(64, (2, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros_like(seq, dtype=torch.bool)
    mask[:, 12:] = True

    def p_marked() -> float:
        probs = torch.softmax(model(input_ids=seq).logits[:, :-1], -1)
        return float(probs.gather(-1, seq[:, 1:, None])[..., 0][mask[:, 1:]].mean())

    with torch.no_grad():
        before = p_marked()
    unlikelihood_loss(model, seq, mask).backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    with torch.no_grad():
        assert p_marked() < before


def test_nothing_marked_costs_nothing():
    model = tiny_model()
    seq = torch.randint(64, (2, 24), generator=torch.Generator().manual_seed(2))
    loss = unlikelihood_loss(model, seq, torch.zeros_like(seq, dtype=torch.bool))
    assert float(loss) == 0.0
