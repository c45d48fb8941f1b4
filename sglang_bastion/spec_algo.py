"""How SGLang sees BASTION: a DFlash-family algorithm with tree verification.

The algorithm object answers SGLang's ``is_*`` / ``supports_*`` questions (claiming the DFlash
family turns on target hidden-state capture and the draft KV pool), settles the server
arguments SGLang's own DFLASH handler would have settled, and refuses configurations the
worker cannot serve with one line naming the problem and the fix.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from sglang_bastion.cpu_attention.plan import group_call_elements
from sglang_bastion.options import (
    ENV_PROFILE,
    BastionOptions,
    publish_options,
    published_options,
)

logger = logging.getLogger(__name__)

TREE_VERIFY_BACKENDS = ("flashinfer", "triton", "bastion_cpu")
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")  # owner/name


class BastionConfigError(SystemExit):
    """A configuration BASTION cannot serve: the launcher prints this one line and exits 1."""

    def __init__(self, message: str) -> None:
        super().__init__(f"sglang-bastion: {message}")


class BastionSpecAlgo(CustomSpecAlgo):
    """BASTION as SGLang's scheduler and model runner query it."""

    def is_dflash(self) -> bool:
        """Drafting, draft KV and hidden-state capture are DFlash's."""
        return True

    def is_dflash_family(self) -> bool:
        """Turns on target hidden-state capture and the draft KV pool."""
        return True

    def supports_target_verify_for_draft(self) -> bool:
        """The drafter's block pass runs as TARGET_VERIFY on the draft runner."""
        return True

    def supports_prefill_shared_read_done(self) -> bool:
        """Target prefill has no later speculative reader of the shared buffer."""
        return True

    def supports_grammar_overlap(self) -> bool:
        """Grammar batches overlap too: the worker advances the queued step's FSMs itself."""
        return True

    def carries_draft_hidden_states(self) -> bool:
        """Disaggregated transfer of draft hidden states is EAGLE-only."""
        return False

    def need_topk(self) -> bool:
        """No EAGLE top-k state travels between steps."""
        return False

    def get_platform_worker_cls(self) -> None:
        """No platform-specific worker."""
        return None

    def create_future_map(
        self,
        device: Any,
        req_to_token_pool: Any,
        needs_cpu_seq_lens: bool = True,
        needs_confidence_relay: bool = False,
    ) -> Any:
        """SGLang's future map, keeping the exact host sequence lengths in every step."""
        from sglang.srt.managers.overlap_utils import FutureMap

        # Always the exact host lengths: the flat tree mask's layout and the controller's
        # context prices need them (an upper bound, enough for DFLASH's chain, is not).
        return FutureMap(device, self, req_to_token_pool, True, needs_confidence_relay)

    def get_num_tokens_per_req_for_target_verify(
        self, num_draft_tokens: int, is_draft_worker: bool
    ) -> int:
        """Tree width for the target, the drafter's block size for the draft runner."""
        if is_draft_worker:
            return int(published_options().block_size)
        return num_draft_tokens

    def handle_server_args(self, server_args: Any) -> None:
        """Settle the arguments SGLang's DFLASH handler would settle, for BASTION's worker."""
        resolved = published_options()  # by validate_server_args, which SGLang runs first
        nodes, block = resolved.max_nodes, resolved.block_size
        server_args.speculative_num_steps = 1
        server_args.speculative_eagle_topk = 1
        # SGLang reserves speculative_num_draft_tokens KV slots per request and step: the
        # window must hold both the tree (N) and the drafter's block (D+1).
        window = max(int(nodes), block)
        server_args.speculative_num_draft_tokens = window
        server_args.page_size = 1
        if server_args.max_running_requests is None:
            server_args.max_running_requests = max_running_requests_default(
                server_args, window, block
            )


def max_running_requests_default(server_args: Any, window: int, block: int) -> int:
    """SGLang's DFLASH default (48), lowered where the W-wide step buffers would not fit."""
    from sglang.srt.utils.common import get_device_memory_capacity

    from sglang_bastion.memory import default_max_running_requests

    target = read_config(server_args.model_path)
    vocab = int((target.get("text_config") or target).get("vocab_size") or 0)
    device_mib = get_device_memory_capacity(str(server_args.device))
    chosen = default_max_running_requests(window, block - 1, vocab or 1, device_mib)
    logger.info("BASTION: --max-running-requests defaults to %d (verify width %d)", chosen, window)
    return chosen


