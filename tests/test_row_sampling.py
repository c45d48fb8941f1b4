"""How the target's token at a tree node is drawn from its processed distribution."""

from __future__ import annotations

import pytest
import torch

from sglang_bastion.row_sampling import inverse_cdf_rows, race_rows, sample_rows

DRAWS = 40_000
ROWS = torch.tensor(
    [  # [R, V]: mass at the edges, zeros between and around it
        [0.5, 0.3, 0.2, 0.0, 0.0],
        [0.0, 0.1, 0.0, 0.0, 0.9],
        [0.0, 0.0, 0.0, 0.0, 1.0],
        [1.0, 0.0, 0.0, 0.0, 0.0],
    ]
)


def frequencies(draw, rows: torch.Tensor) -> torch.Tensor:
    """[R, V] how often ``draw`` picked each token of each row over DRAWS draws."""
    tokens = draw(rows.repeat_interleave(DRAWS, dim=0)).view(rows.shape[0], DRAWS)
    return torch.stack([torch.bincount(row, minlength=rows.shape[1]) for row in tokens]) / DRAWS


@pytest.mark.parametrize("draw", [race_rows, inverse_cdf_rows])
def test_each_rows_token_is_drawn_from_that_rows_distribution(draw):
    torch.manual_seed(0)
    freq = frequencies(draw, ROWS)
    # 4 standard errors of a frequency at p in (0, 1)
    assert (freq - ROWS).abs().max() < 4 * (0.25 / DRAWS) ** 0.5


@pytest.mark.parametrize("draw", [race_rows, inverse_cdf_rows])
def test_a_zero_probability_token_is_never_drawn(draw):
    torch.manual_seed(1)
    freq = frequencies(draw, ROWS)
    assert freq[ROWS == 0].sum() == 0


def test_a_row_that_does_not_sum_to_one_is_drawn_in_proportion():
    torch.manual_seed(2)
    rows = torch.tensor([[0.2, 0.0, 0.6]])  # a renormalised top-k row off by rounding, at scale
    freq = frequencies(inverse_cdf_rows, rows)
    assert (freq - rows / rows.sum()).abs().max() < 4 * (0.25 / DRAWS) ** 0.5


def test_a_skewed_large_vocabulary_keeps_its_small_tokens_share():
    torch.manual_seed(3)
    vocab = 4096
    probs = torch.full((1, vocab), 0.5 / (vocab - 1))  # [1, V]: one token holds half
    probs[0, 7] = 0.5
    tokens = inverse_cdf_rows(probs.expand(DRAWS, -1).contiguous())
    share = (tokens != 7).float().mean()
    assert abs(float(share) - 0.5) < 4 * (0.25 / DRAWS) ** 0.5
    assert int(tokens.max()) < vocab


def test_on_a_cpu_rows_are_drawn_by_their_cumulative_distribution():
    probs = torch.softmax(torch.randn(16, 64), dim=-1)  # [R, V]
    torch.manual_seed(4)
    drawn = sample_rows(probs)
    torch.manual_seed(4)
    assert torch.equal(drawn, inverse_cdf_rows(probs))
