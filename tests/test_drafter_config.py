"""The drafter's block size comes from its config.json, for a local folder or a hub id."""

from __future__ import annotations

import json

import pytest
from huggingface_hub import constants

from sglang_bastion.options import ENV_PUBLISHED, BastionOptions, publish_options
from sglang_bastion.spec_algo import BastionConfigError, BastionSpecAlgo, drafter_block_size

HUB_DRAFTER = "someone/Some-DFlash-b10"


@pytest.fixture
def offline_cache(monkeypatch, tmp_path):
    """An empty Hugging Face cache that is never refreshed from the network."""
    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def cache_config(cache, repo_id: str, config: dict) -> None:
    """Put ``config`` into ``cache`` as the hub's config.json of ``repo_id`` at main."""
    folder = cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0" * 40
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))


def test_a_local_drafters_block_size_is_its_configs(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"dflash_config": {"block_size": 8}}))
    assert drafter_block_size(str(tmp_path)) == 8


def test_a_hub_drafters_block_size_is_read_through_the_hugging_face_cache(offline_cache):
    cache_config(offline_cache, HUB_DRAFTER, {"block_size": 10})
    assert drafter_block_size(HUB_DRAFTER) == 10


def test_a_hub_drafter_that_cannot_be_read_is_refused_naming_the_flag_and_the_fix(offline_cache):
    with pytest.raises(BastionConfigError, match=r"--speculative-draft-model-path .*hf download"):
        drafter_block_size(HUB_DRAFTER)


def test_the_draft_runner_is_sized_by_the_launchers_block_size(monkeypatch):
    monkeypatch.setenv(ENV_PUBLISHED, "")
    publish_options(BastionOptions(max_nodes=32, block_size=10))
    algorithm = BastionSpecAlgo.__new__(BastionSpecAlgo)  # its answers read no instance state
    assert algorithm.get_num_tokens_per_req_for_target_verify(32, is_draft_worker=True) == 10
    assert algorithm.get_num_tokens_per_req_for_target_verify(32, is_draft_worker=False) == 32
