"""BASTION's draft state reserves every decode step's KV exactly as SGLang's DFlash does."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.mem_cache import allocation
from sglang.srt.speculative import dflash_info_v2
from sglang.srt.speculative.draft_worker_common import make_draft_input_v2

from sglang_bastion.draft_input import BastionDraftInput, make_draft_input

WINDOW = 8


@pytest.fixture(scope="module")
def spec_window():
    """A published CPU ServerArgs whose speculative window is WINDOW."""
    from sglang.srt.runtime_context import get_context

    override = get_context().override_server_args(device="cpu", speculative_num_draft_tokens=WINDOW)
    override.install()
    try:
        yield
    finally:
        override.restore()


def fake_batch(committed: list[int], allocated: list[int], top_ks: list[int], page_size: int):
    """A running batch with what a decode reserve reads: its requests' KV lengths, top-k."""
    reqs = [
        SimpleNamespace(
            kv=SimpleNamespace(kv_committed_len=c, kv_allocated_len=a),
            sampling_params=SimpleNamespace(top_k=k),
            decode_batch_idx=3,
        )
        for c, a, k in zip(committed, allocated, top_ks, strict=True)
    ]
    return SimpleNamespace(
        reqs=reqs,
        device=torch.device("cpu"),
        batch_size=lambda: len(reqs),
        maybe_evict_swa=lambda: None,
        token_to_kv_pool_allocator=SimpleNamespace(page_size=page_size),
        tree_cache="tree cache",
        req_to_token_pool="req to token pool",
        req_pool_indices=torch.arange(len(reqs)),
        seq_lens_cpu=None,
        seq_lens_sum=None,
    )


def reserve(draft_input, batch, monkeypatch) -> dict:
    """What ``draft_input.prepare_for_decode(batch)`` asks the allocator for, and leaves."""
    calls = []

    def record(tree_cache, req_to_token_pool, **kwargs):
        calls.append({k: v.clone() if torch.is_tensor(v) else v for k, v in kwargs.items()})

    monkeypatch.setattr(allocation, "alloc_for_spec_decode", record)
    monkeypatch.setattr(dflash_info_v2, "alloc_for_spec_decode", record)
    draft_input.prepare_for_decode(batch)
    (call,) = calls
    return {
        "cur": call["cur_kv_lens"].tolist(),
        "cur_cpu": call["cur_kv_lens_cpu"].tolist(),
        "nxt": call["nxt_kv_lens"].tolist(),
        "nxt_cpu": call["nxt_kv_lens_cpu"].tolist(),
        "needed": call["num_needed_tokens"],
        "seq_lens_cpu": batch.seq_lens_cpu.tolist(),
        "seq_lens_dtype": batch.seq_lens_cpu.dtype,
        "seq_lens_sum": batch.seq_lens_sum,
        "nxt_kept": draft_input.nxt_kv_lens_cpu.tolist(),
        "nxt_sum": draft_input.nxt_kv_lens_sum,
        "max_top_k": draft_input.max_top_k,
        "uniform_top_k": draft_input.uniform_top_k_value,
        "batch_idx": [r.decode_batch_idx for r in batch.reqs],
    }


def both_inputs(bs: int):
    """SGLang's DFlash draft state and BASTION's, for the same ``bs`` requests."""
    bonus, lens = torch.arange(bs), torch.arange(bs) + 10
    return make_draft_input_v2(bonus_tokens=bonus, new_seq_lens=lens), make_draft_input(bonus, lens)


@pytest.mark.parametrize(
    "committed, allocated, top_ks, page_size",
    [
        ([5, 40, 17, 3], [5, 56, 33, 3], [1, 1, 1, 1], 1),  # some need slots, some hold them
        ([5, 40, 17, 3], [5, 40, 17, 19], [1, 4, 1, 20], 1),  # mixed top-k
        ([7, 33], [8, 48], [-1, -1], 16),  # pages: lengths round up to whole pages
        (list(range(0, 480, 10)), list(range(0, 480, 10)), [1] * 48, 1),  # a batch of 48
    ],
)
def test_the_decode_reserve_equals_dflashs(
    spec_window, monkeypatch, committed, allocated, top_ks, page_size
):
    sglang_input, bastion_input = both_inputs(len(committed))
    expected = reserve(
        sglang_input, fake_batch(committed, allocated, top_ks, page_size), monkeypatch
    )
    got = reserve(bastion_input, fake_batch(committed, allocated, top_ks, page_size), monkeypatch)
    assert got == expected
    assert got["needed"] > 0  # the cases reserve new slots: a wrong window would show


def test_an_empty_batch_reserves_nothing(spec_window, monkeypatch):
    _, bastion_input = both_inputs(0)
    monkeypatch.setattr(allocation, "alloc_for_spec_decode", pytest.fail)
    bastion_input.prepare_for_decode(fake_batch([], [], [], 1))
    assert bastion_input.nxt_kv_lens_cpu is None


def test_bastions_draft_state_is_dflashs_to_the_scheduler():
    sglang_input, bastion_input = both_inputs(3)
    assert isinstance(bastion_input, dflash_info_v2.DFlashDraftInputV2)
    assert bastion_input.spec_input_type == sglang_input.spec_input_type
    for name in ("topk_p", "topk_index", "bonus_tokens", "new_seq_lens", "hidden_states"):
        mine, theirs = getattr(bastion_input, name), getattr(sglang_input, name)
        assert (mine.shape, mine.dtype) == (theirs.shape, theirs.dtype), name
    merged = copy.copy(sglang_input)
    merged.merge_batch(bastion_input)  # a prefill's state joins the running batch's
    assert merged.bonus_tokens.tolist() == [0, 1, 2, 0, 1, 2]
    assert type(make_draft_input(torch.arange(2), torch.arange(2))) is BastionDraftInput
