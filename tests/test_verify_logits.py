"""The verify logits cover the whole vocabulary, also when SGLang defers the TP gather."""

from __future__ import annotations

import torch
from sglang.srt.layers.logits_processor import LogitsProcessor

from sglang_bastion.worker import full_vocabulary

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
