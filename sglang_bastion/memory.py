"""The per-step buffers a BASTION step allocates over the vocabulary, and the batch they allow.

SGLang's DFLASH handler defaults ``--max-running-requests`` to 48; BASTION verifies up to W
nodes per request, so its eager per-step buffers grow with W: the verify logits [B*W, V] in
float32, their probability copy when sampling, and the drafter's logits [B*D, V]. The default
is the largest batch, at most DFLASH's 48, whose buffers fit in a fixed share of the device.
"""

from __future__ import annotations

LOGIT_BYTES = 4  # float32 logits and probabilities
STEP_BUFFER_SHARE = 0.05  # of the device's memory, for the per-step vocabulary buffers
DFLASH_MAX_RUNNING = 48  # SGLang's DFLASH default for --max-running-requests


def step_buffer_bytes(batch: int, width: int, depth: int, vocab: int) -> int:
    """Bytes of one step's vocabulary-wide buffers for ``batch`` requests at verify width W."""
    # [B*W, V] logits + [B*W, V] probabilities (sampling) + [B*D, V] draft logits
    return batch * (2 * width + depth) * vocab * LOGIT_BYTES


def default_max_running_requests(
    width: int, depth: int, vocab: int, device_mib: float | None
) -> int:
    """--max-running-requests when none is given: DFLASH's 48, fewer where W would not fit."""
    if not device_mib:
        return DFLASH_MAX_RUNNING
    budget = STEP_BUFFER_SHARE * device_mib * (1 << 20)
    fits = int(budget // step_buffer_bytes(1, width, depth, vocab))
    return max(1, min(DFLASH_MAX_RUNNING, fits))
