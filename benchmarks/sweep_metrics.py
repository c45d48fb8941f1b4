"""One sweep cell's numbers from bench_serving's result and the server's own counters."""

from __future__ import annotations

# (cell key, bench_serving result key)
LATENCY_KEYS = [
    ("ttft_mean_ms", "mean_ttft_ms"),
    ("ttft_p50_ms", "median_ttft_ms"),
    ("ttft_p99_ms", "p99_ttft_ms"),
    ("itl_mean_ms", "mean_itl_ms"),
    ("itl_p50_ms", "median_itl_ms"),
    ("itl_p99_ms", "p99_itl_ms"),
]
BASTION_COUNTERS = ("request_steps", "tree_nodes", "accepted_tokens")


def scheduler_state(info: dict) -> dict:
    """``internal_states[0]`` of a /server_info reply ({} when absent)."""
    states = info.get("internal_states") or [{}]
    return states[0] or {}


def bastion_deltas(before: dict, after: dict) -> dict[str, float] | None:
    """BASTION's cumulative counters accrued between two /server_info replies, if reported."""
    old, new = scheduler_state(before).get("bastion"), scheduler_state(after).get("bastion")
    if not isinstance(old, dict) or not isinstance(new, dict):
        return None
    if any(key not in old or key not in new for key in BASTION_COUNTERS):
        return None
    deltas = {key: float(new[key]) - float(old[key]) for key in BASTION_COUNTERS}
    return deltas if deltas["request_steps"] > 0 else None


def acceptance(algorithm: str, result: dict, deltas: dict[str, float] | None) -> tuple:
    """Average accepted length per request-step (drafts + bonus) and where it comes from."""
    if algorithm == "NONE":
        return 1.0, "no speculation"
    if deltas is not None:
        return deltas["accepted_tokens"] / deltas["request_steps"], "bastion counters"
    value = result.get("accept_length")
    if value:
        return float(value), "sglang avg_spec_accept_length"
    return None, "not reported"


def tree_size(algorithm: str, after: dict, deltas: dict[str, float] | None) -> tuple:
    """Mean verified tree size per request-step (nodes, root included) and its source."""
    if algorithm == "NONE":
        return 1.0, "no speculation"
    if deltas is not None:
        return deltas["tree_nodes"] / deltas["request_steps"], "bastion counters"
    configured = after.get("speculative_num_draft_tokens")
    if configured is None:
        return None, "not reported"
    source = "configured N (no bastion counters)" if algorithm == "BASTION" else "block size"
    return float(configured), source


def cell_metrics(
    method: str, algorithm: str, concurrency: int, result: dict, before: dict, after: dict
) -> dict[str, object]:
    """The recorded numbers of one (method, concurrency) cell."""
    deltas = bastion_deltas(before, after)
    accept, accept_source = acceptance(algorithm, result, deltas)
    size, size_source = tree_size(algorithm, after, deltas)
    cell: dict[str, object] = {
        "method": method,
        "concurrency": concurrency,
        "output_tok_s": float(result["output_throughput"]),
        "request_s": float(result["request_throughput"]),
    }
    cell |= {key: float(result[source]) for key, source in LATENCY_KEYS}
    cell |= {
        "accept_len": accept,
        "tree_size": size,
        "completed": int(result["completed"]),
        "output_tokens": int(result["total_output_tokens"]),
        "duration_s": float(result["duration"]),
        "accept_source": accept_source,
        "tree_source": size_source,
    }
    if deltas is not None:
        cell["bastion_deltas"] = deltas
    controller = (scheduler_state(after).get("bastion") or {}).get("controller") or {}
    if controller.get("overhead_ms"):  # what the adaptive controller had measured by the end
        cell["controller_overhead_ms"] = controller["overhead_ms"]
    return cell
