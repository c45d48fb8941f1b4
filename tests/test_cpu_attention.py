"""``bastion_cpu`` attention: equal to SGLang's Triton backend (run by the Triton interpreter).

Both backends run on the same paged pools, requests and random q/k/v in every mode the
no-speculation path, DFLASH and BASTION use: ragged extend (prefix lengths including 0),
decode, tree verify with padding nodes, chain verify and the DFlash drafter's non-causal
block. The Triton kernels must be decorated with ``TRITON_INTERPRET=1`` in the environment,
so this module sets it before anything imports SGLang (see ``triton_interpreted``).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # SGLang's kernels read it when first imported

import copy
import importlib
import time
import types

import pytest
import torch

from sglang_bastion.cpu_attention import BACKEND_NAME, register_cpu_attention_backend
from sglang_bastion.cpu_attention.kernels import (
    DraftMaskLayout,
    draft_block_mask,
    ragged_layout,
    visibility,
)
from sglang_bastion.cpu_attention.plan import (
    ENV_GROUP_ELEMENTS,
    GROUP_CALL_ELEMENTS,
    group_call_elements,
    query_groups,
)
from sglang_bastion.tree import TreeBatch
from sglang_bastion.tree.verify_inputs import verify_inputs_reference

H, HKV, D = 4, 2, 16  # query heads, key/value heads (GQA group 2), head dim
MAX_REQUESTS, MAX_CONTEXT, POOL_SLOTS = 8, 64, 512
TOLERANCE = {"atol": 2e-5, "rtol": 2e-5}

# ------------------------------------------------------------------ pure kernel specifications


def test_visibility_causal_block_after_prefix():
    # Request 0: 2 cached tokens, 3 new ones; request 1: no prefix, 1 new token (padded to 3).
    visible = visibility(torch.tensor([2, 0]), torch.tensor([3, 1]), 3, 5, causal=True)
    expected_0 = [
        [1, 1, 1, 0, 0],  # new token 0 sees the prefix and itself
        [1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1],
    ]
    expected_1 = [
        [1, 0, 0, 0, 0],  # its only token sees itself
        [1, 0, 0, 0, 0],  # padding rows see column 0 only (never an empty softmax row)
        [1, 0, 0, 0, 0],
    ]
    assert visible.int().tolist() == [expected_0, expected_1]


def test_visibility_non_causal_and_tree():
    prefix, length = torch.tensor([1]), torch.tensor([3])
    full = visibility(prefix, length, 3, 4, causal=False)
    assert full.all()  # the DFlash block sees all of [context || block]
    tree = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool)  # 0 -> {1, 2}
    masked = visibility(prefix, length, 3, 4, causal=True, draft_mask=tree)
    assert masked.int().tolist() == [[[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]]]


def test_draft_block_mask_reads_both_sglang_layouts():
    # Two requests: prefix 1 with a 2-token chain, prefix 0 with a 1-token block.
    prefix, drafts = torch.tensor([1, 0]), torch.tensor([2, 1])
    with_prefix = torch.tensor(  # rows of 1 + 2 columns, then one row of 0 + 1
        [1, 1, 0, 1, 1, 1, 1], dtype=torch.bool
    )
    draft_only = torch.tensor([1, 0, 1, 1, 1], dtype=torch.bool)  # rows of 2, then of 1
    expected = [[[1, 0], [1, 1]], [[1, 0], [0, 0]]]  # outside a request's block: False
    for flat, layout in (
        (with_prefix, DraftMaskLayout.WITH_PREFIX),
        (draft_only, DraftMaskLayout.DRAFT_ONLY),
    ):
        assert draft_block_mask(flat, prefix, drafts, 2, layout).int().tolist() == expected


def test_query_groups_set_a_deep_tree_apart_only_where_its_padding_outweighs_a_call():
    # Fifteen 8-token trees and one of 32: one padded batch would pad 15 x 24 rows.
    assert query_groups([8] * 7 + [32] + [8] * 8, 288) == [[*range(7), *range(8, 16)], [7]]
    # Every group's requests keep their order; a batch of one length is never split.
    deep = [2, 24, 2, 32, 24, 2, 2, 2, 2, 2]
    assert query_groups(deep, 256) == [[0, 2, 5, 6, 7, 8, 9], [1, 3, 4]]
    assert query_groups([6] * 8, 256) == []
    # Few padded elements to save (short trees, or short contexts): one call beats two.
    assert query_groups([8, 8, 2, 24], 256) == []
    assert query_groups(deep, 40) == []
    assert query_groups([3, 5, 1], 64, call_elements=0) == [[2], [0], [1]]


def test_a_hosts_group_price_comes_from_its_variable_and_a_malformed_one_is_named():
    assert group_call_elements({}) == GROUP_CALL_ELEMENTS
    assert group_call_elements({ENV_GROUP_ELEMENTS: " 4096 "}) == 4096
    for bad in ("16k", "-1", "1.5"):
        with pytest.raises(ValueError, match=f"{ENV_GROUP_ELEMENTS}={bad} must be a whole"):
            group_call_elements({ENV_GROUP_ELEMENTS: bad})


def test_ragged_layout_places_tokens_after_their_prefix():
    layout = ragged_layout(torch.tensor([4, 0, 2]), torch.tensor([2, 3, 1]))
    assert layout.batch.tolist() == [0, 0, 1, 1, 1, 2]
    assert layout.row.tolist() == [0, 1, 0, 1, 2, 0]
    assert layout.col.tolist() == [4, 5, 0, 1, 2, 2]
    assert (layout.max_q, layout.max_kv, layout.uniform) == (3, 6, False)


# ------------------------------------------------------------------ SGLang harness


def _triton_kernel_modules() -> list[str]:
    """Modules whose @triton.jit kernels the Triton backend runs in these tests."""
    return [
        "sglang.kernels.ops.attention.extend_attention",
        "sglang.kernels.ops.attention.decode_attention",
        "sglang.srt.mem_cache.kv_index_translator",
    ]


@pytest.fixture(scope="module")
def sglang_context():
    """A published CPU ServerArgs and single-rank parallel state, restored afterwards."""
    pytest.importorskip("sglang")
    from sglang.srt.runtime_context import get_context, get_parallel

    override = get_context().override_server_args(device="cpu")
    override.install()
    try:
        with get_parallel().override(attn_dcp_rank=0, attn_tp_rank=0, tp_rank=0):
            yield
    finally:
        override.restore()


@pytest.fixture(scope="module")
def triton_interpreted(sglang_context):
    """Fail clearly when SGLang's kernels were decorated before TRITON_INTERPRET=1 was set."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for name in _triton_kernel_modules():
        module = importlib.import_module(name)
        compiled = [
            attr
            for attr, value in vars(module).items()
            if isinstance(value, JITFunction) and not isinstance(value, InterpretedFunction)
        ]
        assert not compiled, (
            f"{name} was imported before TRITON_INTERPRET=1 was set ({compiled[:3]}); "
            "run pytest with TRITON_INTERPRET=1 in the environment"
        )


