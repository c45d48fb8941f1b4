"""The memory a BASTION step and its verify graphs take, and what fits in a device.

SGLang's DFLASH handler defaults ``--max-running-requests`` to 48; BASTION verifies up to W
nodes per request, so its per-step buffers grow with W: the verify logits [B*W, V] in
float32, their probability copy when sampling, and the drafter's logits [B*D, V]. The default
is the largest batch, at most DFLASH's 48, whose buffers fit in a fixed share of the device.

Each captured verify width also keeps a Triton graph state of its own (SGLang's
``TritonAttnBackend.init_cuda_graph_state`` at ``max_bs`` requests of W tokens): an int64 KV
slot per token and context position, the split-KV partial results per token and head, and a
full tree mask of the window's size. The widths captured are the narrowest whose states fit in
their own share of the device together; wider ones verify eagerly.
"""

from __future__ import annotations

LOGIT_BYTES = 4  # float32 logits and probabilities
STEP_BUFFER_SHARE = 0.05  # of the device's memory, for the per-step vocabulary buffers
DFLASH_MAX_RUNNING = 48  # SGLang's DFLASH default for --max-running-requests
GRAPH_STATE_SHARE = 0.05  # of the device's memory, for the verify graphs' attention state


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


def verify_graph_bytes(
    *, max_bs: int, width: int, window: int, context: int, heads: int, head_dim: int,
    kv_splits: int,
) -> int:  # fmt: skip
    """Bytes of Triton's graph state for one verify width captured up to ``max_bs`` requests."""
    tokens = max_bs * width
    kv_slots = tokens * context * 8  # [B*W * context] int64
    partials = tokens * heads * kv_splits * (head_dim + 1) * 4  # float32 logits and lse
    mask = max_bs * window * (context + window)  # [B * N * (context + N)] uint8
    return kv_slots + partials + mask


def graph_widths_that_fit(
    widths: tuple[int, ...], bytes_of: dict[int, int], device_mib: float | None
) -> tuple[int, ...]:
    """The narrowest of ``widths`` whose graph states fit in the share of the device together."""
    if not device_mib:
        return tuple(sorted(widths))
    budget, used, fitted = GRAPH_STATE_SHARE * device_mib * (1 << 20), 0, []
    for width in sorted(widths):
        used += bytes_of[width]
        if used > budget:
            break
        fitted.append(width)
    return tuple(fitted)
