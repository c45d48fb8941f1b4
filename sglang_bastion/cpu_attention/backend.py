"""``bastion_cpu``: a pure-PyTorch SGLang attention backend that serves speculative decoding.

One forward pass plans once (``init_forward_metadata``: pool slots, padded-grid coordinates
and visibility masks, all [B, ...] tensors) and every layer then runs one batched gather and
one SDPA call over the padded batch (one per group of a ragged verify, below), in float32.
Modes:

- EXTEND / MIXED / DRAFT_EXTEND_V2: each request's new tokens attend to its cached prefix and,
  causally, to each other (non-causally for ``ENCODER_ONLY`` layers).
- DECODE: one query per request over its whole cached sequence. A verify or extend of one
  token per request without a tree mask (a plain step) takes the same path.
- TARGET_VERIFY: N draft tokens per request (per-request counts under a ragged verify layout)
  after a prefix of ``seq_lens`` tokens. With ``spec_info.custom_mask`` (a tree) a draft token
  sees the prefix plus the draft tokens its mask row names; without one, the block is causal
  (DFLASH's chain verify) or, for ``ENCODER_ONLY`` layers, fully visible (the DFlash drafter's
  non-causal pass over [context || block]). A ragged verify whose trees differ much in size
  (the batch-global budget gives a confident request a deep tree and the others a few nodes)
  is attended in groups of requests of similar sizes, each padded to its own deepest tree
  (`plan.query_groups`): one padded batch would attend every request as deep as the deepest,
  and the attention's cost would follow the widest tree instead of the tokens verified.

``SGLANG_BASTION_SPLIT_VERIFY=1`` attends tree verifies in two parts instead (an unmasked pass
over the prefix and a masked pass over the N x N tree block, merged by log-sum-exp: see
``sglang_bastion.kernels.split_attention``), so no [B, N, prefix + N] mask is built.
``SGLANG_BASTION_CPU_GROUP_ELEMENTS`` sets what one more group costs, in attended elements
(query rows x key columns), for a host whose calls cost more or less than this one's.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

from sglang_bastion.cpu_attention import BACKEND_NAME, kernels
from sglang_bastion.cpu_attention.kernels import DraftMaskLayout, RaggedLayout
from sglang_bastion.cpu_attention.plan import (
    CpuForwardMetadata,
    group_call_elements,
    query_groups,
)
from sglang_bastion.kernels.split_attention import split_verify_padded

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention

logger = logging.getLogger(__name__)

SUPPORTED_MODES = ("EXTEND", "MIXED", "DECODE", "IDLE", "TARGET_VERIFY", "DRAFT_EXTEND_V2")
_EXTEND_MODES = (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DRAFT_EXTEND_V2)
_KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ENV_SPLIT_VERIFY = "SGLANG_BASTION_SPLIT_VERIFY"


class UnsupportedByCpuBackend(NotImplementedError):
    """A mode or layer feature ``bastion_cpu`` does not serve; the message says what does."""


def _refuse(what: str, alternative: str = "triton or flashinfer") -> UnsupportedByCpuBackend:
    """The one-line error for something this backend does not serve."""
    return UnsupportedByCpuBackend(
        f"--attention-backend {BACKEND_NAME} does not support {what}; "
        f"use --attention-backend {alternative} for it."
    )


class BastionCpuAttnBackend(AttentionBackend):
    """Paged MHA/GQA attention in plain PyTorch (SDPA, float32) for CPU development serving."""

    verifies_ragged = True  # TARGET_VERIFY takes SGLang's per-request ragged verify layout
    reads_draft_only_masks = True  # a tree mask of the W x W blocks alone (told by its size)

    def __init__(self, model_runner: Any):
        super().__init__()
        if getattr(model_runner, "use_mla_backend", False):
            raise _refuse("MLA models", "triton")
        self.device = model_runner.device
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        if isinstance(self.token_to_kv_pool, SWAKVPool):
            raise _refuse("hybrid sliding-window KV pools", "triton")
        kv_dtype = getattr(self.token_to_kv_pool, "dtype", torch.float32)
        if kv_dtype not in _KV_DTYPES:
            raise _refuse(f"KV cache dtype {kv_dtype}", "triton")
        self.default_mask_layout = _sglang_default_mask_layout()
        self.forward_metadata: CpuForwardMetadata | None = None
        # Tree verify as prefix pass + tree-block pass (off by default).
        self.split_verify = os.environ.get(ENV_SPLIT_VERIFY, "0") not in ("", "0")
        self.group_call_elements = group_call_elements()  # what a ragged verify's group costs

    # ----------------------------------------------------------------- planning

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Plan one forward pass: key slots, query layout and masks for every layer."""
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self.forward_metadata = None
            return
        if forward_batch.encoder_lens is not None:
            raise _refuse("encoder-decoder (cross-attention) batches")
        if mode.is_decode():
            self.forward_metadata = self._plan_decode(forward_batch)
        elif mode.is_target_verify():
            self.forward_metadata = self._plan_verify(forward_batch)
        elif mode in _EXTEND_MODES:
            self.forward_metadata = self._plan_extend(forward_batch)
        else:
            raise _refuse(
                f"forward mode {mode.name} (it serves {', '.join(SUPPORTED_MODES)})", "triton"
            )

    def init_forward_metadata_out_graph(
        self, forward_batch: ForwardBatch, in_capture: bool = False
    ) -> None:
        """Eager planning; graph capture is refused."""
        if in_capture:
            raise self._no_graphs()
        self.init_forward_metadata(forward_batch)

    def _plan_decode(self, forward_batch: ForwardBatch) -> CpuForwardMetadata:
        """One query per request over its ``seq_lens`` cached tokens (the new one included)."""
        spec_info = forward_batch.spec_info
        if spec_info is not None and getattr(spec_info, "kv_indptr", None) is not None:
            raise _refuse("multi-step draft decode (EAGLE draft steps)", "triton")
        return self._one_query_each(forward_batch, forward_batch.seq_lens.long(), decode=True)

    def _plan_extend(self, forward_batch: ForwardBatch) -> CpuForwardMetadata:
        """New tokens of each request after its cached prefix."""
        if forward_batch.extend_prefix_lens is None or forward_batch.extend_seq_lens is None:
            raise _refuse(
                f"forward mode {forward_batch.forward_mode.name} without extend_prefix_lens / "
                "extend_seq_lens",
                "triton",
            )
        return self._plan_block(
            forward_batch,
            forward_batch.extend_prefix_lens.long(),
            forward_batch.extend_seq_lens.long(),
            draft_mask=None,
        )

    def _plan_verify(self, forward_batch: ForwardBatch) -> CpuForwardMetadata:
        """N draft tokens per request after ``seq_lens`` committed ones, tree mask optional."""
        spec_info = forward_batch.spec_info
        if spec_info is None:
            raise _refuse("TARGET_VERIFY without spec_info", "triton")
        prefix_lens = forward_batch.seq_lens.long()  # [B]
        batch = prefix_lens.shape[0]
        ragged = getattr(spec_info, "ragged_verify_layout", None)
        if ragged is not None:
            draft_lens = ragged.verify_lens.long()[:batch]
        else:
            per_request = getattr(spec_info, "num_tokens_per_req", -1)
            if per_request is None or per_request <= 0:
                per_request = int(spec_info.draft_token_num)
            draft_lens = torch.full_like(prefix_lens, per_request)
        flat_mask = getattr(spec_info, "custom_mask", None)
        draft_mask = None
        width = int(draft_lens.max())
        if width == 1 and ragged is None:  # a plain step: one query each, as a decode
            return self._one_query_each(forward_batch, prefix_lens + 1, decode=False)
        # A ragged batch of one token each sees its prefix and itself under any mask.
        if flat_mask is not None and flat_mask.numel() > 0 and width > 1:
            draft_mask = kernels.draft_block_mask(
                flat_mask,
                prefix_lens,
                draft_lens,
                width,
                self._mask_layout(flat_mask, prefix_lens, draft_lens),
            )
        plan = self._plan_block(forward_batch, prefix_lens, draft_lens, draft_mask=draft_mask)
        if ragged is None or plan.layout.uniform:
            return plan
        # this backend's tensors are on the host
        groups = query_groups(draft_lens.tolist(), plan.layout.max_kv, self.group_call_elements)
        if groups:
            plan.groups = tuple(
                self._plan_group(forward_batch, plan, torch.tensor(rows), draft_mask)
                for rows in groups
            )
        return plan

    def _plan_group(
        self, forward_batch: ForwardBatch, plan: CpuForwardMetadata, rows: torch.Tensor,
        draft_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, CpuForwardMetadata]:  # fmt: skip
        """The token indices [T_g] and the plan of one group of a ragged verify's requests."""
        layout = plan.layout
        assert layout is not None
        tokens = torch.isin(layout.batch, rows).nonzero().squeeze(1)  # [T_g], in pass order
        query_lens = plan.query_lens.index_select(0, rows)  # [B_g]
        width = int(query_lens.max())
        mask = None if draft_mask is None else draft_mask.index_select(0, rows)[:, :width, :width]
        write_loc = forward_batch.out_cache_loc
        group = self._plan_block(
            forward_batch, plan.prefix_lens.index_select(0, rows), query_lens, mask,
            req_pool_indices=forward_batch.req_pool_indices.index_select(0, rows),
            write_loc=None if write_loc is None else write_loc.index_select(0, tokens),
        )  # fmt: skip
        return tokens, group

    def _one_query_each(
        self, forward_batch: ForwardBatch, kv_lens: torch.Tensor, decode: bool
    ) -> CpuForwardMetadata:
        """One query per request, the last of its ``kv_lens`` keys.

        A decode reads the new token's key from the cache; a plain verify step (``decode``
        false) reads it from this forward's write slot, through a one-column ragged layout.
        """
        max_kv = int(kv_lens.max())
        slots = kernels.kv_slot_table(
            self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices, kv_lens, max_kv
        )  # [B, S]
        prefix_lens = kv_lens - 1  # [B]
        layout = None
        if not decode:
            batch = torch.arange(kv_lens.shape[0], device=kv_lens.device)  # [B]
            write_loc = forward_batch.out_cache_loc
            if write_loc is not None:
                slots[batch, prefix_lens] = write_loc[: batch.shape[0]].long()
            layout = RaggedLayout(batch, torch.zeros_like(batch), prefix_lens, 1, max_kv, True)
        return CpuForwardMetadata(
            decode=decode,
            kv_slots=slots,
            layout=layout,
            prefix_lens=prefix_lens,
            query_lens=torch.ones_like(kv_lens),
            kv_lens=kv_lens,
            draft_mask=None,
            all_prefixes_empty=False,  # one query each: the mask never reads it
            equal_kv_lens=bool((kv_lens == max_kv).all()),
        )

    def _plan_block(
        self,
        forward_batch: ForwardBatch,
        prefix_lens: torch.Tensor,
        query_lens: torch.Tensor,
        draft_mask: torch.Tensor | None,
        req_pool_indices: torch.Tensor | None = None,
        write_loc: torch.Tensor | None = None,
    ) -> CpuForwardMetadata:
        """Key slots from ``req_to_token``; the query block's are this forward's write slots
        (``req_pool_indices``, ``write_loc``: a group's own, else the batch's)."""
        layout = kernels.ragged_layout(prefix_lens, query_lens)
        kv_lens = prefix_lens + query_lens  # [B]
        if req_pool_indices is None:
            req_pool_indices = forward_batch.req_pool_indices
            write_loc = forward_batch.out_cache_loc
        slots = kernels.kv_slot_table(
            self.req_to_token_pool.req_to_token,
            req_pool_indices,
            kv_lens,
            layout.max_kv,
        )
        if write_loc is not None:
            slots[layout.batch, layout.col] = write_loc[: layout.num_tokens].long()
        return CpuForwardMetadata(
            decode=False,
            kv_slots=slots,
            layout=layout,
            prefix_lens=prefix_lens,
            query_lens=query_lens,
            kv_lens=kv_lens,
            draft_mask=draft_mask,
            all_prefixes_empty=not bool(prefix_lens.any()),
            equal_kv_lens=bool((kv_lens == layout.max_kv).all()),
        )

    def _mask_layout(
        self, flat_mask: torch.Tensor, prefix_lens: torch.Tensor, draft_lens: torch.Tensor
    ) -> DraftMaskLayout:
        """The flat mask's layout, told apart by its size (SGLang's default when ambiguous)."""
        with_prefix = int((draft_lens * (prefix_lens + draft_lens)).sum())
        draft_only = int((draft_lens * draft_lens).sum())
        if flat_mask.numel() == with_prefix:
            return DraftMaskLayout.WITH_PREFIX
        if flat_mask.numel() == draft_only:
            return DraftMaskLayout.DRAFT_ONLY
        return self.default_mask_layout

    # ----------------------------------------------------------------- forward

    def _begin(
        self, k: torch.Tensor | None, v: torch.Tensor | None, layer: RadixAttention,
        forward_batch: ForwardBatch, save_kv_cache: bool, kwargs: dict[str, Any], *, decode: bool,
    ) -> CpuForwardMetadata:  # fmt: skip
        """Check the call against the plan, write the new keys and values; the plan."""
        _check_layer(layer, kwargs)
        meta = self._metadata()
        if meta.decode != decode:
            called, plan = ("decode", "an extend") if decode else ("extend", "a decode")
            raise RuntimeError(f"{BACKEND_NAME}: forward_{called} called on {plan} plan")
        self._save_kv(k, v, layer, forward_batch, save_kv_cache)
        return meta

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Attention of a block of new tokens per request (extend, mixed, verify, draft)."""
        meta = self._begin(k, v, layer, forward_batch, save_kv_cache, kwargs, decode=False)
        if not meta.groups:
            return self._attend_block(q, k, v, layer, meta, save_kv_cache)
        heads, v_dim = layer.tp_q_head_num, layer.v_head_dim
        out = q.new_zeros(q.shape[0], heads * v_dim)  # [T, H*Dv]: padding rows stay 0
        for tokens, group in meta.groups:  # each group padded to its own longest tree
            k_g = None if k is None else k.index_select(0, tokens)
            v_g = None if v is None else v.index_select(0, tokens)
            rows = self._attend_block(
                q.index_select(0, tokens), k_g, v_g, layer, group, save_kv_cache
            )
            out.index_copy_(0, tokens, rows)
        return out

    def _attend_block(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
        layer: RadixAttention, meta: CpuForwardMetadata, save_kv_cache: bool,
    ) -> torch.Tensor:  # fmt: skip
        """[q rows, H*Dv] attention of ``meta``'s query blocks (keys and values written)."""
        # A plain step's verify (one token per request, its key and value in the pool now):
        # the decode's attention, which sees every key column of its request.
        if meta.one_query_each and (k is None or save_kv_cache):
            return self._attend_one_query(q, layer, meta)
        heads, head_dim, v_dim = layer.tp_q_head_num, layer.qk_head_dim, layer.v_head_dim
        layout = meta.layout
        assert layout is not None
        k_cols, v_cols = self._gather_kv(layer, meta)  # [B, S, Hkv, D], [B, S, Hkv, Dv]
        if k is not None and v is not None:  # the block's own keys exactly as given
            tokens = layout.num_tokens
            k_cols[layout.batch, layout.col] = k[:tokens].view(tokens, -1, head_dim).float()
            v_cols[layout.batch, layout.col] = v[:tokens].view(tokens, -1, v_dim).float()
        causal = layer.attn_type != AttentionType.ENCODER_ONLY
        batch = meta.kv_slots.shape[0]
        queries = kernels.pad_tokens(q.reshape(-1, heads, head_dim), layout, batch)  # [B, Q, H, D]
        if self.split_verify and causal and meta.draft_mask is not None and not layer.logit_cap:
            out = split_verify_padded(
                queries, k_cols, v_cols, meta.prefix_lens, meta.query_lens, meta.draft_mask,
                layer.scaling,
            )  # fmt: skip
            return self._write_output(q, kernels.unpad_tokens(out, layout), heads * v_dim)
        chunks = meta.row_chunks() if meta.needs_mask(causal) else [(0, layout.max_q)]
        parts = [
            kernels.attend(
                queries[:, start:stop],
                k_cols,
                v_cols,
                mask=meta.mask(causal, (start, stop)),
                is_causal=causal,
                scale=layer.scaling,
                logit_cap=_logit_cap(layer),
            )
            for start, stop in chunks
        ]  # [B, R, H, Dv] each
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # [B, Q, H, Dv]
        return self._write_output(q, kernels.unpad_tokens(out, layout), heads * v_dim)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Attention of one new token per request over its cached sequence."""
        meta = self._begin(k, v, layer, forward_batch, save_kv_cache, kwargs, decode=True)
        return self._attend_one_query(q, layer, meta)

    def _attend_one_query(
        self, q: torch.Tensor, layer: RadixAttention, meta: CpuForwardMetadata
    ) -> torch.Tensor:
        """Attention of one query per request over all its key columns (written already)."""
        heads, head_dim, v_dim = layer.tp_q_head_num, layer.qk_head_dim, layer.v_head_dim
        batch = meta.kv_slots.shape[0]
        queries = q.reshape(-1, heads, head_dim)[:batch].unsqueeze(1)  # [B, 1, H, D]
        k_cols, v_cols = self._gather_kv(layer, meta)
        out = kernels.attend(
            queries,
            k_cols,
            v_cols,
            mask=meta.mask(False, (0, 1)),
            is_causal=False,
            scale=layer.scaling,
            logit_cap=_logit_cap(layer),
        )  # [B, 1, H, Dv]
        return self._write_output(q, out.squeeze(1), heads * v_dim)

    def _metadata(self) -> CpuForwardMetadata:
        """This forward's plan; fails loudly when planning was skipped."""
        if self.forward_metadata is None:
            raise RuntimeError(f"{BACKEND_NAME}: init_forward_metadata was not called")
        return self.forward_metadata

    def _save_kv(
        self,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool,
    ) -> None:
        """Write the new tokens' keys and values to the pool at ``out_cache_loc``."""
        if (k is None) != (v is None):
            raise ValueError("k and v must both be given or both be None")
        if save_kv_cache and k is not None:
            loc = KVWriteLoc.for_batch(forward_batch)
            self.token_to_kv_pool.set_kv_buffer(layer, loc, k, v)

    def _gather_kv(
        self, layer: RadixAttention, meta: CpuForwardMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, S, Hkv, D] keys and [B, S, Hkv, Dv] values of every key column, float32."""
        k_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_buffer = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        return kernels.gather_kv(k_buffer, meta.kv_slots), kernels.gather_kv(
            v_buffer, meta.kv_slots
        )

    @staticmethod
    def _write_output(q: torch.Tensor, rows: torch.Tensor, width: int) -> torch.Tensor:
        """[q rows, width] output in q's dtype; rows past the real tokens (padding) are 0."""
        out = q.new_zeros(q.shape[0], width) if rows.shape[0] < q.shape[0] else None
        values = rows.reshape(rows.shape[0], width).to(q.dtype)
        if out is None:
            return values
        out[: rows.shape[0]] = values
        return out

    # ----------------------------------------------------------------- graphs

    @staticmethod
    def _no_graphs() -> UnsupportedByCpuBackend:
        """The error for any graph capture request."""
        return _refuse(
            "CUDA/CPU graph capture (launch with --cuda-graph-backend-decode disabled)", "triton"
        )

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Refuse graph capture: this backend runs eagerly only."""
        raise self._no_graphs()

    def init_forward_metadata_for_breakable_cuda_graph_capture(
        self, forward_batch: ForwardBatch
    ) -> None:
        """Refuse graph capture: this backend runs eagerly only."""
        raise self._no_graphs()

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """Fill value for padded sequence lengths (never used: no graphs)."""
        return 1

    def support_triton(self) -> bool:
        """This backend uses no Triton kernels."""
        return False


def _check_layer(layer: RadixAttention, kwargs: dict[str, Any]) -> None:
    """Refuse, in one line, layer features this backend does not implement."""
    if layer.is_cross_attention:
        raise _refuse("cross-attention layers")
    if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
        raise _refuse(f"sliding-window attention (layer {layer.layer_id})", "triton")
    if layer.attn_type == AttentionType.DECODER_BIDIRECTIONAL:
        raise _refuse("DECODER_BIDIRECTIONAL layers", "triton")
    if getattr(layer, "xai_temperature_len", -1) > 0:
        raise _refuse("xai temperature scaling", "triton")
    if getattr(layer, "k_scale", None) is not None or getattr(layer, "v_scale", None) is not None:
        raise _refuse("scaled (quantized) KV caches", "triton")
    if layer.logit_cap and getattr(layer, "logit_capping_method", "tanh") != "tanh":
        raise _refuse(f"logit capping method {layer.logit_capping_method!r}", "triton")
    extras = sorted(name for name, value in kwargs.items() if value is not None)
    if extras:
        raise _refuse(f"attention arguments {extras}", "triton")


def _logit_cap(layer: RadixAttention) -> float:
    """The layer's tanh logit cap, 0 when it has none."""
    return float(layer.logit_cap or 0.0)


def _sglang_default_mask_layout() -> DraftMaskLayout:
    """The verify-mask layout SGLang's tree builders write on this platform."""
    try:
        from sglang.srt.speculative.eagle_utils import TreeMaskMode, default_tree_mask_mode
    except ImportError:  # older layouts had only the full mask
        return DraftMaskLayout.WITH_PREFIX
    if default_tree_mask_mode() == TreeMaskMode.QLEN_ONLY:
        return DraftMaskLayout.DRAFT_ONLY
    return DraftMaskLayout.WITH_PREFIX


def create_backend(model_runner: Any) -> BastionCpuAttnBackend:
    """SGLang's factory for ``--attention-backend bastion_cpu`` (warns on accelerators)."""
    device = str(getattr(model_runner, "device", "cpu"))
    if not device.startswith("cpu"):
        logger.warning(
            "%s is a CPU development attention backend (plain PyTorch SDPA); on %s prefer "
            "--attention-backend flashinfer or triton.",
            BACKEND_NAME,
            device,
        )
    return BastionCpuAttnBackend(model_runner)
