"""The latency profile: a versioned JSON file of verify timings and their roofline calibration.

One profile is measured per (GPU, target, drafter, dtype, attention backend, block size, TP)
configuration (paper Appendix G.3); tasks, context lengths and concurrency reuse it. Layout::

    {
      "schema_version": 1,
      "identity": {"target": {"name": str, "config_sha256": hex}, "drafter": same | null,
                   "dtype": str, "attention_backend": str, "block_size": int, "tp_size": int},
      "hardware": {"name": str, "peak_flops": FLOP/s, "bandwidth": bytes/s, "device_name": str},
      "grid": [{"batch_size": int, "tokens_per_request": int, "context_len": int,
                "latency_ms": float}, ...],
      "calibration": {"slope": float, "intercept_ms": float, "bytes_per_elem": float},
      "rmse_ms": {"roofline": float, "calibrated": float},
      "t_aux_ms": [[batch_size, ms], ...],   # drafting + tree building, by batch size
      "l_ar_ms": [[batch_size, ms], ...],    # one plain autoregressive target step
      "created_at": ISO-8601 str,
      "tool": str
    }

``load_profile`` checks every field and reports the first problem as one line naming the file,
the field path and the fix.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

from sglang_bastion.budget.roofline import Hardware, ModelShape, roofline_ms

SCHEMA_VERSION = 1
RECALIBRATE = "re-run bastion-calibrate to regenerate the profile"


class ProfileError(ValueError):
    """A latency profile that is unreadable, malformed or measured for another configuration."""


def config_fingerprint(hf_config: dict[str, Any]) -> str:
    """sha256 of the model dimensions that determine verify cost (the resolved ModelShape)."""
    shape = ModelShape.from_hf_config(hf_config)
    canonical = json.dumps(asdict(shape), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class ModelRef:
    """A model named by its path or hub id and fingerprinted by its cost-relevant config."""

    name: str
    config_sha256: str

    @classmethod
    def from_hf_config(cls, name: str, hf_config: dict[str, Any]) -> ModelRef:
        """Reference ``name`` with the fingerprint of its config.json."""
        return cls(name=name, config_sha256=config_fingerprint(hf_config))


@dataclass(frozen=True)
class ProfileIdentity:
    """Everything that changes kernel latency, so a profile is only valid when it matches."""

    target: ModelRef
    drafter: ModelRef | None
    dtype: str  # e.g. "bfloat16"
    attention_backend: str  # e.g. "flashinfer", "triton", "fa3"
    block_size: int  # drafter block size (draft depth + 1)
    tp_size: int  # tensor-parallel degree of the target


@dataclass(frozen=True)
class GridPoint:
    """One timed verify pass: B requests x t tokens at prefix length c."""

    batch_size: int
    tokens_per_request: int
    context_len: int
    latency_ms: float


@dataclass(frozen=True)
class Calibration:
    """latency ~= slope * roofline + intercept, with the bytes per element of the roofline."""

    slope: float
    intercept_ms: float
    bytes_per_elem: float = 2

    def apply(self, roofline: torch.Tensor) -> torch.Tensor:
        """Calibrated latency (ms) from a bare roofline latency (ms)."""
        return self.slope * roofline + self.intercept_ms


@dataclass(frozen=True)
class LatencyProfile:
    """A parsed, validated latency profile."""

    identity: ProfileIdentity
    hardware: Hardware
    device_name: str  # torch.cuda.get_device_name() where it was measured
    grid: tuple[GridPoint, ...]
    calibration: Calibration
    rmse_roofline_ms: float
    rmse_calibrated_ms: float
    t_aux_ms: tuple[tuple[int, float], ...]  # (batch size, ms), batch sizes increasing
    l_ar_ms: tuple[tuple[int, float], ...]  # (batch size, ms), batch sizes increasing
    created_at: str  # ISO 8601
    tool: str
    schema_version: int = SCHEMA_VERSION


def _grid_tensors(grid: Sequence[GridPoint]) -> tuple[torch.Tensor, ...]:
    """[P] float64 tensors: batch sizes, tokens per request, context lengths, latencies."""
    columns = zip(
        *((p.batch_size, p.tokens_per_request, p.context_len, p.latency_ms) for p in grid),
        strict=True,
    )
    return tuple(torch.tensor(col, dtype=torch.float64) for col in columns)


def fit_calibration(
    shape: ModelShape,
    hardware: Hardware,
    grid: Sequence[GridPoint],
    bytes_per_elem: float = 2,
) -> tuple[Calibration, float, float]:
    """Least-squares fit of measured latency on the roofline; RMSE (ms) before and after."""
    if len(grid) < 2:
        raise ValueError(f"calibration needs at least 2 grid points, got {len(grid)}")
    batch, tokens, context, measured = _grid_tensors(grid)  # [P] each
    predicted = roofline_ms(shape, hardware, batch, tokens, context, bytes_per_elem)  # [P]
    centred = predicted - predicted.mean()
    spread = float((centred * centred).sum())
    if spread <= 1e-12 * float((predicted * predicted).sum()):
        raise ValueError("calibration grid has one roofline value: vary batch size and tokens")
    slope = float((centred * (measured - measured.mean())).sum()) / spread
    intercept = float(measured.mean()) - slope * float(predicted.mean())
    if slope <= 0:
        raise ValueError(
            f"fitted calibration slope {slope:.4g} <= 0: measured latency does not grow with the "
            "roofline; widen the grid (larger batch sizes and tokens per request)"
        )
    calibration = Calibration(slope=slope, intercept_ms=intercept, bytes_per_elem=bytes_per_elem)
    rmse_before = float((measured - predicted).square().mean().sqrt())
    rmse_after = float((measured - calibration.apply(predicted)).square().mean().sqrt())
    return calibration, rmse_before, rmse_after


def default_tool() -> str:
    """'sglang-bastion <version>' for the profile's tool field."""
    try:
        return f"sglang-bastion {version('sglang-bastion')}"
    except PackageNotFoundError:
        return "sglang-bastion (source tree)"


