"""Tiny random models in the exact formats SGLang loads: a Qwen3 target and its DFlash drafter.

Nothing can be downloaded here, so tests make their own: a byte-level BPE tokenizer trained
offline on real text (the Python standard library's sources) with a chat template and the
drafter's mask token, a randomly initialised Qwen3 causal LM (HF config.json +
model.safetensors) and a randomly initialised DFlash drafter in the z-lab format
(``DFlashDraftModel``, ``dflash_config.mask_token_id`` / ``target_layer_ids``, ``block_size``).
"""

from __future__ import annotations

import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TinyShape:
    """Sizes of a tiny Qwen3-architecture model."""

    hidden: int = 64
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 128
    max_positions: int = 2048


def stdlib_text(max_chars: int = 400_000) -> str:
    """Real code text: the first files of the Python standard library, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="ignore")
        parts.append(text)
        size += len(text)
        if size >= max_chars:
            break
    return "\n".join(parts)


def write_tokenizer(out: Path, vocab_size: int = 512) -> int:
    """Train a byte-level BPE on stdlib code, save it with its chat template; return its size."""
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
    tok.train_from_iterator([stdlib_text()], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>", "<|MASK|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return tok.get_vocab_size()


def qwen3_config(shape: TinyShape, vocab: int, **extra: object) -> dict[str, object]:
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


def _layer_weights(prefix: str, shape: TinyShape, gen: torch.Generator) -> dict[str, torch.Tensor]:
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


def _save(out: Path, config: dict[str, object], weights: dict[str, torch.Tensor]) -> Path:
    """Write config.json and model.safetensors (bfloat16) into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in weights.items()},
        out / "model.safetensors",
    )
    return out


def write_target(
    out: Path,
    shape: TinyShape = TinyShape(),
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
    return _save(out, qwen3_config(shape, vocab), weights)


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
    shape = TinyShape(hidden=hidden or int(target_cfg["hidden_size"]), layers=layers)
    gen = torch.Generator().manual_seed(seed)
    taps = len(target_layer_ids)
    weights = {
        "fc.weight": torch.randn(shape.hidden, taps * shape.hidden, generator=gen) * 0.08,
        "hidden_norm.weight": torch.ones(shape.hidden),
        "norm.weight": torch.ones(shape.hidden),
    }
    for i in range(layers):
        weights |= _layer_weights(f"layers.{i}", shape, gen)
    config = qwen3_config(
        shape,
        vocab or int(target_cfg["vocab_size"]),
        architectures=["DFlashDraftModel"],
        block_size=block_size,
        num_target_layers=int(target_cfg["num_hidden_layers"]),
        dflash_config={"mask_token_id": mask_id, "target_layer_ids": list(target_layer_ids)},
    )
    return _save(out, config, weights)
