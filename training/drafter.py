"""A DFlash block-diffusion drafter as a plain torch module, for training and offline study.

It computes what SGLang's ``DFlashDraftModel`` computes on the same weights (a test compares
the two through a real server), with parameter names equal to the z-lab checkpoint names, so
``state_dict()`` is the checkpoint:

- context: the target's hidden states after layers ``target_layer_ids`` of every committed
  token, concatenated, ``fc`` then ``hidden_norm``: one ``ctx`` vector per token, from which
  every drafter layer takes keys and values (k_norm and rotary at the token's position; no
  input norm);
- block: the target's embeddings of [bonus, MASK x (B-1)] at positions p..p+B-1 go through
  pre-norm Qwen3 layers whose attention sees all context tokens before p and the whole
  block (non-causal), then ``norm``; the target's LM head turns row k into q_k.

Many blocks of one sequence are drafted in one call: ``anchors`` [b, A] are the positions p of
the A bonus tokens, each block seeing only the context before its own anchor.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last axis, computed in float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` normalised and scaled, in ``x``'s dtype."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight.float()).to(x.dtype)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding of ``x`` [..., L, heads, d] at ``positions`` [..., L]."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angles = positions.float().unsqueeze(-1) * inv_freq  # [..., L, d/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1).unsqueeze(-2)  # [..., L, 1, d]
    sin = torch.cat([angles.sin(), angles.sin()], -1).unsqueeze(-2)
    h = x.float()
    half = torch.cat([-h[..., d // 2 :], h[..., : d // 2]], -1)
    return (h * cos + half * sin).to(x.dtype)


class Attention(nn.Module):
    """Qwen3 attention: q/k norms per head, rotary, grouped KV heads."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        hidden, self.heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        self.kv_heads, self.head_dim = int(cfg["num_key_value_heads"]), int(cfg["head_dim"])
        self.theta = float(cfg.get("rope_theta", 10000.0))
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, eps)
        self.k_norm = RMSNorm(self.head_dim, eps)

    def keys_values(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated, normed keys and values [b, L, kv_heads, d] of rows ``x`` [b, L, H]."""
        b, length = x.shape[:2]
        k = self.k_norm(self.k_proj(x).view(b, length, self.kv_heads, self.head_dim))
        v = self.v_proj(x).view(b, length, self.kv_heads, self.head_dim)
        return rotate(k, positions, self.theta), v

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        ctx_kv: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """Block rows ``x`` [b, Q, H] attending to context keys then their own block's keys."""
        b, rows = x.shape[:2]
        q = self.q_norm(self.q_proj(x).view(b, rows, self.heads, self.head_dim))
        q = rotate(q, positions, self.theta)
        k, v = self.keys_values(x, positions)
        k = torch.cat([ctx_kv[0], k], 1).transpose(1, 2)  # [b, kv_heads, T + Q, d]
        v = torch.cat([ctx_kv[1], v], 1).transpose(1, 2)
        groups = self.heads // self.kv_heads
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.repeat_interleave(groups, 1),
            v.repeat_interleave(groups, 1),
            attn_mask=mask.unsqueeze(1),
        )  # [b, heads, Q, d]
        return self.o_proj(out.transpose(1, 2).reshape(b, rows, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        hidden, inner = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up, projected down."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    """One pre-norm drafter layer."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.input_layernorm = RMSNorm(int(cfg["hidden_size"]), eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(int(cfg["hidden_size"]), eps)
        self.mlp = MLP(cfg)


class DFlashDrafter(nn.Module):
    """The z-lab DFlash drafter (``DFlashDraftModel``) in plain torch."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.config = cfg
        dflash = cfg["dflash_config"]
        self.block_size = int(cfg["block_size"])
        self.mask_token_id = int(dflash["mask_token_id"])
        self.target_layer_ids = [int(i) for i in dflash["target_layer_ids"]]
        hidden, eps = int(cfg["hidden_size"]), float(cfg.get("rms_norm_eps", 1e-6))
        self.fc = nn.Linear(len(self.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(int(cfg["num_hidden_layers"])))
        self.norm = RMSNorm(hidden, eps)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """[b, T, H] context vectors from concatenated target features [b, T, taps*H]."""
        return self.hidden_norm(self.fc(features))

    def forward(
        self, ctx: torch.Tensor, block_embeds: torch.Tensor, anchors: torch.Tensor
    ) -> torch.Tensor:
        """[b, A, B, H] final hidden states of A blocks per sequence.

        ctx: [b, T, H] context vectors of tokens 0..T-1; block_embeds: [b, A, B, H] the
        target's embeddings of each block's [bonus, MASK...]; anchors: [b, A] each block's
        bonus position p (the block sees context tokens < p).
        """
        b, num, block, hidden = block_embeds.shape
        steps = torch.arange(block, device=anchors.device)
        positions = (anchors.unsqueeze(-1) + steps).reshape(b, num * block)  # [b, A*B]
        ctx_pos = torch.arange(ctx.shape[1], device=ctx.device).expand(b, -1)  # [b, T]
        row_anchor = anchors.repeat_interleave(block, 1)  # [b, A*B]
        sees_ctx = ctx_pos.unsqueeze(1) < row_anchor.unsqueeze(2)  # [b, A*B, T]
        owner = torch.arange(num, device=anchors.device).repeat_interleave(block)  # [A*B]
        same_block = (owner.unsqueeze(1) == owner.unsqueeze(0)).expand(b, -1, -1)
        mask = torch.cat([sees_ctx, same_block], 2)  # [b, A*B, T + A*B]
        h = block_embeds.reshape(b, num * block, hidden)
        for layer in self.layers:
            attn = layer.self_attn
            ctx_kv = attn.keys_values(ctx, ctx_pos)
            h = h + attn(layer.input_layernorm(h), positions, ctx_kv, mask)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h).view(b, num, block, hidden)

    @classmethod
    def load(cls, path: Path, dtype: torch.dtype = torch.float32) -> DFlashDrafter:
        """The drafter saved in the z-lab format at ``path``."""
        cfg = json.loads((Path(path) / "config.json").read_text())
        model = cls(cfg)
        model.load_state_dict(load_file(Path(path) / "model.safetensors"))
        return model.to(dtype)
