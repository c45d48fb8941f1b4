"""The draft state a BASTION step hands the scheduler: SGLang's DFlash spec-v2 input, with
its per-step KV reserve made from whole lists instead of per-request tensor writes.

SGLang's scheduler calls the running batch's ``spec_info.prepare_for_decode`` before every
decode step. DFlash's version fills three CPU length tensors one element at a time (three
tensor writes per request and step, about 3 us each on a CPU); at a batch of 48 that was
about 2% of a plainly decoding BASTION server's step, and none of it is on the plain
server's path. This class fills each tensor from a list in one copy and reserves the same
slots through SGLang's own allocator call.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache import allocation
from sglang.srt.mem_cache.allocation_sizing import page_aligned_decode_alloc_lens
from sglang.srt.runtime_context import get_spec
from sglang.srt.speculative import dflash_info_v2
from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2


class BastionDraftInput(DFlashDraftInputV2):
    """DFlash's spec-v2 draft state; its decode reserve is filled per batch, not per request."""

    def prepare_for_decode(self, batch: Any) -> None:
        """Reserve the next step's KV window of every request (as DFlash does), list-wise."""
        bs = batch.batch_size()
        if bs == 0:
            return
        plan_stream, plan_stream_ctx = dflash_info_v2._get_overlap_plan_stream(batch.device)
        batch.maybe_evict_swa()
        self._ensure_prepare_length_buffers(bs, batch.device)
        window = int(get_spec().speculative_num_draft_tokens)  # validated at launch
        reqs = batch.reqs
        cur, nxt, needed = page_aligned_decode_alloc_lens(
            reqs, reserve=2 * window, page_size=batch.token_to_kv_pool_allocator.page_size
        )
        committed = [int(req.kv.kv_committed_len) for req in reqs]  # [B]
        top_ks = [int(req.sampling_params.top_k) for req in reqs]  # [B]
        seq_lens_cpu = self._prepare_batch_seq_lens_cpu_buf[:bs]
        cur_cpu = self._prepare_cur_kv_lens_cpu_buf[:bs]
        nxt_cpu = self._prepare_nxt_kv_lens_cpu_buf[:bs]
        seq_lens_cpu.copy_(torch.tensor(committed, dtype=seq_lens_cpu.dtype))
        cur_cpu.copy_(torch.tensor(cur, dtype=cur_cpu.dtype))
        nxt_cpu.copy_(torch.tensor(nxt, dtype=nxt_cpu.dtype))
        self.max_top_k = max(1, *top_ks)
        self.uniform_top_k_value = top_ks[0] if top_ks.count(top_ks[0]) == bs else None

        caller_stream = None
        if plan_stream is not None:
            caller_stream = torch.get_device_module(batch.device).current_stream()
        with plan_stream_ctx:
            if plan_stream is not None and caller_stream is not None:
                plan_stream.wait_stream(caller_stream)  # the batch's tensors were just rebuilt
            cur_dev = self._prepare_cur_kv_lens_gpu_buf[:bs]
            nxt_dev = self._prepare_nxt_kv_lens_gpu_buf[:bs]
            cur_dev.copy_(cur_cpu, non_blocking=True)
            nxt_dev.copy_(nxt_cpu, non_blocking=True)
            allocation.alloc_for_spec_decode(
                batch.tree_cache,
                batch.req_to_token_pool,
                reqs=reqs,
                req_pool_indices=batch.req_pool_indices,
                cur_kv_lens=cur_dev,
                cur_kv_lens_cpu=cur_cpu,
                nxt_kv_lens=nxt_dev,
                nxt_kv_lens_cpu=nxt_cpu,
                num_needed_tokens=needed,
                batch=batch,
            )
        if caller_stream is not None:  # the forward waits for the reserve, on its own stream
            caller_stream.wait_stream(plan_stream)
        for req in reqs:
            req.decode_batch_idx += 1
        batch.seq_lens_cpu = seq_lens_cpu  # committed; overlap's resolve overwrites it
        batch.seq_lens_sum = sum(committed)
        self.nxt_kv_lens_cpu = nxt_cpu
        self.nxt_kv_lens_sum = sum(nxt)


def make_draft_input(bonus_tokens: torch.Tensor, new_seq_lens: torch.Tensor) -> BastionDraftInput:
    """The draft state of a step that emitted ``bonus_tokens`` [B] at ``new_seq_lens`` [B]."""
    bs = int(new_seq_lens.numel())
    device = bonus_tokens.device
    return BastionDraftInput(
        topk_p=torch.empty((bs, 0), device=device, dtype=torch.float32),  # [B, 0]: unused
        topk_index=torch.empty((bs, 0), device=device, dtype=torch.int64),  # [B, 0]
        bonus_tokens=bonus_tokens.to(dtype=torch.int64),  # [B]
        new_seq_lens=new_seq_lens.to(dtype=torch.int64),  # [B]
        hidden_states=torch.empty((bs, 0), device=device, dtype=torch.float16),  # [B, 0]
    )
