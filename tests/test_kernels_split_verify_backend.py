"""``SGLANG_BASTION_SPLIT_VERIFY=1``: bastion_cpu verifies trees without building the full mask."""

from __future__ import annotations

import pytest
import torch
from test_cpu_attention import TOLERANCE, Harness, run
from test_cpu_attention import sglang_context as sglang_context  # the fixture, re-exported

from sglang_bastion.cpu_attention import BACKEND_NAME, plan
from sglang_bastion.tree import TreeBatch
from sglang_bastion.tree.verify_inputs import verify_inputs_reference

NODES = 6


def padded_trees() -> TreeBatch:
    """Three width-6 trees: full, a 3-node chain then padding, bushy with one padding slot."""
    parents = torch.tensor([[-1, 0, 0, 1, 2, 3], [-1, 0, 1, -1, -1, -1], [-1, 0, 0, 0, 1, -1]])
    depths = torch.tensor([[0, 1, 1, 2, 2, 3], [0, 1, 2, 0, 0, 0], [0, 1, 1, 1, 2, 0]])
    num_nodes = torch.tensor([6, 3, 5])
    real = torch.arange(NODES) < num_nodes.unsqueeze(1)
    return TreeBatch(
        token_ids=torch.zeros(3, NODES, dtype=torch.long),
        parents=parents,
        depths=depths,
        log_scores=torch.where(real, -depths.float(), float("-inf")),
        num_nodes=num_nodes,
    )


@pytest.fixture
def harness(sglang_context) -> Harness:
    return Harness()


def backend(harness: Harness, monkeypatch, split: str):
    monkeypatch.setenv("SGLANG_BASTION_SPLIT_VERIFY", split)
    return harness.backend(BACKEND_NAME)


def test_split_verify_equals_the_full_mask_path(harness, monkeypatch):
    prefix_lens = [5, 9, 0]
    mask = verify_inputs_reference(padded_trees(), torch.tensor(prefix_lens)).custom_mask
    batch = harness.verify_batch(prefix_lens, NODES, custom_mask=mask)
    q, k, v = harness.qkv(3 * NODES)
    expected = run(backend(harness, monkeypatch, "0"), batch, harness.layer(), q, k, v)
    actual = run(backend(harness, monkeypatch, "1"), batch, harness.layer(), q, k, v)
    torch.testing.assert_close(actual, expected, **TOLERANCE)


def test_split_verify_builds_no_full_mask(harness, monkeypatch):
    mask = verify_inputs_reference(padded_trees(), torch.tensor([4, 4, 4])).custom_mask
    batch = harness.verify_batch([4, 4, 4], NODES, custom_mask=mask)
    split = backend(harness, monkeypatch, "1")

    def refuse(*args, **kwargs):
        raise AssertionError("the [B, N, prefix + N] mask was built")

    monkeypatch.setattr(plan.CpuForwardMetadata, "mask", refuse)
    run(split, batch, harness.layer(), *harness.qkv(3 * NODES))


def test_split_verify_is_off_by_default(harness, monkeypatch):
    monkeypatch.delenv("SGLANG_BASTION_SPLIT_VERIFY", raising=False)
    assert harness.backend(BACKEND_NAME).split_verify is False
