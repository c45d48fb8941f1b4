"""Pure tensor functions behind the ``bastion_cpu`` attention backend (no SGLang imports).

Letters: B requests, T flattened query tokens (requests concatenated), Q padded query rows per
request, S padded key/value columns per request, H query heads, Hkv key/value heads, D the
query/key head dim, Dv the value head dim, N draft tokens per request in a verify.

A request's key/value columns are its prefix (already in the paged pool) followed by its own
query tokens, so query row i of request b sits at column ``prefix_lens[b] + i``. Every query
sees the whole prefix; inside its own block it sees the columns the mode allows: earlier or
equal ones (causal), all of them (non-causal), or those a draft mask names (tree verify).
Scores and softmax are computed in float32 whatever the input dtype.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Up to this many query rows per KV head (G*Q), the G query heads sharing a KV head are
# attended as one [G*Q, D] matrix: 1.5-2.5x faster for decode and verify blocks on CPU.
GROUPED_ROWS_LIMIT = 512


class DraftMaskLayout(enum.Enum):
    """How a flat verify mask lays out each request's N x N draft block."""

    # SGLang's FULL_MASK: N rows of (prefix_len + N) columns; the draft block is the last N.
    WITH_PREFIX = "with_prefix"
    # SGLang's QLEN_ONLY: N rows of N columns.
    DRAFT_ONLY = "draft_only"


@dataclass(frozen=True)
class RaggedLayout:
    """Where each flattened query token sits in the padded [B, Q] query and [B, S] key grids."""

    batch: torch.Tensor  # [T] long: request of each token
    row: torch.Tensor  # [T] long: query row within its request
    col: torch.Tensor  # [T] long: key/value column of the token (prefix_len + row)
    max_q: int  # Q
    max_kv: int  # S
    uniform: bool  # every request has exactly Q query tokens: [T] reshapes to [B, Q]

    @property
    def num_tokens(self) -> int:
        """Number of real query tokens T."""
        return self.batch.shape[0]


def ragged_layout(prefix_lens: torch.Tensor, query_lens: torch.Tensor) -> RaggedLayout:
    """Padded-grid coordinates of ragged query blocks appended to ragged prefixes."""
    prefix_lens = prefix_lens.long()
    query_lens = query_lens.long()
    num_requests = query_lens.shape[0]
    device = query_lens.device
    max_q = int(query_lens.max()) if num_requests else 0
    max_kv = int((prefix_lens + query_lens).max()) if num_requests else 0
    batch = torch.repeat_interleave(torch.arange(num_requests, device=device), query_lens)  # [T]
    starts = torch.cumsum(query_lens, 0) - query_lens  # [B]
    row = torch.arange(batch.shape[0], device=device) - starts[batch]  # [T]
    uniform = bool((query_lens == max_q).all()) if num_requests else True
    return RaggedLayout(batch, row, prefix_lens[batch] + row, max_q, max_kv, uniform)


def kv_slot_table(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, kv_lens: torch.Tensor, max_kv: int
) -> torch.Tensor:
    """[B, S] long pool slots of each request's first ``kv_lens[b]`` tokens; 0 (the pool's
    padding slot) past them."""
    columns = torch.arange(max_kv, device=req_to_token.device)  # [S]
    slots = req_to_token[req_pool_indices.long(), :max_kv].long()  # [B, S]
    return torch.where(columns < kv_lens.long().unsqueeze(1), slots, 0)


def draft_block_mask(
    flat_mask: torch.Tensor,
    prefix_lens: torch.Tensor,
    draft_lens: torch.Tensor,
    max_n: int,
    layout: DraftMaskLayout,
) -> torch.Tensor:
    """[B, N, N] bool draft-to-draft visibility read from SGLang's flat verify mask.

    Request b owns ``draft_lens[b]`` rows, concatenated after the rows of earlier requests; the
    prefix columns of the WITH_PREFIX layout are not read (the prefix is always visible).
    Entries outside a request's own n x n block are False.
    """
    prefix_lens = prefix_lens.long()
    draft_lens = draft_lens.long()
    if layout is DraftMaskLayout.WITH_PREFIX:
        row_width = prefix_lens + draft_lens  # [B]
        first_col = prefix_lens
    else:
        row_width = draft_lens
        first_col = torch.zeros_like(prefix_lens)
    block_size = draft_lens * row_width  # [B]
    block_start = torch.cumsum(block_size, 0) - block_size  # [B]
    ids = torch.arange(max_n, device=flat_mask.device)
    rows, cols = ids.view(1, max_n, 1), ids.view(1, 1, max_n)
    index = (
        block_start.view(-1, 1, 1) + rows * row_width.view(-1, 1, 1) + first_col.view(-1, 1, 1)
    ) + cols  # [B, N, N]
    inside = (rows < draft_lens.view(-1, 1, 1)) & (cols < draft_lens.view(-1, 1, 1))
    index = torch.where(inside, index, 0)
    return flat_mask.reshape(-1)[index].bool() & inside


