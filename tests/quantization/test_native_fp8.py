"""Native FP8 checkpoints (`quant_method: fp8`, e4m3 weights, `weight_scale_inv` per
128x128 block, dynamic activations: the official Qwen3-*-FP8 layout), written by hand
from that published layout (quant_util.write_native_fp8) for tiny random Qwen3 and
Llama models whose widths are whole blocks; AutoFP8's per-tensor layout (a
`weight_scale` and a static `input_scale` per projection, `activation_scheme: static`);
and both with one projection left float by modules_to_not_convert / ignored_layers.

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


@pytest.fixture(scope="module")
def static_folder(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("fp8-static"))
    qu.write_native_fp8(folder, qu.make_model(folder, "llama"), block=None)
    return folder


def test_per_tensor_static_greedy_matches_dequantized_hf(static_folder):
    """AutoFP8's layout; the oracle quantizes each projection's input with its stored
    scale (fp8(x / input_scale) * input_scale), as the checkpoint's producer meant."""
    import json
    import os
    from safetensors.torch import load_file
    qc = json.load(open(os.path.join(static_folder, "config.json")))["quantization_config"]
    assert qc == {"quant_method": "fp8", "activation_scheme": "static",
                  "ignored_layers": ["lm_head"]}
    prompts = qu.prompts(qu.shared().TINY_VOCAB)
    ours, llm = qu.jaxllm_greedy(static_folder, prompts, N)
    assert ours == qu.hf_greedy(qu.dequantized_hf(static_folder, "fp8", "tensor"), prompts, N)
    state = dict(nnx.to_flat_state(llm.llm_engine.runner.state))
    t = load_file(os.path.join(static_folder, "model.safetensors"))
    a = llm.llm_engine.runner.arch
    qkv = ("layers", 1, "self_attn", "qkv_proj")
    assert str(state[qkv + ("weight",)].get_value().dtype) == "float8_e4m3fn"
    # one input feeds q, k and v, so their calibrated scales are one value
    attn = "model.layers.1.self_attn."
    want = t[attn + "q_proj.input_scale"].item()
    assert want == t[attn + "k_proj.input_scale"].item() == t[attn + "v_proj.input_scale"].item()
    assert float(state[qkv + ("input_scale",)].get_value()) == want
    # the per-tensor weight scales, one per row of each part
    s = np.asarray(state[qkv + ("weight_scale",)].get_value())
    g = a.num_heads // a.num_kv_heads
    assert s.shape == (a.num_kv_heads, g + 2, a.head_dim)
    assert (s[:, :g] == t[attn + "q_proj.weight_scale"].item()).all()
    assert (s[:, g] == t[attn + "k_proj.weight_scale"].item()).all()
    assert (s[:, g + 1] == t[attn + "v_proj.weight_scale"].item()).all()


# format -> (arch, config overrides, write_native_fp8 kwargs, oracle's activation mode)
SKIP_CASES = {
    "block-modules-to-not-convert": ("qwen3", qu.BLOCK_SHAPES,
                                     dict(skip=["model.layers.1.mlp.down_proj"]), "group"),
    "tensor-ignored-layers": ("llama", {}, dict(block=None,
                                                skip=["model.layers.0.self_attn.o_proj"]),
                              "tensor"),
}


@pytest.mark.parametrize("case", sorted(SKIP_CASES))
def test_module_left_float_loads_float(tmp_path, case):
    """A projection other than lm_head named as not converted is stored float: it
    loads float (no scales) and runs unquantized, its input too."""
    arch, shapes, kwargs, mode = SKIP_CASES[case]
    folder = str(tmp_path / case)
    qu.write_native_fp8(folder, qu.make_model(folder, arch, **shapes), **kwargs)
    prompts = qu.prompts(qu.shared().TINY_VOCAB)
    ours, llm = qu.jaxllm_greedy(folder, prompts, N)
    ref = qu.dequantized_hf(folder, "fp8", mode)
    if mode == "group":      # as test_greedy_matches_dequantized_hf: near-ties of fp8 inputs
        qu.assert_greedy_up_to_ties(ref, prompts, ours, tol=0.01, max_flips=1 / 24)
    else:
        assert ours == qu.hf_greedy(ref, prompts, N)
    state = dict(nnx.to_flat_state(llm.llm_engine.runner.state))
    skipped = kwargs["skip"][0].split(".")      # model.layers.<i>.<block>.<proj>
    path = ("layers", int(skipped[2]), skipped[3], skipped[4])
    assert [k for k in state if k[:4] == path] == [path]
    assert str(state[path].get_value().dtype) == "float32"
    quantized = [k for k in state if len(k) == 5 and k[-1] == "weight"
                 and k[3].endswith("_proj")]
    assert len(quantized) == 4 * 2 - 1
    assert all(str(state[k].get_value().dtype) == "float8_e4m3fn" for k in quantized)
