"""Native FP8 checkpoints (`quant_method: fp8`, e4m3 weights, `weight_scale_inv` per
128x128 block, dynamic activations: the official Qwen3-*-FP8 layout), written by hand
from that published layout (quant_util.write_native_fp8) for tiny random Qwen3 and
Llama models whose widths are whole blocks.

Oracles: HF transformers (float32) running the same weights dequantized, with each
projection's input quantized per token and 128-group as the format's producer does;
and HF transformers' own FP8 loader, which on CPU dequantizes the checkpoint: its
weights equal jaxllm's dequantized ones, and with the same activation hooks its greedy
tokens match. Greedy equality is up to near-ties (see quant_util.assert_greedy_up_to_ties)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as tf
from flax import nnx

import quant_util as qu
from jaxllm.models.loader import load_model

N = 24


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def fp8_folder(request, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp(f"fp8-{request.param}"))
    qu.write_native_fp8(folder, qu.make_model(folder, request.param, **qu.BLOCK_SHAPES))
    return folder


def test_greedy_matches_dequantized_hf(fp8_folder):
    prompts = qu.prompts(qu.shared().TINY_VOCAB)
    ours, _ = qu.jaxllm_greedy(fp8_folder, prompts, N)
    qu.assert_greedy_up_to_ties(qu.dequantized_hf(fp8_folder, "fp8", "group"), prompts, ours,
                                tol=0.01, max_flips=1 / 24)


def test_hf_fp8_loader_agrees(fp8_folder):
    hf = tf.AutoModelForCausalLM.from_pretrained(fp8_folder, dtype=torch.float32).eval()
    loaded = load_model(fp8_folder, "float32")
    assert loaded.quant.method == "fp8" and not loaded.quant.online
    state = dict(nnx.to_flat_state(loaded.state))
    a = loaded.arch
    layer = hf.model.layers[1]
    hk, d, e = a.num_kv_heads, a.head_dim, a.hidden_size
    by_head = lambda m: m.weight.detach().numpy().reshape(hk, -1, d, e)  # noqa: E731
    refs = {  # qkv_proj: each KV head's query heads, then its k and v head
        ("self_attn", "qkv_proj"): np.concatenate(
            [by_head(layer.self_attn.q_proj), by_head(layer.self_attn.k_proj),
             by_head(layer.self_attn.v_proj)], axis=1),
        ("mlp", "down_proj"): layer.mlp.down_proj.weight.detach().numpy()}
    for (name, mod), ref in refs.items():
        w = np.asarray(state[("layers", 1, name, mod, "weight")].get_value()).astype(np.float32)
        s = np.asarray(state[("layers", 1, name, mod, "weight_scale")].get_value())
        w = w.reshape(-1, s.shape[-1], 128) * s.reshape(-1, s.shape[-1], 1)
        np.testing.assert_array_equal(w.reshape(ref.shape), ref)
    assert state[("layers", 0, "self_attn", "qkv_proj", "weight")].get_value().shape == (
        hk, a.num_heads // hk + 2, d, e)
    for n, m in hf.named_modules():
        if isinstance(m, torch.nn.Linear) and n != "lm_head":
            m.register_forward_pre_hook(qu.act_hook("fp8", "group"))
    prompts = qu.prompts(qu.shared().TINY_VOCAB)
    ours, _ = qu.jaxllm_greedy(fp8_folder, prompts, N)
    qu.assert_greedy_up_to_ties(hf, prompts, ours, tol=0.01, max_flips=1 / 24)


def test_block_must_cover_whole_columns(tmp_path):
    """A K width that is not a whole number of blocks is refused (jaxllm groups the
    activations by whole blocks)."""
    from jaxllm.models.errors import CheckpointError
    folder = str(tmp_path / "odd")
    qu.write_native_fp8(folder, qu.make_model(folder, "llama", **qu.BLOCK_SHAPES),
                        block=(128, 128))
    import json
    import os
    path = os.path.join(folder, "config.json")
    cfg = json.load(open(path))
    cfg["quantization_config"]["weight_block_size"] = [128, 96]
    json.dump(cfg, open(path, "w"))
    with pytest.raises(CheckpointError, match="has 128 columns, not a multiple of the "
                                              "weight block 96"):
        load_model(folder, "float32")