def build_profile(
    identity: ProfileIdentity,
    hardware: Hardware,
    device_name: str,
    shape: ModelShape,
    grid: Sequence[GridPoint],
    t_aux_ms: Sequence[tuple[int, float]],
    l_ar_ms: Sequence[tuple[int, float]],
    bytes_per_elem: float = 2,
    tool: str | None = None,
) -> LatencyProfile:
    """A profile from measurements: fits the calibration and stamps the time and tool."""
    calibration, rmse_before, rmse_after = fit_calibration(shape, hardware, grid, bytes_per_elem)
    profile = LatencyProfile(
        identity=identity,
        hardware=hardware,
        device_name=device_name,
        grid=tuple(grid),
        calibration=calibration,
        rmse_roofline_ms=rmse_before,
        rmse_calibrated_ms=rmse_after,
        t_aux_ms=tuple((int(b), float(ms)) for b, ms in sorted(t_aux_ms)),
        l_ar_ms=tuple((int(b), float(ms)) for b, ms in sorted(l_ar_ms)),
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        tool=tool or default_tool(),
    )
    try:
        _parse(profile_to_dict(profile))  # fail now, not when the server loads it
    except _Invalid as err:
        raise ProfileError(f"invalid measurements: {err}") from None
    return profile


# ---------------------------------------------------------------------------------------------
# Serialisation


def _model_ref_dict(ref: ModelRef | None) -> dict[str, str] | None:
    """JSON form of a ModelRef."""
    return None if ref is None else {"name": ref.name, "config_sha256": ref.config_sha256}


