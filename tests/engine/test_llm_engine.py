"""The engine end to end on tiny random models (float32, CPU): continuous batching,
chunked prefill, prefix caching, preemption, fp8 KV, seeded sampling, compile counts."""
from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

from jaxllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ENGINE = dict(dtype="float32", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64,
              cpu_kv_cache_bytes=4 << 20)


def make_prompts(vocab: int, n: int = 32, seed: int = 3, prefix: list[int] | None = None):
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 60, n)
    return [(prefix or []) + rng.integers(0, vocab, k).tolist() for k in lens]


def run(llm, prompts, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def llama(tiny_model):
    folder, hf = tiny_model("llama")
    return folder, hf, LLM(folder, enforce_eager=True, **ENGINE)


@pytest.fixture(scope="module")
def reference(llama):
    """Each prompt generated alone (batch of one), and HF greedy."""
    folder, hf, llm = llama
    prompts = make_prompts(hf.config.vocab_size)
    alone = [run(llm, [p])[0] for p in prompts]
    with torch.no_grad():
        hf_out = [hf.generate(torch.tensor([p]),
                              attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=12, min_new_tokens=12,
                              do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(p):].tolist()
                  for p in prompts]
    return prompts, alone, hf_out


def test_continuous_batching_matches_alone_and_hf(llama, reference):
    _, _, llm = llama
    prompts, alone, hf_out = reference
    assert alone == hf_out
    assert run(llm, prompts) == alone


@pytest.mark.parametrize("engine_args", [
    dict(max_num_batched_tokens=16, enable_chunked_prefill=True),          # chunked prefill
    dict(num_gpu_blocks_override=12, preemption_mode="recompute"),         # forced preemption
    dict(num_gpu_blocks_override=12, preemption_mode="swap", swap_space=0.01),
], ids=["chunked", "preempt-recompute", "preempt-swap"])
def test_batching_variants_match_alone(llama, reference, engine_args):
    folder, _, _ = llama
    prompts, alone, _ = reference
    llm = LLM(folder, enforce_eager=True, **{**ENGINE, **engine_args})
    assert run(llm, prompts) == alone
    stats = llm.llm_engine.get_stats()
    if "num_gpu_blocks_override" in engine_args:
        assert stats.num_preemptions_total > 0
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0


def test_prefix_caching_shared_system_prompt(llama):
    folder, hf, _ = llama
    system = np.random.default_rng(9).integers(0, hf.config.vocab_size, 40).tolist()
    prompts = make_prompts(hf.config.vocab_size, n=12, prefix=system)
    plain = LLM(folder, enforce_eager=True, **ENGINE)
    cached = LLM(folder, enforce_eager=True, enable_prefix_caching=True, **ENGINE)
    want = [run(plain, [p])[0] for p in prompts]
    assert run(cached, prompts) == want
    stats = cached.llm_engine.get_stats()
    assert stats.prefix_cache_hits >= 32 * 11     # two full blocks of the system prompt
    assert stats.num_free_blocks == stats.num_total_blocks


def check_logprobs_close(a, b, top_n: int):
    """vLLM's rule: tokens equal until they diverge; at the divergence each side's
    token is among the other's top-N logprobs; after it, stop comparing."""
    for (ta, la), (tb, lb) in zip(a, b):
        for i, (x, y) in enumerate(zip(ta, tb)):
            if x != y:
                assert x in lb[i] and y in la[i], (i, x, y)
                break


@pytest.mark.parametrize("kv_dtype, stored", [("fp8", "float8_e4m3fn"),
                                              ("fp8_e5m2", "float8_e5m2")])
def test_fp8_kv_cache_logprobs_close(llama, kv_dtype, stored):
    folder, hf, llm = llama
    prompts = make_prompts(hf.config.vocab_size, n=8)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    fp8 = LLM(folder, enforce_eager=True, kv_cache_dtype=kv_dtype, **ENGINE)
    assert str(fp8.llm_engine.runner.kv_caches[0][0].dtype) == stored

    def collect(engine):
        outs = engine.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    base, low = collect(llm), collect(fp8)
    check_logprobs_close(base, low, top_n=5)
    # fp8 must not be a no-op: at least one logprob moved.
    moved = max(abs(b[1][0][b[0][0]].logprob - c[1][0][c[0][0]].logprob)
                for b, c in zip(base, low) if b[0][0] == c[0][0])
    assert moved > 0


def test_seeded_sampling_reproducible_whatever_the_batch(llama):
    _, hf, llm = llama
    prompts = make_prompts(hf.config.vocab_size, n=6, seed=11)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    other = SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True)
    alone = run(llm, [prompts[0]], seeded)[0]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [other, other, seeded, other, other, other], use_tqdm=False)
    mixed = [{"prompt_token_ids": prompts[0]}] + [{"prompt_token_ids": p} for p in prompts[1:]]
    outs2 = llm.generate(mixed[::-1], [other] * 5 + [seeded], use_tqdm=False)
    assert outs2[-1].outputs[0].token_ids == alone
    assert run(llm, [prompts[2]], seeded)[0] == outs[2].outputs[0].token_ids
    # And a different seed gives a different sample.
    assert run(llm, [prompts[0]], SamplingParams(temperature=1.0, top_p=0.9, seed=99,
                                                max_tokens=10, ignore_eos=True))[0] != alone


