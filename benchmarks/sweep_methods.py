"""The methods a sweep compares: launcher arguments and environment of each; the CPU recipe."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from sglang_bastion.budget.latency import COST_MODES
from sglang_bastion.options import ENV_TRACE, ENV_TRACE_STEPS

ROOT = Path(__file__).resolve().parent.parent
# SGLang on a CPU needs these (an empty vllm._custom_ops module; DFLASH's GPU-only start-up
# gate, record_stream and cache-location helper): the same stand-ins the server tests use.
CPU_STANDINS = ROOT / "tests" / "sglang_standins"
# One OpenMP thread per server: on two shared cores, two threads stall at every parallel
# region whenever another process runs (and the shipped CPU profile was measured so).
CPU_ENV = {"TRITON_INTERPRET": "1", "SGLANG_BASTION_TOPK": "4", "OMP_NUM_THREADS": "1"}
CPU_ARGS = [
    "--device", "cpu",
    "--dtype", "bfloat16",
    "--cuda-graph-backend-decode", "disabled",
    "--cuda-graph-backend-prefill", "disabled",
    "--attention-backend", "bastion_cpu",
    "--mem-fraction-static", "0.1",
    "--max-total-tokens", "8192",
    "--skip-server-warmup",
    # SGLang folds its acceptance counters into /server_info only at each decode log
    # interval (default 40 steps); a short CPU sweep needs every step counted.
    "--decode-log-interval", "1",
]  # fmt: skip
PASSTHROUGH_ENV = ("SGLANG_BASTION_TOPK", "OMP_NUM_THREADS")
BASTION_PATTERN = re.compile(r"bastion-(\d+)")
# bastion-adaptive runs the worker's default mode (or --adaptive-mode); a suffix names the
# mode of that method alone, so that one sweep can compare modes side by side.
ADAPTIVE_PATTERN = re.compile(rf"bastion-adaptive(?:-({'|'.join(COST_MODES)}))?")
# Any method with this suffix runs on SGLang's synchronous schedule instead of its default
# overlapped one, so that one sweep can compare the two side by side.
SYNC_SUFFIX = "-sync"
# The default adaptive server with one of its choices changed, to compare side by side:
# the paper's controller (A_hat as the drafter says it), and one width per batch instead of
# the batch-global budget.
ADAPTIVE_VARIANTS = {
    "bastion-surrogate": {"SGLANG_BASTION_LEARN_ACCEPTANCE": "0"},
    "bastion-uniform": {"SGLANG_BASTION_LAYOUT": "uniform"},
}
SYNC_ARGS = ["--disable-overlap-schedule"]


@dataclass(frozen=True)
class Method:
    """One server configuration of a sweep: its name, launcher arguments and environment."""

    name: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    algorithm: str = "NONE"  # SGLang's --speculative-algorithm, NONE without speculation

    def setup(self) -> dict[str, object]:
        """What makes this method's server: its own arguments and environment."""
        return {"args": self.args, "env": self.env}