def profile_to_dict(profile: LatencyProfile) -> dict[str, Any]:
    """The JSON-ready form of a profile."""
    identity = profile.identity
    return {
        "schema_version": profile.schema_version,
        "identity": {
            "target": _model_ref_dict(identity.target),
            "drafter": _model_ref_dict(identity.drafter),
            "dtype": identity.dtype,
            "attention_backend": identity.attention_backend,
            "block_size": identity.block_size,
            "tp_size": identity.tp_size,
        },
        "hardware": {
            "name": profile.hardware.name,
            "peak_flops": profile.hardware.peak_flops,
            "bandwidth": profile.hardware.bandwidth,
            "device_name": profile.device_name,
        },
        "grid": [asdict(p) for p in profile.grid],
        "calibration": asdict(profile.calibration),
        "rmse_ms": {
            "roofline": profile.rmse_roofline_ms,
            "calibrated": profile.rmse_calibrated_ms,
        },
        "t_aux_ms": [[b, ms] for b, ms in profile.t_aux_ms],
        "l_ar_ms": [[b, ms] for b, ms in profile.l_ar_ms],
        "created_at": profile.created_at,
        "tool": profile.tool,
    }


def save_profile(profile: LatencyProfile, path: str | Path) -> None:
    """Validate ``profile`` and write it as JSON to ``path``."""
    data = profile_to_dict(profile)
    try:
        _parse(data)
    except _Invalid as err:
        raise ProfileError(f"refusing to write {path}: {err}") from None
    Path(path).write_text(json.dumps(data, indent=2, allow_nan=False) + "\n")


def load_profile(
    path: str | Path,
    expect: ProfileIdentity | None = None,
    *,
    expect_device_name: str | None = None,
) -> LatencyProfile:
    """Read and validate a profile; with ``expect``, also require it to match this server."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ProfileError(
            f"{path}: cannot read latency profile ({err.strerror}): run bastion-calibrate to "
            "create it, or pass the right path"
        ) from None
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except (json.JSONDecodeError, ValueError) as err:
        raise ProfileError(f"{path}: not valid JSON ({err}); {RECALIBRATE}") from None
    try:
        profile = _parse(data)
    except _Invalid as err:
        raise ProfileError(f"{path}: {err}") from None
    if expect is not None:
        _check_identity(path, profile.identity, expect)
    if expect_device_name is not None and profile.device_name != expect_device_name:
        raise ProfileError(
            f"{path}: hardware.device_name: profile was measured on {profile.device_name!r}, "
            f"this server runs on {expect_device_name!r}: run bastion-calibrate on this device"
        )
    return profile


def _reject_constant(name: str) -> Any:
    """json hook: NaN and Infinity are not valid latencies."""
    raise ValueError(f"non-finite number {name}")


def _check_identity(path: Path, found: ProfileIdentity, expect: ProfileIdentity) -> None:
    """Raise naming the first identity field where the profile and this server differ."""
    for role in ("target", "drafter"):
        have, want = getattr(found, role), getattr(expect, role)
        if (have is None) != (want is None):
            raise ProfileError(
                f"{path}: identity.{role}: profile was measured with {role}="
                f"{have and have.name!r}, this server uses {want and want.name!r}: run "
                "bastion-calibrate for this configuration"
            )
        if have is not None and have.config_sha256 != want.config_sha256:
            raise ProfileError(
                f"{path}: identity.{role}.config_sha256: profile was measured for {role} "
                f"{have.name!r} (config {have.config_sha256[:12]}), this server uses "
                f"{want.name!r} (config {want.config_sha256[:12]}): run bastion-calibrate for "
                "this configuration"
            )
    for field in ("dtype", "attention_backend", "block_size", "tp_size"):
        have, want = getattr(found, field), getattr(expect, field)
        if have != want:
            raise ProfileError(
                f"{path}: identity.{field}: profile was measured for {field}={have!r}, this "
                f"server uses {want!r}: run bastion-calibrate for this configuration"
            )


# ---------------------------------------------------------------------------------------------
# Validation: each reader takes the value and its field path, returns it typed or raises.


class _Invalid(Exception):
    """A field that fails validation; str() is 'field.path: problem; fix'."""


def _fail(where: str, problem: str, fix: str = RECALIBRATE) -> _Invalid:
    """The exception for one bad field."""
    return _Invalid(f"{where}: {problem}; {fix}")


def _object(value: Any, where: str, required: Sequence[str]) -> dict[str, Any]:
    """A JSON object with exactly the ``required`` keys."""
    if not isinstance(value, dict):
        raise _fail(where or "<top level>", f"expected an object, got {_kind(value)}")
    prefix = f"{where}." if where else ""
    for key in required:
        if key not in value:
            raise _fail(f"{prefix}{key}", "missing")
    for key in value:
        if key not in required:
            raise _fail(
                f"{prefix}{key}",
                "unknown key",
                f"remove it (known keys: {', '.join(required)}) or {RECALIBRATE}",
            )
    return value


def _kind(value: Any) -> str:
    """JSON type name of a value, for messages."""
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    names.update({list: "a list", dict: "an object", type(None): "null"})
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{names.get(type(value), type(value).__name__)} ({text})"


def _int(value: Any, where: str, minimum: int) -> int:
    """An integer >= minimum (booleans rejected)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(where, f"expected an integer, got {_kind(value)}")
    if value < minimum:
        raise _fail(where, f"expected an integer >= {minimum}, got {value}")
    return value


