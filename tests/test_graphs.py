"""A BASTION target never captures SGLang's mask-less verify graphs; everything else does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from sglang_bastion import plugin


def captured_decode_graphs(algorithm, is_draft_worker: bool = False) -> list[bool]:
    """What SGLang's TpModelWorker.init_cuda_graphs asks each of its runners to capture."""
    asked = []
    runner = SimpleNamespace(
        is_draft_worker=is_draft_worker,
        spec_algorithm=algorithm,
        init_cuda_graphs=lambda capture_decode_cuda_graph: asked.append(capture_decode_cuda_graph),
    )
    tp_worker = SimpleNamespace(model_runner=runner, model_runner_list=[runner])
    TpModelWorker.init_cuda_graphs(tp_worker)
    return asked


@pytest.fixture(scope="module")
def hooked() -> None:
    """The plugin registered and its hooks applied, as SGLang's load_plugins leaves them."""
    plugin.register()
    HookRegistry.apply_hooks()


def test_a_bastion_target_captures_no_decode_graphs(hooked):
    bastion = SpeculativeAlgorithm.from_string(plugin.ALGORITHM_NAME)
    assert captured_decode_graphs(bastion) == [False]


def test_a_plain_or_dflash_target_captures_its_decode_graphs_as_before(hooked):
    for name in ("NONE", "DFLASH"):
        assert captured_decode_graphs(SpeculativeAlgorithm.from_string(name)) == [True]


def test_the_bastion_drafter_is_left_to_its_workers_own_graphs(hooked):
    bastion = SpeculativeAlgorithm.from_string(plugin.ALGORITHM_NAME)
    assert captured_decode_graphs(bastion, is_draft_worker=True) == [True]
