"""The target side of training and offline evaluation: an HF Qwen3 causal LM.

SGLang captures a DFlash context feature of layer k "before layer k+1", which is the residual
stream after layer k: HF's ``hidden_states[k + 1]``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from training.formats import Qwen3Shape


def new_target(shape: Qwen3Shape, vocab: int, seed: int) -> Qwen3ForCausalLM:
    """A freshly initialised Qwen3 causal LM of ``shape``."""
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.intermediate,
        max_position_embeddings=shape.max_positions,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return Qwen3ForCausalLM(config)


def load_target(path: Path, dtype: torch.dtype = torch.float32) -> Qwen3ForCausalLM:
    """The target saved at ``path`` (eval mode)."""
    return Qwen3ForCausalLM.from_pretrained(path, torch_dtype=dtype).eval()


def features(
    model: Qwen3ForCausalLM, input_ids: torch.Tensor, layer_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [b, T, V], concatenated context features [b, T, taps*H]) of ``input_ids``."""
    out = model(input_ids=input_ids, output_hidden_states=True, use_cache=False)
    feats = torch.cat([out.hidden_states[k + 1] for k in layer_ids], -1)
    return out.logits, feats


@torch.no_grad()
def greedy(model: Qwen3ForCausalLM, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """[b, P + new_tokens] the prompts and the target's greedy continuations."""
    out = model.generate(
        input_ids=prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return out


@torch.no_grad()
def sample(
    model: Qwen3ForCausalLM, prompts: torch.Tensor, new_tokens: int, seed: int
) -> torch.Tensor:
    """[b, P + new_tokens] the prompts and continuations sampled at temperature 1 (no top-k/p)."""
    torch.manual_seed(seed)
    return model.generate(
        input_ids=prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        pad_token_id=0,
    )
