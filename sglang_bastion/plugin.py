"""SGLang plugin entry point (group ``sglang.srt.plugins``), called by SGLang's ``load_plugins``.

SGLang loads plugins in the launcher, in ``sglang serve``, in ``Engine`` and again inside each
spawned scheduler process, so registration is idempotent.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

ALGORITHM_NAME = "BASTION"


def register() -> None:
    """Register ``--speculative-algorithm BASTION`` with SGLang's speculative registry."""
    try:
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    except ImportError:  # SGLang is not installed: nothing to register with
        logger.debug("sglang is not importable; BASTION not registered")
        return
    from sglang_bastion.cpu_attention import register_cpu_attention_backend

    register_cpu_attention_backend()
    if _already_registered(SpeculativeAlgorithm):
        return
    _register_hooks()
    from sglang_bastion.spec_algo import BastionSpecAlgo, validate_server_args

    SpeculativeAlgorithm.register(
        ALGORITHM_NAME,
        supports_overlap=True,
        validate_server_args=validate_server_args,
        spec_class=BastionSpecAlgo,
    )(_worker_factory)


def _already_registered(registry: type) -> bool:
    """True when this process has registered BASTION before."""
    try:
        return registry.from_string(ALGORITHM_NAME) is not None
    except ValueError:  # SGLang's registry does not know the name yet
        return False


def _worker_factory(server_args: object) -> type:
    """The worker class SGLang instantiates for BASTION."""
    from sglang_bastion.worker import BastionWorker

    return BastionWorker


def _register_hooks() -> None:
    """SGLang plugin hooks: /server_info; per-request refusals; penalties; eager verify."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_bastion.graphs import TARGET_GRAPHS_HOOK, eager_tree_verify
    from sglang_bastion.node_sampling import COPY_FOR_FORWARD_HOOK, keep_penalizers
    from sglang_bastion.request_guard import VALIDATE_HOOK, refuse_request_killers
    from sglang_bastion.serving import INTERNAL_STATE_HOOK, add_server_info
    from sglang_bastion.spec_algo import REQUEST_CHECK_HOOK, refuse_unsupported_request

    HookRegistry.register(INTERNAL_STATE_HOOK, add_server_info, HookType.AFTER)
    HookRegistry.register(REQUEST_CHECK_HOOK, refuse_unsupported_request, HookType.AFTER)
    HookRegistry.register(VALIDATE_HOOK, refuse_request_killers, HookType.AFTER)
    HookRegistry.register(COPY_FOR_FORWARD_HOOK, keep_penalizers, HookType.AFTER)
    HookRegistry.register(TARGET_GRAPHS_HOOK, eager_tree_verify, HookType.BEFORE)
