"""Tiny random models in the exact formats SGLang loads: a Qwen3 target and its DFlash drafter.

Nothing can be downloaded here, so tests make their own: a byte-level BPE tokenizer trained
offline on real text (the Python standard library's sources) with a chat template and the
drafter's mask token, a randomly initialised Qwen3 causal LM (HF config.json +
model.safetensors) and a randomly initialised DFlash drafter in the z-lab format
(``DFlashDraftModel``, ``dflash_config.mask_token_id`` / ``target_layer_ids``, ``block_size``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from training.corpus import read_texts, stdlib_files, stdlib_root
from training.formats import (
    Qwen3Shape,
    drafter_config,
    qwen3_config,
    save_model,
    train_tokenizer,
)

TINY_SHAPE = Qwen3Shape()


def stdlib_text(max_chars: int = 400_000) -> str:
    """Real code text: the first files of the Python standard library, sorted by name."""
    root = stdlib_root()
    names = [n for n in stdlib_files(root) if "/" not in n]
    return "\n".join(read_texts(root, names, max_chars))


def write_tokenizer(out: Path, vocab_size: int = 512) -> int:
    """Train a byte-level BPE on stdlib code into ``out``; return its size."""
    return train_tokenizer([stdlib_text()], out, vocab_size)


def _layer_weights(prefix: str, shape: Qwen3Shape, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random weights of one Qwen3 decoder layer under HF names."""
    h, q, kv, f = (
        shape.hidden,
        shape.heads * shape.head_dim,
        shape.kv_heads * shape.head_dim,
        shape.intermediate,
    )

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen) * 0.08

    return {
        f"{prefix}.self_attn.q_proj.weight": rand(q, h),
        f"{prefix}.self_attn.k_proj.weight": rand(kv, h),
        f"{prefix}.self_attn.v_proj.weight": rand(kv, h),
        f"{prefix}.self_attn.o_proj.weight": rand(h, q),
        f"{prefix}.self_attn.q_norm.weight": torch.ones(shape.head_dim),
        f"{prefix}.self_attn.k_norm.weight": torch.ones(shape.head_dim),
        f"{prefix}.mlp.gate_proj.weight": rand(f, h),
        f"{prefix}.mlp.up_proj.weight": rand(f, h),
        f"{prefix}.mlp.down_proj.weight": rand(h, f),
        f"{prefix}.input_layernorm.weight": torch.ones(h),
        f"{prefix}.post_attention_layernorm.weight": torch.ones(h),
    }


def write_target(
    out: Path,
    shape: Qwen3Shape = TINY_SHAPE,
    seed: int = 0,
    few_tokens: tuple[int, ...] | None = None,
) -> Path:
    """A random tiny Qwen3 target with its tokenizer in ``out``.

    With ``few_tokens`` (an even number of ids), the LM head can only ever prefer one of them
    (pairs of rows u and -u, all other rows zero, so the best logit is never negative): a
    drafter sharing that head proposes the target's tokens often, which exercises acceptance
    of deep tree paths with random weights.
    """
    vocab = write_tokenizer(out)
    gen = torch.Generator().manual_seed(seed)
    lm_head = torch.randn(vocab, shape.hidden, generator=gen) * 0.5
    if few_tokens is not None:
        lm_head = torch.zeros(vocab, shape.hidden)
        for plus, minus in zip(few_tokens[::2], few_tokens[1::2], strict=True):
            direction = torch.randn(shape.hidden, generator=gen)
            lm_head[plus], lm_head[minus] = direction, -direction
    weights = {
        "model.embed_tokens.weight": torch.randn(vocab, shape.hidden, generator=gen) * 0.5,
        "model.norm.weight": torch.ones(shape.hidden),
        "lm_head.weight": lm_head,
    }
    for i in range(shape.layers):
        weights |= _layer_weights(f"model.layers.{i}", shape, gen)
    return save_model(out, qwen3_config(shape, vocab), weights)


def write_drafter(
    out: Path,
    target: Path,
    *,
    layers: int = 2,
    block_size: int = 8,
    target_layer_ids: tuple[int, ...] = (0, 2),
    hidden: int | None = None,
    vocab: int | None = None,
    seed: int = 1,
) -> Path:
    """A random DFlash drafter for ``target`` in the z-lab format (hidden/vocab overridable)."""
    target_cfg = json.loads((target / "config.json").read_text())
    from transformers import AutoTokenizer

    mask_id = AutoTokenizer.from_pretrained(target).convert_tokens_to_ids("<|MASK|>")
    shape = Qwen3Shape(hidden=hidden or int(target_cfg["hidden_size"]), layers=layers)
    gen = torch.Generator().manual_seed(seed)
    taps = len(target_layer_ids)
    weights = {
        "fc.weight": torch.randn(shape.hidden, taps * shape.hidden, generator=gen) * 0.08,
        "hidden_norm.weight": torch.ones(shape.hidden),
        "norm.weight": torch.ones(shape.hidden),
    }
    for i in range(layers):
        weights |= _layer_weights(f"layers.{i}", shape, gen)
    config = drafter_config(
        shape,
        vocab or int(target_cfg["vocab_size"]),
        block_size=block_size,
        num_target_layers=int(target_cfg["num_hidden_layers"]),
        mask_token_id=mask_id,
        target_layer_ids=target_layer_ids,
    )
    return save_model(out, config, weights)