def test_n_samples_stop_strings_and_abort(llama):
    _, hf, llm = llama
    tok = llm.get_tokenizer()
    out = llm.generate("the quick brown fox", SamplingParams(n=3, temperature=1.0, seed=5,
                                                              max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    base = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=12,
                                                      ignore_eos=True), use_tqdm=False)[0]
    text = base.outputs[0].text
    stop = text[3:6]
    if stop.strip():
        cut = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=12,
                                                         ignore_eos=True, stop=[stop]),
                           use_tqdm=False)[0].outputs[0]
        assert cut.text == text[:text.index(stop)]
        assert cut.finish_reason == "stop" and cut.stop_reason == stop
    engine = llm.llm_engine
    engine.add_request("x", "the lazy dog", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort_request("x")
    assert not engine.has_unfinished_requests()
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    del tok


def test_async_scheduling_matches_sync(llama):
    """Step N+1 launched before step N is read back (tokens fed on the device) gives
    the same tokens and logprobs as one step at a time, across sampling features; a
    penalty request is read back before the next schedule."""
    folder, hf, llm = llama
    sync = LLM(folder, enforce_eager=True, async_scheduling=False, **ENGINE)
    prompts = [{"prompt_token_ids": p} for p in make_prompts(hf.config.vocab_size, n=12, seed=7)]
    kinds = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
             SamplingParams(temperature=0.9, top_p=0.8, seed=3, max_tokens=11, logprobs=2),
             SamplingParams(temperature=0.7, seed=4, max_tokens=7, presence_penalty=1.5,
                            repetition_penalty=1.3, ignore_eos=True),
             SamplingParams(n=2, temperature=1.0, seed=8, max_tokens=6, min_tokens=3)]
    params = [kinds[i % len(kinds)] for i in range(len(prompts))]

    def outs(engine):
        got = engine.generate(prompts, params, use_tqdm=False)
        return [[(c.token_ids, c.finish_reason, c.logprobs) for c in o.outputs] for o in got]
    assert outs(llm) == outs(sync)
    engine = llm.llm_engine
    assert engine.async_scheduling and not sync.llm_engine.async_scheduling
    engine.add_request("ahead", prompts[0], SamplingParams(temperature=0, max_tokens=3))
    assert engine.step() == [] and engine.engine_core._in_flight is not None   # launched, not read
    assert len(engine.step()[0].outputs[0].token_ids) == 1
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_prompt_too_long_is_rejected_with_vllm_wording(llama):
    _, _, llm = llama
    with pytest.raises(ValueError, match="maximum context length is 128 tokens. However, "
                                         "you requested 140 tokens"):
        llm.generate({"prompt_token_ids": [1] * 130}, SamplingParams(max_tokens=10))
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("engine_args", [
    dict(), dict(max_num_batched_tokens=16, enable_prefix_caching=True)],
    ids=["whole", "chunked-with-prefix-cache"])
def test_prompt_logprobs_match_hf(llama, engine_args):
    folder, hf, _ = llama
    llm = LLM(folder, enforce_eager=True, **{**ENGINE, **engine_args})
    prompt = np.random.default_rng(4).integers(0, hf.config.vocab_size, 40).tolist()
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)   # fills any cache
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].double(), -1).numpy()
    got = out.prompt_logprobs
    assert len(got) == len(prompt) and got[0] is None
    for pos in range(1, len(prompt)):
        entry, row = got[pos], ref[pos - 1]
        assert abs(entry[prompt[pos]].logprob - row[prompt[pos]]) < 1e-4
        assert entry[prompt[pos]].rank == int((row >= row[prompt[pos]]).sum())
        top = np.argsort(-row)[:3]
        assert set(top.tolist()) <= set(entry)


def test_kv_cache_too_small_fails_at_start_with_numbers(tiny_model):
    from jaxllm.config import ConfigError
    folder, _ = tiny_model("llama")
    with pytest.raises(ConfigError, match=r"cannot hold one sequence of max_model_len=512 .*"
                                          r"blocks available \d+.*raise cpu_kv_cache_bytes"):
        LLM(folder, dtype="float32", max_model_len=512, cpu_kv_cache_bytes=64 << 10,
            enforce_eager=True)