def visibility(
    prefix_lens: torch.Tensor,
    query_lens: torch.Tensor,
    max_q: int,
    max_kv: int,
    *,
    causal: bool,
    draft_mask: torch.Tensor | None = None,
    rows: tuple[int, int] | None = None,
) -> torch.Tensor:
    """[B, Q, S] bool: which key column each padded query row may attend to.

    ``draft_mask`` ([B, Q, Q], row i sees block column j) overrides ``causal`` inside the
    block. Padding rows (i >= query_lens[b]) see column 0 only, so no softmax row is empty.
    ``rows = (start, stop)`` builds only those query rows ([B, stop - start, S]).
    """
    start, stop = rows if rows is not None else (0, max_q)
    prefix = prefix_lens.long().view(-1, 1, 1)
    length = query_lens.long().view(-1, 1, 1)
    device = prefix.device
    row = torch.arange(start, stop, device=device).view(1, -1, 1)
    column = torch.arange(max_kv, device=device).view(1, 1, max_kv)
    block_col = column - prefix  # [B, 1, S]
    in_block = (block_col >= 0) & (block_col < length)
    if draft_mask is not None:
        own_rows = draft_mask[:, start:stop]  # [B, R, Q]
        clamped = block_col.clamp(0, max(max_q - 1, 0)).expand(-1, stop - start, -1)
        in_block = in_block & own_rows.gather(2, clamped)
    elif causal:
        in_block = in_block & (block_col <= row)
    visible = (block_col < 0) | in_block  # [B, R, S]
    return torch.where(row < length, visible, column == 0)


def additive_mask(visible: torch.Tensor) -> torch.Tensor:
    """[B, 1, Q, S] float32 mask (0 where visible, -inf elsewhere) in SDPA's broadcast shape."""
    bias = torch.zeros(visible.shape, dtype=torch.float32, device=visible.device)
    return bias.masked_fill_(~visible, float("-inf")).unsqueeze(1)


def pad_tokens(flat: torch.Tensor, layout: RaggedLayout, num_requests: int) -> torch.Tensor:
    """[B, Q, ...] padded copy of the [T, ...] per-token rows (zeros in padding rows)."""
    if layout.uniform:
        return flat[: layout.num_tokens].view(num_requests, layout.max_q, *flat.shape[1:])
    padded = flat.new_zeros(num_requests, layout.max_q, *flat.shape[1:])
    padded[layout.batch, layout.row] = flat[: layout.num_tokens]
    return padded


def unpad_tokens(padded: torch.Tensor, layout: RaggedLayout) -> torch.Tensor:
    """[T, ...] rows of the real query tokens of a [B, Q, ...] padded tensor."""
    if layout.uniform:
        return padded.reshape(-1, *padded.shape[2:])
    return padded[layout.batch, layout.row]


def gather_kv(buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[B, S, Hkv, D] float32 pool rows at ``slots`` ([B, S]) of a [slots, Hkv, D] buffer."""
    rows = torch.index_select(
        buffer.view(buffer.shape[0], -1), 0, slots.reshape(-1)
    )  # [B*S, Hkv*D]
    return rows.view(*slots.shape, *buffer.shape[1:]).float()


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    logit_cap: float = 0.0,
) -> torch.Tensor:
    """[B, Q, H, Dv] float32 attention of q [B, Q, H, D] over k [B, S, Hkv, D], v [B, S, Hkv, Dv].

    ``mask`` is an additive [B, 1, Q, S] bias or None; ``is_causal`` (used only without a
    mask) aligns query row i with key column i, which is right only when no request has a
    prefix. A positive ``logit_cap`` squashes scores as ``cap * tanh(score / cap)``.
    """
    batch, max_q, heads, _ = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    k = k.float().transpose(1, 2)  # [B, Hkv, S, D]
    v = v.float().transpose(1, 2)  # [B, Hkv, S, Dv]
    causal_only = is_causal and mask is None
    if logit_cap <= 0 and (causal_only or max_q * group > GROUPED_ROWS_LIMIT):
        # Long blocks (and top-left causal ones, whose row i must meet column i) keep the
        # heads apart; SDPA repeats the KV heads itself and broadcasts the mask over heads.
        out = F.scaled_dot_product_attention(
            q.float().transpose(1, 2),
            k,
            v,
            attn_mask=mask,
            is_causal=causal_only,
            scale=scale,
            enable_gqa=group > 1,
        )  # [B, H, Q, Dv]
        return out.transpose(1, 2)
    if causal_only:
        mask = _causal_bias(max_q, k.shape[2], q.device)
    # The G query heads of a KV head form one [G*Q, D] matrix per (request, KV head).
    grouped = q.float().view(batch, max_q, kv_heads, group, -1).permute(0, 2, 3, 1, 4)
    grouped = grouped.reshape(batch, kv_heads, group * max_q, -1)  # [B, Hkv, G*Q, D]
    if mask is not None and max_q > 1 and group > 1:
        mask = mask.unsqueeze(2).expand(-1, -1, group, -1, -1).flatten(2, 3)
    if logit_cap > 0:
        scores = torch.matmul(grouped, k.transpose(-1, -2)) * scale  # [B, Hkv, G*Q, S]
        scores = logit_cap * torch.tanh(scores / logit_cap)
        if mask is not None:
            scores = scores + mask
        out = torch.matmul(torch.softmax(scores, dim=-1), v)
    else:
        out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask, scale=scale)
    out = out.view(batch, kv_heads, group, max_q, -1).permute(0, 3, 1, 2, 4)  # [B, Q, Hkv, G, Dv]
    return out.reshape(batch, max_q, heads, -1)


def _causal_bias(max_q: int, max_kv: int, device: torch.device) -> torch.Tensor:
    """[1, 1, Q, S] additive top-left causal mask."""
    upper = torch.ones(max_q, max_kv, dtype=torch.bool, device=device).triu(1)
    bias = torch.zeros(max_q, max_kv, dtype=torch.float32, device=device)
    return bias.masked_fill_(upper, float("-inf")).view(1, 1, max_q, max_kv)
