"""Draft head: each row's top-K tokens with probabilities normalised over the full vocabulary.

The drafter's hidden states [R, H] (R = requests x draft positions) meet the target's LM head
[V, H] in one GEMM that writes the only logits tensor, [R, V] in the weight's dtype (bf16 on
GPU, fp32 accumulation in the tensor cores). One Triton pass then reads every logit once and
keeps, per row, an online max and sum of exp(logit / T) plus a running top-K: a chunk of the
vocabulary only touches the top-K when its maximum beats the current K-th value, which after
the first chunks is rare, so the pass costs one read of the logits. Rows are split into vocabulary
spans (so B = 1 still fills the GPU); a second tiny launch merges the spans' (max, sum, top-K)
states. Compare softmax + topk: a float32 logits copy, a probabilities tensor and two more
passes over R x V.

Tie rule: equal logits go to the smaller token id (the torch reference uses ``torch.topk``,
whose order among exact ties is unspecified; the tests use tie-free logits, plus one test of
the kernel's own rule).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_bastion.kernels.dispatch import next_power_of_2, use_triton

# Programs the split pass aims for: a few per SM of an H100/H200 (132 SMs).
_TARGET_PROGRAMS = 512
_BLOCK_V = 2048


def draft_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, V] logits of hidden [R, H] under LM-head rows ``weight[:vocab]``.

    The GEMM runs in the weight's dtype (bf16 logits, fp32 accumulation), as SGLang's DFLASH
    draft head does: a float32 copy of a bf16 head would cost a [V, H] conversion every step.
    """
    return hidden.to(weight.dtype) @ weight[:vocab].T


# Below e^-80 a term adds under V * 2e-35 to a softmax sum of at least 1. Clamping there keeps
# exp out of float32's subnormal range, which CPUs compute about ten times slower: for 112 rows
# of 4096 logits spread over ~100 nats (a confident model's), torch.logsumexp took 2.6 ms and
# this 0.3 ms (benchmarks/bench_draft_head.py times both).
_EXP_FLOOR = -80.0


