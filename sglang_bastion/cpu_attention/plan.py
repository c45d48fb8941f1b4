"""The per-forward plan of the ``bastion_cpu`` backend: what every layer of one pass shares.

Pure PyTorch (no SGLang imports): the backend fills it from a ForwardBatch once per forward;
each layer then asks it for the mask of its causality (built once, or in row chunks when a
long prefill would make it too large).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from sglang_bastion.cpu_attention import kernels
from sglang_bastion.cpu_attention.kernels import RaggedLayout

MASK_ELEMENTS = 1 << 24  # largest mask built at once (64 MiB of float32); beyond: row chunks
# What one more group of a ragged verify costs, in attended elements (query rows x key columns
# of a padded attention): its own plan, and at every layer its gathers, mask and SDPA call. On
# this CPU a group added 0.4 ms a layer at the tiny pair's heads, what 16K elements cost, so a
# verify splits its requests by query length only where the padding it saves outweighs that.
GROUP_CALL_ELEMENTS = 16384
ENV_GROUP_ELEMENTS = "SGLANG_BASTION_CPU_GROUP_ELEMENTS"  # another host's price for a group


def group_call_elements(environ: dict[str, str] | None = None) -> int:
    """The price of one more group of a ragged verify: ``SGLANG_BASTION_CPU_GROUP_ELEMENTS``,
    else ``GROUP_CALL_ELEMENTS``."""
    text = (os.environ if environ is None else environ).get(ENV_GROUP_ELEMENTS, "").strip()
    if not text:
        return GROUP_CALL_ELEMENTS
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(
            f"{ENV_GROUP_ELEMENTS}={text} must be a whole number of attended elements (query "
            f"rows x key columns) of at least 0; unset it for the default {GROUP_CALL_ELEMENTS}"
        )
    return value


@dataclass
class CpuForwardMetadata:
    """Per-forward plan shared by every layer."""

    decode: bool
    kv_slots: torch.Tensor  # [B, S] long: pool slot of every key column (0 past a request)
    layout: RaggedLayout | None  # extend/verify: where each query token sits (None: decode)
    prefix_lens: torch.Tensor  # [B] long: cached tokens before the query block
    query_lens: torch.Tensor  # [B] long: query tokens per request
    kv_lens: torch.Tensor  # [B] long: key columns per request (prefix + query block)
    draft_mask: torch.Tensor | None  # [B, Q, Q] bool tree visibility (None: causal / full)
    all_prefixes_empty: bool  # no request has a prefix: top-left causal alignment is exact
    equal_kv_lens: bool  # every request has S key columns: no padding column to hide
    # A ragged verify attended in groups of requests of similar query lengths: each group's
    # token indices [T_g] into the pass and its own plan (empty: one padded batch)
    groups: tuple[tuple[torch.Tensor, CpuForwardMetadata], ...] = ()
    _masks: dict[bool, torch.Tensor | None] = field(default_factory=dict)

    @property
    def max_q(self) -> int:
        """Padded query rows per request Q."""
        return 1 if self.layout is None else self.layout.max_q

    @property
    def one_query_each(self) -> bool:
        """Whether every request has one query token that sees all its key columns (a decode,
        or a verify or extend of one token per request without a tree mask)."""
        return self.decode or (self.max_q == 1 and self.draft_mask is None)

    def needs_mask(self, causal: bool) -> bool:
        """Whether SDPA needs an explicit mask (else none, or its own top-left is_causal)."""
        if self.one_query_each:  # only the padding columns of shorter requests to hide
            return not self.equal_kv_lens
        if self.draft_mask is None and self.all_prefixes_empty:
            return not (causal or self.equal_kv_lens)
        return True

    def row_chunks(self) -> list[tuple[int, int]]:
        """Query-row ranges whose masks stay within MASK_ELEMENTS (one range when it fits)."""
        batch, max_kv = self.kv_slots.shape
        step = max(1, MASK_ELEMENTS // max(1, batch * max_kv))
        return [(start, min(start + step, self.max_q)) for start in range(0, self.max_q, step)]

    def mask(self, causal: bool, rows: tuple[int, int]) -> torch.Tensor | None:
        """Additive [B, 1, R, S] mask of query rows ``rows``, None when SDPA needs none."""
        if not self.needs_mask(causal):
            return None
        if rows != (0, self.max_q):
            return self._build_mask(causal, rows)  # a chunk of an oversized mask
        if causal not in self._masks:
            self._masks[causal] = self._build_mask(causal, rows)
        return self._masks[causal]

    def _build_mask(self, causal: bool, rows: tuple[int, int]) -> torch.Tensor:
        """Build the additive mask of query rows ``rows``."""
        max_kv = self.kv_slots.shape[1]
        if self.one_query_each:
            columns = torch.arange(max_kv, device=self.kv_slots.device)
            visible = (columns < self.kv_lens.unsqueeze(1)).unsqueeze(1)  # [B, 1, S]
        else:
            visible = kernels.visibility(
                self.prefix_lens,
                self.query_lens,
                self.max_q,
                max_kv,
                causal=causal,
                draft_mask=self.draft_mask,
                rows=rows,
            )
        return kernels.additive_mask(visible)


def query_groups(
    query_lens: list[int], key_columns: int, call_elements: int = GROUP_CALL_ELEMENTS
) -> list[list[int]]:
    """Requests split by query length into groups attended apart, each padded to its own
    longest: the split with the fewest attended elements (padded query rows x
    ``key_columns``) plus ``call_elements`` per group ([] when the whole batch is best)."""
    call_rows = call_elements / max(1, key_columns)  # a group's cost in padded query rows
    lengths = sorted(set(query_lens))  # [L] distinct query lengths, ascending
    count = [0] * (len(lengths) + 1)  # count[j]: requests with one of the first j lengths
    for n in query_lens:
        count[lengths.index(n) + 1] += 1
    for j in range(len(lengths)):
        count[j + 1] += count[j]
    best = [0] + [None] * len(lengths)  # best[j]: least cost of the first j lengths
    cut = [0] * (len(lengths) + 1)
    for j in range(1, len(lengths) + 1):  # a group holds lengths i..j-1, padded to lengths[j-1]
        best[j], cut[j] = min(
            (best[i] + call_rows + (count[j] - count[i]) * lengths[j - 1], i) for i in range(j)
        )
    bounds = []
    j = len(lengths)
    while j > 0:
        bounds.append((lengths[cut[j]], lengths[j - 1]))
        j = cut[j]
    if len(bounds) == 1:
        return []
    return [
        [b for b, n in enumerate(query_lens) if low <= n <= high] for low, high in reversed(bounds)
    ]
