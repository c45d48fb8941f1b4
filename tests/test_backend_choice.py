"""With no --attention-backend, BASTION serves with a backend that verifies trees."""

from __future__ import annotations

import pytest
from resolution import resolved_bastion_args

from sglang_bastion.spec_algo import BastionConfigError, tree_verify_backend


def resolved_backend(*extra: str) -> str:
    """The attention backend SGLang resolves for a CPU BASTION server with ``extra`` flags."""
    return resolved_bastion_args(extra).attention_backend


def test_sglangs_default_that_cannot_verify_trees_is_replaced_not_refused():
    assert resolved_backend() == "bastion_cpu"  # SGLang's CPU default here is torch_native


def test_a_backend_the_user_names_is_refused_by_name_when_it_cannot_verify_trees():
    with pytest.raises(BastionConfigError, match="--attention-backend torch_native cannot"):
        resolved_backend("--attention-backend", "torch_native")


def test_a_named_tree_backend_is_kept():
    assert resolved_backend("--attention-backend", "bastion_cpu") == "bastion_cpu"


def test_on_a_gpu_the_choice_is_triton_whose_verify_graphs_carry_the_tree_mask():
    assert tree_verify_backend("cuda") == "triton"
    assert tree_verify_backend("cuda:0") == "triton"
    assert tree_verify_backend("cpu") == "bastion_cpu"
