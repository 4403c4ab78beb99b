"""Quantized q and k/v projections become one qkv_proj when they share a scheme, and stay
apart when they do not or when tensor parallelism cannot split the KV heads. The fused
layer's numerics are covered by every format's greedy-parity test (their checkpoints
all quantize q, k and v alike; the compressed-tensors ones have 2 query heads a KV
head), its row order here (4 a KV head) and by test_native_fp8's dequantized weights,
and the unfused layer under TP by tp8_quant_cases (TP = 4 and 8 with 2 KV heads against
TP = 1 fused)."""
from __future__ import annotations

import numpy as np
import pytest

from jaxllm.layers.quantization.schemes import (ActScheme, LinearScheme, QuantConfig,
                                                fuse_qkv, unfuse_qkv)
from jaxllm.models.quant_config import resolve_for_tp
from jaxllm.models.quant_loader import join_parts
from jaxllm.models.registry import arch_from_hf_config

FP8 = LinearScheme("fp8", None, ActScheme("fp8"))
INT8 = LinearScheme("int8", None, ActScheme("int8"))


def _layer(q, kv, i=0):
    pairs = [(f"layers.{i}.self_attn.q_proj", q), (f"layers.{i}.self_attn.kv_proj", kv),
             (f"layers.{i}.mlp.down_proj", FP8)]
    return [(m, s) for m, s in pairs if s is not None]


def test_same_scheme_fuses_and_unfuses_back():
    schemes = _layer(FP8, FP8, 0) + _layer(FP8, FP8, 1)
    fused = fuse_qkv(schemes)
    assert [m for m, _ in fused] == ["layers.0.self_attn.qkv_proj", "layers.0.mlp.down_proj",
                                     "layers.1.self_attn.qkv_proj", "layers.1.mlp.down_proj"]
    assert all(s == FP8 for _, s in fused)
    assert unfuse_qkv(fused) == tuple(schemes)


@pytest.mark.parametrize("q,kv", [(FP8, INT8), (None, FP8), (FP8, None)])
def test_different_or_float_parts_stay_apart(q, kv):
    assert fuse_qkv(_layer(q, kv)) == tuple(_layer(q, kv))


def _arch(kv_heads):
    return arch_from_hf_config({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 8, "num_key_value_heads": kv_heads,
        "num_hidden_layers": 2, "vocab_size": 320, "rms_norm_eps": 1e-5}, "test")


@pytest.mark.parametrize("kv_heads,tp,fused", [(2, 1, True), (2, 2, True), (2, 4, False),
                                              (4, 8, False), (8, 8, True)])
def test_fused_only_where_tp_splits_the_kv_heads(kv_heads, tp, fused):
    quant = resolve_for_tp(None, "fp8", _arch(kv_heads), "test", tp)
    modules = {m.split(".", 2)[2] for m, _ in quant.schemes}
    assert modules == ({"self_attn.qkv_proj"} if fused else
                       {"self_attn.q_proj", "self_attn.kv_proj"}) | {
        "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"}


def test_rows_grouped_by_kv_head():
    """q's heads 0-3 read KV head 0 and 4-7 KV head 1 (HF's GQA order): each KV head's
    rows are its query heads, then its k head, then its v head."""
    arch, d = _arch(2), 8
    q = np.arange(8)[:, None, None] * np.ones((1, d, 3))            # [Q, D, K'] head ids
    k, v = 100 + np.arange(2)[:, None, None] * np.ones((1, d, 3)), \
        200 + np.arange(2)[:, None, None] * np.ones((1, d, 3))
    parts = [x.reshape(-1, 3) for x in (q, k, v)]
    rows = join_parts(arch, "self_attn.qkv_proj", parts).reshape(2, 6, d, 3)[:, :, 0, 0]
    np.testing.assert_array_equal(rows, [[0, 1, 2, 3, 100, 200], [4, 5, 6, 7, 101, 201]])


def test_describe_counts_the_checkpoints_linear_layers():
    """The start-up line counts q, k and v as three linear layers (as the checkpoint
    has them) whether they run as one qkv_proj or as q_proj and kv_proj."""
    schemes = _layer(FP8, FP8, 0) + _layer(FP8, FP8, 1)
    fused = QuantConfig("fp8", True, fuse_qkv(schemes)).describe()
    apart = QuantConfig("fp8", True, tuple(schemes)).describe()
    assert "8 linear layers in 4 matmuls" in fused
    assert "8 linear layers in 6 matmuls" in apart
