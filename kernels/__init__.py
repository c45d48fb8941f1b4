"""Triton kernels for the tree path on CUDA, each beside a pure-torch reference.

Every public entry point without a suffix dispatches: the Triton kernel when its tensors are
on a CUDA device (unless ``SGLANG_BASTION_DISABLE_KERNELS=1``), the ``*_reference`` torch
version elsewhere. The ``*_triton`` versions also run on CPU under ``TRITON_INTERPRET=1``
(the tests).

- `draft_head_topk` / `topk_softmax`: top-K tokens and full-vocabulary probabilities;
  `shard_top_k` / `merge_shard_top_k`: the same over a tensor-parallel LM head's shards.
- `build_trees_from_top_k`: `build_trees` from [B, D, K] top-K instead of [B, D, V]; on CPU
  tensors it runs `tree_build_cpu.c`, a C extension compiled at install (not Triton).
- `verify_inputs`: `linearize` (mask, positions, retrieve arrays) in one launch.
- `accept`: `accept_path` plus the KV-slot moves in one launch.
- `split_tree_attention`: dense prefix pass + masked tree block, merged by log-sum-exp.
- `split_verify_padded`: the same split over ``bastion_cpu``'s padded columns (torch), which
  that backend uses under ``SGLANG_BASTION_SPLIT_VERIFY=1``.
"""

from sglang_bastion.kernels.acceptance import (
    Acceptance,
    accept,
    accept_reference,
    accept_triton,
)
from sglang_bastion.kernels.dispatch import use_triton
from sglang_bastion.kernels.draft_head import (
    draft_head_topk,
    draft_logits,
    merge_shard_top_k,
    shard_top_k,
    topk_softmax,
    topk_softmax_reference,
    topk_softmax_triton,
)
from sglang_bastion.kernels.split_attention import (
    attend_with_lse,
    merge_states,
    split_tree_attention,
    split_tree_attention_reference,
    split_tree_attention_triton,
    split_verify_padded,
)
from sglang_bastion.kernels.tree_build import (
    build_trees_from_top_k,
    build_trees_from_top_k_reference,
    build_trees_from_top_k_triton,
    tree_size,
)
from sglang_bastion.kernels.verify_inputs import (
    verify_inputs,
    verify_inputs_reference,
    verify_inputs_triton,
)

__all__ = [
    "Acceptance",
    "accept",
    "accept_reference",
    "accept_triton",
    "attend_with_lse",
    "build_trees_from_top_k",
    "build_trees_from_top_k_reference",
    "build_trees_from_top_k_triton",
    "draft_head_topk",
    "draft_logits",
    "merge_shard_top_k",
    "merge_states",
    "shard_top_k",
    "split_tree_attention",
    "split_tree_attention_reference",
    "split_tree_attention_triton",
    "split_verify_padded",
    "topk_softmax",
    "topk_softmax_reference",
    "topk_softmax_triton",
    "tree_size",
    "use_triton",
    "verify_inputs",
    "verify_inputs_reference",
    "verify_inputs_triton",
]