def drafter_block_size(path: str | None, revision: str | None = None) -> int:
    """The DFlash drafter's block size D+1 from its config.json (16, DFlash's, when unstated)."""
    config = drafter_config(path, revision) if path else {}
    nested = config.get("dflash_config") or {}
    return int(nested.get("block_size") or config.get("block_size") or 16)


def drafter_config(path: str, revision: str | None = None) -> dict[str, Any]:
    """The drafter's config.json, from its folder or through the Hugging Face hub and cache."""
    config = read_config(path, revision)
    if not config:
        raise BastionConfigError(
            f"--speculative-draft-model-path {path}: no config.json in a local folder, on the "
            "Hugging Face hub or in its cache; download the drafter first (hf download "
            f"{path}) or pass its local folder"
        )
    return config


def read_config(path: str | Path, revision: str | None = None) -> dict[str, Any]:
    """A model's config.json from its folder, else the hub (or its cache); {} when neither."""
    file = Path(path) / "config.json"
    if file.is_file():
        return json.loads(file.read_text())
    if Path(path).exists() or not HUB_ID.fullmatch(str(path)):
        return {}  # a local path, without a config
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HFValidationError

    try:
        cached = hf_hub_download(str(path), "config.json", revision=revision)
    except (OSError, HFValidationError, ValueError):
        return {}  # unreachable, unknown or malformed: callers decide what that means
    return json.loads(Path(cached).read_text())


def tree_verify_backend(device: str) -> str:
    """The attention backend BASTION serves with on ``device`` when none was named."""
    if device.startswith("cpu"):
        return "bastion_cpu"
    return "triton"  # its verify graphs carry the tree mask (verify_graphs.py)


def validate_server_args(server_args: Any) -> None:
    """Refuse, in one line, what the BASTION worker cannot serve."""
    drafter = server_args.speculative_draft_model_path
    if not drafter:
        raise BastionConfigError(
            "--speculative-algorithm BASTION needs a DFlash drafter: pass "
            "--speculative-draft-model-path <drafter folder or hub id>"
        )
    if Path(drafter).exists() and not (Path(drafter) / "config.json").is_file():
        raise BastionConfigError(
            f"--speculative-draft-model-path {drafter} has no config.json; "
            "point it at a DFlash drafter folder"
        )
    backend = server_args.attention_backend
    if backend is not None and backend not in TREE_VERIFY_BACKENDS:
        given = (getattr(server_args, "_raw_input", None) or {}).get("attention_backend")
        if given is not None:
            raise BastionConfigError(
                f"--attention-backend {backend} cannot verify trees (no custom attention "
                f"mask); use one of {', '.join(TREE_VERIFY_BACKENDS)}"
            )
        chosen = tree_verify_backend(str(server_args.device))
        logger.warning(
            "BASTION: no --attention-backend was given and SGLang's default for this device, "
            "%s, cannot verify trees; serving with %s (pass --attention-backend to choose)",
            backend, chosen,
        )  # fmt: skip
        server_args.attention_backend = chosen
    if server_args.page_size not in (None, 1):
        raise BastionConfigError(
            f"--page-size {server_args.page_size} is not supported: BASTION moves accepted "
            "tree nodes token by token; use --page-size 1"
        )
    if getattr(server_args, "speculative_draft_window_size", None):
        raise BastionConfigError("--speculative-draft-window-size is not supported with BASTION")
    if getattr(server_args, "pp_size", 1) != 1:
        raise BastionConfigError("pipeline parallelism (--pp-size > 1) is not supported")
    if getattr(server_args, "enable_dp_attention", False):
        raise BastionConfigError("--enable-dp-attention is not supported; use --tp-size")
    if getattr(server_args, "enable_mixed_chunk", False):
        raise BastionConfigError("--enable-mixed-chunk is not supported with BASTION")
    check_drafter_matches_target(server_args.model_path, drafter)
    try:
        options = BastionOptions.from_env()
        options.validate(server_args.speculative_num_draft_tokens)
    except ValueError as error:
        raise BastionConfigError(str(error)) from None
    if server_args.attention_backend == "bastion_cpu":
        try:
            group_call_elements()
        except ValueError as error:
            raise BastionConfigError(str(error)) from None
    tp_size = getattr(server_args, "tp_size", 1) or 1
    if tp_size > 1 and options.resolved_mode in ("ema", "ema_calib"):
        raise BastionConfigError(
            f"SGLANG_BASTION_MODE={options.resolved_mode} is not supported with --tp-size "
            f"{tp_size}: every rank must choose the same trees, and the EMA modes follow each "
            "rank's own step times; use SGLANG_BASTION_MODE=static (or fixed)"
        )
    if options.profile and options.resolved_mode != "fixed":
        check_profile_matches_server(options.profile, server_args)
    nodes = server_args.speculative_num_draft_tokens or options.default_max_nodes
    revision = getattr(server_args, "speculative_draft_model_revision", None)
    block = drafter_block_size(drafter, revision)
    publish_options(replace(options, max_nodes=int(nodes), block_size=block))


