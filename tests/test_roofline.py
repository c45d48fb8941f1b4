"""Roofline cost model of one verify pass: config parsing, hand-checked counts, shape of R(N)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_bastion.budget import (
    HARDWARE,
    Hardware,
    ModelShape,
    expert_touch,
    roofline_ms,
    verify_bytes,
    verify_flops,
)

DATA = Path(__file__).parent / "data"
QWEN3_8B = DATA / "qwen3-8b-config.json"
QWEN3_30B_A3B = DATA / "qwen3-30b-a3b-config.json"

# L=2 layers, h=8, n_q=2 and n_kv=1 heads of d=4 (h_q=8, h_kv=4), f=16, V=32.
TINY = ModelShape(
    num_layers=2,
    hidden_size=8,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    intermediate_size=16,
    vocab_size=32,
)
# The same attention with an MoE FFN: E=8 experts of width f_e=4, K=2 per token.
TINY_MOE = ModelShape(
    num_layers=2,
    hidden_size=8,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    intermediate_size=0,
    vocab_size=32,
    num_experts=8,
    experts_per_token=2,
    moe_intermediate_size=4,
)


def test_reads_dense_shape_from_config_file():
    shape = ModelShape.from_config_file(QWEN3_8B)
    assert shape == ModelShape(
        num_layers=36,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=12288,
        vocab_size=151936,
    )
    assert not shape.is_moe


def test_reads_moe_shape_with_head_dim_not_hidden_over_heads():
    shape = ModelShape.from_config_file(QWEN3_30B_A3B)
    # Qwen3-30B-A3B: 32 heads of 128 on a 2048-wide residual stream.
    assert (shape.head_dim, shape.q_width, shape.kv_width) == (128, 4096, 512)
    assert (shape.num_experts, shape.experts_per_token, shape.moe_intermediate_size) == (
        128,
        8,
        768,
    )
    assert shape.is_moe


def test_head_dim_and_kv_heads_default_like_hugging_face():
    config = json.loads(QWEN3_8B.read_text())
    del config["head_dim"], config["num_key_value_heads"]
    shape = ModelShape.from_hf_config(config)
    assert shape.head_dim == 4096 // 32
    assert shape.num_kv_heads == shape.num_heads


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "vocab_size"])
def test_missing_required_field_is_named(field):
    config = json.loads(QWEN3_8B.read_text())
    del config[field]
    with pytest.raises(ValueError, match=field):
        ModelShape.from_hf_config(config)


def test_non_integer_field_is_named():
    config = json.loads(QWEN3_8B.read_text())
    config["intermediate_size"] = "12288"
    with pytest.raises(ValueError, match="intermediate_size"):
        ModelShape.from_hf_config(config)


def test_unmodelled_shared_experts_are_rejected():
    config = json.loads(QWEN3_30B_A3B.read_text())
    config["shared_expert_intermediate_size"] = 5632
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        ModelShape.from_hf_config(config)


def test_hardware_lookup_ignores_case_spaces_and_dashes():
    assert Hardware.lookup("h100 sxm") is HARDWARE["H100-SXM"]
    assert Hardware.lookup("RTX_PRO_6000") is HARDWARE["RTX-PRO-6000"]
    assert Hardware.lookup("A100") is HARDWARE["A100-80GB"]


def test_unknown_hardware_error_lists_known_names():
    with pytest.raises(ValueError, match=r"unknown hardware 'TPU-v5'.*H100-SXM.*A6000"):
        Hardware.lookup("TPU-v5")


@pytest.mark.parametrize(
    ("device_name", "preset"),
    [
        ("NVIDIA H100 80GB HBM3", "H100-SXM"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA RTX A6000", "A6000"),
        ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "RTX-PRO-6000"),
    ],
)
def test_cuda_device_names_map_to_presets(device_name, preset):
    assert Hardware.from_device_name(device_name) is HARDWARE[preset]


def test_dense_flops_by_hand():
    # B=1 request, t=2 tokens, c=3 cached: s=2 tokens, each query sees c+t=5 keys.
    qkv = 2 * 2 * 8 * (8 + 2 * 4)  # s h (h_q + 2 h_kv) multiply-adds
    out = 2 * 2 * 8 * 8  # s h_q h
    attention = 2 * (2 * 2 * 5 * 8)  # QK^T and PV: s (c+t) h_q each
    ffn = 3 * 2 * 2 * 8 * 16  # gate, up, down: s h f each
    lm_head = 2 * 2 * 8 * 32  # s h V, once per pass
    expected = 2 * (qkv + out + attention + ffn) + lm_head
    assert expected == 6272
    assert float(verify_flops(TINY, 1, 2, 3)) == expected


def test_dense_bytes_by_hand():
    # Same pass, counted in elements, then x2 bytes.
    weights = 2 * (8 * (8 + 2 * 4) + 8 * 8 + 3 * 8 * 16)  # per layer: QKV, O, gate/up/down
    lm_head_weights = 32 * 8
    embedding_rows = 2 * 8  # s h
    kv_cache = 2 * (1 * 3 * 2 * 4 + 1 * 2 * 2 * 4)  # per layer: read c=3, write t=2 (K and V)
    activations = 2 * (
        2 * (8 + 8 + 2 * 4)  # QKV: in h, out h_q + 2 h_kv
        + 2 * (2 * 8)  # attention core: Q in, O out
        + 2 * (8 + 8)  # O projection: in h_q, out h
        + 2 * (8 + 2 * 16)  # gate/up: in h, out 2f
        + 2 * (16 + 8)  # down: in f, out h
    )
    logits = 2 * 8 + 2 * 32  # final hidden in, logits out
    elements = weights + lm_head_weights + embedding_rows + kv_cache + activations + logits
    assert elements == 2064
    assert float(verify_bytes(TINY, 1, 2, 3)) == 2 * elements
    assert float(verify_bytes(TINY, 1, 2, 3, bytes_per_elem=1)) == elements


def test_moe_flops_by_hand():
    # B=1, t=2, c=3 as above; the FFN is a router over E=8 plus K=2 experts of width 4.
    attention_block = 2 * 2 * 8 * (8 + 2 * 4) + 2 * 2 * 8 * 8 + 2 * (2 * 2 * 5 * 8)
    moe = 2 * 2 * 8 * 8 + 3 * 2 * 2 * 2 * 8 * 4  # router s h E; experts 3 x s K h f_e
    expected = 2 * (attention_block + moe) + 2 * 2 * 8 * 32
    assert float(verify_flops(TINY_MOE, 1, 2, 3)) == expected


def test_expert_touch_saturates_at_experts_over_k():
    # U(s) = min(E, s K) with E=8, K=2: every expert is touched from s = E/K = 4 tokens on.
    touched = expert_touch(TINY_MOE, torch.arange(7.0))
    assert touched.tolist() == [0, 2, 4, 6, 8, 8, 8]


def test_moe_bytes_per_token_drop_by_one_token_of_experts_after_saturation():
    tokens = torch.arange(9.0)  # B=1, so s = t
    step = verify_bytes(TINY_MOE, 1, tokens, 100).diff()  # bytes added by token t+1
    before, after = step[:4], step[4:]
    assert torch.all(before == before[0]) and torch.all(after == after[0])
    # Past s = E/K a new token no longer pulls in K experts' weights: L K 3 h f_e elements.
    assert float(before[0] - after[0]) == 2 * (2 * 2 * 3 * 8 * 4)


def test_small_batch_is_memory_bound_on_h100():
    shape = ModelShape.from_config_file(QWEN3_8B)
    h100 = HARDWARE["H100-SXM"]
    compute_s = float(verify_flops(shape, 1, 1, 1024)) / h100.peak_flops
    memory_s = float(verify_bytes(shape, 1, 1, 1024)) / h100.bandwidth
    assert memory_s > 50 * compute_s
    # Reading ~16 GB of bf16 weights at 3.35 TB/s takes about 5 ms.
    assert 4.0 < float(roofline_ms(shape, h100, 1, 1, 1024)) < 6.0


def test_many_tokens_are_compute_bound_on_h100():
    shape = ModelShape.from_config_file(QWEN3_8B)
    h100 = HARDWARE["H100-SXM"]
    compute_s = float(verify_flops(shape, 8, 128, 1024)) / h100.peak_flops
    memory_s = float(verify_bytes(shape, 8, 128, 1024)) / h100.bandwidth
    assert compute_s > 2 * memory_s
    assert float(roofline_ms(shape, h100, 8, 128, 1024)) == pytest.approx(compute_s * 1e3)


def _assert_convex_non_decreasing(curve: torch.Tensor) -> None:
    """First and second differences >= 0, up to float64 rounding."""
    tolerance = 1e-9 * float(curve.abs().max())
    assert float(curve.diff().min()) >= -tolerance
    assert float(curve.diff(n=2).min()) >= -tolerance


@pytest.mark.parametrize("hardware", sorted(HARDWARE))
@pytest.mark.parametrize(("batch", "context"), [(1, 0), (1, 4096), (16, 512), (64, 8192)])
def test_dense_roofline_convex_non_decreasing_in_tokens(hardware, batch, context):
    shape = ModelShape.from_config_file(QWEN3_8B)
    tokens = torch.arange(1.0, 1025.0)
    _assert_convex_non_decreasing(roofline_ms(shape, HARDWARE[hardware], batch, tokens, context))


@settings(max_examples=60, deadline=None)
@given(
    layers=st.integers(1, 64),
    kv_heads=st.integers(1, 16),
    group=st.integers(1, 8),
    head_dim=st.sampled_from([32, 64, 128, 256]),
    ffn_ratio=st.floats(1.0, 6.0),
    vocab=st.integers(1000, 300_000),
    hardware=st.sampled_from(sorted(HARDWARE)),
    batch=st.integers(1, 128),
    context=st.integers(0, 32_768),
)
def test_any_dense_roofline_is_convex_non_decreasing_in_tokens(
    layers, kv_heads, group, head_dim, ffn_ratio, vocab, hardware, batch, context
):
    hidden = kv_heads * group * head_dim
    shape = ModelShape(
        num_layers=layers,
        hidden_size=hidden,
        num_heads=kv_heads * group,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=int(ffn_ratio * hidden),
        vocab_size=vocab,
    )
    tokens = torch.arange(1.0, 257.0)
    _assert_convex_non_decreasing(roofline_ms(shape, HARDWARE[hardware], batch, tokens, context))


def test_tokens_and_context_broadcast_like_tensors():
    h100 = HARDWARE["H100-SXM"]
    tokens = torch.tensor([1.0, 16.0, 64.0])  # [3]
    context = torch.tensor([[0.0], [2048.0]])  # [2, 1]
    grid = roofline_ms(TINY, h100, 4, tokens, context)
    assert grid.shape == (2, 3) and grid.dtype == torch.float64
    for i, c in enumerate(context[:, 0].tolist()):
        for j, t in enumerate(tokens.tolist()):
            assert float(grid[i, j]) == float(roofline_ms(TINY, h100, 4, t, c))


def test_python_numbers_give_a_zero_dim_tensor():
    assert verify_flops(TINY, 1, 2, 3).shape == ()


def test_negative_token_count_is_rejected():
    with pytest.raises(ValueError, match="tokens"):
        verify_flops(TINY, 1, torch.tensor([1.0, -1.0]), 0)