class Harness:
    """Real SGLang pools, a model-runner stand-in and batch builders for one attention layer."""

    def __init__(
        self, dtype: torch.dtype = torch.float32, seed: int = 0, values: torch.dtype | None = None
    ):
        from sglang.srt.configs.model_config import AttentionArch
        from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from transformers import Qwen3Config

        self.dtype = dtype
        self.values_dtype = values or dtype  # random values are rounded to this dtype first
        self.generator = torch.Generator().manual_seed(seed)
        self.req_pool = ReqToTokenPool(
            size=MAX_REQUESTS, max_context_len=MAX_CONTEXT, device="cpu", enable_memory_saver=False
        )
        self.kv_pool = MHATokenToKVPool(
            size=POOL_SLOTS,
            page_size=1,
            dtype=dtype,
            head_num=HKV,
            head_dim=D,
            layer_num=1,
            device="cpu",
            enable_memory_saver=False,
        )
        translator = KVIndexTranslator(
            req_to_token=self.req_pool.req_to_token,
            token_to_kv_pool_allocator=None,
            token_to_kv_pool=self.kv_pool,
            page_size=1,
            device="cpu",
        )
        hf_config = Qwen3Config(
            hidden_size=H * D, num_attention_heads=H, num_key_value_heads=HKV, head_dim=D
        )
        model_config = types.SimpleNamespace(  # what the backends read of ModelConfig
            attention_arch=AttentionArch.MHA,
            hf_config=hf_config,
            linear_attn_registry_result=None,
            get_num_kv_heads=lambda *_: HKV,
            get_max_num_attention_heads=lambda: H,
            head_dim=D,
            v_head_dim=D,
            swa_v_head_dim=None,
            context_len=MAX_CONTEXT,
            is_encoder_decoder=False,
        )
        self.runner = types.SimpleNamespace(  # what the backends read of ModelRunner
            device="cpu",
            gpu_id=0,
            model_config=model_config,
            req_to_token_pool=self.req_pool,
            token_to_kv_pool=self.kv_pool,
            token_to_kv_pool_allocator=None,
            kv_index_translator=translator,
            kv_cache_dtype=dtype,
            page_size=1,
            sliding_window_size=None,
            is_draft_worker=False,
            spec_algorithm=None,
            use_mla_backend=False,
            decode_num_tokens_per_req=lambda: 1,
        )

    def backend(self, name: str):
        """A fresh attention backend of the given kind on this harness's pools."""
        if name == "triton":
            from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

            return TritonAttnBackend(self.runner)
        if name == "torch_native":
            from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

            return TorchNativeAttnBackend(self.runner)
        from sglang_bastion.cpu_attention.backend import create_backend

        return create_backend(self.runner)

    @staticmethod
    def layer(encoder_only: bool = False, logit_cap: float = 0.0):
        """One RadixAttention layer: causal decoder, or non-causal like the DFlash drafter."""
        from sglang.srt.layers.radix_attention import AttentionType, RadixAttention

        attn_type = AttentionType.ENCODER_ONLY if encoder_only else AttentionType.DECODER
        return RadixAttention(
            H, D, D**-0.5, HKV, layer_id=0, logit_cap=logit_cap, attn_type=attn_type
        )

    def random(self, *shape: int) -> torch.Tensor:
        """Standard-normal values (rounded to ``values_dtype``) in the harness dtype."""
        values = torch.randn(*shape, generator=self.generator).to(self.values_dtype)
        return values.to(self.dtype)

    def requests(self, prefix_lens: list[int], new_lens: list[int]):
        """Place requests in the pools: random rows and slots, random cached prefix K/V.

        Returns (req_pool_indices [B], out_cache_loc [T]) for the new tokens.
        """
        total = [p + n for p, n in zip(prefix_lens, new_lens, strict=True)]
        rows = torch.randperm(MAX_REQUESTS, generator=self.generator)[: len(total)] + 1
        slots = torch.randperm(POOL_SLOTS - 1, generator=self.generator)[: sum(total)] + 1
        new_slots, start = [], 0
        for row, length, prefix in zip(rows.tolist(), total, prefix_lens, strict=True):
            own = slots[start : start + length]
            self.req_pool.req_to_token[row, :length] = own.int()
            new_slots.append(own[prefix:])
            start += length
        k_buffer = self.kv_pool.get_key_buffer(0)
        v_buffer = self.kv_pool.get_value_buffer(0)
        k_buffer[slots] = self.random(len(slots), HKV, D)
        v_buffer[slots] = self.random(len(slots), HKV, D)
        return rows.long(), torch.cat(new_slots).long()

    def _bind(self, batch):
        """Give a ForwardBatch its KV-location plan (as ForwardBatch.init_new does)."""
        translator = self.runner.kv_index_translator
        translator.own_plan(batch).bind(batch, translator)
        return batch

    def extend_batch(self, prefix_lens: list[int], new_lens: list[int]):
        """An EXTEND ForwardBatch appending ``new_lens`` tokens to ``prefix_lens`` cached ones."""
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

        rows, out_cache_loc = self.requests(prefix_lens, new_lens)
        seq_lens = torch.tensor(prefix_lens) + torch.tensor(new_lens)
        extend_lens = torch.tensor(new_lens)
        return self._bind(
            ForwardBatch(
                forward_mode=ForwardMode.EXTEND,
                batch_size=len(new_lens),
                input_ids=torch.zeros(sum(new_lens), dtype=torch.long),
                req_pool_indices=rows,
                seq_lens=seq_lens,
                out_cache_loc=out_cache_loc,
                seq_lens_sum=int(seq_lens.sum()),
                seq_lens_cpu=seq_lens,
                extend_num_tokens=sum(new_lens),
                extend_prefix_lens=torch.tensor(prefix_lens),
                extend_seq_lens=extend_lens,
                extend_start_loc=torch.cumsum(extend_lens, 0) - extend_lens,
                extend_prefix_lens_cpu=list(prefix_lens),
                extend_seq_lens_cpu=list(new_lens),
            )
        )

    def decode_batch(self, seq_lens: list[int]):
        """A DECODE ForwardBatch: one new token ending each sequence of ``seq_lens`` tokens."""
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

        rows, out_cache_loc = self.requests([n - 1 for n in seq_lens], [1] * len(seq_lens))
        lens = torch.tensor(seq_lens)
        return self._bind(
            ForwardBatch(
                forward_mode=ForwardMode.DECODE,
                batch_size=len(seq_lens),
                input_ids=torch.zeros(len(seq_lens), dtype=torch.long),
                req_pool_indices=rows,
                seq_lens=lens,
                out_cache_loc=out_cache_loc,
                seq_lens_sum=int(lens.sum()),
                seq_lens_cpu=lens,
            )
        )

    def verify_batch(
        self, prefix_lens: list[int], num_draft: int, custom_mask: torch.Tensor | None = None
    ):
        """A TARGET_VERIFY ForwardBatch of ``num_draft`` tokens per request (tree if masked)."""
        rows, out_cache_loc = self.requests(prefix_lens, [num_draft] * len(prefix_lens))
        return self.verify_batch_at(
            rows, prefix_lens, [num_draft] * len(prefix_lens), out_cache_loc, custom_mask
        )

    def verify_batch_at(
        self,
        rows: torch.Tensor,
        prefix_lens: list[int],
        draft_lens: list[int],
        out_cache_loc: torch.Tensor,
        custom_mask: torch.Tensor | None = None,
    ):
        """A TARGET_VERIFY ForwardBatch over requests already placed in the pools.

        Unequal ``draft_lens`` give a ragged verify (SGLang's ``ragged_verify_layout``).
        """
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
        from sglang.srt.speculative.dflash_info import DFlashVerifyInput

        tokens = sum(draft_lens)
        lens = torch.tensor(prefix_lens)
        spec_info = DFlashVerifyInput(
            draft_token=torch.zeros(tokens, dtype=torch.long),
            positions=torch.zeros(tokens, dtype=torch.long),
            draft_token_num=max(draft_lens),
            custom_mask=custom_mask,
        )
        if len(set(draft_lens)) > 1:  # the one field of RaggedVerifyLayout attention reads
            spec_info.ragged_verify_layout = types.SimpleNamespace(
                verify_lens=torch.tensor(draft_lens, dtype=torch.int32)
            )
        return self._bind(
            ForwardBatch(
                forward_mode=ForwardMode.TARGET_VERIFY,
                batch_size=len(prefix_lens),
                input_ids=torch.zeros(tokens, dtype=torch.long),
                req_pool_indices=rows,
                seq_lens=lens,
                out_cache_loc=out_cache_loc,
                seq_lens_sum=int(lens.sum()),
                seq_lens_cpu=lens,
                spec_info=spec_info,
            )
        )

    def qkv(self, num_tokens: int):
        """Random q [T, H*D], k [T, Hkv, D], v [T, Hkv, D] for the new tokens."""
        return (
            self.random(num_tokens, H * D),
            self.random(num_tokens, HKV, D),
            self.random(num_tokens, HKV, D),
        )