def pool_tokens(cap: int, longest_prompt: int, output_len: int, window: int) -> int:
    """KV tokens a CPU server needs to hold ``cap`` requests at once, rounded up to 1024.

    Each request holds its prompt, its output and, on a speculative server, SGLang's decode
    over-allocation of 2 x the draft-token window (``DFlashDraftInputV2.prepare_for_decode``).
    """
    tokens = cap * (longest_prompt + output_len + 2 * window)
    return -(-tokens // 1024) * 1024


def largest_window(methods: list[Method], default: int = 32) -> int:
    """The largest --speculative-num-draft-tokens among ``methods`` (``default`` if none)."""
    windows = [
        int(m.args[i + 1]) for m in methods for i, flag in enumerate(m.args[:-1])
        if flag == "--speculative-num-draft-tokens"
    ]  # fmt: skip
    return max([default, *windows])


def speculative_args(algorithm: str, drafter: Path, num_draft_tokens: int | None = None) -> list:
    """Launcher arguments selecting ``algorithm`` with ``drafter`` (and N draft tokens)."""
    args = ["--speculative-algorithm", algorithm, "--speculative-draft-model-path", str(drafter)]
    if num_draft_tokens is not None:
        args += ["--speculative-num-draft-tokens", str(num_draft_tokens)]
    return args


def parse_methods(
    names: list[str],
    drafter: Path | None,
    eagle_drafter: Path | None = None,
    profile: Path | None = None,
    adaptive_max_nodes: int | None = None,
    adaptive_mode: str | None = None,
) -> list[Method]:
    """The methods named on the command line, in order; ValueError naming what is missing."""
    bases = [name.removesuffix(SYNC_SUFFIX) for name in names]
    overlapped = parse_overlapped(
        bases, drafter, eagle_drafter, profile, adaptive_max_nodes, adaptive_mode
    )
    return [
        Method(name, [*m.args, *SYNC_ARGS], m.env, m.algorithm) if name != base else m
        for name, base, m in zip(names, bases, overlapped, strict=True)
    ]


def parse_overlapped(
    names: list[str],
    drafter: Path | None,
    eagle_drafter: Path | None,
    profile: Path | None,
    adaptive_max_nodes: int | None,
    adaptive_mode: str | None,
) -> list[Method]:
    """The methods named, without the synchronous suffix, on SGLang's default schedule."""
    fixed = [int(m.group(1)) for n in names if (m := BASTION_PATTERN.fullmatch(n))]
    methods = []
    for name in names:
        if name == "none":
            methods.append(Method(name))
            continue
        if name == "eagle3":
            if eagle_drafter is None:
                raise ValueError("method eagle3 needs --eagle-draft-model-path")
            methods.append(Method(name, speculative_args("EAGLE3", eagle_drafter), {}, "EAGLE3"))
            continue
        if drafter is None:
            raise ValueError(f"method {name} needs --draft-model-path")
        if name == "dflash":
            methods.append(Method(name, speculative_args("DFLASH", drafter), {}, "DFLASH"))
        elif match := BASTION_PATTERN.fullmatch(name):
            args = speculative_args("BASTION", drafter, int(match.group(1)))
            methods.append(Method(name, args, {"SGLANG_BASTION_MODE": "fixed"}, "BASTION"))
        elif name in ADAPTIVE_VARIANTS or (adaptive := ADAPTIVE_PATTERN.fullmatch(name)):
            if profile is None:
                raise ValueError(f"method {name} needs --profile (a latency profile)")
            n_max = adaptive_max_nodes or max(fixed, default=32)
            # With a profile the worker's controller is adaptive (its default mode, or the
            # one named: static, ema, ema_calib).
            env = {"SGLANG_BASTION_PROFILE": str(profile)}
            if name in ADAPTIVE_VARIANTS:
                env.update(ADAPTIVE_VARIANTS[name])
            elif mode := adaptive.group(1) or adaptive_mode:
                env["SGLANG_BASTION_MODE"] = mode
            args = speculative_args("BASTION", drafter, n_max)
            methods.append(Method(name, args, env, "BASTION"))
        else:
            raise ValueError(
                f"unknown method {name!r}: use none, dflash, eagle3, bastion-<N>, "
                f"bastion-adaptive, bastion-adaptive-<{'|'.join(COST_MODES)}>, "
                f"{', '.join(ADAPTIVE_VARIANTS)}, each optionally with {SYNC_SUFFIX!r} "
                "(synchronous schedule)"
            )
    return methods


# A sweep's step traces keep every step of its cells (the worker's default keeps 5000).
TRACE_STEPS = 1_000_000


def trace_env(method: Method, folder: Path | None) -> dict[str, str]:
    """The step-trace environment of ``method``'s server: a BASTION server writes its own
    ``<folder>/<method>.jsonl`` (servers of one sweep never share a trace); none without a
    folder or for another algorithm."""
    if folder is None or method.algorithm != "BASTION":
        return {}
    return {ENV_TRACE: str(folder / f"{method.name}.jsonl"), ENV_TRACE_STEPS: str(TRACE_STEPS)}


def server_setup(
    method: Method, user_args: list[str], on_cpu: bool
) -> tuple[list[str], dict[str, str]]:
    """Extra launcher arguments and environment for ``method`` (the CPU recipe on a CPU)."""
    env = dict(method.env)
    if not on_cpu:
        return [*method.args, *user_args], env
    env = {**CPU_ENV, **{k: os.environ[k] for k in PASSTHROUGH_ENV if k in os.environ}, **env}
    path = [str(CPU_STANDINS), os.environ.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
    env.setdefault("SGLANG_PLUGINS", "bastion")
    return [*CPU_ARGS, *method.args, *user_args], env