def check_profile_matches_server(path: str, server_args: Any) -> None:
    """Refuse a latency profile that is malformed or measured for another configuration."""
    from sglang_bastion.budget import ProfileError, load_profile
    from sglang_bastion.budget.identity import attention_backend_name, serving_identity

    target = read_config(server_args.model_path)
    drafter = read_config(server_args.speculative_draft_model_path)
    try:
        profile = load_profile(path)
        if not target or not drafter:
            return  # configs out of reach: the worker checks the resolved ones at start-up
        dtype = server_args.dtype if server_args.dtype not in (None, "auto") else None
        expect = serving_identity(
            target_name=server_args.model_path, target_config=target,
            drafter_name=server_args.speculative_draft_model_path, drafter_config=drafter,
            dtype=dtype or profile.identity.dtype,
            attention_backend=attention_backend_name(server_args),
            block_size=drafter_block_size(server_args.speculative_draft_model_path),
            tp_size=getattr(server_args, "tp_size", 1),
        )  # fmt: skip
        load_profile(path, expect)
    except ProfileError as error:
        raise BastionConfigError(f"{ENV_PROFILE}: {error}") from None


def check_drafter_matches_target(target_path: str, drafter_path: str) -> None:
    """Refuse a drafter built for another target (hidden size, vocabulary, tapped layers)."""
    target, drafter = read_config(target_path), read_config(drafter_path)
    if not target or not drafter:
        return  # configs out of reach: SGLang's own loaders check what they can
    text = target.get("text_config") or target
    if "DFlashDraftModel" not in (drafter.get("architectures") or []):
        raise BastionConfigError(
            f"{drafter_path} is not a DFlash drafter (architectures "
            f"{drafter.get('architectures')}); BASTION needs a DFlashDraftModel checkpoint"
        )
    for field in ("hidden_size", "vocab_size"):
        if field in drafter and field in text and int(drafter[field]) != int(text[field]):
            raise BastionConfigError(
                f"drafter {field}={drafter[field]} does not match the target's "
                f"{field}={text[field]}: this drafter was built for another target model"
            )
    layers = int(text.get("num_hidden_layers", 0))
    taps = (drafter.get("dflash_config") or {}).get("target_layer_ids") or []
    bad = [i for i in taps if not 0 <= int(i) < layers - 1]
    if layers and bad:
        raise BastionConfigError(
            f"drafter target_layer_ids {taps} tap layers {bad} that a {layers}-layer target "
            f"cannot provide (valid: 0..{layers - 2}); this drafter was built for another target"
        )


REQUEST_CHECK_HOOK = "sglang.srt.speculative.dflash_utils.validate_dflash_request"


def refuse_unsupported_request(
    result: str | None, req: Any, *args: Any, **kwargs: Any
) -> str | None:
    """SGLang hook (after ``validate_dflash_request``): why BASTION cannot serve ``req``, if so.

    The scheduler finishes such a request at once with this message (an HTTP 400); the other
    requests in the batch never see it.
    """
    if result is not None:
        return result
    from sglang.srt.runtime_context import get_spec

    if str(get_spec().speculative_algorithm).upper() != "BASTION":
        return None
    if getattr(req, "return_sampling_mask", False):
        return (
            "BASTION does not return sampling masks: send the request without "
            "return_sampling_mask, or serve it with --speculative-algorithm DFLASH"
        )
    return None
