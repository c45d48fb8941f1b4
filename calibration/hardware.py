"""The device a profile is measured on: its name and its roofline (peak FLOP/s, bandwidth).

GPUs use the datasheet presets in ``budget/roofline.py``, found from the CUDA device name.
There is no datasheet for a CPU (or an unlisted GPU), so its roofline is measured: the best
of a few large matrix multiplies in the serving dtype gives the peak FLOP/s, the best of a few
large tensor copies (one read and one write per element) gives the memory bandwidth. The
calibration fit absorbs what the probe misses, as it does for datasheet numbers.
"""

from __future__ import annotations

import time

import torch

from sglang_bastion.budget import Hardware
from sglang_bastion.budget.identity import device_name
from sglang_bastion.calibration.timing import synchronize


def device_hardware(device: torch.device, dtype: torch.dtype) -> Hardware:
    """The datasheet preset for this GPU, or a measured roofline where there is none."""
    name = device_name(device)
    if device.type == "cuda":
        try:
            return Hardware.from_device_name(name)
        except ValueError:
            pass
    return measure_hardware(device, dtype, name=f"measured: {name}")


def _best_seconds(run: object, device: torch.device, tries: int) -> float:
    """Fastest of ``tries`` synchronised calls of ``run`` (after one warm-up call)."""
    run()  # type: ignore[operator]
    synchronize(device)
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        run()  # type: ignore[operator]
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_hardware(
    device: torch.device,
    dtype: torch.dtype,
    *,
    name: str,
    matmul_size: int = 1024,
    copy_bytes: int = 64 << 20,
    tries: int = 5,
) -> Hardware:
    """A roofline measured on ``device``: matmul FLOP/s in ``dtype`` and copy bandwidth."""
    if device.type == "cuda":  # enough work to fill a GPU
        matmul_size, copy_bytes = max(matmul_size, 8192), max(copy_bytes, 1 << 30)
    a = torch.randn(matmul_size, matmul_size, device=device).to(dtype)  # [n, n]
    b = torch.randn(matmul_size, matmul_size, device=device).to(dtype)  # [n, n]
    seconds = _best_seconds(lambda: a @ b, device, tries)
    peak_flops = 2 * matmul_size**3 / seconds
    source = torch.empty(copy_bytes, dtype=torch.uint8, device=device)  # [bytes]
    target = torch.empty_like(source)
    seconds = _best_seconds(lambda: target.copy_(source), device, tries)
    bandwidth = 2 * copy_bytes / seconds  # each byte is read once and written once
    return Hardware(name=name, peak_flops=peak_flops, bandwidth=bandwidth)
