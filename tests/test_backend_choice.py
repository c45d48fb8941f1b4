"""With no --attention-backend, BASTION serves with a backend that verifies trees."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sglang_bastion.options import ENV_PUBLISHED
from sglang_bastion.spec_algo import BastionConfigError, tree_verify_backend

PAIR = Path(__file__).resolve().parent.parent / "training" / "pair"


def resolved_backend(*extra: str) -> str:
    """The attention backend SGLang resolves for a CPU BASTION server with ``extra`` flags."""
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.server_args import prepare_server_args

    from sglang_bastion.plugin import register

    register()
    argv = ["--model-path", str(PAIR / "target"), "--device", "cpu",
            "--speculative-algorithm", "BASTION",
            "--speculative-draft-model-path", str(PAIR / "drafter"), *extra]  # fmt: skip
    published = os.environ.get(ENV_PUBLISHED)
    server_args = prepare_server_args(argv)
    try:
        server_args.resolve_once()  # publishes the options, as a launcher does
    finally:
        os.environ.pop(ENV_PUBLISHED, None)
        if published is not None:
            os.environ[ENV_PUBLISHED] = published
    return resolving_view(server_args).attention_backend


def test_sglangs_default_that_cannot_verify_trees_is_replaced_not_refused():
    assert resolved_backend() == "bastion_cpu"  # SGLang's CPU default here is torch_native


def test_a_backend_the_user_names_is_refused_by_name_when_it_cannot_verify_trees():
    with pytest.raises(BastionConfigError, match="--attention-backend torch_native cannot"):
        resolved_backend("--attention-backend", "torch_native")


def test_a_named_tree_backend_is_kept():
    assert resolved_backend("--attention-backend", "bastion_cpu") == "bastion_cpu"


def test_on_a_gpu_the_choice_is_flashinfer_when_installed_else_triton(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    assert tree_verify_backend("cuda") == "flashinfer"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert tree_verify_backend("cuda:0") == "triton"
    assert tree_verify_backend("cpu") == "bastion_cpu"
