"""When the tree-path helpers run a compiled kernel rather than the pure-torch reference."""

from __future__ import annotations

import os

import torch

# Set to 1 to force the torch references even on CUDA or CPU tensors (debugging, A/B timing).
ENV_DISABLE = "SGLANG_BASTION_DISABLE_KERNELS"


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when every tensor is on a CUDA device and the kernels are not disabled."""
    if os.environ.get(ENV_DISABLE, "") not in ("", "0"):
        return False
    return all(t.is_cuda for t in tensors)


def use_compiled_cpu(*tensors: torch.Tensor) -> bool:
    """True when every tensor is on the CPU and the kernels are not disabled."""
    if os.environ.get(ENV_DISABLE, "") not in ("", "0"):
        return False
    return all(t.device.type == "cpu" for t in tensors)


def next_power_of_2(n: int) -> int:
    """Smallest power of two at least ``n`` (and at least 1)."""
    return 1 << max(0, n - 1).bit_length()
