"""Weight-only 4- and 8-bit checkpoints (the plain-jnp dequantizing reference path):
GPTQ (v1 zeros minus one and v2, symmetric and asymmetric, act order with g_idx,
group sizes 32/64/128, 4 and 8 bits), AWQ GEMM (interleaved packing; a module left
float by modules_to_not_convert) and compressed-tensors pack-quantized with
`actorder: group` (weight_g_idx), written by hand from the published layouts
(int_checkpoints.write_gptq_or_awq); compressed-tensors pack-quantized W4A16 (symmetric
and asymmetric) and W8A16, packed by the compressed-tensors package.

Oracles: HF transformers (float32) with the same weights dequantized (by the writer;
no activation quantization in these formats): greedy tokens equal. The
compressed-tensors ones also by HF transformers loading the checkpoint itself, or
(act order, which compressed-tensors no longer writes) by that package's unpacker
decoding the hand-written tensors back to the oracle's weights."""
from __future__ import annotations

import pytest
import torch
import transformers as tf
from flax import nnx

import int_checkpoints as ic
import quant_util as qu

N = 24
GPTQ_AWQ = {
    "gptq-4bit-g128": dict(method="gptq", bits=4, group=128),
    "gptq-4bit-g32-desc-act": dict(method="gptq", bits=4, group=32, desc_act=True),
    "gptq-8bit-g64": dict(method="gptq", bits=8, group=64),
    "gptq-v2-4bit-g64-asym": dict(method="gptq", bits=4, group=64, version="gptq_v2",
                                  sym=False),
    "gptq-4bit-per-channel": dict(method="gptq", bits=4, group=-1),
    "gptq-v2-4bit-g128-ragged": dict(method="gptq", bits=4, group=128, version="gptq_v2",
                                     sym=False),
    "gptq-4bit-g64-asym": dict(method="gptq", bits=4, group=64, sym=False),    # v1
    "gptq-8bit-g32-desc-act": dict(method="gptq", bits=8, group=32, desc_act=True),
    "awq-4bit-g128": dict(method="awq", group=128, sym=False),
    "awq-4bit-g64": dict(method="awq", group=64, sym=False),
    "awq-4bit-g128-float-down-proj": dict(method="awq", group=128, sym=False,
                                          skip=["model.layers.1.mlp.down_proj"]),
    # compressed-tensors pack-quantized with actorder: group (weight_g_idx)
    "pack-4bit-g32-asym-act-order": dict(method="pack", bits=4, group=32, sym=False,
                                         desc_act=True),
}


