"""BASTION's own serving knobs (SGLang's CLI cannot be extended by a plugin, so they are
environment variables, read once when the server starts)."""

from __future__ import annotations

import os
from dataclasses import dataclass

ENV_TOP_K = "SGLANG_BASTION_TOPK"
ENV_MAX_NODES = "SGLANG_BASTION_DEFAULT_MAX_NODES"
# Set by the launcher once it has resolved N (--speculative-num-draft-tokens), for the worker.
ENV_RESOLVED_MAX_NODES = "_SGLANG_BASTION_RESOLVED_MAX_NODES"


@dataclass(frozen=True)
class BastionOptions:
    """Knobs beyond SGLang's flags: K of the top-K lattice and the default tree size."""

    top_k: int = 8  # K: candidate tokens per draft position
    default_max_nodes: int = 16  # N when --speculative-num-draft-tokens is not given
    max_nodes: int | None = None  # N as the launcher resolved it

    @classmethod
    def from_env(cls) -> BastionOptions:
        """Options from SGLANG_BASTION_* environment variables, defaults elsewhere."""
        return cls(
            top_k=_int_env(ENV_TOP_K, cls.top_k),
            default_max_nodes=_int_env(ENV_MAX_NODES, cls.default_max_nodes),
            max_nodes=_int_env(ENV_RESOLVED_MAX_NODES, 0) or None,
        )

    def validate(self) -> None:
        """Raise ValueError naming the variable when a knob is out of range."""
        if not 1 <= self.top_k <= 64:
            raise ValueError(f"{ENV_TOP_K}={self.top_k} must be between 1 and 64")
        if self.default_max_nodes < 1:
            raise ValueError(f"{ENV_MAX_NODES}={self.default_max_nodes} must be at least 1")


def _int_env(name: str, default: int) -> int:
    """An integer environment variable, or ``default`` when unset."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be an integer") from None