def _number(value: Any, where: str, *, positive: bool = False, nonneg: bool = False) -> float:
    """A finite number, optionally > 0 or >= 0 (booleans rejected)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _fail(where, f"expected a number, got {_kind(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise _fail(where, f"expected a finite number, got {value}")
    if positive and value <= 0:
        raise _fail(where, f"expected a positive number, got {value}")
    if nonneg and value < 0:
        raise _fail(where, f"expected a number >= 0, got {value}")
    return value


def _str(value: Any, where: str) -> str:
    """A non-empty string."""
    if not isinstance(value, str) or not value:
        raise _fail(where, f"expected a non-empty string, got {_kind(value)}")
    return value


def _list(value: Any, where: str) -> list[Any]:
    """A non-empty list."""
    if not isinstance(value, list):
        raise _fail(where, f"expected a list, got {_kind(value)}")
    if not value:
        raise _fail(where, "expected a non-empty list, got []")
    return value


def _model_ref(value: Any, where: str) -> ModelRef:
    """A {name, config_sha256} object."""
    obj = _object(value, where, ("name", "config_sha256"))
    digest = _str(obj["config_sha256"], f"{where}.config_sha256")
    if not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise _fail(f"{where}.config_sha256", f"expected 64 lowercase hex digits, got {digest!r}")
    return ModelRef(name=_str(obj["name"], f"{where}.name"), config_sha256=digest)


def _optional_model_ref(value: Any, where: str) -> ModelRef | None:
    """A {name, config_sha256} object or null."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _fail(where, f"expected an object or null, got {_kind(value)}")
    return _model_ref(value, where)


def _batch_table(value: Any, where: str, *, positive: bool) -> tuple[tuple[int, float], ...]:
    """A non-empty list of [batch_size, ms] pairs with strictly increasing batch sizes."""
    rows = []
    for i, row in enumerate(_list(value, where)):
        if not isinstance(row, list) or len(row) != 2:
            raise _fail(f"{where}[{i}]", f"expected a [batch_size, ms] pair, got {_kind(row)}")
        batch = _int(row[0], f"{where}[{i}][0]", minimum=1)
        ms = _number(row[1], f"{where}[{i}][1]", positive=positive, nonneg=not positive)
        if rows and batch <= rows[-1][0]:
            raise _fail(
                f"{where}[{i}][0]", f"batch sizes must increase, got {batch} after {rows[-1][0]}"
            )
        rows.append((batch, ms))
    return tuple(rows)