def run(backend, batch, layer, q, k, v, save_kv_cache: bool = True) -> torch.Tensor:
    """Plan one forward on ``backend`` and run the layer through SGLang's dispatcher."""
    backend.init_forward_metadata(batch)
    return backend.forward(q, k, v, layer, batch, save_kv_cache=save_kv_cache)


def assert_matches_triton(
    harness: Harness, batch, layer, num_tokens: int, *, unlike=None
) -> torch.Tensor:
    """Run both backends on the same batch and q/k/v; they must agree to float tolerance.

    ``unlike`` (batch, layer) names a different attention pattern over the same tokens whose
    result must differ, proving the pattern under test was actually applied.
    """
    q, k, v = harness.qkv(num_tokens)
    expected = run(harness.backend("triton"), batch, layer, q, k, v)
    actual = run(harness.backend(BACKEND_NAME), batch, layer, q, k, v)
    assert actual.shape == expected.shape == (num_tokens, H * D)
    torch.testing.assert_close(actual, expected, **TOLERANCE)
    if unlike is not None:
        other = run(harness.backend(BACKEND_NAME), *unlike, q, k, v)
        assert (other - actual).abs().max() > 1e-3
    return actual


@pytest.fixture
def harness(triton_interpreted) -> Harness:
    return Harness()


