"""The on-disk formats SGLang loads: an HF Qwen3 target, a z-lab DFlash drafter, a tokenizer.

Target: ``config.json`` (``Qwen3ForCausalLM``) + ``model.safetensors`` + tokenizer files.
Drafter: ``config.json`` with ``architectures=["DFlashDraftModel"]``, ``block_size``,
``num_target_layers`` and ``dflash_config = {mask_token_id, target_layer_ids}``, weights named
``fc.weight``, ``hidden_norm.weight``, ``norm.weight`` and ``layers.{i}.*`` (Qwen3 layer
names); it has no embedding or LM head of its own (it uses the target's).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

MASK_TOKEN = "<|MASK|>"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", MASK_TOKEN]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class Qwen3Shape:
    """Sizes of a small Qwen3-architecture model (target or drafter)."""

    hidden: int = 64
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 128
    max_positions: int = 2048


def train_tokenizer(texts: Iterable[str], out: Path, vocab_size: int) -> int:
    """Train a byte-level BPE with the chat template and mask token into ``out``; its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return tok.get_vocab_size()


def qwen3_config(shape: Qwen3Shape, vocab: int, **extra: object) -> dict[str, object]:
    """An HF config.json dict for a Qwen3 model of the given shape."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": shape.hidden,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "intermediate_size": shape.intermediate,
        "vocab_size": vocab,
        "max_position_embeddings": shape.max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 0,
        **extra,
    }


def drafter_config(
    shape: Qwen3Shape,
    vocab: int,
    *,
    block_size: int,
    num_target_layers: int,
    mask_token_id: int,
    target_layer_ids: Iterable[int],
) -> dict[str, object]:
    """A z-lab DFlash drafter config.json dict."""
    return qwen3_config(
        shape,
        vocab,
        architectures=["DFlashDraftModel"],
        block_size=block_size,
        num_target_layers=num_target_layers,
        dflash_config={"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)},
    )


def save_model(
    out: Path,
    config: dict[str, object],
    weights: dict[str, torch.Tensor],
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (in ``dtype``) into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in weights.items()}
    save_file(tensors, out / "model.safetensors")
    return out
