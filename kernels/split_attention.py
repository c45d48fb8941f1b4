"""Split tree-verify attention: a dense pass over the prefix merged with a masked tree block.

Every tree node sees the whole prefix, so attention over the prefix needs no mask (only each
request's length); only the N x N tree block does. Each query row's softmax over [prefix |
tree] is the log-sum-exp merge of two partial softmaxes: ``(o_p, lse_p)`` over the prefix and
``(o_t, lse_t)`` over the tree block, ``o = o_p * exp(lse_p - lse) + o_t * exp(lse_t - lse)``
with ``lse = logaddexp(lse_p, lse_t)``. Nothing of size batch x tokens x context is built: the
mask is the [B, N, N] tree block (`ancestor_mask`), and the prefix pass is a plain causal-free
attention that FlashInfer's cascade / merge-state or any dense kernel could serve.

Layout (paged, as SGLang's pools): q [B, N, H, Dh]; k_buf [slots, Hkv, Dh] and v_buf
[slots, Hkv, Dv]; prefix_slots [B, P] (first ``prefix_lens[b]`` columns real); tree_slots
[B, N] (the tree tokens' own KV, first ``tree_lens[b]`` real); tree_mask [B, N, N] bool (row i
sees column j). Rows i >= tree_lens[b] are padding: their output is 0. Scores and softmax in
float32.

Triton: launch 1, grid (B x Hkv, splits + 1): programs 0..splits-1 each attend the G x N query
rows of one KV head (its G query heads stacked) over one chunk of the prefix, unmasked, and
the last one over the tree block with the mask; each writes its normalised output and lse.
Launch 2 merges the splits per row. The splits keep B = 1 busy on a long prefix.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_bastion.kernels.dispatch import next_power_of_2, use_triton

_TARGET_PROGRAMS = 264  # two per SM of an H100/H200
_MERGE_CHUNK = 8  # parts the merge reads at a time
_BLOCK_M = 64  # query rows per program (G x N stacked rows are cut into blocks of this)


def attend_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised attention [B, N, H, Dv] and its lse [B, N, H] over the visible columns.

    q [B, N, H, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv], visible broadcastable to [B, N, S].
    Rows that see nothing get output 0 and lse -inf.
    """
    group = q.shape[2] // k.shape[2]
    k = k.float().repeat_interleave(group, dim=2)  # [B, S, H, D]
    v = v.float().repeat_interleave(group, dim=2)  # [B, S, H, Dv]
    scores = torch.einsum("bnhd,bshd->bhns", q.float(), k) * scale  # [B, H, N, S]
    scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, H, N]
    weights = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)  # all-masked rows: 0
    out = torch.einsum("bhns,bshd->bnhd", weights, v)
    return out, lse.transpose(1, 2)


def merge_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention over the union of two disjoint column sets, from each one's (out, lse)."""
    lse = torch.logaddexp(lse_a, lse_b)  # [B, N, H]
    weight_a = torch.exp(lse_a - lse).nan_to_num(0.0).unsqueeze(-1)
    weight_b = torch.exp(lse_b - lse).nan_to_num(0.0).unsqueeze(-1)
    return out_a * weight_a + out_b * weight_b, lse


