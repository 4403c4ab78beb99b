"""Refusals of GPTQ, AWQ, compressed-tensors pack-quantized and native FP8 checkpoints
(test_quant_errors.py has the compressed-tensors W8A8 ones): a setting the loader does
not implement, packed tensors or scales that do not fit their weights, scale values
that are not finite and positive, and act-order g_idx maps naming groups that do not
exist. Each is one line naming the problem, raised before any weight reaches the
device, by the loader and by the launcher's check alike.

Checkpoints: tiny Llamas written by quant_util (GPTQ / AWQ / native FP8 by hand from
the published layouts, pack-quantized W4A16 asymmetric by the compressed-tensors
package), one per format for the module, each edited in a copy by one case."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import int_checkpoints as ic
import quant_util as qu
from quant_util import no_device_puts  # noqa: F401  (a fixture)
from jaxllm.models.errors import CheckpointError
from jaxllm.models.info import check_checkpoint, read_model_arch
from jaxllm.models.loader import load_model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """format -> folder, written on first use."""
    made = {}
    writers = {
        # default tiny widths: K 64 / 112 in groups of 32 and 64, the last one short
        "gptq": lambda f: ic.write_gptq_or_awq(f, qu.make_model(f, "llama"), "gptq",
                                               bits=4, group=32, desc_act=True),
        "awq": lambda f: ic.write_gptq_or_awq(f, qu.make_model(f, "llama"), "awq",
                                              group=64, sym=False),
        "pack": lambda f: qu.write_compressed_tensors(
            f, qu.make_model(f, "llama", **qu.BLOCK_SHAPES), "W4A16_ASYM"),
        "fp8": lambda f: qu.write_native_fp8(f, qu.make_model(f, "llama", **qu.BLOCK_SHAPES)),
    }

    def get(fmt):
        if fmt not in made:
            made[fmt] = str(tmp_path_factory.mktemp(fmt))
            writers[fmt](made[fmt])
        return made[fmt]
    return get


def _qc(**values):
    return lambda cfg: cfg["quantization_config"].update(values)


def _tensor(name, edit):
    """Replace tensor `name` by edit(its value)."""
    return lambda t: t.update({name: edit(t[name].clone())})


def _at(index, value):
    def edit(x):
        x[index] = value
        return x
    return edit


L0, L1 = "model.layers.0.", "model.layers.1."


def _act_order(g_idx_of):
    """pack-quantized with group act order: config and a weight_g_idx per module."""
    def edit_config(cfg):
        for g in cfg["quantization_config"]["config_groups"].values():
            g["weights"]["actorder"] = "group"

    def edit_tensors(t):
        for name in [n for n in t if n.endswith(".weight_packed")]:
            part = name[:-len(".weight_packed")]
            k = t[name].shape[1] * 8
            t[part + ".weight_g_idx"] = torch.from_numpy(g_idx_of(part, k))
    return edit_config, edit_tensors


def _g_idx_with_one_stray(part, k):
    g = (np.arange(k) // 128).astype(np.int32)
    if part == L1 + "self_attn.o_proj":
        g[7] = k // 128
    return g


# case -> (format, config edit, tensors edit, message)
CASES = {
    # GPTQ settings
    "gptq_checkpoint_format": ("gptq", _qc(checkpoint_format="marlin"), None,
                               "quantization_config.checkpoint_format='marlin' is not "
                               "supported (gptq, gptq_v2)"),
    "gptq_lm_head": ("gptq", _qc(lm_head=True), None,
                     "quantization_config.lm_head=true: a quantized lm_head is not supported"),
    "gptq_dynamic": ("gptq", _qc(dynamic={"-:.*down_proj": {}}), None,
                     "quantization_config.dynamic is set: per-module GPTQ settings are not "
                     "supported"),
    # AWQ settings
    "awq_8_bits": ("awq", _qc(bits=8), None, "bits=8 is not supported for awq (4)"),
    "awq_w_bit_8": ("awq", lambda c: (c["quantization_config"].pop("bits"),
                                      _qc(w_bit=8)(c)), None,
                    "bits=8 is not supported for awq (4)"),
    "awq_no_zero_point": ("awq", _qc(zero_point=False), None,
                          "quantization_config.zero_point=false is not supported"),
    # packed tensors that do not fit the weight
    "gptq_qweight_shape": ("gptq", None, _tensor(L1 + "self_attn.q_proj.qweight",
                                                 lambda x: x[:-1].contiguous()),
                           "tensor model.layers.1.self_attn.q_proj.qweight is I32 (7, 64), "
                           "which does not fit the weight (64, 64) in 4-bit groups of 32 "
                           "(expected I32 (8, 64))"),
    "gptq_qweight_dtype": ("gptq", None, _tensor(L0 + "mlp.up_proj.qweight",
                                                 lambda x: x.float()),
                           "tensor model.layers.0.mlp.up_proj.qweight is F32 (8, 112)"),
    "gptq_widths_not_multiple_of_8": (
        "gptq", lambda c: c.update(intermediate_size=108), None,
        "model.layers.0.mlp.gate_proj is (108, 64); packed weights need widths that are "
        "multiples of 8"),
    "pack_zero_point_shape": ("pack", None, _tensor(L0 + "mlp.down_proj.weight_zero_point",
                                                    lambda x: x[:, :1].contiguous()),
                              "tensor model.layers.0.mlp.down_proj.weight_zero_point has "
                              "shape (16, 1), expected (16, 2)"),
    "pack_zero_point_missing": ("pack", None, lambda t: t.pop(
        L1 + "mlp.gate_proj.weight_zero_point"),
        "the config says asymmetric weights (weights.symmetric=false), but "
        "model.layers.1.mlp.gate_proj."
        "weight_zero_point is missing"),
    # scales that do not match their weights
    "gptq_scales_shape": ("gptq", None, _tensor(L0 + "mlp.down_proj.scales",
                                                lambda x: x[:-1].contiguous()),
                          "tensor model.layers.0.mlp.down_proj.scales is F16 (3, 64), which "
                          "does not fit the weight (64, 112) in 4-bit groups of 32 "
                          "(expected F16 (4, 64))"),
    "awq_scales_shape": ("awq", None, _tensor(L1 + "mlp.down_proj.scales",
                                              lambda x: x.T.contiguous()),
                         "tensor model.layers.1.mlp.down_proj.scales is F16 (64, 2), which "
                         "does not fit the weight (64, 112) in 4-bit groups of 64 "
                         "(expected F16 (2, 64))"),
    "fp8_scale_inv_shape": ("fp8", None, _tensor(L0 + "mlp.down_proj.weight_scale_inv",
                                                 lambda x: x.repeat(2, 1)),
                            "scale model.layers.0.mlp.down_proj.weight_scale_inv has shape "
                            "(2, 2), which does not match the weight "
                            "model.layers.0.mlp.down_proj.weight (128, 256) in (128, 128) "
                            "blocks (expected (1, 2))"),
    # scale values
    "gptq_nan_scale": ("gptq", None, _tensor(L1 + "self_attn.o_proj.scales",
                                             _at((1, 3), float("nan"))),
                       "scale model.layers.1.self_attn.o_proj.scales has values that are "
                       "not finite and positive"),
    "awq_zero_scale": ("awq", None, _tensor(L1 + "mlp.up_proj.scales", _at((0, 0), 0.0)),
                       "scale model.layers.1.mlp.up_proj.scales has values that are not "
                       "finite and positive"),
    "pack_negative_scale": ("pack", None, _tensor(L0 + "self_attn.v_proj.weight_scale",
                                                  _at((5, 0), -0.01)),
                            "scale model.layers.0.self_attn.v_proj.weight_scale has values "
                            "that are not finite and positive"),
    "fp8_inf_scale": ("fp8", None, _tensor(L1 + "self_attn.k_proj.weight_scale_inv",
                                           _at((0, 0), float("inf"))),
                      "scale model.layers.1.self_attn.k_proj.weight_scale_inv has values "
                      "that are not finite and positive"),
    # act order naming groups that do not exist (q, k and v share theirs: edit all three)
    "gptq_g_idx_past_the_groups": (
        "gptq", None, lambda t: [_tensor(L1 + f"self_attn.{p}_proj.g_idx", _at(5, 2))(t)
                                 for p in "qkv"],
        "g_idx of model.layers.1.self_attn.q_proj names groups outside 0..1"),
    "gptq_g_idx_negative": ("gptq", None, _tensor(L0 + "mlp.down_proj.g_idx", _at(100, -1)),
                            "g_idx of model.layers.0.mlp.down_proj names groups outside 0..3"),
    "pack_g_idx_past_the_groups": (
        "pack", *_act_order(_g_idx_with_one_stray),
        "g_idx of model.layers.1.self_attn.o_proj names groups outside 0..0"),
    # native FP8 settings
    "fp8_e5m2": ("fp8", _qc(fmt="e5m2"), None,
                 "quantization_config.fmt='e5m2' is not supported (e4m3 is)"),
    "fp8_static_with_blocks": ("fp8", _qc(activation_scheme="static"), None,
                               "block-scaled weights with activation_scheme='static' are not "
                               "supported (dynamic is)"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_in_one_line_before_any_weight_moves(checkpoints, tmp_path, no_device_puts,
                                                     case):
    fmt, edit_config, edit_tensors, message = CASES[case]
    folder = qu.edited_copy(checkpoints(fmt), tmp_path / "ckpt", edit_config, edit_tensors)
    with pytest.raises(CheckpointError) as e:
        load_model(folder, "float32")
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert no_device_puts == []
    arch, _ = read_model_arch(folder)
    with pytest.raises(CheckpointError) as e:
        check_checkpoint(folder, "auto", None, arch)
    assert message in str(e.value), str(e.value)


@pytest.mark.parametrize("fmt", ["gptq", "awq", "pack", "fp8"])
def test_unedited_checkpoints_pass_the_checks(checkpoints, tmp_path, fmt):
    """The cases' checkpoints before their edits: the launcher's check passes, and
    the act-order one with in-range g_idx too (each refusal is the edit's)."""
    folder = checkpoints(fmt)
    check_checkpoint(folder, "auto", None, read_model_arch(folder)[0])
    if fmt == "pack":
        folder = qu.edited_copy(folder, tmp_path / "ordered",
                                *_act_order(lambda part, k: (np.arange(k) // 128)
                                            .astype(np.int32)))
        check_checkpoint(folder, "auto", None, read_model_arch(folder)[0])
