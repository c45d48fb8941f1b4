"""``--attention-backend bastion_cpu``: pure-PyTorch attention that serves speculative decoding.

SGLang's ``torch_native`` backend cannot run target verification or the DFlash drafter's
non-causal pass, and ``triton`` under ``TRITON_INTERPRET=1`` is about 100x slower on a CPU.
This backend (``backend.py``, math in ``kernels.py``) serves extend, decode, chain and tree
verify and the drafter's block; :func:`register_cpu_attention_backend` makes it selectable.
It is never chosen implicitly: only ``--attention-backend bastion_cpu`` (or
``--speculative-draft-attention-backend bastion_cpu``) selects it.
"""

from __future__ import annotations

from typing import Any

BACKEND_NAME = "bastion_cpu"

__all__ = ["BACKEND_NAME", "register_cpu_attention_backend"]


def register_cpu_attention_backend() -> bool:
    """Register ``bastion_cpu`` with SGLang's attention registry and CLI choices (idempotent).

    Returns False when SGLang is not importable (nothing to register with).
    """
    try:
        from sglang.srt.arg_groups.choices import (
            ATTENTION_BACKEND_CHOICES,
            DRAFT_ATTENTION_BACKEND_CHOICES,
        )
        from sglang.srt.layers.attention.attention_registry import (
            ATTENTION_BACKENDS,
            register_attention_backend,
        )
    except ImportError:
        return False
    if ATTENTION_BACKENDS.get(BACKEND_NAME) is not _create_backend:
        register_attention_backend(BACKEND_NAME)(_create_backend)
    # The CLI validates against these lists (argparse holds them by reference), and DFLASH's
    # draft worker falls back to another backend for names missing from the draft list.
    for choices in (ATTENTION_BACKEND_CHOICES, DRAFT_ATTENTION_BACKEND_CHOICES):
        if BACKEND_NAME not in choices:
            choices.append(BACKEND_NAME)
    return True


def _create_backend(model_runner: Any) -> Any:
    """Build the backend for a model runner (imports the SGLang-dependent module lazily)."""
    from sglang_bastion.cpu_attention.backend import create_backend

    return create_backend(model_runner)
