"""The learning-rate schedule every training stage uses."""

from __future__ import annotations

import math


def cosine_lr(step: int, steps: int, peak: float, warmup: int = 30) -> float:
    """Linear warm-up then cosine decay to 10% of ``peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
