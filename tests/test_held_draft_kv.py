"""Plain steps' draft-KV writes are held per batch and made together, oldest first."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_bastion.held_draft_kv import HeldDraftKv, holding_allowed

BATCH = ("a", "b")


def step(value: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One plain step's writes for two requests: features [2, 3], slots [2], positions [2]."""
    return torch.full((2, 3), float(value)), torch.tensor([value, value + 1]), torch.tensor([7, 9])


def test_held_writes_come_out_in_the_order_they_were_held():
    held = HeldDraftKv(limit=8)
    for value in (10, 20, 30):
        assert not held.hold(BATCH, *step(value))
    features, slots, positions = held.take()
    assert features[:, 0].tolist() == [10, 10, 20, 20, 30, 30]
    assert slots.tolist() == [10, 11, 20, 21, 30, 31] and positions.tolist() == [7, 9] * 3
    assert len(held) == 0 and held.take() is None


def test_the_hold_asks_to_be_made_once_its_limit_of_steps_is_held():
    held = HeldDraftKv(limit=2)
    assert not held.hold(BATCH, *step(1))
    assert held.hold(BATCH, *step(2))


def test_writes_belong_to_their_batch_and_another_batch_cannot_add_to_them():
    held = HeldDraftKv()
    assert held.belongs_to(("c",))  # nothing held: any batch may hold
    held.hold(BATCH, *step(1))
    assert held.belongs_to(BATCH) and not held.belongs_to(("a",))  # a request left
    with pytest.raises(ValueError, match="made first"):
        held.hold(("a",), *step(2))
    held.take()
    assert held.belongs_to(("a",))


def test_holding_is_refused_where_something_else_reads_the_draft_kv():
    plain = SimpleNamespace(enable_hierarchical_cache=False)
    assert holding_allowed(plain, SimpleNamespace(lilicorr=None)) is None
    hicache = SimpleNamespace(enable_hierarchical_cache=True)
    assert "hierarchical cache" in holding_allowed(hicache, SimpleNamespace(lilicorr=None))
    assert "LiLiCorr" in holding_allowed(plain, SimpleNamespace(lilicorr=object()))