_TOP_KEYS = (
    "schema_version",
    "identity",
    "hardware",
    "grid",
    "calibration",
    "rmse_ms",
    "t_aux_ms",
    "l_ar_ms",
    "created_at",
    "tool",
)


def _parse(data: Any) -> LatencyProfile:
    """Validate the JSON form of a profile and build it."""
    if isinstance(data, dict) and "schema_version" in data:
        found = data["schema_version"]
        if isinstance(found, bool) or found != SCHEMA_VERSION:
            raise _fail(
                "schema_version",
                f"unsupported version {found!r}, this build reads {SCHEMA_VERSION}",
                "re-run bastion-calibrate with this version of sglang-bastion",
            )
    top = _object(data, "", _TOP_KEYS)

    ident = _object(
        top["identity"],
        "identity",
        ("target", "drafter", "dtype", "attention_backend", "block_size", "tp_size"),
    )
    identity = ProfileIdentity(
        target=_model_ref(ident["target"], "identity.target"),
        drafter=_optional_model_ref(ident["drafter"], "identity.drafter"),
        dtype=_str(ident["dtype"], "identity.dtype"),
        attention_backend=_str(ident["attention_backend"], "identity.attention_backend"),
        block_size=_int(ident["block_size"], "identity.block_size", minimum=1),
        tp_size=_int(ident["tp_size"], "identity.tp_size", minimum=1),
    )

    hw = _object(top["hardware"], "hardware", ("name", "peak_flops", "bandwidth", "device_name"))
    hardware = Hardware(
        name=_str(hw["name"], "hardware.name"),
        peak_flops=_number(hw["peak_flops"], "hardware.peak_flops", positive=True),
        bandwidth=_number(hw["bandwidth"], "hardware.bandwidth", positive=True),
    )

    grid = []
    for i, point in enumerate(_list(top["grid"], "grid")):
        where = f"grid[{i}]"
        obj = _object(
            point, where, ("batch_size", "tokens_per_request", "context_len", "latency_ms")
        )
        grid.append(
            GridPoint(
                batch_size=_int(obj["batch_size"], f"{where}.batch_size", minimum=1),
                tokens_per_request=_int(
                    obj["tokens_per_request"], f"{where}.tokens_per_request", minimum=1
                ),
                context_len=_int(obj["context_len"], f"{where}.context_len", minimum=0),
                latency_ms=_number(obj["latency_ms"], f"{where}.latency_ms", positive=True),
            )
        )

    cal = _object(top["calibration"], "calibration", ("slope", "intercept_ms", "bytes_per_elem"))
    calibration = Calibration(
        slope=_number(cal["slope"], "calibration.slope", positive=True),
        intercept_ms=_number(cal["intercept_ms"], "calibration.intercept_ms"),
        bytes_per_elem=_number(cal["bytes_per_elem"], "calibration.bytes_per_elem", positive=True),
    )

    rmse = _object(top["rmse_ms"], "rmse_ms", ("roofline", "calibrated"))
    created_at = _str(top["created_at"], "created_at")
    try:
        datetime.fromisoformat(created_at)
    except ValueError:
        raise _fail("created_at", f"expected an ISO 8601 time, got {created_at!r}") from None

    return LatencyProfile(
        identity=identity,
        hardware=hardware,
        device_name=_str(hw["device_name"], "hardware.device_name"),
        grid=tuple(grid),
        calibration=calibration,
        rmse_roofline_ms=_number(rmse["roofline"], "rmse_ms.roofline", nonneg=True),
        rmse_calibrated_ms=_number(rmse["calibrated"], "rmse_ms.calibrated", nonneg=True),
        t_aux_ms=_batch_table(top["t_aux_ms"], "t_aux_ms", positive=False),
        l_ar_ms=_batch_table(top["l_ar_ms"], "l_ar_ms", positive=True),
        created_at=created_at,
        tool=_str(top["tool"], "tool"),
    )
