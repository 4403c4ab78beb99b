"""--quantization fp8 | int8 on a float checkpoint (vLLM's online FP8 and its int8
twin): per-output-channel weights quantized at load (RTN, amax / 448 or amax / 127),
per-token activation scales in the layer (int8: and a zero point per token). Oracle:
HF transformers (float32) with every projection's weight quantized and dequantized per
channel in torch and its input quantized per token in a hook (int8: weight and input
first rotated along K in Hadamard blocks, scipy's matrices). Embeddings and lm_head
(tied or not) stay float, as in vLLM. Also: the setting is auto-detected from
quantization_config, and a checkpoint's own method may be named."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from flax import nnx
from scipy.linalg import hadamard

import quant_util as qu
from jaxllm.models.loader import load_model

N = 24


def block_rotation(k: int) -> np.ndarray:
    """The K x K rotation online int8 applies: block-diagonal normalized Hadamard
    blocks, each the largest power of two up to 64 dividing K."""
    b = 1
    while b < 64 and k % (2 * b) == 0:
        b *= 2
    return np.kron(np.eye(k // b), hadamard(b) / np.sqrt(b)).astype(np.float32)


def rtn_hf(hf, kind: str):
    """A copy of `hf` with per-channel RTN weights and per-token activation hooks."""
    model = copy.deepcopy(hf)
    qmax = 448.0 if kind == "fp8" else 127.0
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name != "lm_head":
            w = m.weight.data
            if kind == "int8":      # x W^T = (x R)(W R)^T: both sides rotated
                r = torch.from_numpy(block_rotation(w.shape[1]))
                w = w @ r
                m.register_forward_pre_hook(lambda mod, args, r=r: (args[0] @ r,))
            s = (w.abs().amax(dim=1, keepdim=True) / qmax).clamp_min(1e-12)
            m.weight.data = qu._fake_quant(w, kind, s)
            m.register_forward_pre_hook(
                qu.act_hook(kind, "token_asym" if kind == "int8" else "token"))
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_online_greedy_matches_rtn_hf(tiny_model, arch, kind):
    folder, hf = tiny_model(arch)
    prompts = qu.prompts(qu.shared().TINY_VOCAB)
    ours, llm = qu.jaxllm_greedy(folder, prompts, N, quantization=kind)
    qu.assert_greedy_up_to_ties(rtn_hf(hf, kind), prompts, ours, tol=0.01, max_flips=1 / 24)
    state = dict(nnx.to_flat_state(llm.llm_engine.runner.state))
    leaf = state[("layers", 0, "mlp", "gate_up_proj", "weight")].get_value()
    assert str(leaf.dtype) == ("float8_e4m3fn" if kind == "fp8" else "int8")
    a = llm.llm_engine.runner.arch
    assert leaf.shape == (2, a.intermediate_size, a.hidden_size)        # [N..., K]


def test_online_weights_are_per_channel_rtn(tiny_model):
    folder, hf = tiny_model("llama")
    loaded = load_model(folder, "float32", quantization="int8")
    state = dict(nnx.to_flat_state(loaded.state))
    q = np.asarray(state[("layers", 1, "mlp", "down_proj", "weight")].get_value())
    s = np.asarray(state[("layers", 1, "mlp", "down_proj", "weight_scale")].get_value())
    w = hf.model.layers[1].mlp.down_proj.weight.detach().numpy()      # [E, F]
    w = w @ block_rotation(w.shape[1])        # online int8 rotates K first
    np.testing.assert_allclose(s, np.abs(w).max(axis=1) / 127, rtol=1e-6)
    np.testing.assert_array_equal(q, np.clip(np.round(w / s[:, None]), -128, 127))
    assert np.abs(q).max() == 127
    adj = np.asarray(state[("layers", 1, "mlp", "down_proj", "azp_adj")].get_value())
    np.testing.assert_array_equal(adj, q.astype(np.int64).sum(axis=1))


@pytest.mark.parametrize("arch", ["llama", "llama_tied"])
@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_embeddings_and_lm_head_stay_float(tiny_model, arch, kind):
    folder, _ = tiny_model(arch)
    plain = dict(nnx.to_flat_state(load_model(folder, "float32").state))
    loaded = load_model(folder, "float32", quantization=kind)
    state = dict(nnx.to_flat_state(loaded.state))
    names = [("embed_tokens",)] + ([] if arch == "llama_tied" else [("lm_head",)])
    assert (("lm_head",) in state) == (arch == "llama")
    for name in names:
        got = np.asarray(state[name].get_value())
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, np.asarray(plain[name].get_value()))
    assert {p.split(".")[0] for p, _ in loaded.quant.schemes} == {"layers"}


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_prompt_logprobs_differ_from_float_by_the_quantization_error(tiny_model, kind):
    """Teacher-forced logprobs of a prompt: the quantized model's equal the RTN
    oracle's to float rounding, and differ from the float model's by much more (the
    quantization error the oracle also has)."""
    folder, hf = tiny_model("llama")
    ids = qu.prompts(qu.shared().TINY_VOCAB, lens=(40,))[0]
    ours = _prompt_logprobs(folder, ids, quantization=kind)
    oracle, exact = _hf_logprobs(rtn_hf(hf, kind), ids), _hf_logprobs(hf, ids)
    err = np.abs(ours - exact).mean()
    assert np.abs(ours - oracle).mean() < err / 20, (np.abs(ours - oracle).mean(), err)
    assert 1e-3 < err < 0.5


def _prompt_logprobs(folder, ids, **kwargs):
    from jaxllm import LLM, SamplingParams
    llm = LLM(folder, dtype="float32", max_model_len=128, max_num_batched_tokens=64,
              enforce_eager=True, cpu_kv_cache_bytes=8 << 20, **kwargs)
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(
        max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    return np.array([out.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i])


def _hf_logprobs(model, ids):
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()


def test_auto_detected_and_confirmed(tmp_path):
    folder = str(tmp_path / "ct")
    qu.write_compressed_tensors(folder, qu.make_model(folder, "llama"), "FP8_DYNAMIC")
    auto = load_model(folder, "float32")
    named = load_model(folder, "float32", quantization="compressed-tensors")
    assert auto.quant == named.quant and auto.quant.method == "compressed-tensors"
    # per layer: qkv_proj (q and k/v fused, one scheme), o_proj, gate_up_proj, down_proj
    assert not auto.quant.online and len(auto.quant.schemes) == 2 * 4


def test_ptpc_fp8_is_the_online_fp8_scheme(tiny_model):
    """vLLM's ptpc_fp8 (per-token activation, per-channel weight scales, dynamic) is
    what jaxllm's online fp8 runs: the same QuantConfig and the same weights."""
    folder, _ = tiny_model("llama")
    ptpc, fp8 = (load_model(folder, "float32", quantization=q) for q in ("ptpc_fp8", "fp8"))
    assert ptpc.quant == fp8.quant and ptpc.quant.method == "fp8" and ptpc.quant.online
    a, b = (dict(nnx.to_flat_state(m.state)) for m in (ptpc, fp8))
    key = ("layers", 0, "mlp", "gate_up_proj", "weight")
    np.testing.assert_array_equal(np.asarray(a[key].get_value()).astype(np.float32),
                                  np.asarray(b[key].get_value()).astype(np.float32))