# ------------------------------------------------------------------ equality with Triton


@pytest.fixture(params=["grouped", "per_head", "row_chunks"])
def code_path(request, monkeypatch):
    """Run a test through each way bastion_cpu can evaluate a block."""
    from sglang_bastion.cpu_attention import kernels, plan

    if request.param == "per_head":  # the path long prefills take (heads kept apart)
        monkeypatch.setattr(kernels, "GROUPED_ROWS_LIMIT", 0)
    if request.param == "row_chunks":  # the path oversized masks take (a few rows at a time)
        monkeypatch.setattr(plan, "MASK_ELEMENTS", 40)
    return request.param


@pytest.mark.parametrize("encoder_only", [False, True], ids=["causal", "non_causal"])
def test_extend_ragged_batch_with_prefixes(harness, code_path, encoder_only):
    # Prefix lengths 0, 5 and 11 with 7, 1 and 4 new tokens: ragged in both directions.
    batch = harness.extend_batch([0, 5, 11], [7, 1, 4])
    layer, other = harness.layer(encoder_only=encoder_only), harness.layer(not encoder_only)
    assert_matches_triton(harness, batch, layer, 12, unlike=(batch, other))


@pytest.mark.parametrize("logit_cap", [0.0, 2.0])
def test_extend_without_prefixes(harness, logit_cap):
    # No prefixes: plain top-left causal attention (SDPA's own is_causal without a cap).
    batch = harness.extend_batch([0, 0], [6, 3])
    assert_matches_triton(harness, batch, harness.layer(logit_cap=logit_cap), 9)