def log_sum_exp(x: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """[R] log sum_v exp(x[r, v]) of float32 [R, V] rows whose maxima are ``row_max`` [R]."""
    top = row_max.unsqueeze(1)
    return (x - top).clamp_(min=_EXP_FLOOR).exp_().sum(dim=1).log_() + row_max


def topk_softmax_reference(
    logits: torch.Tensor, top_k: int, temperature: float | torch.Tensor = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, K] float32 probabilities (softmax of logits / T over all of V) and [R, K] long ids."""
    scaled = logits.float()  # [R, V]
    if isinstance(temperature, torch.Tensor) or temperature != 1.0:
        scaled = scaled * _inverse_temperature(temperature, logits).unsqueeze(1)
    values, ids = scaled.topk(top_k, dim=1)  # [R, K] each, descending
    return torch.exp(values - log_sum_exp(scaled, values[:, 0]).unsqueeze(1)), ids


def topk_softmax_triton(
    logits: torch.Tensor,
    top_k: int,
    temperature: float | torch.Tensor = 1.0,
    *,
    block_v: int = _BLOCK_V,
    splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`topk_softmax_reference` as one read of the logits (two launches: spans, merge)."""
    rows, vocab = logits.shape
    if not 1 <= top_k <= vocab:
        raise ValueError(f"top_k must be in [1, {vocab}], got {top_k}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    inv_t = _inverse_temperature(temperature, logits)  # [R] float32
    block_v = min(block_v, next_power_of_2(vocab))
    chunks = triton.cdiv(vocab, block_v)
    if splits is None:
        splits = max(1, min(chunks, triton.cdiv(_TARGET_PROGRAMS, max(rows, 1))))
    span = triton.cdiv(chunks, splits) * block_v  # vocabulary entries per split
    splits = triton.cdiv(vocab, span)
    kp = next_power_of_2(top_k)
    device = logits.device
    part_val = torch.empty(rows, splits, kp, dtype=torch.float32, device=device)
    part_idx = torch.empty(rows, splits, kp, dtype=torch.int32, device=device)
    part_m = torch.empty(rows, splits, dtype=torch.float32, device=device)
    part_l = torch.empty(rows, splits, dtype=torch.float32, device=device)
    probs = torch.empty(rows, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(rows, top_k, dtype=torch.int64, device=device)
    if rows == 0:
        return probs, ids
    _span_kernel[(rows, splits)](
        logits, logits.stride(0), inv_t, vocab, span, splits,
        part_val, part_idx, part_m, part_l,
        K=top_k, KP=kp, BLOCK_V=block_v,
    )  # fmt: skip
    _merge_kernel[(rows,)](
        part_val, part_idx, part_m, part_l, splits, probs, ids,
        K=top_k, KP=kp, SP=next_power_of_2(chunks),  # vocabulary-bound, not batch-bound
    )  # fmt: skip
    return probs, ids


def topk_softmax(
    logits: torch.Tensor, top_k: int, temperature: float | torch.Tensor = 1.0, *,
    kernels: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Top-K probabilities and ids of each row: Triton on CUDA, the torch reference elsewhere."""
    if use_triton(logits, kernels=kernels):
        return topk_softmax_triton(logits, top_k, temperature)
    return topk_softmax_reference(logits, top_k, temperature)


def draft_head_topk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    vocab: int,
    top_k: int,
    temperature: float | torch.Tensor = 1.0,
    *,
    kernels: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, K] full-vocabulary probabilities (temperature applied) and ids of hidden [R, H]."""
    return topk_softmax(draft_logits(hidden, weight, vocab), top_k, temperature, kernels=kernels)


def shard_top_k(
    hidden: torch.Tensor, weight: torch.Tensor, vocab: int, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One vocabulary shard's part of the draft head: [R, K] top logits, their [R, K] local
    ids and the shard's [R] log-sum-exp (float32), for ``merge_shard_top_k`` across shards."""
    logits = draft_logits(hidden, weight, vocab).float()  # [R, V_shard]
    values, ids = logits.topk(min(top_k, vocab), dim=1)  # [R, K] each
    return values, ids, log_sum_exp(logits, values[:, 0])


def merge_shard_top_k(
    values: torch.Tensor, ids: torch.Tensor, lse: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, K] full-vocabulary probabilities and global ids from S shards' [S, R, K] top logits,
    [S, R, K] global ids and [S, R] log-sum-exps: what `draft_head_topk` gives unsharded."""
    shards, rows, k = values.shape
    flat = values.permute(1, 0, 2).reshape(rows, shards * k)  # [R, S*K]
    best, pick = flat.topk(top_k, dim=1)  # [R, K] each: the K best lie among the shards' K best
    total = torch.logsumexp(lse, dim=0)  # [R]
    merged_ids = ids.permute(1, 0, 2).reshape(rows, shards * k).gather(1, pick)
    return torch.exp(best - total.unsqueeze(1)), merged_ids


def _inverse_temperature(temperature: float | torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """[R] float32 1 / T of every row (T a float or an [R] tensor, all positive)."""
    rows = logits.shape[0]
    if isinstance(temperature, torch.Tensor):
        t = temperature.to(device=logits.device, dtype=torch.float32).reshape(-1)
        return (1.0 / t).expand(rows).contiguous()
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    return torch.full((rows,), 1.0 / temperature, dtype=torch.float32, device=logits.device)


@triton.jit(do_not_specialize=["span", "splits"])  # both follow the number of rows
def _span_kernel(
    logits_ptr, stride_row, inv_t_ptr, vocab, span, splits,
    part_val_ptr, part_idx_ptr, part_m_ptr, part_l_ptr,
    K: tl.constexpr, KP: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """One (row, vocabulary span): online max / sum-exp and the span's top-K."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    inv_t = tl.load(inv_t_ptr + row)
    slots = tl.arange(0, KP)
    cols = tl.arange(0, BLOCK_V)
    # Unused slots hold +inf so that the minimum (the K-th value) ignores them.
    top_val = tl.where(slots < K, float("-inf"), float("inf"))  # [KP]
    top_idx = tl.zeros([KP], dtype=tl.int32)
    m = tl.max(tl.full([BLOCK_V], float("-inf"), tl.float32), axis=0)
    total = tl.sum(tl.zeros([BLOCK_V], dtype=tl.float32), axis=0)
    start = split * span
    stop = tl.minimum(start + span, vocab)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    for off in range(start, stop, BLOCK_V):
        idx = off + cols
        x = tl.load(row_ptr + idx, mask=idx < stop, other=float("-inf")).to(tl.float32) * inv_t
        chunk_max = tl.max(x, axis=0)
        m_new = tl.maximum(m, chunk_max)
        alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp(m - m_new))
        total = total * alpha + tl.sum(tl.where(x == float("-inf"), 0.0, tl.exp(x - m_new)))
        m = m_new
        kth = tl.min(top_val, axis=0)
        while chunk_max > kth:  # rare after the first chunks: the chunk beats the K-th value
            pos = tl.argmax(x, axis=0)  # the smallest id among equal maxima
            # Evict the K-th value; among equal ones, the largest id.
            evict = tl.argmax(tl.where(top_val == kth, top_idx, -1), axis=0)
            top_val = tl.where(slots == evict, chunk_max, top_val)
            top_idx = tl.where(slots == evict, off + pos, top_idx)
            x = tl.where(cols == pos, float("-inf"), x)
            chunk_max = tl.max(x, axis=0)
            kth = tl.min(top_val, axis=0)
    part = row * splits + split
    tl.store(part_val_ptr + part * KP + slots, top_val)
    tl.store(part_idx_ptr + part * KP + slots, top_idx)
    tl.store(part_m_ptr + part, m)
    tl.store(part_l_ptr + part, total)


@triton.jit(do_not_specialize=["splits"])
def _merge_kernel(
    part_val_ptr, part_idx_ptr, part_m_ptr, part_l_ptr, splits, probs_ptr, ids_ptr,
    K: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr,
):  # fmt: skip
    """One row: merge the spans' sum-exp states and pick the K best of their top-Ks, in order."""
    row = tl.program_id(0)
    s = tl.arange(0, SP)
    live = s < splits
    ms = tl.load(part_m_ptr + row * splits + s, mask=live, other=float("-inf"))
    ls = tl.load(part_l_ptr + row * splits + s, mask=live, other=0.0)
    m = tl.max(ms, axis=0)
    lse = m + tl.log(tl.sum(tl.where(ms == float("-inf"), 0.0, ls * tl.exp(ms - m)), axis=0))
    slots = tl.arange(0, KP)
    offs = (row * splits + s[:, None]) * KP + slots[None, :]  # [SP, KP]
    keep = live[:, None] & (slots[None, :] < K)
    vals = tl.load(part_val_ptr + offs, mask=keep, other=float("-inf"))
    ids = tl.load(part_idx_ptr + offs, mask=keep, other=2147483647)
    for k in tl.static_range(K):
        best = tl.max(tl.max(vals, axis=1), axis=0)
        pick = tl.min(tl.min(tl.where(vals == best, ids, 2147483647), axis=1), axis=0)
        tl.store(probs_ptr + row * K + k, tl.exp(best - lse))
        tl.store(ids_ptr + row * K + k, pick.to(tl.int64))
        vals = tl.where((vals == best) & (ids == pick), float("-inf"), vals)