def test_float_model_stays_float(tiny_model):
    folder, _ = tiny_model("llama")
    loaded = load_model(folder, "float32")
    assert loaded.quant is None
    assert {str(x.dtype) for x in jax_leaves(loaded.state)} == {"float32"}


def jax_leaves(state):
    import jax
    return jax.tree.leaves(state)


def test_each_step_size_takes_its_options_jit(tiny_model, monkeypatch):
    """The runner picks the step's jit by its padded token count (its XLA options
    depend on it, step_compiler_options): with options forced to differ between
    steps of up to 16 tokens and larger ones, launches ask by padded tokens (a
    decode-only step's are its sequence bucket), the two sides get two jits, and
    every warm-up program holds the jit its launches call."""
    from jaxllm.runner import step_fn
    monkeypatch.setattr(step_fn, "step_compiler_options", lambda leaves, t: (
        {"xla_gpu_dot_merger_threshold_mb": 0} if t <= 16 else None))
    seen, call = [], step_fn.StepJits.__call__

    def spy(self, tokens, prompt=False):
        seen.append(tokens)
        return call(self, tokens, prompt)
    monkeypatch.setattr(step_fn.StepJits, "__call__", spy)
    folder, _ = tiny_model("llama")
    _, llm = qu.jaxllm_greedy(folder, qu.prompts(qu.shared().TINY_VOCAB), 4,
                              quantization="fp8")
    runner = llm.llm_engine.runner
    # the 62-token prefill of 3 sequences pads to 64 tokens, their decode steps to 4
    assert set(seen) == {64, 4} and runner.plan.seq_buckets == (4,)
    assert runner._step_jit(4) is runner._step_jit(16)
    assert runner._step_jit(16) is not runner._step_jit(32)
    for t, s, decode_only in runner.plan.all_shapes():
        assert runner._step_program(t, s, decode_only).jitted is runner._step_jit(t)
