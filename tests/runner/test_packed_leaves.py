"""The step's norm weights packed into one buffer per dtype (runner/packed_leaves.py,
on by default): the state comes back exactly inside a jit, and an engine with packing
on generates the same greedy tokens with fewer step arguments."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.runner import packed_leaves


def _tiny_state(quantized: bool):
    from flax import nnx

    from jaxllm.layers.quantization.schemes import online_scheme, uniform_config
    from jaxllm.models.llama import LlamaForCausalLM
    from jaxllm.models.registry import arch_from_hf_config
    arch = arch_from_hf_config({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
        "max_position_embeddings": 256, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False})
    quant = uniform_config("fp8", 2, online_scheme("fp8"), True) if quantized else None
    model = LlamaForCausalLM(arch, jnp.bfloat16, rngs=nnx.Rngs(0), quant=quant)
    return nnx.split(model)[1]


@pytest.mark.parametrize("quantized", [False, True], ids=["bf16", "fp8"])
def test_norms_packed_and_back(quantized):
    """Norm weights (2 a layer and the final one) go into one buffer; embeddings,
    weights and per-channel scales stay whole; the state comes back exactly inside a
    jit."""
    state = _tiny_state(quantized)
    leaves, treedef = packed_leaves.flatten(state, pack=False)
    assert treedef == jax.tree.structure(state)
    (whole, buffers), layout = packed_leaves.flatten(state, pack=True)
    norms = 2 * 2 + 1
    assert len(whole) == len(leaves) - norms
    assert [b.dtype for b in buffers] == [jnp.bfloat16]
    assert buffers[0].size == norms * 64
    assert sum(x.dtype == jnp.float32 for x in whole) == 4 * 2 * quantized   # the scales
    back = jax.jit(layout.unflatten)((whole, buffers))
    assert jax.tree.structure(back) == jax.tree.structure(state)
    for got, want in zip(jax.tree.leaves(back), leaves):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_engine_greedy_unchanged_with_fewer_arguments(tiny_model, monkeypatch, quantization):
    from jaxllm import LLM, SamplingParams
    folder, _ = tiny_model("llama")
    prompts = [np.random.default_rng(2).integers(0, 250, n).tolist() for n in (5, 17, 40)]
    outs, counts = [], []
    for pack in ("0", "1"):
        monkeypatch.setenv("JAXLLM_PACK_SMALL_LEAVES", pack)
        llm = LLM(folder, dtype="float32", max_model_len=128, max_num_seqs=4,
                  max_num_batched_tokens=64, enforce_eager=True, cpu_kv_cache_bytes=8 << 20,
                  quantization=quantization)
        res = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                           use_tqdm=False)
        outs.append([o.outputs[0].token_ids for o in res])
        counts.append(len(jax.tree.leaves(llm.llm_engine.runner.params)))
        del llm
    assert outs[0] == outs[1]
    # 2 layers of 2 norms and the final norm: one f32 buffer
    assert counts[1] == counts[0] - (2 * 2 + 1) + 1


def test_switch_takes_0_or_1(monkeypatch):
    monkeypatch.delenv("JAXLLM_PACK_SMALL_LEAVES", raising=False)
    assert packed_leaves.enabled()          # on by default
    for value, on in (("0", False), ("1", True)):
        monkeypatch.setenv("JAXLLM_PACK_SMALL_LEAVES", value)
        assert packed_leaves.enabled() is on
    monkeypatch.setenv("JAXLLM_PACK_SMALL_LEAVES", "yes")
    with pytest.raises(ValueError, match="JAXLLM_PACK_SMALL_LEAVES='yes': 0 or 1"):
        packed_leaves.enabled()
