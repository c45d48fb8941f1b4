"""The SGLang plugin entry point is declared and importable without SGLang."""

from __future__ import annotations

from importlib.metadata import entry_points

from sglang_bastion import plugin


def test_entry_point_is_declared_in_sglangs_plugin_group():
    found = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "bastion"]
    assert found, "install the package (pip install -e .) so its entry points are visible"
    assert found[0].load() is plugin.register


def test_register_is_callable_without_sglang_installed_or_with_it():
    plugin.register()
    plugin.register()  # plugins may be loaded twice in one process
