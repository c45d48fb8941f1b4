"""Roofline cost of one target verify pass (paper Section 3.4 and Appendix G).

Notation (Appendix G): L layers, h hidden width, n_q / n_kv query / key-value heads of width d
(h_q = n_q d, h_kv = n_kv d), f dense FFN width, V vocabulary; for Qwen-style MoE, E experts,
K active experts per token and f_e the width of one expert. A verify pass runs B requests x t
tokens each on top of a cached prefix of c tokens per request; s = B t tokens in all.

A matrix multiply-add counts 2 FLOPs. Memory traffic is counted in elements and multiplied by
bytes_per_elem (bp); it approximates the bytes moved by one pass, not the resident size.
Omitted as small: norms, rotary embeddings, residual adds, softmax, MoE dispatch and combine.
Calibration (profile.py) absorbs what the formulas leave out: kernel fusion, caches, tiling,
scheduling and the tree-attention mask.

Every count is linear in the context c, so a batch of requests with different prefix lengths
costs exactly what the same batch costs at their mean prefix length.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

Scalar = int | float | torch.Tensor  # a number, or a float64 tensor that broadcasts


def _config_int(config: dict[str, Any], key: str, *, minimum: int = 1) -> int:
    """One integer field of a Hugging Face config, checked."""
    if key not in config or config[key] is None:
        raise ValueError(f"model config is missing required field {key!r}")
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"model config field {key!r} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"model config field {key!r} must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a decoder-only Transformer that set the cost of a forward pass."""

    num_layers: int  # L
    hidden_size: int  # h
    num_heads: int  # n_q
    num_kv_heads: int  # n_kv
    head_dim: int  # d
    intermediate_size: int  # f: dense FFN width (0 for an MoE model)
    vocab_size: int  # V
    num_experts: int = 0  # E (0: dense)
    experts_per_token: int = 0  # K
    moe_intermediate_size: int = 0  # f_e: width of one expert

    def __post_init__(self) -> None:
        """Reject shapes the cost model cannot price."""
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelShape.{name} must be >= 1, got {getattr(self, name)}")
        if self.vocab_size < 1:
            raise ValueError(f"ModelShape.vocab_size must be >= 1, got {self.vocab_size}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelShape.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.is_moe:
            if not 1 <= self.experts_per_token <= self.num_experts:
                raise ValueError(
                    f"ModelShape.experts_per_token must be in [1, num_experts={self.num_experts}]"
                    f", got {self.experts_per_token}"
                )
            if self.moe_intermediate_size < 1:
                raise ValueError("ModelShape.moe_intermediate_size must be >= 1 for an MoE model")
        elif self.intermediate_size < 1:
            raise ValueError("ModelShape.intermediate_size must be >= 1 for a dense model")

    @property
    def is_moe(self) -> bool:
        """Whether the FFN is a routed mixture of experts."""
        return self.num_experts > 0

    @property
    def q_width(self) -> int:
        """h_q = n_q d."""
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """h_kv = n_kv d."""
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelShape:
        """Read the shape from a Hugging Face config.json dict (or its ``text_config``)."""
        if "hidden_size" not in config and isinstance(config.get("text_config"), dict):
            config = config["text_config"]
        if config.get("use_sliding_window"):
            raise ValueError(
                "model config field 'use_sliding_window' is true: sliding-window attention is "
                "not modelled (full attention in every layer is assumed)"
            )
        hidden = _config_int(config, "hidden_size")
        heads = _config_int(config, "num_attention_heads")
        kv_heads = (
            _config_int(config, "num_key_value_heads")
            if config.get("num_key_value_heads") is not None
            else heads
        )
        if config.get("head_dim") is not None:
            head_dim = _config_int(config, "head_dim")
        elif hidden % heads:
            raise ValueError(
                f"model config has no 'head_dim' and hidden_size {hidden} is not divisible by "
                f"num_attention_heads {heads}: add 'head_dim'"
            )
        else:
            head_dim = hidden // heads
        num_experts, experts_per_token, expert_width = 0, 0, 0
        expert_key = next((k for k in ("num_experts", "num_local_experts") if config.get(k)), None)
        if expert_key is not None:
            num_experts = _config_int(config, expert_key)
            experts_per_token = _config_int(config, "num_experts_per_tok")
            # Qwen-MoE names the expert width moe_intermediate_size; Mixtral reuses
            # intermediate_size.
            width_key = "moe_intermediate_size"
            if width_key not in config:
                width_key = "intermediate_size"
            expert_width = _config_int(config, width_key)
            if config.get("shared_expert_intermediate_size"):
                raise ValueError(
                    "model config field 'shared_expert_intermediate_size' is set: shared experts "
                    "are not modelled (Appendix G covers Qwen3-MoE, routed experts only)"
                )
            if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
                raise ValueError(
                    "model config fields 'mlp_only_layers'/'decoder_sparse_step' mix dense and "
                    "MoE layers: only all-MoE models are modelled"
                )
        return cls(
            num_layers=_config_int(config, "num_hidden_layers"),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=0 if num_experts else _config_int(config, "intermediate_size"),
            vocab_size=_config_int(config, "vocab_size"),
            num_experts=num_experts,
            experts_per_token=experts_per_token,
            moe_intermediate_size=expert_width,
        )

    @classmethod
    def from_config_file(cls, path: str | Path) -> ModelShape:
        """Read the shape from a config.json file (or a directory holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        with path.open() as f:
            return cls.from_hf_config(json.load(f))


def _normalise(name: str) -> str:
    """Lower case, letters and digits only: 'RTX PRO 6000' == 'rtx-pro-6000'."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


@dataclass(frozen=True)
class Hardware:
    """An accelerator's roofline: dense peak throughput and memory bandwidth."""

    name: str
    peak_flops: float  # FLOP/s, dense (no structured sparsity) at the compute dtype
    bandwidth: float  # bytes/s, device memory

    def __post_init__(self) -> None:
        """Reject non-positive rates."""
        if not self.peak_flops > 0 or not self.bandwidth > 0:
            raise ValueError(
                f"Hardware {self.name!r} needs peak_flops > 0 and bandwidth > 0, got "
                f"{self.peak_flops} and {self.bandwidth}"
            )

    @staticmethod
    def lookup(name: str) -> Hardware:
        """The preset called ``name`` (case, spaces and dashes ignored; a few aliases)."""
        key = _normalise(name)
        key = _ALIASES.get(key, key)
        for preset_name, preset in HARDWARE.items():
            if _normalise(preset_name) == key:
                return preset
        raise ValueError(
            f"unknown hardware {name!r}; known: {', '.join(HARDWARE)} "
            "(or build Hardware(name, peak_flops, bandwidth) from the datasheet)"
        )

    @staticmethod
    def from_device_name(device_name: str) -> Hardware:
        """The preset matching a CUDA device name such as 'NVIDIA H100 80GB HBM3'."""
        key = _normalise(device_name)
        for pattern, preset_name in _DEVICE_PATTERNS:
            if re.search(pattern, key):
                return HARDWARE[preset_name]
        raise ValueError(
            f"no hardware preset matches device {device_name!r}; known: {', '.join(HARDWARE)}"
        )


# Datasheet dense BF16 tensor-core peaks (the "with sparsity" figures halved) and memory
# bandwidths. H200 has the H100-SXM compute with faster HBM3e.
HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in (
        Hardware("A100-40GB", 312e12, 1.555e12),
        Hardware("A100-80GB", 312e12, 2.039e12),
        Hardware("H100-SXM", 989.4e12, 3.35e12),
        Hardware("H100-PCIe", 756e12, 2.0e12),
        Hardware("H200", 989.4e12, 4.8e12),
        Hardware("A6000", 154.8e12, 768e9),
        Hardware("L40S", 362.05e12, 864e9),
        Hardware("RTX-PRO-6000", 503.8e12, 1.792e12),
    )
}
# Normalised short name -> normalised preset name.
_ALIASES: dict[str, str] = {
    "a100": "a10080gb",
    "h100": "h100sxm",
    "rtxa6000": "a6000",
    "rtxpro6000blackwell": "rtxpro6000",
}
# Normalised CUDA device name pattern -> preset, most specific first.
_DEVICE_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"a100.*40gb|a100.*pcie.*40", "A100-40GB"),
    (r"a100", "A100-80GB"),
    (r"h100.*pcie", "H100-PCIe"),
    (r"h100", "H100-SXM"),
    (r"h200", "H200"),
    (r"rtxpro6000", "RTX-PRO-6000"),
    (r"a6000", "A6000"),
    (r"l40s", "L40S"),
)


