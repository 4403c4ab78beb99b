"""compressed-tensors checkpoints, packed by the compressed-tensors package itself
(its presets and ModelCompressor; quant_util.write_compressed_tensors), loaded by
jaxllm: greedy tokens equal HF transformers running the same weights dequantized with
the same activation quantization (float32), and equal HF transformers loading the
checkpoint itself through its compressed-tensors integration (CPU), the second oracle.

INT8 against the second oracle: compressed-tensors' own forward scales int8
activations by amax / 127.5, vLLM's kernels (and jaxllm) by amax / 127, so there the
tokens must agree up to near-ties of HF's logits rather than exactly."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as tf
from flax import nnx

import quant_util as qu

# (arch, preset, weight kind, activation mode of the oracle, config overrides)
CASES = {
    "llama-fp8-dynamic": ("llama", "FP8_DYNAMIC", "fp8", "token", {}),
    "qwen3-fp8-dynamic": ("qwen3", "FP8_DYNAMIC", "fp8", "token", {}),
    "llama-fp8-static": ("llama", "FP8", "fp8", "tensor", {}),
    "llama-int8-w8a8": ("llama", "W8A8", "int8", "token", {}),
    "qwen3-int8-w8a8": ("qwen3", "W8A8", "int8", "token", {}),
    # a zero point per token too (vLLM's azp W8A8)
    "llama-int8-w8a8-azp": ("llama", "W8A8_AZP", "int8", "token_asym", {}),
    "llama-fp8-block": ("llama", "FP8_BLOCK", "fp8", "group", qu.BLOCK_SHAPES),
}
N = 24


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def get(case):
        if case not in made:
            arch, preset, *_ , overrides = CASES[case]
            folder = str(tmp_path_factory.mktemp(case))
            qu.write_compressed_tensors(folder, qu.make_model(folder, arch, **overrides), preset)
            made[case] = folder
        return made[case]
    return get


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_matches_dequantized_hf(checkpoints, case):
    folder = checkpoints(case)
    _, _, kind, mode, _ = CASES[case]
    prompts = qu.prompts(qu.shared().TINY_VOCAB)
    ours, llm = qu.jaxllm_greedy(folder, prompts, N)
    ref = qu.hf_greedy(qu.dequantized_hf(folder, kind, mode), prompts, N)
    assert ours == ref
    # The weights stay quantized on the device, [N, K] (HF's own layout), q and k/v as
    # one qkv_proj: each KV head's query heads, then its k and v head.
    state = dict(nnx.to_flat_state(llm.llm_engine.runner.state))
    w = state[("layers", 0, "self_attn", "qkv_proj", "weight")].get_value()
    assert w.dtype == (jnp_fp8() if kind == "fp8" else np.int8)
    a = llm.llm_engine.runner.arch
    g = a.num_heads // a.num_kv_heads
    assert w.shape == (a.num_kv_heads, g + 2, a.head_dim, a.hidden_size)
    if mode == "token_asym":     # the zero points' correction: the weight's sums over K
        adj = state[("layers", 0, "self_attn", "qkv_proj", "azp_adj")].get_value()
        np.testing.assert_array_equal(adj, np.asarray(w).astype(np.int64).sum(axis=-1))


def jnp_fp8():
    import jax.numpy as jnp
    return jnp.float8_e4m3fn


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_matches_hf_loading_the_checkpoint(checkpoints, case):
    folder = checkpoints(case)
    kind = CASES[case][2]
    prompts = qu.prompts(qu.shared().TINY_VOCAB)
    ours, _ = qu.jaxllm_greedy(folder, prompts, N)
    hf = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if kind == "fp8":
        assert ours == qu.hf_greedy(hf, prompts, N)
    else:
        qu.assert_greedy_up_to_ties(hf, prompts, ours, tol=0.05)
