"""Which passes run in CUDA graphs: the drafter's block does, the target's tree verify does not.

SGLang captures the target's TARGET_VERIFY graphs for DFlash without an attention mask (its
FlashInfer and Triton graph metadata carry none for DFlash), and replays one whenever the
verify width equals the captured width. A BASTION tree replayed in such a graph would be
attended causally: wrong tokens, silently. So a BASTION target captures no decode graphs and
its verify runs eagerly (SGLang's EagerRunner); the drafter's block pass keeps DFlash's own
graphs, which its worker captures separately. SGLang still captures the target's prefill
graphs as configured.
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
        "BASTION: the target verifies trees eagerly (SGLang's verify graphs carry no tree "
        "mask); the drafter's block pass runs in its graphs"
    )
    return args[:1], {**kwargs, "capture_decode_cuda_graph": False}
