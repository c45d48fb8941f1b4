"""Draft head kernel: top-K ids and full-vocabulary probabilities in one pass over the logits."""

from __future__ import annotations

import itertools

import pytest
import torch

from sglang_bastion.kernels import (
    draft_head_topk,
    merge_shard_top_k,
    shard_top_k,
    topk_softmax_reference,
    topk_softmax_triton,
)
from sglang_bastion.kernels.draft_head import draft_logits, log_sum_exp

# Probabilities are exp(x - lse) in float32 with a different summation order than torch's.
RTOL, ATOL = 1e-5, 1e-7


def logits(rows: int, vocab: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[R, V] spread-out logits; float32 draws have no ties."""
    generator = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(rows, vocab, generator=generator)).to(dtype)


@pytest.mark.parametrize("splits", [1, 3, None])
def test_kernel_matches_reference_over_vocabulary_spans(splits):
    x = logits(rows=5, vocab=700, seed=0)
    temperature = torch.tensor([1.0, 0.5, 2.0, 0.7, 1.3])
    probs, ids = topk_softmax_triton(x, 8, temperature, block_v=128, splits=splits)
    ref_probs, ref_ids = topk_softmax_reference(x, 8, temperature)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(probs, ref_probs, rtol=RTOL, atol=ATOL)


def test_probabilities_are_normalised_over_the_whole_vocabulary():
    x = logits(rows=3, vocab=64, seed=1)
    probs, _ = topk_softmax_triton(x, 64, 0.8, block_v=16)
    torch.testing.assert_close(probs.sum(dim=1), torch.ones(3), rtol=1e-6, atol=1e-6)


def test_probabilities_are_descending_and_ids_distinct():
    probs, ids = topk_softmax_triton(logits(rows=4, vocab=300, seed=2), 16, 1.0, block_v=64)
    assert bool((probs[:, 1:] <= probs[:, :-1]).all())
    assert all(len(set(row)) == 16 for row in ids.tolist())


def test_equal_logits_go_to_the_smaller_token_id():
    x = torch.zeros(1, 200)
    x[0, [150, 7, 90, 33]] = 5.0  # four equal maxima, split across vocabulary spans
    _, ids = topk_softmax_triton(x, 6, 1.0, block_v=32, splits=4)
    assert ids.tolist() == [[7, 33, 90, 150, 0, 1]]


def test_bf16_logits_rank_by_value_then_id():
    x = logits(rows=4, vocab=500, seed=3, dtype=torch.bfloat16)  # bf16: ties are common
    probs, ids = topk_softmax_triton(x, 8, 1.0, block_v=64)
    expected = torch.sort(x.float(), dim=1, descending=True, stable=True).indices[:, :8]
    assert torch.equal(ids, expected)
    ref_probs = torch.softmax(x.float(), dim=1).gather(1, expected)
    torch.testing.assert_close(probs, ref_probs, rtol=RTOL, atol=ATOL)


def test_strided_logits_of_a_padded_vocabulary():
    wide = logits(rows=3, vocab=320, seed=4)
    x = wide[:, :300]  # rows strided by 320: an LM head padded past the real vocabulary
    probs, ids = topk_softmax_triton(x, 4, 1.0, block_v=64)
    ref_probs, ref_ids = topk_softmax_reference(x.contiguous(), 4, 1.0)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(probs, ref_probs, rtol=RTOL, atol=ATOL)


def test_draft_head_reads_only_the_real_vocabulary_rows_of_the_lm_head():
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(6, 32, generator=generator)
    weight = torch.randn(110, 32, generator=generator)
    weight[100:] = 100.0  # padding rows that would win every top-K
    probs, ids = draft_head_topk(hidden, weight, 100, 4)
    assert bool((ids < 100).all())
    ref_probs, ref_ids = topk_softmax_reference(hidden @ weight[:100].T, 4)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(probs, ref_probs, rtol=RTOL, atol=ATOL)


def test_nonpositive_temperature_is_refused():
    with pytest.raises(ValueError, match="temperature"):
        topk_softmax_reference(logits(rows=1, vocab=10, seed=6), 2, 0.0)


@pytest.mark.parametrize("bounds", [(0, 150, 300), (0, 100, 230, 300), (0, 10, 300)])
def test_merged_vocabulary_shards_give_the_unsharded_draft_head(bounds):
    generator = torch.Generator().manual_seed(len(bounds))
    hidden = torch.randn(6, 16, generator=generator)
    weight = 2 * torch.randn(300, 16, generator=generator)  # [V, H]: tensor parallelism splits V
    parts = [
        shard_top_k(hidden, weight[start:end], end - start, 8)
        for start, end in itertools.pairwise(bounds)
    ]
    values = torch.stack([v for v, _, _ in parts])  # [S, R, K]
    ids = torch.stack([i + start for (_, i, _), start in zip(parts, bounds, strict=False)])
    lse = torch.stack([s for _, _, s in parts])  # [S, R]
    probs, merged = merge_shard_top_k(values, ids, lse, 8)
    want_probs, want_ids = draft_head_topk(hidden, weight, 300, 8)
    assert torch.equal(merged, want_ids)
    torch.testing.assert_close(probs, want_probs, rtol=1e-5, atol=1e-7)


def test_log_sum_exp_matches_torch_on_logits_that_spread_far_below_the_maximum():
    gen = torch.Generator().manual_seed(5)
    logits = 40 * torch.randn(16, 4096, generator=gen)  # rows span hundreds of nats
    logits[0, 7] = float("-inf")  # a masked token
    want = torch.logsumexp(logits, dim=1)
    got = log_sum_exp(logits, logits.max(dim=1).values)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_draft_logits_are_computed_in_the_lm_heads_dtype():
    hidden = torch.randn(3, 16)
    weight = torch.randn(40, 16).bfloat16()
    logits = draft_logits(hidden, weight, 32)
    assert logits.dtype == torch.bfloat16 and logits.shape == (3, 32)
    torch.testing.assert_close(logits.float(), hidden @ weight[:32].float().T, rtol=2e-2, atol=0.1)
