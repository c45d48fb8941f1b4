"""The identity a profile is measured for, computed the same way by the calibration and the server.

Also the device's readable name, which a profile records and a server compares.

A profile is valid only for the configuration it was measured with (budget/profile.py,
``ProfileIdentity``). Both sides build it with ``serving_identity`` from what SGLang resolved:
the target's and drafter's configs (fingerprinted by their cost-relevant shape), the compute
dtype, the attention backend, the drafter's block size and the TP degree.
"""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path
from typing import Any

import torch

from sglang_bastion.budget.profile import ModelRef, ProfileIdentity

BF16_FLAGS = ("amx_bf16", "avx512_bf16", "avx_ne_convert")  # x86 bfloat16 instruction flags


def dtype_name(dtype: torch.dtype | str) -> str:
    """'bfloat16' for torch.bfloat16 (and for the string 'bfloat16')."""
    return str(dtype).removeprefix("torch.")


def attention_backend_name(config: Any) -> str:
    """The attention backend the target decodes (and verifies) with, as SGLang resolved it.

    Read from SGLang's published runtime context (the same in the calibration process and in
    a server's scheduler, before or after the runner's backends exist), else from the flags.
    """
    try:
        from sglang.srt.runtime_context import attention_backends

        decode = attention_backends()[1]
    except Exception:  # no published context (e.g. outside a server process)
        decode = None
    if decode:
        return str(decode)
    for field in ("decode_attention_backend", "attention_backend"):
        value = getattr(config, field, None)
        if value:
            return str(value)
    return "auto"


def model_ref(name: str, hf_config: dict[str, Any]) -> ModelRef:
    """A model reference; a config the roofline cannot read is fingerprinted as a whole."""
    try:
        return ModelRef.from_hf_config(name, hf_config)
    except ValueError:  # e.g. an unusual drafter config: any change still changes the hash
        canonical = json.dumps(hf_config, sort_keys=True, default=str, separators=(",", ":"))
        return ModelRef(name=name, config_sha256=hashlib.sha256(canonical.encode()).hexdigest())


def serving_identity(
    *,
    target_name: str,
    target_config: dict[str, Any],
    drafter_name: str | None,
    drafter_config: dict[str, Any] | None,
    dtype: torch.dtype | str,
    attention_backend: str,
    block_size: int,
    tp_size: int,
) -> ProfileIdentity:
    """The ProfileIdentity of a BASTION server configuration."""
    drafter = None
    if drafter_name is not None:
        drafter = model_ref(drafter_name, drafter_config or {})
    return ProfileIdentity(
        target=model_ref(target_name, target_config),
        drafter=drafter,
        dtype=dtype_name(dtype),
        attention_backend=attention_backend,
        block_size=int(block_size),
        tp_size=int(tp_size),
    )


def worker_identity(worker: Any, config: Any) -> ProfileIdentity:
    """The identity of a live BASTION worker (``sglang_bastion.worker.BastionWorker``)."""
    target_config = worker.target_worker.model_runner.model_config
    drafter_config = worker.draft_model_runner.model_config
    return serving_identity(
        target_name=str(config.model_path),
        target_config=target_config.hf_config.to_dict(),
        drafter_name=str(config.speculative_draft_model_path),
        drafter_config=drafter_config.hf_config.to_dict(),
        dtype=target_config.dtype,
        attention_backend=attention_backend_name(config),
        block_size=int(worker.block_size),
        tp_size=int(config.tp_size),
    )


def device_name(device: torch.device) -> str:
    """A readable name of the device kind: the CUDA device name, or the CPU model."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return f"CPU {cpu_model()}"
    return device.type


def cpu_model() -> str:
    """The CPU model string from /proc/cpuinfo, else what the platform module reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def cpu_bf16_flags(cpuinfo: str | None = None) -> str:
    """The CPU's bfloat16 instruction flags in ``cpuinfo`` (default /proc/cpuinfo), or 'none'."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "unknown"
    words = set(cpuinfo.split())
    return ", ".join(flag for flag in BF16_FLAGS if flag in words) or "none"