def split_tree_attention_reference(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    prefix_slots: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_slots: torch.Tensor,
    tree_mask: torch.Tensor,
    tree_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """[B, N, H, Dv] float32 tree-verify attention as two partial passes and a merge (torch)."""
    batch, nodes = tree_slots.shape
    prefix_cols = torch.arange(prefix_slots.shape[1], device=q.device)
    sees_prefix = (prefix_cols < prefix_lens.view(-1, 1)).unsqueeze(1)  # [B, 1, P]
    out_p, lse_p = attend_with_lse(q, k_buf[prefix_slots], v_buf[prefix_slots], sees_prefix, scale)
    rows = torch.arange(nodes, device=q.device)
    real = rows.view(1, -1) < tree_lens.view(-1, 1)  # [B, N]
    sees_tree = tree_mask.bool() & real.unsqueeze(2) & real.unsqueeze(1)  # [B, N, N]
    out_t, lse_t = attend_with_lse(q, k_buf[tree_slots], v_buf[tree_slots], sees_tree, scale)
    out, _ = merge_states(out_p, lse_p, out_t, lse_t)
    return out * real.view(batch, nodes, 1, 1)


def split_verify_padded(
    q: torch.Tensor,
    k_cols: torch.Tensor,
    v_cols: torch.Tensor,
    prefix_lens: torch.Tensor,
    query_lens: torch.Tensor,
    draft_mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """[B, Q, H, Dv] float32 tree verify over padded key columns, split at each prefix (torch).

    ``bastion_cpu``'s layout: q [B, Q, H, D]; k_cols / v_cols [B, S, Hkv, *] with request b's
    prefix in columns [0, prefix_lens[b]) and its Q query tokens' own keys right after;
    draft_mask [B, Q, Q]. Padding rows (i >= query_lens[b]) come out 0.
    """
    batch, max_q = q.shape[:2]
    prefix_lens = prefix_lens.long()
    max_prefix = int(prefix_lens.max()) if batch else 0
    cols = torch.arange(max_prefix, device=q.device)
    sees_prefix = (cols < prefix_lens.view(-1, 1)).unsqueeze(1)  # [B, 1, P]
    out_p, lse_p = attend_with_lse(
        q, k_cols[:, :max_prefix], v_cols[:, :max_prefix], sees_prefix, scale
    )
    rows = torch.arange(max_q, device=q.device)
    own = (prefix_lens.view(-1, 1) + rows).clamp(max=k_cols.shape[1] - 1)  # [B, Q]
    k_tree = k_cols.gather(1, own[:, :, None, None].expand(-1, -1, *k_cols.shape[2:]))
    v_tree = v_cols.gather(1, own[:, :, None, None].expand(-1, -1, *v_cols.shape[2:]))
    real = rows.view(1, -1) < query_lens.view(-1, 1)  # [B, Q]
    sees_tree = draft_mask.bool() & real.unsqueeze(2) & real.unsqueeze(1)
    out_t, lse_t = attend_with_lse(q, k_tree, v_tree, sees_tree, scale)
    out, _ = merge_states(out_p, lse_p, out_t, lse_t)
    return out * real.view(batch, max_q, 1, 1)


def split_tree_attention_triton(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    prefix_slots: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_slots: torch.Tensor,
    tree_mask: torch.Tensor,
    tree_lens: torch.Tensor,
    scale: float,
    *,
    block_s: int = 64,
    block_m: int = _BLOCK_M,
    splits: int | None = None,
) -> torch.Tensor:
    """`split_tree_attention_reference` in two launches (partial passes, then the merge)."""
    batch, nodes, heads, head_dim = q.shape
    kv_heads, v_dim = k_buf.shape[1], v_buf.shape[2]
    group = heads // kv_heads
    max_prefix = prefix_slots.shape[1]
    device = q.device
    np_ = next_power_of_2(nodes)
    rows = max(16, next_power_of_2(group * np_))  # G x N query rows per KV head, padded
    block_m = min(rows, block_m)
    row_blocks = rows // block_m
    if splits is None:
        splits = triton.cdiv(_TARGET_PROGRAMS, max(1, batch * kv_heads * row_blocks))
    splits = max(1, min(splits, triton.cdiv(max(max_prefix, 1), block_s)))
    chunk = triton.cdiv(triton.cdiv(max(max_prefix, 1), splits), block_s) * block_s
    parts = splits + 1  # the last one is the tree block
    part_out = torch.empty(batch, parts, heads, nodes, v_dim, dtype=torch.float32, device=device)
    part_lse = torch.empty(batch, parts, heads, nodes, dtype=torch.float32, device=device)
    out = torch.empty(batch, nodes, heads, v_dim, dtype=torch.float32, device=device)
    if batch == 0 or nodes == 0:
        return out
    q = q if q.stride(3) == 1 else q.contiguous()
    k_buf = k_buf if k_buf.stride(2) == 1 else k_buf.contiguous()
    v_buf = v_buf if v_buf.stride(2) == 1 else v_buf.contiguous()
    prefix_slots = prefix_slots if prefix_slots.stride(1) == 1 else prefix_slots.contiguous()
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _partial_kernel[(batch * kv_heads * row_blocks, parts)](
        q, q.stride(0), q.stride(1), q.stride(2),
        k_buf, k_buf.stride(0), k_buf.stride(1),
        v_buf, v_buf.stride(0), v_buf.stride(1),
        prefix_slots, prefix_slots.stride(0), prefix_lens,
        tree_slots.contiguous(), _bytes(tree_mask.contiguous()), tree_lens,
        part_out, part_lse, scale, chunk, splits, kv_heads, row_blocks,
        N=nodes, NP=np_, G=group, ROWS=block_m, DH=head_dim, DV=v_dim,
        BLOCK_S=block_s, BLOCK_T=max(16, np_), PRECISION=precision,
        num_warps=8 if block_m * head_dim >= 64 * 128 else 4,  # 4 would spill at 64 x 128
    )  # fmt: skip
    _merge_kernel[(batch * nodes * heads,)](
        part_out, part_lse, tree_lens, out, parts, nodes, heads, PC=_MERGE_CHUNK, DV=v_dim,
    )  # fmt: skip
    return out


def split_tree_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    prefix_slots: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_slots: torch.Tensor,
    tree_mask: torch.Tensor,
    tree_lens: torch.Tensor,
    scale: float,
    *,
    kernels: bool = True,
) -> torch.Tensor:
    """Split tree-verify attention: Triton on CUDA, the torch reference elsewhere."""
    args = (q, k_buf, v_buf, prefix_slots, prefix_lens, tree_slots, tree_mask, tree_lens, scale)
    if use_triton(q, k_buf, v_buf, kernels=kernels):
        return split_tree_attention_triton(*args)
    return split_tree_attention_reference(*args)


def _bytes(mask: torch.Tensor) -> torch.Tensor:
    """A bool tensor's storage as uint8 (no copy), which every Triton backend loads alike."""
    return mask.view(torch.uint8) if mask.dtype == torch.bool else mask


@triton.jit(do_not_specialize=["chunk", "splits", "row_blocks"])  # they follow the batch
def _partial_kernel(
    q_ptr, sq_b, sq_n, sq_h,
    k_ptr, sk_slot, sk_h, v_ptr, sv_slot, sv_h,
    prefix_slots_ptr, sp_b, prefix_lens_ptr,
    tree_slots_ptr, tree_mask_ptr, tree_lens_ptr,
    out_ptr, lse_ptr, scale, chunk, splits, kv_heads, row_blocks,
    N: tl.constexpr, NP: tl.constexpr, G: tl.constexpr, ROWS: tl.constexpr,
    DH: tl.constexpr, DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """One (request, KV head, row block, part): query rows over a prefix chunk or the tree."""
    pid = tl.program_id(0)
    b = pid // (kv_heads * row_blocks)
    kvh = (pid // row_blocks) % kv_heads
    part = tl.program_id(1)
    r = (pid % row_blocks) * ROWS + tl.arange(0, ROWS)  # rows g * NP + i of this block
    g = r // NP  # query head within the group
    i = r % NP  # tree row
    n_tree = tl.load(tree_lens_ptr + b)
    row_ok = (g < G) & (i < N)
    head = kvh * G + g
    dh = tl.arange(0, DH)
    dv = tl.arange(0, DV)
    q_rows = q_ptr + b.to(tl.int64) * sq_b + i * sq_n + head * sq_h
    q = tl.load(q_rows[:, None] + dh[None, :], mask=row_ok[:, None], other=0.0)  # [ROWS, DH]
    m = tl.full([ROWS], float("-inf"), tl.float32)
    total = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, DV], dtype=tl.float32)
    if part < splits:  # a prefix chunk: every row sees every real column
        prefix = tl.load(prefix_lens_ptr + b)
        start = part * chunk
        stop = tl.minimum(start + chunk, prefix)
        s = tl.arange(0, BLOCK_S)
        for off in range(start, stop, BLOCK_S):
            col_ok = off + s < stop
            slot = tl.load(prefix_slots_ptr + b * sp_b + off + s, mask=col_ok, other=0)
            k = tl.load(
                k_ptr + slot.to(tl.int64)[:, None] * sk_slot + kvh * sk_h + dh[None, :],
                mask=col_ok[:, None], other=0.0,
            )  # fmt: skip
            v = tl.load(
                v_ptr + slot.to(tl.int64)[:, None] * sv_slot + kvh * sv_h + dv[None, :],
                mask=col_ok[:, None], other=0.0,
            )  # fmt: skip
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            scores = tl.where(col_ok[None, :], scores, float("-inf"))
            m, total, acc = _online_step(scores, v, m, total, acc, PRECISION)
    else:  # the tree block, under its mask
        t = tl.arange(0, BLOCK_T)
        col_ok = t < n_tree
        slot = tl.load(tree_slots_ptr + b * N + t, mask=col_ok, other=0)
        k = tl.load(
            k_ptr + slot.to(tl.int64)[:, None] * sk_slot + kvh * sk_h + dh[None, :],
            mask=col_ok[:, None], other=0.0,
        )  # fmt: skip
        v = tl.load(
            v_ptr + slot.to(tl.int64)[:, None] * sv_slot + kvh * sv_h + dv[None, :],
            mask=col_ok[:, None], other=0.0,
        )  # fmt: skip
        sees = (row_ok & (i < n_tree))[:, None] & col_ok[None, :]
        mask_rows = tree_mask_ptr + b * N * N + i[:, None] * N  # [ROWS, 1]
        sees &= tl.load(mask_rows + t[None, :], mask=sees, other=0) != 0
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        scores = tl.where(sees, scores, float("-inf"))
        m, total, acc = _online_step(scores, v, m, total, acc, PRECISION)
    seen = total > 0
    out = acc / tl.where(seen, total, 1.0)[:, None]
    lse = tl.where(seen, m + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    heads = kv_heads * G
    row = ((b * (splits + 1) + part) * heads + head) * N + i  # [B, parts, H, N]
    tl.store(lse_ptr + row, lse, mask=row_ok)
    tl.store(out_ptr + row.to(tl.int64)[:, None] * DV + dv[None, :], out, mask=row_ok[:, None])


@triton.jit
def _online_step(scores, v, m, total, acc, PRECISION: tl.constexpr):
    """Fold one block of scores [R, S] and values [S, DV] into the running softmax state."""
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    base = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing yet
    p = tl.exp(scores - base[:, None])
    alpha = tl.exp(m - base)
    total = total * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, total, acc


@triton.jit(do_not_specialize=["parts"])  # follows the batch through the split count
def _merge_kernel(
    part_out_ptr, part_lse_ptr, tree_lens_ptr, out_ptr, parts, nodes, heads,
    PC: tl.constexpr, DV: tl.constexpr,
):  # fmt: skip
    """One (request, row, head): merge the parts' (out, lse) states, PC parts at a time.

    Padding rows get 0. The chunk PC is fixed, so no compiled size follows the batch.
    """
    pid = tl.program_id(0)
    head = pid % heads
    i = (pid // heads) % nodes
    b = pid // (heads * nodes)
    dv = tl.arange(0, DV)
    m = tl.full([], float("-inf"), tl.float32)  # running max of the parts' lse
    total = tl.zeros([], tl.float32)  # sum of exp(lse - m)
    acc = tl.zeros([DV], tl.float32)  # sum of out * exp(lse - m)
    for start in range(0, parts, PC):
        p = start + tl.arange(0, PC)
        row = ((b * parts + p) * heads + head) * nodes + i  # [PC]
        lse = tl.load(part_lse_ptr + row, mask=p < parts, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)
        rescale = tl.exp(m - base)  # 0 while nothing was seen
        w = tl.exp(lse - base)  # [PC]: 0 for empty parts
        out_rows = part_out_ptr + row.to(tl.int64)[:, None] * DV  # [PC, 1]
        outs = tl.load(out_rows + dv[None, :], mask=(p < parts)[:, None], other=0.0)  # [PC, DV]
        acc = acc * rescale + tl.sum(outs * w[:, None], axis=0)
        total = total * rescale + tl.sum(w, axis=0)
        m = m_new
    merged = acc / tl.where(total > 0, total, 1.0)
    merged = tl.where(i < tl.load(tree_lens_ptr + b), merged, 0.0)
    tl.store(out_ptr + pid.to(tl.int64) * DV + dv, merged)