def test_extend_with_logit_cap(harness, code_path):
    batch = harness.extend_batch([3, 0], [4, 2])
    assert_matches_triton(harness, batch, harness.layer(logit_cap=2.0), 6)


def test_decode_ragged_sequences(harness):
    batch = harness.decode_batch([9, 1, 17])
    assert_matches_triton(harness, batch, harness.layer(), 3)


def test_decode_equal_sequences_needs_no_mask(harness):
    batch = harness.decode_batch([6, 6])
    assert_matches_triton(harness, batch, harness.layer(), 2)


def test_tree_verify_with_padding_nodes(harness, code_path):
    # Three trees of width 6 built the way BASTION builds them; slots past num_nodes are
    # padding, whose mask rows see only the prefix and themselves.
    parents = torch.tensor(
        [
            [-1, 0, 0, 1, 2, 3],  # six real nodes, two branches
            [-1, 0, 1, -1, -1, -1],  # a 3-node chain, then three padding slots
            [-1, 0, 0, 0, 1, -1],  # a bushy root, one padding slot
        ]
    )
    depths = torch.tensor([[0, 1, 1, 2, 2, 3], [0, 1, 2, 0, 0, 0], [0, 1, 1, 1, 2, 0]])
    num_nodes = torch.tensor([6, 3, 5])
    real = torch.arange(6) < num_nodes.unsqueeze(1)
    trees = TreeBatch(
        token_ids=torch.zeros(3, 6, dtype=torch.long),
        parents=parents,
        depths=depths,
        log_scores=torch.where(real, -depths.float(), float("-inf")),
        num_nodes=num_nodes,
    )
    prefix_lens = [5, 9, 2]
    mask = verify_inputs_reference(trees, torch.tensor(prefix_lens)).custom_mask
    batch = harness.verify_batch(prefix_lens, 6, custom_mask=mask)
    chain = copy.copy(batch)
    chain.spec_info = copy.copy(batch.spec_info)
    chain.spec_info.custom_mask = None
    assert_matches_triton(harness, batch, harness.layer(), 18, unlike=(chain, harness.layer()))