@pytest.mark.parametrize("case", sorted(GPTQ_AWQ))
def test_gptq_awq_greedy_matches_dequantized_hf(tmp_path, case):
    kw = dict(GPTQ_AWQ[case])
    arch = "qwen3" if "g64" in case else "llama"
    folder = str(tmp_path / case)
    # ragged: widths 192 and 320, whose last group of 128 is short (SmolLM2's 576 too)
    shapes = dict(qu.BLOCK_SHAPES, hidden_size=192, intermediate_size=320,
                  num_attention_heads=3, num_key_value_heads=1) if "ragged" in case \
        else qu.BLOCK_SHAPES
    hf = qu.make_model(folder, arch, **shapes)
    ic.write_gptq_or_awq(folder, hf, kw.pop("method"), **kw)
    prompts = qu.prompts(qu.shared().TINY_VOCAB)
    ours, llm = qu.jaxllm_greedy(folder, prompts, N)
    assert ours == qu.hf_greedy(hf, prompts, N)
    state = dict(nnx.to_flat_state(llm.llm_engine.runner.state))
    w = state[("layers", 0, "mlp", "down_proj", "weight")].get_value()
    a = llm.llm_engine.runner.arch
    packed = 2 if kw.get("bits", 4) == 4 else 1
    assert str(w.dtype) == "uint8" and w.shape == (a.hidden_size,
                                                   a.intermediate_size // packed)
    if kw.get("skip"):    # layer 1's down_proj is float [K, N], its layer otherwise quantized
        down = [k for k in state if k[:4] == ("layers", 1, "mlp", "down_proj")]
        assert down == [("layers", 1, "mlp", "down_proj")], down
        w = state[down[0]].get_value()
        assert str(w.dtype) == "float32" and w.shape == (a.intermediate_size, a.hidden_size)
        up = state[("layers", 1, "mlp", "gate_up_proj", "weight")].get_value()
        assert str(up.dtype) == "uint8"


def test_pack_act_order_layout_decodes_with_compressed_tensors(tmp_path):
    """The hand-written pack-quantized act-order tensors, decoded with compressed-tensors'
    own unpacker and the documented group map (column k scaled by group g_idx[k]), are
    the weights the oracle runs; each g_idx is a real shuffle of the groups, shared by
    the modules of one input."""
    import numpy as np
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.torch import load_file
    folder = str(tmp_path / "pack")
    hf = qu.make_model(folder, "llama", **qu.BLOCK_SHAPES)
    ic.write_gptq_or_awq(folder, hf, "pack", bits=4, group=32, sym=False, desc_act=True)
    t = load_file(f"{folder}/model.safetensors")
    modules = dict(hf.named_modules())
    parts = [n[:-len(".weight_packed")] for n in t if n.endswith(".weight_packed")]
    assert len(parts) == 7 * hf.config.num_hidden_layers
    for part in parts:
        n, k = t[part + ".weight_shape"].tolist()
        g_idx = t[part + ".weight_g_idx"].long()
        groups = k // 32
        assert t[part + ".weight_g_idx"].dtype == torch.int32
        assert torch.bincount(g_idx).tolist() == [32] * groups
        assert (g_idx != torch.arange(k) // 32).any()
        q = unpack_from_int32(t[part + ".weight_packed"], 4, torch.Size([n, k])).float()
        z = unpack_from_int32(t[part + ".weight_zero_point"], 4, torch.Size([n, groups]),
                              packed_dim=0).float()
        s = t[part + ".weight_scale"].float()
        w = (q - z[:, g_idx]) * s[:, g_idx]
        np.testing.assert_array_equal(w.numpy(), modules[part].weight.detach().numpy())
    layer = "model.layers.0."
    for a, b in (("self_attn.q_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
        assert torch.equal(t[layer + a + ".weight_g_idx"], t[layer + b + ".weight_g_idx"])


@pytest.mark.parametrize("preset", ["W4A16", "W4A16_ASYM", "W8A16"])
def test_pack_quantized_matches_the_packer_and_hf(tmp_path, preset):
    """Oracles: the packer's own model, which compressed-tensors decompresses on its
    first forward, and HF transformers loading the folder -- except asymmetric, whose
    packed zero points transformers' loader rejects ([N/8, G] against its [N, G])."""
    folder = str(tmp_path / preset)
    packed = qu.make_model(folder, "llama", **qu.BLOCK_SHAPES)
    qu.write_compressed_tensors(folder, packed, preset)
    prompts = qu.prompts(qu.shared().TINY_VOCAB)
    ours, llm = qu.jaxllm_greedy(folder, prompts, N)
    assert ours == qu.hf_greedy(packed, prompts, N)
    if preset != "W4A16_ASYM":
        hf = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        assert ours == qu.hf_greedy(hf, prompts, N)
    assert llm.llm_engine.runner.config.model.quantization is None     # auto-detected


def test_flag_naming_the_checkpoint_method(tmp_path):
    from jaxllm.models.errors import CheckpointError
    from jaxllm.models.loader import load_model
    folder = str(tmp_path / "awq")
    ic.write_gptq_or_awq(folder, qu.make_model(folder, "llama", **qu.BLOCK_SHAPES), "awq",
                         group=128, sym=False)
    auto = load_model(folder, "float32").quant
    assert auto.layout == "awq"
    # vLLM's name for its Marlin-kernel path on an AWQ checkpoint loads the same model
    for flag in ("awq", "awq_marlin"):
        assert load_model(folder, "float32", quantization=flag).quant == auto, flag
    for flag in ("gptq", "gptq_marlin"):
        with pytest.raises(CheckpointError, match=f"quantization='{flag}' disagrees with the "
                                                  "checkpoint's quantization_config."
                                                  "quant_method='awq'"):
            load_model(folder, "float32", quantization=flag)


def test_act_order_differing_across_q_k_v_is_refused(tmp_path, monkeypatch):
    """q, k and v are one matmul (qkv_proj), so they must share an act order: a GPTQ
    checkpoint whose q_proj has its own g_idx is refused in one line naming both,
    before any weight reaches the device; at a TP size that keeps q apart (more
    devices than KV heads) the launcher's check takes it."""
    import os

    import jax
    import numpy as np
    from safetensors.torch import load_file, save_file

    from jaxllm.models.errors import CheckpointError
    from jaxllm.models.loader import load_model
    folder = str(tmp_path / "gptq")
    ic.write_gptq_or_awq(folder, qu.make_model(folder, "llama", **qu.BLOCK_SHAPES), "gptq",
                         bits=4, group=32, desc_act=True)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    name = "model.layers.1.self_attn.q_proj.g_idx"
    tensors[name] = torch.from_numpy(np.roll(tensors[name].numpy(), 1))
    save_file(tensors, path)
    puts = []
    real = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: puts.append(1) or real(*a, **k))
    with pytest.raises(CheckpointError, match="model.layers.1.self_attn.q_proj and "
                                              "model.layers.1.self_attn.k_proj have "
                                              "different g_idx"):
        load_model(folder, "float32")
    assert not puts
    from jaxllm.models.info import check_checkpoint, read_model_arch
    arch, _ = read_model_arch(folder)
    with pytest.raises(CheckpointError, match="different g_idx"):
        check_checkpoint(folder, "auto", None, arch)
    assert arch.num_kv_heads % 4
    check_checkpoint(folder, "auto", None, arch, tp=4)
