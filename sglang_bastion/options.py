"""BASTION's own serving knobs (SGLang's CLI cannot be extended by a plugin, so they are
environment variables).

The launcher reads them once (``BastionOptions.from_env``, in the server-argument check),
resolves the tree budget N and publishes the result as one JSON snapshot that the spawned
scheduler processes inherit; the worker reads that snapshot (``published_options``) and never
the user's variables.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

ENV_TOP_K = "SGLANG_BASTION_TOPK"
ENV_MAX_NODES = "SGLANG_BASTION_DEFAULT_MAX_NODES"
ENV_PROFILE = "SGLANG_BASTION_PROFILE"
ENV_MODE = "SGLANG_BASTION_MODE"
ENV_LAYOUT = "SGLANG_BASTION_LAYOUT"
ENV_WIDTHS = "SGLANG_BASTION_WIDTHS"
ENV_EMA_ALPHA = "SGLANG_BASTION_EMA_ALPHA"
ENV_MEASURE_OVERHEAD = "SGLANG_BASTION_MEASURE_OVERHEAD"
ENV_LEARN_ACCEPTANCE = "SGLANG_BASTION_LEARN_ACCEPTANCE"
ENV_TRACE = "SGLANG_BASTION_TRACE"
ENV_TRACE_STEPS = "SGLANG_BASTION_TRACE_STEPS"
ENV_DISABLE_KERNELS = "SGLANG_BASTION_DISABLE_KERNELS"
# The launcher's resolved options (JSON), inherited by the scheduler processes it spawns.
ENV_PUBLISHED = "_SGLANG_BASTION_OPTIONS"

MODES = ("fixed", "static", "ema", "ema_calib")  # fixed N, then the latency model's modes
LAYOUTS = ("global", "uniform", "ragged")


@dataclass(frozen=True)
class BastionOptions:
    """Knobs beyond SGLang's flags: lattice width, tree budget, controller, tracing."""

    top_k: int = 8  # K: candidate tokens per draft position
    default_max_nodes: int = 16  # N when --speculative-num-draft-tokens is not given
    max_nodes: int | None = None  # N as the launcher resolved it
    block_size: int | None = None  # D+1: the drafter's block, as the launcher read it
    profile: str | None = None  # latency profile from bastion-calibrate
    mode: str | None = None  # None: "static" with a profile, else "fixed"
    layout: str = "global"  # one budget over the batch's tokens; one width; first drops
    widths: tuple[int, ...] = ()  # verify widths the adaptive modes may pick; () = the ladder
    ema_alpha: float = 0.1  # weight of the newest observed/predicted ratio (ema modes)
    measure_overhead: bool = True  # price the measured per-step time the profile leaves out
    learn_acceptance: bool = True  # calibrate A_hat online; plain steps when trees do not pay
    trace: str | None = None  # JSONL file the worker appends one record per step to
    trace_steps: int = 5000  # at most this many steps are traced
    kernels: bool = True  # False: every op runs its torch reference (debugging, A/B timing)

    @property
    def resolved_mode(self) -> str:
        """The controller mode in force: the explicit one, else static with a profile."""
        return self.mode or ("static" if self.profile else "fixed")

    @classmethod
    def from_env(cls) -> BastionOptions:
        """Options from SGLANG_BASTION_* environment variables, defaults elsewhere."""
        return cls(
            top_k=_int_env(ENV_TOP_K, cls.top_k),
            default_max_nodes=_int_env(ENV_MAX_NODES, cls.default_max_nodes),
            profile=os.environ.get(ENV_PROFILE) or None,
            mode=(os.environ.get(ENV_MODE) or "").strip().lower() or None,
            layout=(os.environ.get(ENV_LAYOUT) or cls.layout).strip().lower(),
            widths=_int_list_env(ENV_WIDTHS),
            ema_alpha=_float_env(ENV_EMA_ALPHA, cls.ema_alpha),
            measure_overhead=_bool_env(ENV_MEASURE_OVERHEAD, cls.measure_overhead),
            learn_acceptance=_bool_env(ENV_LEARN_ACCEPTANCE, cls.learn_acceptance),
            trace=os.environ.get(ENV_TRACE) or None,
            trace_steps=_int_env(ENV_TRACE_STEPS, cls.trace_steps),
            kernels=not _bool_env(ENV_DISABLE_KERNELS, False),
        )

    def to_json(self) -> str:
        """The options as one JSON object (the published snapshot)."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> BastionOptions:
        """Options from ``to_json``'s output."""
        fields = json.loads(text)
        return cls(**{**fields, "widths": tuple(fields["widths"])})

    def validate(self, max_nodes: int | None = None) -> None:
        """Raise ValueError naming the variable when a knob is out of range.

        ``max_nodes``: the server's --speculative-num-draft-tokens (None: the default N).
        """
        if not 1 <= self.top_k <= 64:
            raise ValueError(f"{ENV_TOP_K}={self.top_k} must be between 1 and 64")
        if self.default_max_nodes < 1:
            raise ValueError(f"{ENV_MAX_NODES}={self.default_max_nodes} must be at least 1")
        if self.mode is not None and self.mode not in MODES:
            raise ValueError(f"{ENV_MODE}={self.mode} must be one of {', '.join(MODES)}")
        if self.resolved_mode != "fixed" and not self.profile:
            raise ValueError(
                f"{ENV_MODE}={self.resolved_mode} needs a latency profile: run "
                f"bastion-calibrate for this target and drafter, then set {ENV_PROFILE}=<file>"
                f" (or {ENV_MODE}=fixed for a fixed tree size)"
            )
        if self.layout not in LAYOUTS:
            raise ValueError(f"{ENV_LAYOUT}={self.layout} must be one of {', '.join(LAYOUTS)}")
        if self.widths and min(self.widths) < 1:
            raise ValueError(f"{ENV_WIDTHS}={_csv(self.widths)} must list widths of at least 1")
        nodes = max_nodes or self.default_max_nodes
        if self.widths and max(self.widths) > nodes:
            raise ValueError(
                f"{ENV_WIDTHS}={_csv(self.widths)} lists widths above the tree budget "
                f"N={nodes}: raise --speculative-num-draft-tokens or drop those widths"
            )
        if not 0 < self.ema_alpha <= 1:
            raise ValueError(f"{ENV_EMA_ALPHA}={self.ema_alpha} must be in (0, 1]")
        if self.trace_steps < 1:
            raise ValueError(f"{ENV_TRACE_STEPS}={self.trace_steps} must be at least 1")


