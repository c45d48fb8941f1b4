"""The /server_info hook: ``internal_states[0]["bastion"]`` shows the worker's state.

``add_server_info`` is registered with SGLang's plugin hook registry (plugin.py).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

INTERNAL_STATE_HOOK = (
    "sglang.srt.managers.scheduler_components.internal_state."
    "SchedulerInternalStateController._add_speculative"
)


def add_server_info(result: Any, controller: Any, state: dict[str, Any]) -> Any:
    """SGLang hook (after ``_add_speculative``): add the BASTION worker's state."""
    worker = getattr(controller.scheduler, "draft_worker", None)
    read = getattr(worker, "bastion_state", None)
    if callable(read):
        try:
            state["bastion"] = read()
        except Exception:  # never break /server_info for the stats
            logger.exception("BASTION: could not read the worker's state")
    return result
