"""Draft trees: best-first building, linearising for verification, and exact acceptance."""

from sglang_bastion.tree.acceptance import accept_path
from sglang_bastion.tree.batch import TreeBatch
from sglang_bastion.tree.builder import build_trees, build_trees_from_top_k, lattice_size
from sglang_bastion.tree.linearize import VerifyInputs, ancestor_mask, linearize

__all__ = [
    "TreeBatch",
    "VerifyInputs",
    "accept_path",
    "ancestor_mask",
    "build_trees",
    "build_trees_from_top_k",
    "lattice_size",
    "linearize",
]
