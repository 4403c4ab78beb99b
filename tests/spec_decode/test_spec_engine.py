"""Speculative decoding end to end on a tiny random Llama (float32, CPU): greedy
output token-identical to speculation off for n-gram, a draft model and a noisy
oracle proposer, with chunked prefill, prefix caching (on and off), n > 1, stop
strings and preemption in the mix; the scheduler's slot accounting. (Seeded
sampling draws a row's randomness from (seed, output index) alone, so it mostly
agrees with speculation off too, but not exactly: a verify step's shape differs
from plain decoding's and float sums with it; test_rejection_distribution.py checks
the sampled distribution instead.)"""
from __future__ import annotations

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams

ENGINE = dict(dtype="float32", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64,
              cpu_kv_cache_bytes=4 << 20, enforce_eager=True)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def prompts(vocab: int, n: int = 8, seed: int = 5) -> list[list[int]]:
    """Half random, half a phrase repeated (prompt lookup finds matches there)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        if i % 2:
            phrase = rng.integers(0, vocab, 6).tolist()
            out.append(phrase * 4 + phrase[:3])
        else:
            out.append(rng.integers(0, vocab, int(rng.integers(2, 50))).tolist())
    return out


def generate(llm, ps, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]


class NoisyOracle:
    """Drafts the reference's own continuation, with one token wrong every third
    call: full acceptance, partial acceptance and rejection all occur."""
    num_lookahead_tokens = 0

    def __init__(self, truth: dict):
        self.truth, self.calls = truth, 0

    def propose(self, requests, max_drafts, block_tables):
        out = []
        for r, k in zip(requests, max_drafts):
            self.calls += 1
            full = self.truth.get(tuple(r.prompt_token_ids), [])
            d = list(full[r.num_tokens:r.num_tokens + k])
            if self.calls % 3 == 0 and d:
                j = self.calls % len(d)
                d[j] = (d[j] + 1) % 300
            out.append(d)
        return out

    def finish(self, request_ids):
        pass


@pytest.fixture(scope="module")
def target(tiny_model):
    return tiny_model("llama")[0]


VARIANTS = {
    "plain": {},
    "chunked": dict(max_num_batched_tokens=16),
    "preempt": dict(num_gpu_blocks_override=14),
    "no-prefix-cache": dict(enable_prefix_caching=False),
}


@pytest.fixture(scope="module")
def references(target):
    """Speculation off, per variant: greedy outputs, and n=2 greedy samples with a
    stop string."""
    refs = {}
    for name, extra in VARIANTS.items():
        llm = LLM(target, **{**ENGINE, **extra})
        ps = prompts(llm.llm_engine.arch.vocab_size)
        refs[name] = (ps, generate(llm, ps), generate(llm, ps, sampled_params(llm, ps)))
    return refs


def sampled_params(llm, ps):
    """n=2 greedy samples (siblings share the prompt's blocks), stopped by a piece of
    text from the middle of a greedy output."""
    text = llm.generate([{"prompt_token_ids": ps[1]}], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3] or "zzz"
    return SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])


# Prefix caching off changes the KV manager, not how drafts are verified: checked with
# n-gram only (CI time).
@pytest.mark.parametrize("method, variant", [
    (m, v) for m in ("ngram", "oracle", "draft_model") for v in VARIANTS
    if v != "no-prefix-cache" or m == "ngram"])
def test_output_identical_to_speculation_off(target, references, method, variant):
    ps, greedy_ref, sampled_ref = references[variant]
    assert any(c[2] == "stop" for o in sampled_ref for c in o)     # a stop string ends some
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    if method == "draft_model":
        spec = {"model": target, "num_speculative_tokens": 3}   # the target drafts itself
    llm = LLM(target, **{**ENGINE, **VARIANTS[variant]}, speculative_config=spec)
    core = llm.llm_engine.engine_core
    if method == "oracle":
        truth = {tuple(p): p + g[0][0] for p, g in zip(ps, greedy_ref)}
        llm.llm_engine.executor.proposer = NoisyOracle(truth)
    assert generate(llm, ps) == greedy_ref
    stats = core.spec_stats
    assert stats.num_draft_tokens > 0      # (random weights rarely repeat a prompt's n-gram)
    if method != "ngram":
        # Drafts that are (nearly always) right: most of them accepted.
        assert stats.num_accepted_tokens > 0.5 * stats.num_draft_tokens
    assert generate(llm, ps, sampled_params(llm, ps)) == sampled_ref


def test_rejected_drafts_give_their_slots_back(target):
    llm = LLM(target, **ENGINE, speculative_config={"method": "ngram",
                                                    "num_speculative_tokens": 4})
    p = [5, 6, 7, 8] * 6
    truth = {tuple(p): p + generate(LLM(target, **ENGINE), [p])[0][0][0]}
    oracle = NoisyOracle(truth)
    oracle.propose = lambda reqs, ks, tables: [
        [(t + 1) % 300 for t in truth[tuple(r.prompt_token_ids)][r.num_tokens:r.num_tokens + k]]
        for r, k in zip(reqs, ks)]   # all wrong
    llm.llm_engine.executor.proposer = oracle
    eng = llm.llm_engine
    eng.add_request("r", {"prompt_token_ids": p}, GREEDY)
    seen = []
    while eng.has_unfinished_requests():
        eng.step()
        req = eng.scheduler.requests.get("r")
        if req is not None:
            seen.append((req.num_computed_tokens, req.num_tokens, req.num_output_placeholders))
    # KV covers exactly the known tokens but the newest (and one in flight, if any):
    # no rejected draft is counted as computed.
    assert seen and all(c == n - 1 + pending for c, n, pending in seen)
    stats = eng.engine_core.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == 0


def test_no_compilation_after_warm_up(target, references):
    """Verify steps are decode steps of the warm-up's buckets (up to max_num_seqs x
    (k + 1) rows), so speculating compiles nothing after warm-up."""
    import jax
    ps, greedy_ref, _ = references["plain"]
    llm = LLM(target, **{**ENGINE, "enforce_eager": False},
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    llm.llm_engine.executor.proposer = NoisyOracle(
        {tuple(p): p + g[0][0] for p, g in zip(ps, greedy_ref)})
    compiles = []
    listener = lambda name, *a, **k: (  # noqa: E731
        compiles.append(name) if "backend_compile" in name else None)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        mixed = [GREEDY, SamplingParams(temperature=0.7, top_k=5, seed=1, max_tokens=9),
                 SamplingParams(temperature=1.0, max_tokens=7, logprobs=2)] * 3
        assert generate(llm, ps) == greedy_ref
        llm.generate([{"prompt_token_ids": p} for p in ps], mixed[:len(ps)], use_tqdm=False)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []
    assert llm.llm_engine.engine_core.spec_stats.num_accepted_tokens > 0