def test_a_one_token_verify_with_its_mask_sees_its_prefix_and_itself(harness):
    # A plain step: every request verifies its root alone, under the all-True mask.
    prefix_lens = [5, 0, 12]
    mask = torch.ones(sum(prefix_lens) + len(prefix_lens), dtype=torch.bool)
    batch = harness.verify_batch(prefix_lens, 1, custom_mask=mask)
    assert_matches_triton(harness, batch, harness.layer(), 3)


def test_a_one_token_verify_of_equal_contexts_attends_without_a_mask(harness):
    # A plain step of requests with equal contexts: a decode's attention, no mask to build.
    mask = torch.ones(2 * (7 + 1), dtype=torch.bool)
    batch = harness.verify_batch([7, 7], 1, custom_mask=mask)
    assert_matches_triton(harness, batch, harness.layer(), 2)
    backend = harness.backend(BACKEND_NAME)
    backend.init_forward_metadata(batch)
    assert not backend.forward_metadata.needs_mask(causal=True)


def test_a_one_token_extend_that_saves_no_kv_attends_its_own_key_as_given(harness):
    # Not saved, the new keys are not in the pool: the block path must use them as given.
    batch = harness.extend_batch([4, 2], [1, 1])
    q, k, v = harness.qkv(2)
    expected = run(harness.backend("triton"), batch, harness.layer(), q, k, v, False)
    actual = run(harness.backend(BACKEND_NAME), batch, harness.layer(), q, k, v, False)
    torch.testing.assert_close(actual, expected, **TOLERANCE)


def test_a_one_token_verify_that_saves_no_kv_attends_its_own_key_as_given(harness):
    # The plain step's plan has a query layout too: the block path reads it.
    batch = harness.verify_batch([3, 0, 8], 1)
    q, k, v = harness.qkv(3)
    expected = run(harness.backend("triton"), batch, harness.layer(), q, k, v, False)
    actual = run(harness.backend(BACKEND_NAME), batch, harness.layer(), q, k, v, False)
    torch.testing.assert_close(actual, expected, **TOLERANCE)


def test_chain_verify_without_mask_is_causal(harness):
    # DFLASH's target verify: no custom mask, the block is causal after the prefix.
    batch = harness.verify_batch([4, 10], 5)
    assert_matches_triton(harness, batch, harness.layer(), 10)


def test_dflash_drafter_block_is_non_causal(harness, code_path):
    # The drafter's pass: TARGET_VERIFY mode, no mask, ENCODER_ONLY layers: every block
    # token sees the whole context and the whole block.
    batch = harness.verify_batch([7, 3, 12], 4)
    causal = (batch, harness.layer())
    assert_matches_triton(harness, batch, harness.layer(encoder_only=True), 12, unlike=causal)


# ------------------------------------------------------------------ behaviour of bastion_cpu