def test_no_compilation_after_warm_up(tiny_model):
    folder, hf = tiny_model("qwen3")
    llm = LLM(folder, **ENGINE)                       # warm-up compiles every bucket
    compiles = []
    listener = lambda name, *a, **k: (  # noqa: E731
        compiles.append(name) if "backend_compile" in name else None)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        prompts = make_prompts(hf.config.vocab_size, n=20, seed=5)
        params = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
                  SamplingParams(temperature=0.7, top_k=5, seed=1, max_tokens=5),
                  SamplingParams(temperature=1.0, max_tokens=7, logprobs=3)] * 7
        inputs = [{"prompt_token_ids": p} for p in prompts]
        first = llm.generate(inputs, params[:20], use_tqdm=False)
        # The GPU warm-up's run of every program once (padding inputs): each program
        # runs, and what the engine generates after it is unchanged.
        runner, ran = llm.llm_engine.runner, []
        programs = dict(runner.compilation.programs)
        runner.compilation.programs = {k: (lambda *a, _k=k, _p=p: ran.append(_k) or _p(*a))
                            for k, p in programs.items()}
        runner.run_programs_once()
        runner.compilation.programs = programs
        again = llm.generate(inputs, params[:20], use_tqdm=False)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []
    assert sorted(map(str, ran)) == sorted(map(str, programs)) and len(programs) >= 10
    greedy = range(0, 20, 3)
    assert [again[i].outputs[0].token_ids for i in greedy] == \
        [first[i].outputs[0].token_ids for i in greedy]


def test_step_deltas_rebuild_the_outputs_of_step(llama):
    """step_deltas() through pickle and the server's OutputDecoder gives, step by
    step, the RequestOutputs that step() gives on a twin engine: n=2 with logprobs,
    prompt logprobs, a stop string, FINAL_ONLY; the prompt travels once."""
    import dataclasses
    import pickle
    from jaxllm.engine.output_wire import OutputDecoder
    from jaxllm.sampling_params import RequestOutputKind
    folder, _, llm = llama
    text = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=12,
                                                      ignore_eos=True), use_tqdm=False)
    stop = text[0].outputs[0].text[3:6]
    cases = [("hello world", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                            stop=[stop])),
             ([5, 17, 42, 99, 3], SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=10,
                                                 logprobs=2, prompt_logprobs=1)),
             ("the lazy dog", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                             output_kind=RequestOutputKind.FINAL_ONLY))]
    engines = [LLM(folder, enforce_eager=True, **ENGINE).llm_engine for _ in range(2)]
    for engine in engines:
        for i, (prompt, params) in enumerate(cases):
            engine.add_request(f"r{i}", prompt, params)
    plain, wired = engines
    decoder, sizes, steps, last = OutputDecoder(), {}, 0, {}
    while plain.has_unfinished_requests():
        want = plain.step()
        deltas = [pickle.loads(pickle.dumps(d)) for d in wired.step_deltas()]
        for d in deltas:
            sizes.setdefault(d[0], []).append(len(pickle.dumps(d)))
        got = [decoder.decode(d) for d in deltas]
        assert [dataclasses.replace(o, metrics=None) for o in got] == \
            [dataclasses.replace(o, metrics=None) for o in want]
        assert all(type(o.metrics) is type(w.metrics) for o, w in zip(got, want))
        last.update((o.request_id, o) for o in got)
        steps += 1
    assert not wired.has_unfinished_requests() and not decoder._state
    assert steps > 6 and len(sizes["r2"]) == 1           # FINAL_ONLY: one output
    assert sizes["r1"][1] < sizes["r1"][0]                # the prompt part went once
    assert all(o.finished for o in last.values()) and len(last["r1"].outputs) == 2
    if stop.strip():
        assert last["r0"].outputs[0].finish_reason == "stop"


def test_default_token_budget_follows_vllms_server_rule():
    from types import SimpleNamespace
    from jaxllm.executor.executor import default_token_budget

    def device(platform, kind, gib):
        return SimpleNamespace(platform=platform, device_kind=kind,
                               memory_stats=lambda: {"bytes_limit": int(gib * (1 << 30))})
    assert default_token_budget(device("gpu", "NVIDIA H200", 104.85)) == 8192
    assert default_token_budget(device("gpu", "NVIDIA H100 80GB HBM3", 59.7)) == 8192
    assert default_token_budget(device("gpu", "NVIDIA A100-SXM4-80GB", 59.7)) == 2048
    assert default_token_budget(device("gpu", "NVIDIA L4", 16.6)) == 2048
    assert default_token_budget(device("cpu", "cpu", 0)) == 2048


def test_stopping_token_text_is_not_output(llama):
    """vLLM's rule: a request ended by a stop token id (or EOS) has that token in its
    token_ids but not its text: the text is that of the tokens before it."""
    llm = llama[2]
    prompt = {"prompt_token_ids": make_prompts(llm.llm_engine.arch.vocab_size, n=1)[0]}

    def greedy(**kw):
        return llm.generate([prompt], SamplingParams(temperature=0, ignore_eos=True, **kw),
                            use_tqdm=False)[0].outputs[0]
    ids = list(greedy(max_tokens=24).token_ids)
    for skip in (True, False):
        texts = [greedy(max_tokens=n, skip_special_tokens=skip).text for n in range(1, 25)]
        # A token met for the first time that adds text of its own.
        k = next(i for i in range(1, 24) if ids[i] not in ids[:i] and texts[i] != texts[i - 1])
        out = greedy(max_tokens=24, stop_token_ids=[ids[k]], skip_special_tokens=skip)
        assert list(out.token_ids) == ids[:k + 1] and out.finish_reason == "stop"
        assert out.text == texts[k - 1]        # the k tokens before the stop token
