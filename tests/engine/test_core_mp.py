"""The engine core in a process of its own (JAXLLM_ENABLE_MULTIPROCESSING=1,
engine/core_mp.py) against the same engine in this process, on the tiny random Llama
(float32, CPU): the outputs must be the same, field by field, for greedy and seeded
sampling with n > 1 and logprobs, stop strings (found in this process, the engine told
after), JSON-schema constraints (grammars in the engine process), and errors."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.sampling_params import StructuredOutputsParams

ENGINE = dict(dtype="float32", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64,
              enforce_eager=True)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"},
                                           "b": {"enum": ["x", "yy", "zzz"]}},
          "required": ["a", "b"], "additionalProperties": False}


def _mp_llm(folder, **extra):
    os.environ["JAXLLM_ENABLE_MULTIPROCESSING"] = "1"
    try:
        return LLM(folder, **ENGINE, **extra)
    finally:
        del os.environ["JAXLLM_ENABLE_MULTIPROCESSING"]


@pytest.fixture(scope="module")
def engines(tiny_model):
    folder, hf = tiny_model("llama")
    local, remote = LLM(folder, **ENGINE), _mp_llm(folder)
    yield hf.config.vocab_size, local, remote
    remote.llm_engine.shutdown()


def prompts(vocab: int, n: int = 10, seed: int = 3):
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(0, vocab, k).tolist()}
            for k in rng.integers(1, 60, n)]


def fields(outs):
    """Every field a user reads, logprobs rounded (two processes' f32 sums)."""
    def lp(entries):
        if entries is None:
            return None
        return [{t: (round(e.logprob, 4), e.rank, e.decoded_token) for t, e in d.items()}
                if d is not None else None for d in entries]
    return [(o.request_id != "", o.prompt_token_ids, o.num_cached_tokens, o.finished,
             lp(o.prompt_logprobs),
             [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason,
               None if c.cumulative_logprob is None else round(c.cumulative_logprob, 3),
               lp(c.logprobs)) for c in o.outputs]) for o in outs]


def both(engines, ps, params):
    _, local, remote = engines
    a = local.generate(ps, params, use_tqdm=False)
    b = remote.generate(ps, params, use_tqdm=False)
    return a, b


def test_engine_runs_in_another_process(engines):
    _, _, remote = engines
    engine = remote.llm_engine
    assert engine.engine_core.process.is_alive() and engine.engine_core.process.pid != os.getpid()
    with pytest.raises(RuntimeError, match="process of its own"):
        engine.scheduler
    # The engine core's own parts, reached in its process.
    assert engine.engine_core.call_utility(_num_blocks) == engine.get_stats().num_total_blocks + 1


def _num_blocks(core):
    return core.executor.num_gpu_blocks


def test_greedy_same_as_in_process(engines):
    vocab, _, remote = engines
    ps = prompts(vocab)
    a, b = both(engines, ps, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert fields(a) == fields(b)
    assert all(len(o.outputs[0].token_ids) == 12 for o in b)
    stats = remote.llm_engine.get_stats()
    assert stats.generation_tokens_total >= 12 * len(ps) and stats.num_running == 0


def test_seeded_sampling_n2_logprobs_same(engines):
    vocab = engines[0]
    params = SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=10, logprobs=2,
                            prompt_logprobs=1, ignore_eos=True)
    a, b = both(engines, prompts(vocab, n=6, seed=5), params)
    assert fields(a) == fields(b)
    assert all(len(o.outputs) == 2 and o.outputs[0].logprobs for o in b)


def test_stop_string_same_as_in_process(engines):
    """A stop string cut out of a greedy output: the remote engine's request is
    finished in this process at the same token, its later tokens dropped."""
    vocab = engines[0]
    ps = prompts(vocab, n=6, seed=11)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    first = both(engines, ps, greedy)       # the same prefix cache state in both
    assert fields(first[0]) == fields(first[1])
    text = max((o.outputs[0].text for o in first[0]), key=len)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    a, b = both(engines, ps, params)
    assert fields(a) == fields(b)
    assert any(o.outputs[0].finish_reason == "stop" and o.outputs[0].stop_reason == stop
               for o in b)


