"""The CPU stand-ins the test servers load do what SGLang's GPU code they replace does."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

STANDINS = Path(__file__).resolve().parent / "sglang_standins" / "sitecustomize.py"


@pytest.fixture(scope="module")
def standins():
    """The stand-ins module, without leaving its import hook in this process."""
    before = list(sys.meta_path)
    spec = importlib.util.spec_from_file_location("bastion_test_standins", STANDINS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.meta_path[:] = before
    return module


def test_req_to_token_writes_equal_sglangs_kernel_on_a_ragged_batch(standins):
    from sglang.srt.mem_cache import allocation

    pool_indices = torch.tensor([3, 0, 2], dtype=torch.int64)
    starts = torch.tensor([5, 0, 17], dtype=torch.int64)
    ends = torch.tensor([69, 8, 81], dtype=torch.int64)  # 64, 8 and 64 new slots
    out_cache_loc = torch.arange(1000, 1136, dtype=torch.int64)
    want = torch.full((4, 128), -1, dtype=torch.int32)
    allocation.assign_req_to_token_pool[(3,)](
        pool_indices, want, starts, ends, out_cache_loc, want.shape[1], 4
    )  # SGLang's own kernel (interpreted here)
    fake = SimpleNamespace(assign_req_to_token_pool_func=None)
    standins._req_to_token_writes_on_cpu(fake)
    got = torch.full((4, 128), -1, dtype=torch.int32)
    fake.assign_req_to_token_pool_func(pool_indices, got, starts, ends, out_cache_loc, 3)
    assert torch.equal(got, want)
    assert int((got >= 0).sum()) == 136
