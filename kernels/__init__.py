"""The draft head and split verification attention: each a torch reference and a Triton kernel.

Every public entry point without a suffix dispatches: the Triton kernel when its tensors are
on a CUDA device (unless called with ``kernels=False``), the ``*_reference`` torch version
elsewhere. The ``*_triton`` versions also run on CPU under ``TRITON_INTERPRET=1`` (the
tests). The tree ops (build, verify inputs, acceptance) live in `sglang_bastion.tree`, each
module holding its own reference, kernel and dispatcher the same way; ``tree_build_cpu.c``
here is the tree build's compiled CPU path.

- `draft_head_topk` / `topk_softmax`: top-K tokens and full-vocabulary probabilities;
  `shard_top_k` / `merge_shard_top_k`: the same over a tensor-parallel LM head's shards.
- `split_tree_attention`: dense prefix pass + masked tree block, merged by log-sum-exp.
- `split_verify_padded`: the same split over ``bastion_cpu``'s padded columns (torch), which
  that backend uses under ``SGLANG_BASTION_SPLIT_VERIFY=1``.
"""

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

__all__ = [
    "attend_with_lse",
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
    "use_triton",
]
