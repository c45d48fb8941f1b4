"""Running counters behind /server_info's "bastion" entry."""

from __future__ import annotations

import torch

from sglang_bastion.stats import BastionStats


def test_means_are_per_request_step():
    stats = BastionStats()
    stats.add_step(torch.tensor([16, 8]), torch.tensor([3, 1]), width=16, predicted=None)
    stats.add_step(torch.tensor([4]), torch.tensor([2]), width=4, predicted=None)
    state = stats.as_dict()
    assert state["request_steps"] == 3 and state["tree_nodes"] == 28
    assert state["mean_tree_size"] == 28 / 3 and state["mean_accept_length"] == 2.0
    assert state["verify_tokens"] == 36 and state["mean_batch_size"] == 1.5


def test_timings_average_only_steps_with_a_prediction():
    stats = BastionStats()
    stats.add_step(torch.tensor([4]), torch.tensor([1]), width=4, predicted=2.0)
    stats.add_timing(2.0, 3.0)
    stats.add_timing(None, 50.0)
    state = stats.as_dict()
    assert state["timed_steps"] == 1 and state["mean_observed_verify_ms"] == 3.0
    assert state["last"]["observed_verify_ms"] == 50.0


def test_an_idle_server_reports_no_means():
    state = BastionStats().as_dict()
    assert state["steps"] == 0 and state["mean_tree_size"] is None


def plain_twice(stats: BastionStats, host: bool) -> BastionStats:
    """A speculative step, then two plain steps of 3 requests, counted on the host or not."""
    stats.add_step(torch.tensor([5, 2]), torch.tensor([4, 1]), width=5, predicted=None)
    for _ in range(2):
        if host:
            stats.add_plain_step(3, predicted=1.5)
        else:
            stats.add_step(torch.ones(3, dtype=torch.long), torch.ones(3, dtype=torch.long),
                           width=1, predicted=1.5, plain=True)  # fmt: skip
    return stats


def test_plain_steps_counted_on_the_host_read_as_counted_on_the_device():
    host, device = plain_twice(BastionStats(), True), plain_twice(BastionStats(), False)
    assert host.as_dict() == device.as_dict()
    assert torch.equal(host.packed(), device.packed())
    assert host.as_dict()["plain_steps"] == 2 and host.as_dict()["root_only_request_steps"] == 6


def test_a_server_that_only_stepped_plainly_packs_its_counters():
    stats = BastionStats(max_accept=4)
    stats.add_plain_step(2)
    packed = stats.packed().tolist()
    assert packed[:7] == [1, 1, 2, 2, 2, 2, 2] and packed[7:] == [0, 2, 0, 0, 0]