def test_tree_mask_layouts_agree(harness):
    # SGLang writes QLEN_ONLY masks (draft block only) on its CPU engine: same result.
    prefix_lens = [3, 6]
    block = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    with_prefix = torch.cat(
        [torch.cat([torch.ones(3, p, dtype=torch.bool), block], 1).flatten() for p in prefix_lens]
    )
    batch = harness.verify_batch(prefix_lens, 3, custom_mask=with_prefix)
    q, k, v = harness.qkv(6)
    backend, layer = harness.backend(BACKEND_NAME), harness.layer()
    expected = run(backend, batch, layer, q, k, v)
    batch.spec_info.custom_mask = block.flatten().repeat(2)
    torch.testing.assert_close(run(backend, batch, layer, q, k, v), expected, atol=0, rtol=0)


@pytest.mark.parametrize(
    ("prefix_lens", "draft_lens", "grouped"),
    [
        ([4, 7, 2], [3, 5, 1], False),  # one padded batch
        ([4, 7, 2, 9, 5], [1, 5, 1, 40, 2], True),  # short trees apart from the deep one
    ],
)
@pytest.mark.parametrize("draft_only", [False, True], ids=["with-prefix", "draft-only"])
def test_ragged_verify_equals_each_request_alone(
    harness, prefix_lens, draft_lens, grouped, draft_only
):
    # Per-request tree sizes: the batch gives each request exactly what a verify of that
    # request alone gives (each of those matches Triton above), whether the backend attends
    # the batch padded to its deepest tree or in groups of similar sizes, and whether the mask
    # holds the prefix columns or the tree blocks alone (what BASTION's worker gives it).
    rows, out_cache_loc = harness.requests(prefix_lens, draft_lens)
    blocks = [torch.tril(torch.ones(n, n, dtype=torch.bool)) for n in draft_lens]
    blocks[1][3, 1:3] = False  # node 3 of request 1 hangs off the root: a real tree

    def flat_mask(indices: list[int]) -> torch.Tensor:
        shown = [0 if draft_only else prefix_lens[i] for i in range(len(prefix_lens))]
        rows_of = [torch.cat([torch.ones(draft_lens[i], shown[i]), blocks[i]], 1) for i in indices]
        return torch.cat([r.flatten() for r in rows_of]).bool()

    q, k, v = harness.qkv(sum(draft_lens))
    backend, layer = harness.backend(BACKEND_NAME), harness.layer()
    if grouped:  # contexts this short never pay for a second call at the default price
        backend.group_call_elements = 64
    batch = harness.verify_batch_at(
        rows, prefix_lens, draft_lens, out_cache_loc, flat_mask(list(range(len(draft_lens))))
    )
    together = run(backend, batch, layer, q, k, v)
    assert bool(backend.forward_metadata.groups) == grouped
    starts = [sum(draft_lens[:i]) for i in range(len(draft_lens) + 1)]
    for i in range(len(draft_lens)):
        own = slice(starts[i], starts[i + 1])
        alone_batch = harness.verify_batch_at(
            rows[i : i + 1],
            prefix_lens[i : i + 1],
            draft_lens[i : i + 1],
            out_cache_loc[own],
            flat_mask([i]),
        )
        alone = run(backend, alone_batch, layer, q[own], k[own], v[own])
        torch.testing.assert_close(together[own], alone, **TOLERANCE)


@pytest.mark.parametrize("mode", ["MIXED", "DRAFT_EXTEND_V2"])
def test_other_extend_modes(harness, mode):
    # MIXED: a chunked-prefill step mixing a prefill chunk with decoding requests (one new
    # token each); DRAFT_EXTEND_V2: EAGLE-style draft extend, also an extend after a prefix.
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    batch = harness.extend_batch([6, 0, 13], [1, 5, 1])
    batch.forward_mode = ForwardMode[mode]
    assert_matches_triton(harness, batch, harness.layer(), 7)


def test_saved_keys_and_shared_kv_layers(harness):
    # The new tokens' K/V land in the pool at out_cache_loc; a layer that passes k=v=None
    # (KV shared with an earlier layer) reads them back and gets the same result.
    batch = harness.extend_batch([4, 2], [3, 5])
    q, k, v = harness.qkv(8)
    backend, layer = harness.backend(BACKEND_NAME), harness.layer()
    with_kv = run(backend, batch, layer, q, k, v)
    torch.testing.assert_close(harness.kv_pool.get_key_buffer(0)[batch.out_cache_loc], k)
    torch.testing.assert_close(run(backend, batch, layer, q, None, None), with_kv)


