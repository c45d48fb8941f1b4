"""Where the target's tree verify runs in graphs, and where it verifies eagerly (and why)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sglang.srt.platforms.cpu import CpuSRTPlatform

from sglang_bastion import verify_graphs
from sglang_bastion.verify_graphs import verify_graphs_unavailable


class TritonAttnBackend:
    """Stands for SGLang's Triton backend by name, as the gate reads it."""


class FlashInferAttnBackend:
    """Stands for SGLang's FlashInfer backend by name."""


def target(backend: object, shared_output: object = object()) -> SimpleNamespace:
    """A target model runner as the gate sees it."""
    return SimpleNamespace(attn_backend=backend, graph_shared_output=shared_output)


@pytest.fixture
def gpu(monkeypatch):
    """A platform that captures device graphs, with decode graphs enabled."""
    capturing = SimpleNamespace(capabilities=SimpleNamespace(graph_capture=True))
    monkeypatch.setattr(verify_graphs, "current_platform", capturing)
    monkeypatch.setattr(verify_graphs, "check_cuda_graph_backend", lambda phase, backend: False)


def test_triton_on_a_graph_capturing_platform_verifies_in_graphs(gpu):
    assert verify_graphs_unavailable(target(TritonAttnBackend())) is None


def test_disabled_decode_graphs_verify_eagerly_and_say_which_flag(gpu, monkeypatch):
    monkeypatch.setattr(verify_graphs, "check_cuda_graph_backend", lambda phase, backend: True)
    reason = verify_graphs_unavailable(target(TritonAttnBackend()))
    assert "--cuda-graph-backend-decode disabled" in reason


def test_a_platform_without_graph_capture_verifies_eagerly():
    reason = verify_graphs_unavailable(target(TritonAttnBackend()))  # this CPU host's platform
    assert "captures no device graphs" in reason


def test_the_cpu_engines_compiled_graphs_are_not_capture_graphs(gpu, monkeypatch):
    monkeypatch.setattr(verify_graphs, "current_platform", CpuSRTPlatform())
    assert "CpuSRTPlatform captures no device graphs" in verify_graphs_unavailable(
        target(TritonAttnBackend())
    )


def test_a_backend_whose_graphs_carry_no_tree_mask_verifies_eagerly_and_names_triton(gpu):
    reason = verify_graphs_unavailable(target(FlashInferAttnBackend()))
    assert "FlashInferAttnBackend" in reason and "--attention-backend triton" in reason


def test_no_shared_graph_output_buffer_verifies_eagerly(gpu):
    assert "no graph output buffer" in verify_graphs_unavailable(
        target(TritonAttnBackend(), shared_output=None)
    )