def _as_f64(name: str, value: Scalar) -> torch.Tensor:
    """A float64 tensor of ``value``, rejecting negatives."""
    tensor = torch.as_tensor(value, dtype=torch.float64)
    if bool((tensor < 0).any()):
        raise ValueError(f"{name} must be >= 0")
    return tensor


def expert_touch(shape: ModelShape, total_tokens: Scalar) -> torch.Tensor:
    """U(s) = min(E, s K): experts one MoE layer reads for s tokens (each at most once)."""
    s = _as_f64("total_tokens", total_tokens)
    return torch.clamp(s * shape.experts_per_token, max=float(shape.num_experts))


def verify_flops(shape: ModelShape, batch: Scalar, tokens: Scalar, context: Scalar) -> torch.Tensor:
    """FLOPs of one verify pass of ``batch`` requests x ``tokens`` tokens at prefix ``context``."""
    b = _as_f64("batch", batch)
    t = _as_f64("tokens", tokens)
    c = _as_f64("context", context)
    s = b * t  # total tokens in the pass
    h, hq, hkv = shape.hidden_size, shape.q_width, shape.kv_width
    # Q, K, V projections (h -> h_q + 2 h_kv) and the output projection (h_q -> h).
    projections = 2 * s * h * (hq + 2 * hkv) + 2 * s * hq * h
    # Scores Q K^T and the weighted sum P V: each of the s queries meets c + t keys (the tree
    # mask hides most of the t new ones, but the kernel still computes them), width h_q each.
    attention = 2 * (2 * s * (c + t) * hq)
    if shape.is_moe:
        # Router (h -> E) on every token, then K gated experts: gate and up (h -> 2 f_e), down.
        ffn = 2 * s * h * shape.num_experts + 3 * 2 * s * shape.experts_per_token * h * (
            shape.moe_intermediate_size
        )
    else:
        # Gated FFN: gate and up (h -> 2 f), down (f -> h).
        ffn = 3 * 2 * s * h * shape.intermediate_size
    # LM head (h -> V) on every token: every tree node needs its logits.
    lm_head = 2 * s * h * shape.vocab_size
    return shape.num_layers * (projections + attention + ffn) + lm_head


