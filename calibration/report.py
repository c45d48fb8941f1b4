"""From measurements to files: fit the calibration, write the profile JSON and its figure."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from sglang_bastion.budget import LatencyProfile, ModelShape, build_profile, save_profile
from sglang_bastion.budget.identity import device_name, worker_identity
from sglang_bastion.calibration.figure import plot_profile
from sglang_bastion.calibration.hardware import device_hardware
from sglang_bastion.calibration.measure import Measurements
from sglang_bastion.calibration.runtime import Runtime

BYTES_PER_ELEM = {"float32": 4, "float16": 2, "bfloat16": 2}


def can_fit(measured: Measurements) -> bool:
    """Whether there is enough to fit: two verify widths or sizes, T_aux and L_AR."""
    shapes = {(p.batch_size, p.tokens_per_request) for p in measured.grid()}
    return len(shapes) >= 2 and bool(measured.t_aux_table()) and bool(measured.l_ar_table())


def measurement_table(measured: Measurements) -> str:
    """The timed verify shapes as text lines: batch size, tokens, context, latency."""
    lines = [f"batch  tokens  context  latency_ms ({measured.statistic})"]
    lines += [
        f"{p.batch_size:5d}  {p.tokens_per_request:6d}  {p.context_len:7d}  {p.latency_ms:10.3f}"
        for p in measured.grid()
    ]
    lines.append(f"T_aux ms by batch size: {measured.t_aux_table()}")
    lines.append(f"L_AR ms by batch size:  {measured.l_ar_table()}")
    return "\n".join(lines)


def write_profile(
    runtime: Runtime,
    measured: Measurements,
    output: Path | None,
    default_output: Callable[[object, str], Path],
) -> tuple[LatencyProfile, Path, Path] | None:
    """Fit, then write the profile and its PNG; None when too little was measured."""
    if not can_fit(measured):
        return None
    model_config = runtime.model_runner.model_config
    shape = ModelShape.from_hf_config(model_config.hf_config.to_dict())
    name = device_name(runtime.device)
    identity = worker_identity(runtime.worker, runtime.server_args)  # as the server calls it
    profile = build_profile(
        identity=identity,
        hardware=device_hardware(runtime.device, runtime.dtype),
        device_name=name,
        shape=shape,
        grid=measured.grid(),
        t_aux_ms=measured.t_aux_table(),
        l_ar_ms=measured.l_ar_table(),
        bytes_per_elem=BYTES_PER_ELEM.get(identity.dtype, 2),
    )
    json_path = (output or default_output(runtime.config, name)).resolve()
    json_path.parent.mkdir(parents=True, exist_ok=True)
    save_profile(profile, json_path)
    png_path = plot_profile(profile, shape, json_path.with_suffix(".png"))
    return profile, json_path, png_path
