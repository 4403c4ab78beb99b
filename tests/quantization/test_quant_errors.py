"""A checkpoint jaxllm cannot run correctly is refused with the reason, before any
weight reaches the device: unknown quant_method, unsupported format, bit width or
strategy, settings the loader does not implement, scales that do not fit their
weights, quantized tensors the config does not account for, and --quantization
disagreeing with the checkpoint. The base checkpoint is a compressed-tensors INT8 W8A8
tiny Llama packed by the compressed-tensors package (quant_util)."""
from __future__ import annotations

import pytest
import torch

import quant_util as qu
from quant_util import no_device_puts  # noqa: F401  (a fixture)
from jaxllm.config import ConfigError
from jaxllm.entrypoints.cli import main
from jaxllm.models.errors import CheckpointError
from jaxllm.models.loader import load_model


@pytest.fixture(scope="module")
def w8a8(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("ct-w8a8"))
    qu.write_compressed_tensors(folder, qu.make_model(folder, "llama"), "W8A8")
    return folder


def _group(cfg):
    return cfg["quantization_config"]["config_groups"]["group_0"]


def _set(path, value):
    def edit(cfg):
        *head, last = path
        node = cfg["quantization_config"]
        for key in head:
            node = node[key]
        node[last] = value
    return edit


CASES = {
    "unknown_quant_method": (_set(["quant_method"], "bitsandbytes"),
                             None, "quant_method='bitsandbytes' is not supported"),
    "awq_gemv": (lambda c: c.update(quantization_config={
        "quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}), None,
        "quantization_config.version='gemv' is not supported (gemm)"),
    "gptq_3_bits": (lambda c: c.update(quantization_config={
        "quant_method": "gptq", "bits": 3, "group_size": 128}), None,
        "bits=3 is not supported (4 or 8)"),
    "gptq_group_size": (lambda c: c.update(quantization_config={
        "quant_method": "gptq", "bits": 4, "group_size": 48}), None,
        "group_size=48 is not supported"),
    "pack_quantized_w4a8": (
        lambda c: (_set(["format"], "pack-quantized")(c),
                   _group(c).update(format="pack-quantized")),
        None, "pack-quantized weights with quantized activations are not supported"),
    "unknown_format": (
        lambda c: (_set(["format"], "marlin-24")(c), _group(c).update(format="marlin-24")),
        None, "format 'marlin-24' is not supported"),
    "four_bit_weights": (_set(["config_groups", "group_0", "weights", "num_bits"], 4), None,
                         "num_bits=4 is not supported"),
    "asymmetric": (_set(["config_groups", "group_0", "weights", "symmetric"], False), None,
                   "symmetric=false (zero points) is not supported"),
    "static_asymmetric_inputs": (
        lambda c: _group(c)["input_activations"].update(dynamic=False, strategy="tensor",
                                                        symmetric=False), None,
        "input_activations.symmetric=false (zero points) is not supported (int8 inputs "
        "with dynamic token scales are)"),
    "group_strategy": (_set(["config_groups", "group_0", "weights", "strategy"], "group"),
                       None, "strategy='group' is not supported"),
    "kv_scales_missing": (_set(["kv_cache_scheme"], {"num_bits": 8, "type": "float"}), None,
                          "missing tensor model.layers.0.self_attn.k_scale (the "
                          "kv_cache_scheme says the KV scales are stored)"),
    "kv_cache_scheme_dynamic": (_set(["kv_cache_scheme"], {"num_bits": 8, "type": "float",
                                                           "dynamic": True}), None,
                                "is not supported (8-bit float, per tensor, static, "
                                "symmetric: fp8 KV scales)"),
    "sparsity_config": (_set(["sparsity_config"], {"format": "sparse-24-bitmask"}), None,
                        "quantization_config.sparsity_config is set; jaxllm does not "
                        "implement it"),
    "transform_config": (_set(["transform_config"], {"config_groups": {"u": {}}}), None,
                         "quantization_config.transform_config is set; jaxllm does not "
                         "implement it"),
    "empty_config_groups": (_set(["config_groups"], {}), None,
                            "quantization_config.config_groups is empty"),
    "two_groups_one_module": (
        lambda c: c["quantization_config"]["config_groups"].update(
            group_1=dict(_group(c), targets=["re:.*down_proj"])), None,
        "model.layers.0.mlp.down_proj matches config groups group_0, group_1; give each "
        "module one group"),
    "dynamic_weights": (_set(["config_groups", "group_0", "weights", "dynamic"], True), None,
                        "config_groups.group_0.weights.dynamic is set; weights need stored "
                        "scales"),
    "pack_quantized_dynamic_weights": (
        lambda c: (_set(["format"], "pack-quantized")(c),
                   _group(c).update(format="pack-quantized", input_activations=None),
                   _group(c)["weights"].update(dynamic=True)),
        None, "config_groups.group_0.weights.dynamic is set; weights need stored scales"),
    "output_activations": (_set(["config_groups", "group_0", "output_activations"],
                                {"num_bits": 8, "type": "int"}), None,
                           "output_activations is set"),
    "per_group_activations": (
        _set(["config_groups", "group_0", "input_activations", "strategy"], "group"), None,
        "input_activations: strategy='group' dynamic=True is not supported"),
    "quantized_lm_head": (_set(["ignore"], []), None, "a quantized lm_head is not supported"),
    "k_and_v_differ": (_set(["ignore"], ["lm_head", "model.layers.1.self_attn.v_proj"]), None,
                       "model.layers.1.self_attn.k_proj and model.layers.1.self_attn.v_proj "
                       "are quantized differently"),
    "scale_shape": (None, lambda t: t.update({
        "model.layers.1.mlp.up_proj.weight_scale": torch.ones(7, 1)}),
        "scale model.layers.1.mlp.up_proj.weight_scale has shape (7, 1), which does not "
        "match the weight model.layers.1.mlp.up_proj.weight (112, 64)"),
    "scale_missing": (None, lambda t: t.pop("model.layers.0.self_attn.o_proj.weight_scale"),
                      "missing tensor model.layers.0.self_attn.o_proj.weight_scale"),
    "scale_not_positive": (None, lambda t: t["model.layers.0.mlp.down_proj.weight_scale"]
                           .__setitem__(3, 0.0), "not finite and positive"),
    "weights_not_int8": (None, lambda t: t.update({
        "model.layers.0.self_attn.q_proj.weight":
            t["model.layers.0.self_attn.q_proj.weight"].float()}),
        "tensor model.layers.0.self_attn.q_proj.weight is F32, but the quantization_config "
        "says int8"),
    # The case without its config: int8 weights must never be read as floats.
    "no_quantization_config": (lambda c: c.pop("quantization_config"), None,
                               "is stored as I8, but config.json has no quantization_config"),
    "ignored_but_int8": (_set(["ignore"], ["lm_head", "re:.*down_proj"]), None,
                         "model.layers.0.mlp.down_proj.weight is stored as I8, but the "
                         "quantization_config (compressed-tensors) does not quantize"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_before_any_weight_moves(w8a8, tmp_path, no_device_puts, case):
    edit_config, edit_tensors, message = CASES[case]
    folder = qu.edited_copy(w8a8, tmp_path / "ckpt", edit_config, edit_tensors)
    with pytest.raises(CheckpointError) as e:
        load_model(folder, "float32")
    assert message in str(e.value), str(e.value)
    assert "\n" not in str(e.value)
    assert no_device_puts == []


@pytest.mark.parametrize("flag, message", [
    ("fp8", "quantization='fp8' disagrees with the checkpoint's quantization_config."
            "quant_method='compressed-tensors'"),
    ("int8", "quantization='int8' disagrees"),
    ("gguf", "quantization='gguf' disagrees"),
    ("ptpc_fp8", "quantization='ptpc_fp8' disagrees"),
    ("awq_marlin", "quantization='awq_marlin' disagrees"),
])
def test_flag_disagreeing_with_checkpoint(w8a8, no_device_puts, flag, message):
    with pytest.raises(CheckpointError, match=message):
        load_model(w8a8, "float32", quantization=flag)
    assert no_device_puts == []


@pytest.mark.parametrize("flag, message", [
    ("compressed-tensors", "quantization='compressed-tensors' needs a checkpoint quantized "
                           "that way"),
    ("gguf", "quantization='gguf' needs a GGUF file, and this is an HF folder"),
])
def test_checkpoint_method_on_a_float_model(tiny_model, no_device_puts, flag, message):
    folder, _ = tiny_model("llama")
    with pytest.raises(CheckpointError, match=message):
        load_model(folder, "float32", quantization=flag)
    assert no_device_puts == []


def test_unknown_quantization_setting():
    from jaxllm.config import ModelConfig
    with pytest.raises(ConfigError, match="quantization='bitsandbytes' is not supported; "
                                          "choose one of gguf, fp8, int8, compressed-tensors, "
                                          "awq, gptq"):
        ModelConfig(quantization="bitsandbytes")


@pytest.mark.parametrize("case", ["scale_shape", "unknown_quant_method"])
def test_cli_one_line_exit_2(w8a8, tmp_path, capsys, case):
    edit_config, edit_tensors, message = CASES[case]
    folder = qu.edited_copy(w8a8, tmp_path / "ckpt", edit_config, edit_tensors)
    with pytest.raises(SystemExit) as e:
        main(["generate", folder, "--prompt", "hi", "--compilation-cache-dir", "none"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2
    assert len(err) == 1 and message in err[0], err


def test_cli_flag_disagreeing(w8a8, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", w8a8, "--quantization", "fp8", "--prompt", "hi",
              "--compilation-cache-dir", "none"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "disagrees" in err[0], err
