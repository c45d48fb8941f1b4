"""SGLang's own decode graphs: a BASTION target captures none, its worker captures its own.

SGLang captures the target's TARGET_VERIFY graphs for DFlash without an attention mask (its
FlashInfer and Triton graph metadata carry none for DFlash), and replays one whenever the
verify width equals the captured width. A BASTION tree replayed in such a graph would be
attended causally: wrong tokens, silently. So a BASTION target captures none of SGLang's
decode graphs; the worker then captures tree-verify graphs that carry the mask, one per
verify width, where the backend allows (``verify_graphs.py``), and verifies eagerly
elsewhere. The drafter's block pass keeps DFlash's own graphs, which its worker captures
separately. SGLang still captures the target's prefill graphs as configured.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

TARGET_GRAPHS_HOOK = "sglang.srt.managers.tp_worker.TpModelWorker.init_cuda_graphs"


def eager_tree_verify(*args: Any, **kwargs: Any) -> tuple[tuple, dict] | None:
    """SGLang hook (before ``TpModelWorker.init_cuda_graphs``): no mask-less verify graphs."""
    from sglang_bastion.spec_algo import BastionSpecAlgo

    tp_worker = args[0]
    runner = tp_worker.model_runner
    if runner.is_draft_worker or not isinstance(runner.spec_algorithm, BastionSpecAlgo):
        return None
    logger.info(
        "BASTION: the target captures none of SGLang's decode graphs (its verify graphs carry "
        "no tree mask); the drafter's block pass runs in its graphs"
    )
    return args[:1], {**kwargs, "capture_decode_cuda_graph": False}
