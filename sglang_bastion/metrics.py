"""BASTION's controller on SGLang's Prometheus endpoint (``--enable-metrics``).

The scheduler process writes SGLang's own metrics through ``prometheus_client`` in its
multi-process mode; these series go through the same machinery, with SGLang's labels
(``model_name``, ``tp_rank``), so ``/metrics`` serves them beside ``sglang:spec_accept_length``.

Every ``interval`` decode steps (SGLang's ``--decode-log-interval``) the worker snapshots its
cumulative counters (``BastionStats.packed``) into a copy read one interval later
(`LateRead`): each snapshot publishes the interval that ended at the one before it, so no
step waits for the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang_bastion.late_read import LateRead
from sglang_bastion.stats import PACKED, BastionStats

_AT = {name: i for i, name in enumerate(PACKED)}


@dataclass
class BastionMetrics:
    """The Prometheus series of one BASTION worker, and its snapshots in flight and landed."""

    labels: dict[str, str]
    series: dict[str, Any]
    interval: int
    pending: LateRead | None = None
    last: list[float] | None = None


def create_metrics(labels: dict[str, Any], interval: int, registry: Any = None) -> BastionMetrics:
    """The series, registered once per scheduler process (in ``registry``, default the
    process's own, which SGLang's multi-process collection reads)."""
    from prometheus_client import REGISTRY, Counter, Gauge  # after PROMETHEUS_MULTIPROC_DIR

    names, registry = list(labels), registry or REGISTRY

    def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
        return Gauge(
            name, doc, labelnames=[*names, *extra], multiprocess_mode="mostrecent",
            registry=registry,
        )  # fmt: skip

    def counter(name: str, doc: str) -> Any:
        return Counter(name, doc, labelnames=names, registry=registry)

    series = {
        "steps": counter("sglang:bastion_steps", "BASTION decode steps."),
        "plain_steps": counter(
            "sglang:bastion_plain_steps",
            "BASTION decode steps that decoded plainly (every request its root alone).",
        ),
        "mean_tree_size": gauge(
            "sglang:bastion_mean_tree_size", "Mean verified tree size per request (nodes)."
        ),
        "verify_width": gauge(
            "sglang:bastion_verify_width", "Mean verify width W (tokens per request per pass)."
        ),
        "predicted_accept_length": gauge(
            "sglang:bastion_predicted_accept_length",
            "Mean tokens per request-step the controller priced (A_cal, or A_hat unlearned).",
        ),
        "realised_accept_length": gauge(
            "sglang:bastion_realised_accept_length",
            "Mean tokens per request-step emitted (accepted drafts and the bonus).",
        ),
        "accept_depth_share": gauge(
            "sglang:bastion_accept_depth_share",
            "Share of request-steps whose accepted path reached this draft depth.",
            ("depth",),
        ),
        "plain_step_share": gauge(
            "sglang:bastion_plain_step_share", "Share of decode steps that decoded plainly."
        ),
        "root_only_share": gauge(
            "sglang:bastion_root_only_request_share",
            "Share of request-steps that verified their root alone (no speculation for it).",
        ),
    }
    return BastionMetrics({k: str(v) for k, v in labels.items()}, series, max(1, interval))


def after_step(metrics: BastionMetrics, stats: BastionStats) -> None:
    """Every ``interval`` steps: snapshot the counters, publish the last interval landed."""
    if stats.steps % metrics.interval:
        return
    landed = metrics.pending.values() if metrics.pending is not None else None
    packed = stats.packed()
    if packed is None:
        return
    if metrics.pending is None or landed is not None:  # else the last copy is still in flight
        metrics.pending = LateRead(packed)
    if landed is None:
        return
    before = metrics.last or [0.0] * len(landed)  # the first interval starts at zero
    publish(metrics, [now - then for now, then in zip(landed, before, strict=True)])
    metrics.last = landed


def publish(metrics: BastionMetrics, delta: list[float]) -> None:
    """Set every series from one interval's counter deltas (`PACKED` order, then counts)."""
    s, labels = metrics.series, metrics.labels
    steps, requests = delta[_AT["steps"]], delta[_AT["request_steps"]]
    if steps <= 0 or requests <= 0:
        return
    counts = delta[len(PACKED) :]  # request-steps by tokens emitted: 0, 1, ..., D + 1
    emitted = sum(length * n for length, n in enumerate(counts))
    s["steps"].labels(**labels).inc(steps)
    s["plain_steps"].labels(**labels).inc(delta[_AT["plain_steps"]])
    s["mean_tree_size"].labels(**labels).set(delta[_AT["tree_nodes"]] / requests)
    s["verify_width"].labels(**labels).set(delta[_AT["verify_tokens"]] / requests)
    s["predicted_accept_length"].labels(**labels).set(delta[_AT["priced_tokens"]] / requests)
    s["realised_accept_length"].labels(**labels).set(emitted / requests)
    for depth in range(1, len(counts) - 1):  # depth d reached: more than d tokens emitted
        reached = sum(counts[depth + 1 :])
        s["accept_depth_share"].labels(**labels, depth=str(depth)).set(reached / requests)
    s["plain_step_share"].labels(**labels).set(delta[_AT["plain_steps"]] / steps)
    s["root_only_share"].labels(**labels).set(delta[_AT["root_only"]] / requests)