def test_bfloat16_is_attended_in_float32(triton_interpreted):
    # A bf16 model and KV cache give the float32 result of the same values, rounded once.
    results = []
    for dtype in (torch.bfloat16, torch.float32):
        harness = Harness(dtype=dtype, seed=7, values=torch.bfloat16)
        batch = harness.verify_batch([5, 8], 4)
        q, k, v = harness.qkv(8)
        results.append(run(harness.backend(BACKEND_NAME), batch, harness.layer(), q, k, v))
    assert results[0].dtype == torch.bfloat16
    torch.testing.assert_close(results[0], results[1].to(torch.bfloat16), atol=0, rtol=0)


def test_refuses_unsupported_modes_and_layers_in_one_line(harness):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sglang_bastion.cpu_attention.backend import UnsupportedByCpuBackend

    backend = harness.backend(BACKEND_NAME)
    batch = harness.extend_batch([0], [2])
    batch.forward_mode = ForwardMode.DLLM_EXTEND
    with pytest.raises(UnsupportedByCpuBackend, match=r"DLLM_EXTEND.*TARGET_VERIFY.*triton"):
        backend.init_forward_metadata(batch)
    for capture in (
        lambda: backend.init_cuda_graph_state(4, 64),
        lambda: backend.init_forward_metadata_out_graph(batch, in_capture=True),
    ):
        with pytest.raises(UnsupportedByCpuBackend, match="graph capture") as error:
            capture()
        assert "\n" not in str(error.value)
    batch.forward_mode = ForwardMode.EXTEND
    q, k, v = harness.qkv(2)
    windowed = harness.layer()
    windowed.sliding_window_size = 8
    with pytest.raises(UnsupportedByCpuBackend, match="sliding-window"):
        run(backend, batch, windowed, q, k, v)
    batch.forward_mode = ForwardMode.IDLE  # nothing to attend: an empty output
    assert run(backend, batch, harness.layer(), q[:0], k[:0], v[:0]).shape == (0, H * D)


def test_warns_when_built_for_an_accelerator(triton_interpreted, caplog):
    from sglang_bastion.cpu_attention.backend import create_backend

    runner = types.SimpleNamespace(**{**vars(Harness().runner), "device": "cuda"})
    with caplog.at_level("WARNING"):
        create_backend(runner)
    assert "CPU development attention backend" in caplog.text


def test_registration_is_idempotent(sglang_context):
    from sglang.srt.arg_groups.choices import (
        ATTENTION_BACKEND_CHOICES,
        DRAFT_ATTENTION_BACKEND_CHOICES,
    )
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    assert register_cpu_attention_backend() and register_cpu_attention_backend()
    assert ATTENTION_BACKEND_CHOICES.count(BACKEND_NAME) == 1
    assert DRAFT_ATTENTION_BACKEND_CHOICES.count(BACKEND_NAME) == 1
    factory = ATTENTION_BACKENDS[BACKEND_NAME]
    register_cpu_attention_backend()
    assert ATTENTION_BACKENDS[BACKEND_NAME] is factory
    assert type(factory(Harness().runner)).__name__ == "BastionCpuAttnBackend"


def test_decode_is_about_as_fast_as_torch_native(triton_interpreted):
    # Plain decode, 4 ragged requests: planning plus one layer within 3x of torch_native's
    # per-request loop (best of 20 interleaved runs, robust to a busy machine).
    harness = Harness()
    batch = harness.decode_batch([48, 40, 48, 33])
    layer = harness.layer()
    q, k, v = harness.qkv(4)
    backends = {name: harness.backend(name) for name in ("torch_native", BACKEND_NAME)}
    best = dict.fromkeys(backends, float("inf"))
    for _ in range(20):
        for name, backend in backends.items():
            start = time.perf_counter()
            run(backend, batch, layer, q, k, v)
            best[name] = min(best[name], time.perf_counter() - start)
    assert best[BACKEND_NAME] < 3 * best["torch_native"], best
