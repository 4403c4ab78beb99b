"""Speculative decoding on the default model (SmolLM2-135M-Instruct, real weights):
greedy output identical to speculation off for n-gram drafts on code-editing chats
(where they land) and for random EAGLE-1 and EAGLE-3 heads of the model's shape (no
real head can be downloaded here; their drafts are wrong, so every verify step
rejects, and the output must still be plain greedy decoding's). The draft-model
method on this model: scripts/spec_acceptance.py (a draft of its first 4 or 8
layers, outputs identical to speculation off)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxllm import LLM, SamplingParams

ENGINE = dict(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=256, enforce_eager=True)
CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    return subtotal * (1 + tax_rate)
'''
MESSAGES = [
    [{"role": "user", "content": f"Rename `subtotal` to `net` in this function:\n{CODE}"}],
    [{"role": "user", "content": f"Add type hints to this function:\n{CODE}"}],
]
PARAMS = SamplingParams(temperature=0, max_tokens=48)
DRAFT_VOCAB = 1024     # EAGLE-3's own head vocabulary (head id i -> target id 2i + 7)


def tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.chat(MESSAGES, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain():
    llm = LLM(**ENGINE)
    return llm.llm_engine.arch, tokens(llm)


def write_head(folder, arch, method: str) -> str:
    """A random EAGLE head of the target's shape (formats: jaxllm/models/eagle.py)."""
    rng = np.random.default_rng(0)
    w = lambda *shape: rng.normal(0, 0.05, shape).astype(np.float32)  # noqa: E731
    h, f, q, kv = arch.hidden_size, arch.intermediate_size, arch.q_size, arch.kv_size
    pre, q_in = ("midlayer.", 2 * h) if method == "eagle3" else ("layers.0.", h)
    t = {pre + "self_attn.q_proj.weight": w(q, q_in), pre + "self_attn.k_proj.weight": w(kv, q_in),
         pre + "self_attn.v_proj.weight": w(kv, q_in), pre + "self_attn.o_proj.weight": w(h, q),
         pre + "mlp.gate_proj.weight": w(f, h), pre + "mlp.up_proj.weight": w(f, h),
         pre + "mlp.down_proj.weight": w(h, f), pre + "post_attention_layernorm.weight": 1 + w(h)}
    cfg = dict(architectures=["LlamaForCausalLMEagle3" if method == "eagle3" else
                              "LlamaForCausalLM"], model_type="llama", hidden_size=h,
               intermediate_size=f, num_attention_heads=arch.num_heads,
               num_key_value_heads=arch.num_kv_heads, head_dim=arch.head_dim,
               num_hidden_layers=1, vocab_size=arch.vocab_size, rms_norm_eps=arch.rms_norm_eps,
               rope_theta=arch.rope_theta, max_position_embeddings=arch.max_position_embeddings,
               torch_dtype="float32")
    if method == "eagle3":
        t.update({"fc.weight": w(h, 3 * h), pre + "input_layernorm.weight": 1 + w(h),
                  pre + "hidden_norm.weight": 1 + w(h), "norm.weight": 1 + w(h),
                  "lm_head.weight": w(DRAFT_VOCAB, h),
                  "d2t": (np.arange(DRAFT_VOCAB) + 7).astype(np.int64)})
        cfg.update(draft_vocab_size=DRAFT_VOCAB, target_hidden_size=h)
    else:
        t.update({"fc.weight": w(h, 2 * h), "fc.bias": w(h)})
        cfg["bias"] = True
    save_file(t, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


def test_ngram_greedy_identical_on_the_default_model(plain):
    llm = LLM(**ENGINE, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                            "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    assert tokens(llm) == plain[1]
    stats = llm.llm_engine.engine_core.spec_stats
    assert stats.num_accepted_tokens > 0       # the code in the prompt is drafted from


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_random_eagle_head_greedy_identical_on_the_default_model(plain, tmp_path, method):
    arch, want = plain
    head = write_head(tmp_path, arch, method)
    llm = LLM(**ENGINE, speculative_config={"method": method, "model": head,
                                            "num_speculative_tokens": 3})
    assert tokens(llm) == want
    assert llm.llm_engine.engine_core.spec_stats.num_draft_tokens > 0
