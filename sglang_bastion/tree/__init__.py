"""Draft trees: the tree structure and the three tree ops, one module each.

- `builder`: `build_trees_from_top_k` (Triton on CUDA, compiled C on CPU, a plain heap as the
  reference) and `build_trees`, the same on dense marginals.
- `verify_inputs`: the verify pass's inputs in SGLang's layout (torch reference, Triton).
- `acceptance`: `accept`, the exact walk with the target's own tokens plus its KV moves
  (torch reference, Triton); `accept_path`, the walk alone.
"""

from sglang_bastion.tree.acceptance import Acceptance, accept, accept_path
from sglang_bastion.tree.batch import TreeBatch
from sglang_bastion.tree.builder import build_trees, build_trees_from_top_k, lattice_size
from sglang_bastion.tree.verify_inputs import VerifyInputs, ancestor_mask, verify_inputs

__all__ = [
    "Acceptance",
    "TreeBatch",
    "VerifyInputs",
    "accept",
    "accept_path",
    "ancestor_mask",
    "build_trees",
    "build_trees_from_top_k",
    "lattice_size",
    "verify_inputs",
]