def verify_bytes(
    shape: ModelShape,
    batch: Scalar,
    tokens: Scalar,
    context: Scalar,
    bytes_per_elem: float = 2,
) -> torch.Tensor:
    """Bytes moved by one verify pass of ``batch`` requests x ``tokens`` tokens at ``context``."""
    b = _as_f64("batch", batch)
    t = _as_f64("tokens", tokens)
    c = _as_f64("context", context)
    s = b * t  # total tokens in the pass
    h, hq, hkv = shape.hidden_size, shape.q_width, shape.kv_width
    # Weights, read once per pass per layer: Q/K/V and output projections.
    attention_weights = h * (hq + 2 * hkv) + hq * h
    # Activation I/O of the attention block, input read + output written per step:
    # QKV projection, attention core (Q in, O out; K/V are in the KV-cache term), O projection.
    attention_io = s * (h + hq + 2 * hkv) + s * (2 * hq) + s * (hq + h)
    if shape.is_moe:
        e, k, fe = shape.num_experts, shape.experts_per_token, shape.moe_intermediate_size
        # Router weights (h x E), plus the gate/up/down weights of each expert some token picks.
        ffn_weights = h * e + expert_touch(shape, s) * 3 * h * fe
        # Router I/O, then each token's copy in each of its K experts: gate/up and down.
        ffn_io = s * (h + e) + s * k * (h + 2 * fe) + s * k * (fe + h)
    else:
        f = shape.intermediate_size
        ffn_weights = torch.as_tensor(3 * h * f, dtype=torch.float64)  # gate, up, down
        ffn_io = s * (h + 2 * f) + s * (f + h)  # gate/up projection, down projection
    # KV cache per layer: read the c cached keys and values of each request, write the t new.
    kv_cache = b * (c + t) * 2 * hkv
    per_layer = attention_weights + ffn_weights + attention_io + ffn_io + kv_cache
    # Once per pass: embedding rows of the s tokens, the LM head weights (counted separately
    # from the embedding even when tied), the final hidden states in and the logits out.
    embedding = s * h
    lm_head = shape.vocab_size * h + s * h + s * shape.vocab_size
    return bytes_per_elem * (shape.num_layers * per_layer + embedding + lm_head)


def roofline_ms(
    shape: ModelShape,
    hardware: Hardware,
    batch: Scalar,
    tokens: Scalar,
    context: Scalar,
    bytes_per_elem: float = 2,
) -> torch.Tensor:
    """Roofline latency of one verify pass: max(compute time, memory time), in milliseconds."""
    compute_s = verify_flops(shape, batch, tokens, context) / hardware.peak_flops
    memory_s = verify_bytes(shape, batch, tokens, context, bytes_per_elem) / hardware.bandwidth
    return torch.maximum(compute_s, memory_s) * 1e3