def _int_env(name: str, default: int) -> int:
    """An integer environment variable, or ``default`` when unset."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be an integer") from None


def _int_list_env(name: str) -> tuple[int, ...]:
    """A comma-separated list of integers, or () when unset."""
    raw = (os.environ.get(name) or "").strip()
    if not raw:
        return ()
    try:
        return tuple(int(part) for part in raw.split(","))
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be comma-separated integers, e.g. 8,12,16") from None


def _csv(values: tuple[int, ...]) -> str:
    """Integers as the environment variable spells them."""
    return ",".join(str(v) for v in values)


def _bool_env(name: str, default: bool) -> bool:
    """A 0/1 environment variable, or ``default`` when unset."""
    raw = (os.environ.get(name) or "").strip().lower()
    if raw == "":
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={raw!r} must be 0 or 1")


def _float_env(name: str, default: float) -> float:
    """A float environment variable, or ``default`` when unset."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be a number") from None


def publish_options(options: BastionOptions) -> None:
    """Make ``options`` the snapshot this process's children (the schedulers) serve with."""
    os.environ[ENV_PUBLISHED] = options.to_json()


def published_options() -> BastionOptions:
    """The options the launcher resolved and published for this server."""
    raw = os.environ.get(ENV_PUBLISHED)
    if not raw:
        raise RuntimeError(
            "the BASTION worker found no resolved options: start it through SGLang's launcher "
            "(python -m sglang.launch_server --speculative-algorithm BASTION ...) or "
            "bastion-calibrate, which check the server arguments first"
        )
    return BastionOptions.from_json(raw)
