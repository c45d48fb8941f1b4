"""The controller's Prometheus series: what each one says about an interval of steps."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

from sglang_bastion.metrics import after_step, create_metrics
from sglang_bastion.stats import BastionStats

LABELS = {"model_name": "m", "tp_rank": 0}


def sample(registry: CollectorRegistry, name: str, **extra: str) -> float | None:
    """A series' value under the test labels."""
    return registry.get_sample_value(name, {"model_name": "m", "tp_rank": "0", **extra})


def step(stats: BastionStats, sizes, emitted, width, plain=False, priced=None) -> None:
    """One decode step's counts."""
    priced = None if priced is None else torch.tensor(priced, dtype=torch.float64)
    stats.add_step(torch.tensor(sizes), torch.tensor(emitted), width, None, plain, priced)


@pytest.fixture
def served():
    """Three snapshots, every 2 steps: the third publishes the interval of steps 3 and 4."""
    registry = CollectorRegistry()
    metrics = create_metrics(LABELS, interval=2, registry=registry)
    stats = BastionStats(max_accept=4)
    for sizes, emitted, width, plain, priced in [
        ([4, 4], [1, 2], 4, False, [2.0, 2.0]),
        ([4, 4], [3, 1], 4, False, [2.0, 2.0]),  # snapshot 1: its copy starts
        ([8, 8], [4, 3], 8, False, [3.0, 3.5]),
        ([1, 1], [1, 1], 1, True, None),  # snapshot 2: steps 1-2 are published
        ([8, 8], [2, 2], 8, False, [3.0, 3.0]),
        ([8, 8], [2, 2], 8, False, [3.0, 3.0]),  # snapshot 3: steps 3-4 are published
    ]:
        step(stats, sizes, emitted, width, plain, priced)
        after_step(metrics, stats)
    return registry


def test_each_snapshot_publishes_the_interval_before_it(served):
    # steps 3 and 4: trees of 8 and a plain step; 4 + 3 + 1 + 1 tokens over 4 request-steps
    assert sample(served, "sglang:bastion_mean_tree_size") == pytest.approx(4.5)
    assert sample(served, "sglang:bastion_realised_accept_length") == pytest.approx(2.25)
    assert sample(served, "sglang:bastion_predicted_accept_length") == pytest.approx(8.5 / 4)
    assert sample(served, "sglang:bastion_verify_width") == pytest.approx(4.5)


def test_counters_add_every_published_interval(served):
    assert sample(served, "sglang:bastion_steps_total") == 4.0  # two intervals of two steps
    assert sample(served, "sglang:bastion_plain_steps_total") == 1.0


def test_depth_shares_count_the_request_steps_that_reached_each_depth(served):
    shares = [sample(served, "sglang:bastion_accept_depth_share", depth=str(d)) for d in (1, 2, 3)]
    assert shares == [0.5, 0.5, 0.25]  # 4, 3, 1 and 1 tokens: depths 3, 2, 0 and 0 reached


def test_plain_shares_count_steps_and_root_only_requests():
    registry = CollectorRegistry()
    metrics = create_metrics(LABELS, interval=2, registry=registry)
    stats = BastionStats(max_accept=4)
    for plain in (False, False, True, False, True, True):
        step(stats, [1, 1] if plain else [4, 1], [1, 1], 1 if plain else 4, plain)
        after_step(metrics, stats)
    # the last interval published: steps 3 and 4, one plain, and 3 of 4 requests root-only
    assert sample(registry, "sglang:bastion_plain_step_share") == 0.5
    assert sample(registry, "sglang:bastion_root_only_request_share") == 0.75


def test_nothing_is_published_before_a_snapshot_landed():
    registry = CollectorRegistry()
    metrics = create_metrics(LABELS, interval=2, registry=registry)
    stats = BastionStats(max_accept=4)
    for _ in range(3):
        step(stats, [4], [2], 4)
        after_step(metrics, stats)
    assert sample(registry, "sglang:bastion_mean_tree_size") is None