def test_json_schema_same_as_in_process(engines):
    vocab = engines[0]
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=48,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    a, b = both(engines, prompts(vocab, n=6, seed=2), params)
    assert fields(a) == fields(b)
    for o in b:
        if o.outputs[0].finish_reason == "stop":
            assert set(json.loads(o.outputs[0].text)) == {"a", "b"}


def test_bad_requests_fail_here_and_lose_nothing(engines):
    vocab, _, remote = engines
    with pytest.raises(ValueError, match="out of vocabulary"):
        remote.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [vocab + 5]}],
                        SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError):
        remote.generate([{"prompt_token_ids": [1, 2]}], SamplingParams(
            max_tokens=4, structured_outputs=StructuredOutputsParams(regex="(")),
            use_tqdm=False)
    out = remote.generate([{"prompt_token_ids": [1, 2, 3]}],
                          SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                          use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert remote.llm_engine.get_stats().num_running == 0


def test_engine_start_failure_is_raised_here(tiny_model):
    folder, _ = tiny_model("llama")
    with pytest.raises(Exception, match="max_num_batched_tokens"):
        _mp_llm(folder, max_num_batched_tokens=1 << 40)


def test_setting_must_be_0_or_1(tiny_model, monkeypatch):
    monkeypatch.setenv("JAXLLM_ENABLE_MULTIPROCESSING", "yes")
    with pytest.raises(ValueError, match="JAXLLM_ENABLE_MULTIPROCESSING"):
        LLM(tiny_model("llama")[0], **ENGINE)


class Oracle:
    """Drafts each request's own greedy continuation: every draft accepted, so a step
    gives a request several tokens (picklable: it is set in the engine process too)."""
    num_lookahead_tokens = 0

    def __init__(self, truth: dict):
        self.truth = truth

    def propose(self, requests, max_drafts, block_tables):
        return [list(self.truth.get(tuple(r.prompt_token_ids), [])[r.num_tokens:r.num_tokens + k])
                for r, k in zip(requests, max_drafts)]

    def finish(self, request_ids):
        pass


def _set_proposer(core, proposer):
    core.executor.proposer = proposer


def _accepted_tokens(core):
    return core.spec_stats.num_accepted_tokens


@pytest.fixture(scope="module")
def spec_remote(tiny_model):
    folder, _ = tiny_model("llama")
    remote = _mp_llm(folder, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    yield remote
    remote.llm_engine.shutdown()


def text_fields(outs):
    return [[(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs]
            for o in outs]


def test_speculation_with_stop_strings_same_as_in_process(engines, spec_remote):
    """Several tokens of one request in one step's records, a stop string inside
    them: the same cut, text and finish reason as the in-process engine (greedy
    speculation is token-identical to none: tests/spec_decode/test_spec_engine.py)."""
    vocab, local = engines[0], engines[1]
    ps = prompts(vocab, n=6, seed=9)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    reference = local.generate(ps, greedy, use_tqdm=False)
    truth = {tuple(p["prompt_token_ids"]): p["prompt_token_ids"] + o.outputs[0].token_ids
             for p, o in zip(ps, reference)}
    spec_remote.llm_engine.engine_core.call_utility(_set_proposer, Oracle(truth))
    assert text_fields(spec_remote.generate(ps, greedy, use_tqdm=False)) == text_fields(reference)
    stops = sorted({o.outputs[0].text[7:9] for o in reference if len(o.outputs[0].text) > 9})
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=stops)
    b = spec_remote.generate(ps, params, use_tqdm=False)
    assert text_fields(b) == text_fields(local.generate(ps, params, use_tqdm=False))
    assert sum(o.outputs[0].finish_reason == "stop" for o in b) >= 3
    assert spec_remote.llm_engine.engine_core.call_utility(_accepted_tokens) > 20
