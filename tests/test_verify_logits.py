"""What the verify pass hands SGLang's sampler: the whole vocabulary, host-side bounds (how a
node's token is then drawn: test_row_sampling.py)."""

from __future__ import annotations

import torch
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
from sglang.srt.speculative.draft_worker_common import make_draft_input_v2

from sglang_bastion.worker import full_vocabulary, host_top_k_bounds

V = 8  # the vocabulary; each of two ranks holds half of it


def deferring_processor(full: torch.Tensor) -> LogitsProcessor:
    """SGLang's logits processor with the verify gather deferred, its all-gather stood in."""
    processor = LogitsProcessor.__new__(LogitsProcessor)
    processor.defer_verify_gather, processor.vocab_size = True, V
    processor._gather_softcap_fused = lambda logits, metadata, use_buffer: full
    return processor


def test_a_deferred_shard_is_gathered_before_the_targets_tokens_are_chosen():
    full = torch.arange(3 * V, dtype=torch.float32).view(3, V).flip(1)  # argmax in shard 0
    shard = full[:, V // 2 :]  # [bs*W, V/2]: the second rank's half
    logits = full_vocabulary(deferring_processor(full), shard)
    assert logits.shape == (3, V) and logits.argmax(-1).tolist() == [0, 0, 0]


def test_full_logits_pass_through_untouched():
    full = torch.randn(3, V)
    assert full_vocabulary(deferring_processor(full * 0), full) is full
    assert full_vocabulary(None, full) is full


def draft_input(**prepared) -> DFlashDraftInputV2:
    """SGLang's DFlash draft input as built between steps, with ``prepared`` host fields."""
    draft = make_draft_input_v2(bonus_tokens=torch.zeros(2, dtype=torch.long),
                                new_seq_lens=torch.ones(2, dtype=torch.long))  # fmt: skip
    for name, value in prepared.items():
        setattr(draft, name, value)
    return draft


def test_a_prepared_steps_top_k_bounds_reach_the_sampler_as_host_values():
    assert host_top_k_bounds(draft_input(max_top_k=50, uniform_top_k_value=50)) == (50, 50)
    assert host_top_k_bounds(draft_input(max_top_k=50, uniform_top_k_value=None)) == (50, None)
    assert host_top_k_bounds(draft_input(max_top_k=1, uniform_top_k_value=1)) == (1, 1)


def test_an_unprepared_draft_input_leaves_the_bounds_to_the_sampler():
    assert host_top_k_bounds(draft_input()) == (None, None)  # not "top-1 for everyone"
    assert host_top_k_bounds(None) == (None, None)
