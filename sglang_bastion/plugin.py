"""SGLang plugin entry point (group ``sglang.srt.plugins``), called by SGLang's ``load_plugins``."""

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
    if _already_registered(SpeculativeAlgorithm):
        return
    SpeculativeAlgorithm.register(
        ALGORITHM_NAME, supports_overlap=False, validate_server_args=_refuse_until_worker_lands
    )(_worker_factory)


def _already_registered(registry: type) -> bool:
    """True when this process has registered BASTION before (plugins load once per process)."""
    try:
        return registry.from_string(ALGORITHM_NAME) is not None
    except Exception:  # unknown names raise in SGLang's registry
        return False


def _refuse_until_worker_lands(server_args: object) -> None:
    """Fail server start-up with one line: this release ships the algorithmic core only."""
    raise ValueError(
        "--speculative-algorithm BASTION: this sglang-bastion release ships the algorithmic "
        "core (sglang_bastion.tree, sglang_bastion.controller, sglang_bastion.budget) but not "
        "yet its SGLang worker; use --speculative-algorithm DFLASH for now."
    )


def _worker_factory(server_args: object) -> type:
    """The worker class for BASTION (not shipped in this release)."""
    _refuse_until_worker_lands(server_args)
    raise AssertionError("unreachable")
