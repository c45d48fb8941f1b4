"""The SGLang plugin entry point is declared, and registering makes BASTION known to SGLang."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

from sglang_bastion import plugin


def test_entry_point_is_declared_in_sglangs_plugin_group():
    found = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "bastion"]
    assert found, "install the package (pip install -e .) so its entry points are visible"
    assert found[0].load() is plugin.register


def test_register_makes_bastion_and_bastion_cpu_known_to_sglang_once():
    pytest.importorskip("sglang")
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_bastion.spec_algo import BastionSpecAlgo

    plugin.register()
    plugin.register()  # plugins may be loaded twice in one process
    algorithm = SpeculativeAlgorithm.from_string(plugin.ALGORITHM_NAME)
    assert isinstance(algorithm, BastionSpecAlgo) and algorithm.is_dflash_family()
    assert "bastion_cpu" in ATTENTION_BACKENDS
    assert ATTENTION_BACKEND_CHOICES.count("bastion_cpu") == 1
