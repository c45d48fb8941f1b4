"""When an op runs a compiled kernel rather than its pure-torch reference."""

from __future__ import annotations

import torch


def use_triton(*tensors: torch.Tensor, kernels: bool = True) -> bool:
    """True when kernels are on and every tensor is on a CUDA device."""
    return kernels and all(t.is_cuda for t in tensors)


def use_compiled_cpu(*tensors: torch.Tensor, kernels: bool = True) -> bool:
    """True when kernels are on and every tensor is on the CPU."""
    return kernels and all(t.device.type == "cpu" for t in tensors)


def next_power_of_2(n: int) -> int:
    """Smallest power of two at least ``n`` (and at least 1)."""
    return 1 << max(0, n - 1).bit_length()
