"""--load-format dummy with --quantization fp8 | int8 | awq | gptq: random quantized
weights of the model's shape built on the device (benchmarks), the KV sizing counting
the quantized weight bytes, and the start-up log line with the weights' GiB."""
from __future__ import annotations

import logging

import jax
import numpy as np
import pytest
from flax import nnx

import int_checkpoints as ic
import quant_util as qu
from jaxllm import LLM, SamplingParams
from jaxllm.models.loader import load_model

ENGINE = dict(dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
              enforce_eager=True, cpu_kv_cache_bytes=8 << 20)


def _bytes(state) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(state))


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_dummy_quantized_weights(tiny_model, kind):
    folder, _ = tiny_model("llama")
    loaded = load_model(folder, "float32", "dummy", quantization=kind)
    state = dict(nnx.to_flat_state(loaded.state))
    w = np.asarray(state[("layers", 0, "mlp", "down_proj", "weight")].get_value())
    s = np.asarray(state[("layers", 0, "mlp", "down_proj", "weight_scale")].get_value())
    a = loaded.arch
    assert str(w.dtype) == ("float8_e4m3fn" if kind == "fp8" else "int8")
    assert w.shape == (a.hidden_size, a.intermediate_size) and s.shape == (a.hidden_size,)
    wf = w.astype(np.float32) * s[:, None]
    # like the float dummy weights: spread over +-0.035, not constant, not zero
    assert 0.03 < np.abs(wf).max() <= 0.036 and np.std(wf) > 0.015   # fp8 rounds 127 to 128
    float_bytes = _bytes(load_model(folder, "float32", "dummy").state)
    assert _bytes(loaded.state) < 0.6 * float_bytes


def test_dummy_follows_the_checkpoint_scheme(tmp_path):
    folder = str(tmp_path / "fp8")
    qu.write_native_fp8(folder, qu.make_model(folder, "qwen3", **qu.BLOCK_SHAPES))
    loaded = load_model(folder, "float32", "dummy")
    state = dict(nnx.to_flat_state(loaded.state))
    s = state[("layers", 0, "mlp", "gate_up_proj", "weight_scale")].get_value()
    assert s.shape == (2, 256, 1)       # per row, one 128-group of K = 128
    assert loaded.quant.method == "fp8"


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_dummy_quantized_engine_runs_and_sizes_kv_by_quantized_bytes(tiny_model, caplog,
                                                                      kind):
    folder, _ = tiny_model("llama")
    with caplog.at_level(logging.INFO, logger="jaxllm.models.loader"):
        llm = LLM(folder, load_format="dummy", quantization=kind, **ENGINE)
    runner = llm.llm_engine.runner
    quantized = _bytes(runner.state)
    report = runner.initialize_kv_cache()
    assert report.weights == quantized
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weights:")]
    assert lines and f"{quantized / (1 << 30):.3f} GiB" in lines[0] and kind in lines[0]
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_dummy_gptq_weights_dequantize_to_the_float_range(tmp_path):
    folder = str(tmp_path / "gptq")
    ic.write_gptq_or_awq(folder, qu.make_model(folder, "llama", **qu.BLOCK_SHAPES), "gptq",
                         bits=4, group=128)
    loaded = load_model(folder, "float32", "dummy")
    state = dict(nnx.to_flat_state(loaded.state))
    leaf = lambda name: np.asarray(  # noqa: E731
        state[("layers", 0, "mlp", "down_proj", name)].get_value())
    w, s, z = leaf("weight"), leaf("weight_scale"), leaf("weight_zero_point")
    q = np.stack([w & 15, w >> 4], -1).reshape(w.shape[0], -1).astype(np.float32)
    wf = (q - z[:, :1]) * s[:, :1]
    assert w.dtype == np.uint8 and 0.025 < np.abs(wf).max() <= 0.035 + 1e-6
    assert len(np.unique(q)) == 16


@pytest.mark.parametrize("kind", ["awq", "gptq"])
def test_dummy_4bit_on_a_float_config(tiny_model, kind):
    """awq / gptq on a float model's config with dummy weights: 4-bit weights in groups
    of 128 (those checkpoints' usual form) that dequantize to the float dummy range, and
    an engine that runs them; real weights still need a quantized checkpoint."""
    folder, _ = tiny_model("llama")
    loaded = load_model(folder, "float32", "dummy", quantization=kind)
    assert loaded.quant.method == kind
    scheme = loaded.quant.scheme("layers.0.mlp.down_proj")
    assert scheme.weight == "uint4" and scheme.group == 128 and scheme.act is None
    state = dict(nnx.to_flat_state(loaded.state))
    leaf = lambda name: np.asarray(  # noqa: E731
        state[("layers", 0, "mlp", "down_proj", name)].get_value())
    w, s, z = leaf("weight"), leaf("weight_scale"), leaf("weight_zero_point")
    a = loaded.arch
    assert w.dtype == np.uint8 and w.shape == (a.hidden_size, a.intermediate_size // 2)
    assert s.shape == z.shape == (a.hidden_size, -(-a.intermediate_size // 128))
    q = np.stack([w & 15, w >> 4], -1).reshape(w.shape[0], -1).astype(np.float32)
    wf = (q - z[:, :1]) * s[:, :1]
    assert 0.025 < np.abs(wf).max() <= 0.035 + 1e-6 and len(np.unique(q)) == 16
    llm = LLM(folder, load_format="dummy", quantization=kind, **ENGINE)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(Exception, match="needs a checkpoint quantized that way"):
        load_model(folder, "float32", "auto", quantization=kind)
    # The launcher's check (jaxllm serve, the CLI) agrees with the loader.
    from jaxllm.models.errors import CheckpointError
    from jaxllm.models.info import check_checkpoint
    check_checkpoint(folder, "dummy", kind, loaded.arch)
    with pytest.raises(CheckpointError, match="needs a checkpoint quantized that way"):
        check_checkpoint(folder, "auto", kind, loaded.arch)
