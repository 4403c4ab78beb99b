"""Whole-model parity with HF transformers (float32, CPU) on tiny random models."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxllm.layers.attention import AttentionMetadata, AttentionSpec
from jaxllm.models.loader import load_model

ARCHS = ["llama", "llama_tied", "mistral", "qwen2", "qwen3"]
BS = 16


def ragged_step(model, kv, steps, tables, spec):
    """Run one flat ragged batch. steps: list of (seq, token_ids, start). Returns
    logits for every token [T, V] and the new pool."""
    ids, pos, slots, lens, qsl = [], [], [], [], [0]
    width = max(len(t) for t in tables.values())
    bt = np.zeros((len(steps), width), np.int32)
    for row, (seq, toks, start) in enumerate(steps):
        table = np.asarray(tables[seq], np.int32)
        p = np.arange(start, start + len(toks))
        ids += list(toks)
        pos += list(p)
        slots += list(table[p // BS] * BS + p % BS)
        lens.append(start + len(toks))
        qsl.append(qsl[-1] + len(toks))
        bt[row, :len(table)] = table
    md = AttentionMetadata(jnp.array(slots, jnp.int32), jnp.array(bt), jnp.array(lens, jnp.int32),
                           jnp.array(qsl, jnp.int32))
    graphdef, state = nnx.split(model)
    logits, kv = _jitted_forward(graphdef, state, kv, jnp.array(ids, jnp.int32),
                                 jnp.array(pos, jnp.int32), md, spec)
    return np.asarray(logits), kv


def _forward(graphdef, state, kv, ids, pos, md, spec):
    model = nnx.merge(graphdef, state)
    hidden, kv = model(ids, pos, kv, md, spec)
    return model.compute_logits(hidden), kv


_jitted_forward = jax.jit(_forward, static_argnums=(0, 6))


def nan_pool(arch, num_blocks):
    shape = (arch.num_kv_heads, num_blocks, BS, arch.head_dim)
    return [(jnp.full(shape, jnp.nan), jnp.full(shape, jnp.nan)) for _ in range(arch.num_layers)]


@pytest.mark.parametrize("arch", ARCHS)
def test_ragged_logits_match_hf(tiny_model, arch):
    folder, hf = tiny_model(arch)
    loaded = load_model(folder, "float32")
    model = nnx.merge(loaded.graphdef, loaded.state)
    a = loaded.arch
    spec = AttentionSpec(sm_scale=a.head_dim ** -0.5, sliding_window=a.sliding_window)
    rng = np.random.default_rng(1)
    lens = [13, 37, 1, 50]
    seqs = [rng.integers(0, a.vocab_size, n) for n in lens]
    # Non-contiguous random blocks; unused pool slots are NaN and must not leak.
    perm = list(rng.permutation(np.arange(1, 24)))
    tables = {i: [int(perm.pop()) for _ in range(-(-(n + 1) // BS))] for i, n in enumerate(lens)}
    kv = nan_pool(a, 24)
    # Step 1: seq 0 whole, seq 1 first chunk (20), seq 3 first chunk (31).
    l1, kv = ragged_step(model, kv, [(0, seqs[0], 0), (1, seqs[1][:20], 0),
                                     (3, seqs[3][:31], 0)], tables, spec)
    # Step 2: seq 1 rest, seq 2 whole (1 token), seq 3 rest.
    l2, kv = ragged_step(model, kv, [(1, seqs[1][20:], 20), (2, seqs[2], 0),
                                     (3, seqs[3][31:], 31)], tables, spec)
    ours = {0: l1[:13], 1: np.concatenate([l1[13:33], l2[:17]]), 2: l2[17:18],
            3: np.concatenate([l1[33:64], l2[18:]])}
    for i, s in enumerate(seqs):
        with torch.no_grad():
            ref = hf(torch.tensor(s)[None]).logits[0].numpy()
        err = np.abs(ours[i] - ref).max() / np.abs(ref).max()
        assert np.isfinite(ours[i]).all()
        assert err < 1e-4, (arch, i, err)


@pytest.mark.parametrize("arch,backend", [(a, "reference") for a in ARCHS] +
                         [("llama", "pallas"), ("qwen3", "pallas")])
def test_greedy_continuation_matches_hf_generate(tiny_model, arch, backend):
    """`pallas` runs the Pallas kernels in interpret mode (CPU)."""
    from jaxllm import LLM
    folder, hf = tiny_model(arch)
    llm = LLM(folder, dtype="float32", max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=64, enforce_eager=True, cpu_kv_cache_bytes=8 << 20,
              attention_backend=backend)
    assert llm.llm_engine.runner.spec.backend == backend
    _assert_greedy_matches_hf(llm, hf, arch)


def test_decode_step_options_keep_greedy_parity(tiny_model, monkeypatch):
    """JAXLLM_DECODE_SPREAD=1 and JAXLLM_DECODE_KV_WRITE=1 (Pallas, interpret mode): the
    same greedy tokens as HF. Tables 32 blocks wide, so the spread plan is in use."""
    from jaxllm import LLM
    monkeypatch.setenv("JAXLLM_DECODE_SPREAD", "1")
    monkeypatch.setenv("JAXLLM_DECODE_KV_WRITE", "1")
    folder, hf = tiny_model("llama")
    llm = LLM(folder, dtype="float32", max_model_len=512, max_num_seqs=4,
              max_num_batched_tokens=64, enforce_eager=True, cpu_kv_cache_bytes=8 << 20,
              attention_backend="pallas")
    spec = llm.llm_engine.runner.spec
    assert spec.decode_spread and spec.decode_kv_write
    _assert_greedy_matches_hf(llm, hf, "llama")


def test_speculation_with_the_kv_write_default_keeps_greedy_parity(tiny_model, monkeypatch):
    """The decode kernel's KV write on (the default) under ngram speculation, Pallas in
    interpret mode: the same greedy tokens as HF. Verify steps (k + 1 one-token rows of
    a request) must write apart; interpret mode runs the programs in order and so
    cannot show a missing guard, which tests/runner/test_input_batch.py checks."""
    from jaxllm import LLM
    monkeypatch.delenv("JAXLLM_DECODE_KV_WRITE", raising=False)
    folder, hf = tiny_model("llama")
    llm = LLM(folder, dtype="float32", max_model_len=512, max_num_seqs=4,
              max_num_batched_tokens=64, enforce_eager=True, cpu_kv_cache_bytes=8 << 20,
              attention_backend="pallas", speculative_config={
                  "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    assert llm.llm_engine.runner.spec.folds_kv_write
    _assert_greedy_matches_hf(llm, hf, "llama")
    assert llm.llm_engine.engine_core.spec_stats.num_draft_tokens > 0


def _assert_greedy_matches_hf(llm, hf, arch):
    from jaxllm import SamplingParams
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, hf.config.vocab_size, n).tolist() for n in (5, 17, 40)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                        use_tqdm=False)
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]),
                              attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=32, min_new_tokens=32,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(p):].tolist(), arch

