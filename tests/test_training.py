"""The shipped trained pairs and their training command: formats, determinism, quality."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from training.drafter import DFlashDrafter
from training.target import features, load_target

ROOT = Path(__file__).resolve().parent.parent
PAIR = ROOT / "training" / "pair"
PAIRS = [PAIR, ROOT / "training" / "pair-b16"]
BLOCKS = {"pair": 8, "pair-b16": 16}
each_pair = pytest.mark.parametrize("pair", PAIRS, ids=lambda p: p.name)


@each_pair
def test_the_shipped_pair_is_in_the_formats_sglang_loads(pair):
    target = json.loads((pair / "target" / "config.json").read_text())
    drafter = json.loads((pair / "drafter" / "config.json").read_text())
    assert target["architectures"] == ["Qwen3ForCausalLM"] and target["num_hidden_layers"] >= 4
    assert drafter["architectures"] == ["DFlashDraftModel"]
    assert drafter["block_size"] == BLOCKS[pair.name]
    assert drafter["dflash_config"]["target_layer_ids"]
    assert drafter["hidden_size"] == target["hidden_size"]
    assert (pair / "target" / "tokenizer.json").is_file()
    recorded = json.loads((pair / "training.json").read_text())
    assert recorded["recipe"]["block_size"] == drafter["block_size"]


@each_pair
def test_the_shipped_pair_stays_small(pair):
    size = sum(f.stat().st_size for f in pair.rglob("*") if f.is_file())
    assert size < 30e6


@each_pair
def test_the_drafter_module_loads_the_checkpoint_names_exactly(pair):
    names = set(load_file(pair / "drafter" / "model.safetensors"))
    assert names == set(DFlashDrafter.load(pair / "drafter").state_dict())


@each_pair
def test_the_drafter_predicts_the_targets_next_tokens_on_held_out_code(pair):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pair / "target")
    target, drafter = load_target(pair / "target"), DFlashDrafter.load(pair / "drafter").eval()
    text = "import os\n\n\ndef join_all(parts):\n    result = []\n    for part in parts:\n"
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    block = drafter.block_size
    with torch.no_grad():
        seq = target.generate(input_ids=ids, max_new_tokens=48, do_sample=False, pad_token_id=0)
        _, feats = features(target, seq, drafter.target_layer_ids)
        anchors = ids.shape[1] + torch.arange(0, 32, 4).unsqueeze(0)  # [1, A]: 8 blocks
        ids_in = torch.full((1, anchors.shape[1], block), drafter.mask_token_id)
        ids_in[0, :, 0] = seq[0, anchors[0]]
        hidden = drafter(drafter.context(feats), target.model.embed_tokens(ids_in), anchors)
        guess = target.lm_head(hidden[0, :, 1:]).argmax(-1)  # [A, L-1]
    truth = seq[0, anchors[0].unsqueeze(1) + torch.arange(1, block)]
    # a trained drafter, not a random one (chance: 1 in 4096); the tiny pair's gets 75%
    assert (guess == truth).float().mean() > 0.05


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tiny", "b16"])
def test_training_is_deterministic_from_the_seed(tmp_path, recipe):
    def train(out: Path) -> tuple[bytes, bytes]:
        command = [sys.executable, "-m", "training.train", "--quick", "--recipe", recipe]
        subprocess.run([*command, "--out", str(out), "--seed", "3"], check=True, cwd=ROOT,
                       capture_output=True, timeout=300)  # fmt: skip
        return tuple((out / m / "model.safetensors").read_bytes() for m in ("target", "drafter"))

    assert train(tmp_path / "a") == train(tmp_path / "b")


class _Idle:
    """A stand-in model for the self-training filter (greedy is replaced below)."""

    def eval(self) -> _Idle:
        return self


def _continuations(monkeypatch, rows: torch.Tensor) -> None:
    """Make the stage's greedy decoding return ``rows`` (prompt + continuation each)."""
    from training import self_training

    monkeypatch.setattr(self_training, "greedy", lambda model, prompts, new: rows)


def test_self_training_keeps_only_the_continuations_that_do_not_loop(monkeypatch):
    from training.self_training import loop_free_continuations

    prompt = torch.arange(8).repeat(2, 1)  # [2, P]
    varied = torch.arange(100, 140)  # 40 distinct tokens
    looped = torch.tensor([7, 8, 9, 10, 11]).repeat(8)  # a period-5 loop of 40 tokens
    rows = torch.stack([torch.cat([prompt[0], varied]), torch.cat([prompt[1], looped])])
    _continuations(monkeypatch, rows)
    kept = loop_free_continuations(_Idle(), prompt, continuation=40, run=12)
    assert kept.tolist() == rows[:1].tolist()


def test_a_self_training_round_whose_continuations_all_loop_names_the_fix(monkeypatch):
    from training.self_training import train_self
    from training.unlikelihood import Continuations

    looped = torch.tensor([3, 4]).repeat(1, 30)  # [1, 60]: prompt and continuation loop
    _continuations(monkeypatch, looped)
    model = load_target(PAIR / "target")
    with pytest.raises(RuntimeError, match="more unlikelihood steps"):
        train_self(
            model, torch.arange(500), torch.Generator().manual_seed(0), rounds=1, steps=1,
            lr=1e-4, prompts=1, real_share=0.5, log=[],
            draw=Continuations(prompt_len=8, continuation=52, run=12, batch=1, refresh=1,
                               seq_len=16),
        )  # fmt: skip
