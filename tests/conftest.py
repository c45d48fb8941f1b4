"""Shared fixtures; the tests' helper modules are importable as plain modules."""

import os
import sys
from pathlib import Path

import pytest

# SGLang's Triton kernels can only be interpreted on a CPU; the flag must precede their import.
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).parent))

FEW_TOKENS = (300, 301, 302, 303)


@pytest.fixture(scope="session")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Qwen3 target that emits one of four tokens, and a DFlash drafter for it."""
    from tiny_models import write_drafter, write_target

    root = tmp_path_factory.mktemp("pair")
    target = write_target(root / "target", few_tokens=FEW_TOKENS)
    return target, write_drafter(root / "drafter", target)
