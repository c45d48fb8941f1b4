"""The acceptance benchmark's measures: the loop test and the accepted-path statistics."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from pair_acceptance import loops, path_stats, seq_rep, truth_ranks


def test_a_span_of_sixteen_repeated_back_to_back_is_a_loop():
    rng = np.random.default_rng(0)
    fresh = rng.permutation(1000)[:100]  # no token twice
    assert not loops(fresh)
    span = fresh[:16]
    assert loops(np.concatenate([fresh[50:70], span, span, fresh[70:80]]))
    assert not loops(np.concatenate([fresh[50:70], span, span[:15], fresh[70:80]]))


def test_short_cycles_and_long_repeated_lines_are_loops():
    rng = np.random.default_rng(1)
    fresh = rng.permutation(1000)[:100]
    cycle = np.tile(fresh[:3], 7)  # 21 tokens of period 3: a 16-token stretch recurs 3 later
    assert loops(np.concatenate([fresh[40:60], cycle]))
    assert not loops(np.concatenate([fresh[40:60], np.tile(fresh[:3], 6)]))  # 18 < 16 + 3
    line = fresh[:30]  # a 30-token line written twice in a row
    assert loops(np.concatenate([line, line]))
    assert not loops(np.concatenate([line, fresh[60:70], line]))  # recurs, not back to back


def test_seq_rep_counts_the_four_grams_that_repeat_an_earlier_one():
    fresh = np.random.default_rng(2).permutation(1000)[:40]
    assert seq_rep(fresh) == 0.0
    assert seq_rep(np.tile(fresh[:2], 10)) == pytest.approx(1 - 2 / 17)  # 17 four-grams, 2 distinct
    once = np.concatenate([fresh[:10], fresh[:4], fresh[20:30]])  # one 4-gram written twice
    assert seq_rep(once) == pytest.approx(1 / 21)


def test_path_statistics_count_siblings_on_the_accepted_path():
    ranks = np.array([[0, 0, 0], [0, 2, 0], [1, 0, 5], [3, 1, 0]])  # [steps, D]
    accepted = np.array([3, 3, 1, 0])
    stats = path_stats(accepted, ranks, depth=3)
    assert stats["whole block"] == 0.5
    assert stats["steps w/ sibling"] == 0.5  # steps 1 and 2; step 3 accepted nothing
    assert stats["sibling share of accepted"] == 2 / 7
    # below accepted top-1 tokens: (0,0)->0, (0,1)->0, (1,0)->2 -> 2 of 3 right
    assert stats["top-1 right below top-1"] == 2 / 3
    # below accepted siblings: (1,1) rank 2 -> next 0 right; (2,0) rank 1 -> next 0 right
    assert stats["top-1 right below sibling"] == 1.0


def test_truth_ranks_rank_the_token_that_follows_each_anchor():
    seqs = torch.tensor([[5, 1, 2, 3, 0]])
    probs = torch.zeros(1, 2, 2, 6)  # anchors 0 and 1, depth 2
    probs[0, 0, 0, [1, 4]] = torch.tensor([0.7, 0.3])  # token 1 is top-1 after anchor 0
    probs[0, 0, 1, [2, 4]] = torch.tensor([0.2, 0.8])  # token 2 ranks second
    probs[0, 1, 0, 2] = 1.0
    probs[0, 1, 1, [3, 1, 2]] = torch.tensor([0.1, 0.5, 0.4])  # token 3 ranks third
    assert truth_ranks(seqs, probs, first=0).tolist() == [[[0, 1], [0, 2]]]
