"""The target's tree verify in device graphs: one per (batch-size bucket, verify width).

SGLang's ``DecodeCudaGraphRunner`` captures TARGET_VERIFY graphs, but for the DFlash family
it captures them without an attention mask wherever the backend can run DFlash's chain
causally (``dflash_utils._DFLASH_VERIFY_SKIP_CUSTOM_MASK_BACKENDS``: Triton, FlashInfer, FA3,
...). A tree replayed in such a graph is attended causally: wrong tokens, silently. So a
BASTION target captures none of SGLang's own decode graphs (``graphs.py``), and the worker
captures ``TreeVerifyGraphRunner``s instead: SGLang's runner, capturing with its custom-mask
buffer, so the backend's captured metadata reads the mask buffer that the backend refills
from each step's tree at replay (Triton: ``TritonAttnBackend._update_target_verify_buffers``).
Inputs, positions (the nodes' depths), KV slots and lengths go through SGLang's own replay
buffers as for any verify graph.

One runner per verify width the controller can choose, each over an attention backend of its
own: a runner's ``init_cuda_graph_state`` re-allocates its backend's graph buffers, which
would leave another runner's captured views reading stale ones. A width with no runner, or a
batch larger than the captured ones, verifies eagerly.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, check_cuda_graph_backend
from sglang.srt.model_executor.runner.base_cuda_graph_runner import get_batch_sizes_to_capture
from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
from sglang.srt.platforms import current_platform

from sglang_bastion.memory import verify_graph_bytes

logger = logging.getLogger(__name__)

# Backends whose captured TARGET_VERIFY metadata reads a custom-mask buffer that replay
# refills (checked against SGLang 0.5.23's code and, on a CPU, through an emulation of its
# graph runner: tests/test_server_verify_graphs.py). FlashInfer's graph wrappers can carry a
# mask too, but no test here can run them, so it verifies eagerly.
MASKED_GRAPH_BACKENDS = frozenset({"TritonAttnBackend"})


class TreeVerifyGraphRunner(DecodeCudaGraphRunner):
    """SGLang's decode graph runner for TARGET_VERIFY, capturing the tree mask's buffer."""

    def get_spec_info(self, num_tokens: int) -> Any:
        """The capture batch's verify input, with the runner's mask buffer as its mask."""
        spec_info = super().get_spec_info(num_tokens)
        spec_info.custom_mask = self.buffers.custom_mask  # [max_bs * W * (1 + W)] all True
        return spec_info


def verify_graphs_unavailable(model_runner: Any) -> str | None:
    """Why the target's tree verify cannot run in graphs here; None when it can."""
    if check_cuda_graph_backend(Phase.DECODE, Backend.DISABLED):
        return "decode graphs are disabled (--cuda-graph-backend-decode disabled)"
    platform = type(current_platform).__name__
    if not current_platform.capabilities.graph_capture or platform == "CpuSRTPlatform":
        return f"SGLang's {platform} captures no device graphs"
    backend = type(model_runner.attn_backend).__name__
    if backend not in MASKED_GRAPH_BACKENDS:
        return (
            f"{backend} graphs are not known to carry a tree mask here; "
            "--attention-backend triton verifies in graphs"
        )
    if getattr(model_runner, "graph_shared_output", None) is None:
        return "SGLang allocated no graph output buffer for the target"
    return None


def decodes_eagerly(model_runner: Any) -> bool:
    """Whether the target runs a decode forward eagerly: it holds no graph runner that could
    take a plain decode batch for one of the graphs it captured for verify passes."""
    graphs = getattr(model_runner, "decode_cuda_graph_runner", None)
    return graphs is None or graphs is getattr(model_runner, "eager_runner", None)


def verify_graph_state_bytes(
    model_runner: Any, widths: Sequence[int], window: int
) -> dict[int, int]:
    """Bytes of the Triton graph state each verify width would keep, by width."""
    backend = model_runner.attn_backend
    shape = {"window": window, "context": backend.max_context_len, "heads": backend.num_head,
             "head_dim": backend.v_head_dim, "kv_splits": backend.max_kv_splits}  # fmt: skip
    return {
        width: verify_graph_bytes(
            max_bs=max(get_batch_sizes_to_capture(model_runner, width)[0]), width=width, **shape
        )
        for width in widths
    }


def capture_verify_graphs(
    model_runner: Any, widths: Sequence[int]
) -> dict[int, TreeVerifyGraphRunner]:
    """A captured verify-graph runner per width, each over an attention backend of its own."""
    runners = {}
    for width in sorted(set(widths)):
        backend = _fresh_attention_backend(model_runner)
        runners[width] = TreeVerifyGraphRunner(
            model_runner, attn_backend=backend, speculative_num_draft_tokens=width
        )
    return runners


def _fresh_attention_backend(model_runner: Any) -> Any:
    """A new attention backend of the target's kind, with its own workspace."""
    kept = model_runner.init_new_workspace
    try:
        return model_runner._get_attention_backend(init_new_workspace=True)
    finally:
        model_runner.init_new_workspace = kept


@contextlib.contextmanager
def replaying(model_runner: Any, runner: TreeVerifyGraphRunner) -> Iterator[None]:
    """``runner`` as the target's decode graph runner for one forward."""
    kept = model_runner.decode_cuda_graph_runner
    model_runner.decode_cuda_graph_runner = runner
    try:
        yield
    finally:
        model_runner.decode_cuda_graph_runner = kept
