"""Every tree op runs once per verify width the controller can choose, before serving."""

from __future__ import annotations

import torch

from sglang_bastion.controller import Controller, width_ladder
from sglang_bastion.tree import warmup

CPU = torch.device("cpu")


def test_every_ladder_width_is_warmed():
    widths = width_ladder(32)
    warmed = warmup.warm_tree_ops(CPU, widths, depth=7, top_k=4, max_nodes=32, window=32)
    assert warmed == list(widths)


def test_each_width_runs_verify_inputs_and_acceptance(monkeypatch):
    calls = []
    for name in ("verify_inputs", "accept"):
        op = getattr(warmup, name)
        monkeypatch.setattr(warmup, name, lambda trees, *a, op=op, name=name, **k: (
            calls.append((name, trees.max_nodes)), op(trees, *a, **k))[1])  # fmt: skip
    warmup.warm_tree_ops(CPU, (4, 8), depth=7, top_k=4, max_nodes=8, window=8)
    assert calls == [("verify_inputs", 4), ("accept", 4), ("verify_inputs", 8), ("accept", 8)]


def test_a_fixed_controller_verifies_only_its_budget_an_adaptive_one_its_ladder():
    assert Controller("fixed", 16).verify_widths() == (16,)
    assert Controller("fixed", 16, widths=(4, 8)).verify_widths() == (16,)
