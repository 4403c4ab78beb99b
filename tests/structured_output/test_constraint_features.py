"""Structured outputs with the engine's other features: unconstrained rows beside
constrained ones, async vs sync scheduling, n > 1, stop strings, logprobs (the
constrained distribution's), max_tokens and max_model_len too small for the grammar,
streaming, abort, and the grammar cache."""
from __future__ import annotations

import math

import pytest
from constraint_cases import CASES, SCHEMA, grammar_regex, mixed_constrained, random_schemas
from structured_helpers import TINY_ENGINE, constrained, meets, replay, token_prompts

from jaxllm import LLM, SamplingParams
from jaxllm.sampling_params import RequestOutputKind


def test_unconstrained_rows_unchanged_tiny(tiny_llm):
    """Each unconstrained request (greedy, and seeded random) gives exactly the tokens it
    gives alone when it shares its steps with constrained requests (prompts up to 90
    tokens: some prefill in chunks beside constrained decodes)."""
    assert tiny_llm.llm_engine.async_scheduling
    plain_prompts = token_prompts(6, seed=1)
    plain = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
             SamplingParams(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True)] * 3
    alone = [tiny_llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids
             for p, sp in zip(plain_prompts, plain)]
    others = mixed_constrained(10, seed=5)
    prompts = plain_prompts + token_prompts(len(others), seed=2)
    outs = tiny_llm.generate(prompts, plain + others, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:len(plain)]] == alone
    for p, o in zip(others, outs[len(plain):]):
        if o.outputs[0].finish_reason == "stop":
            meets(p.structured_outputs, o.outputs[0].text, grammar_regex(p))


def test_unconstrained_rows_unchanged_default_model(default_llm):
    """The same batch twice, its neighbours free and then constrained (the same shapes,
    only the masks differ): the unconstrained rows do not change, and the first is
    what it is alone."""
    assert default_llm.llm_engine.async_scheduling
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    plain = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
             SamplingParams(temperature=1.0, seed=5, max_tokens=16, ignore_eos=True)]
    others = [constrained(seed=i, max_tokens=16, **c) for i, (_, c, _) in enumerate(CASES)]
    free = [SamplingParams(temperature=1.0, seed=i, max_tokens=16) for i in range(len(CASES))]
    neighbours = [p for p, _, _ in CASES]

    def run(params):
        outs = default_llm.generate(prompts + neighbours, plain + params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs[:len(plain)]], outs[len(plain):]
    beside_free, _ = run(free)
    beside_constrained, outs = run(others)
    assert beside_constrained == beside_free
    assert all(len(t) == 16 for t in beside_free)
    alone = default_llm.generate(prompts[0], plain[0], use_tqdm=False)[0].outputs[0]
    assert alone.token_ids == beside_constrained[0]
    for p, o in zip(others, outs):
        if o.outputs[0].finish_reason == "stop":
            meets(p.structured_outputs, o.outputs[0].text, grammar_regex(p))


def test_async_scheduling_matches_sync(tiny_llm, tiny_folder):
    """Async scheduling reads step N back (advancing the matchers) after launching
    step N+1's model: the masks must still follow every token, so a seeded constrained
    request gives the same tokens one step at a time."""
    sync = LLM(tiny_folder, async_scheduling=False, **TINY_ENGINE)
    assert not sync.llm_engine.async_scheduling
    params = mixed_constrained(16, seed=40)
    prompts = token_prompts(len(params), seed=3)

    def run(llm):
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason)
                for o in llm.generate(prompts, params, use_tqdm=False)]
    assert run(tiny_llm) == run(sync)


# -- n > 1, stop strings ----------------------------------------------------------------


def test_n_samples_each_follow_the_schema(default_llm, tiny_llm):
    params = constrained(n=3, seed=7, max_tokens=48, json=SCHEMA, disable_any_whitespace=True)
    out = default_llm.generate("A person as JSON: ", params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for c in out.outputs:
        assert c.finish_reason == "stop"
        meets(params.structured_outputs, c.text)
    assert len({c.text for c in out.outputs}) > 1
    # Unseeded samples of a random schema on the tiny model.
    params = constrained(n=8, seed=None, max_tokens=100, json=random_schemas(8, 1)[0],
                         disable_any_whitespace=True)
    tiny = tiny_llm.generate("the lazy dog", params, use_tqdm=False)[0]
    assert len(tiny.outputs) == 8 and len({c.text for c in tiny.outputs}) > 1
    finished = [c for c in tiny.outputs if c.finish_reason == "stop"]
    assert len(finished) >= 6
    for c in finished:
        meets(params.structured_outputs, c.text)


def test_stop_strings_with_a_constraint(tiny_llm):
    choice = dict(choice=["alpha beta", "gamma delta"])
    regex = dict(regex=r"[a-c]{3};[a-c]{3}")
    params = [constrained(seed=s, max_tokens=20, stop=[" "], **choice) for s in range(4)]
    params += [constrained(seed=s, max_tokens=20, stop=[" "], include_stop_str_in_output=True,
                           **choice) for s in range(4)]
    params += [constrained(seed=s, max_tokens=20, stop=[";"], **regex) for s in range(4)]
    outs = [o.outputs[0] for o in tiny_llm.generate(["x"] * len(params), params,
                                                    use_tqdm=False)]
    for out in outs:
        assert out.finish_reason == "stop"
    assert {o.text for o in outs[:4]} <= {"alpha", "gamma"}
    assert {o.stop_reason for o in outs[:4]} == {" "}
    assert {o.text for o in outs[4:8]} <= {"alpha ", "gamma "}
    for out in outs[8:]:
        assert len(out.text) == 3 and set(out.text) <= set("abc") and out.stop_reason == ";"


# -- logprobs ------------------------------------------------------------------------------


def test_logprobs_are_the_constrained_distributions(default_llm):
    """With a choice, at every position the top logprobs above -inf are exactly the
    tokens that continue towards a choice (EOS once a choice is complete), and they
    sum to 1: the reported logprobs are the constrained distribution's."""
    choices = ["yes", "no", "maybe", "maybe not"]
    eos = default_llm.llm_engine.eos_token_id
    params = [constrained(seed=s, max_tokens=8, logprobs=20, choice=choices)
              for s in range(6)]
    outs = default_llm.generate(["Will it rain tomorrow? Answer:"] * len(params), params,
                                use_tqdm=False)
    for o in outs:
        out = o.outputs[0]
        assert out.finish_reason == "stop" and out.text in choices
        assert len(out.logprobs) == len(out.token_ids)
        prefix = ""
        for token, entry in zip(out.token_ids, out.logprobs):
            sampled = entry[token]
            assert math.isfinite(sampled.logprob) and sampled.logprob <= 0
            finite = {t: lp for t, lp in entry.items() if math.isfinite(lp.logprob)}
            assert len(finite) < 20, "a choice allows few tokens: all are in the top 20"
            for t, lp in finite.items():
                if t == eos:
                    assert prefix in choices
                else:
                    assert any(c.startswith(prefix + lp.decoded_token) for c in choices), \
                        (prefix, lp.decoded_token)
            total = sum(math.exp(lp.logprob) for lp in finite.values())
            assert total == pytest.approx(1.0, abs=1e-3)
            assert sampled.rank <= len(finite)
            prefix += sampled.decoded_token if token != eos else ""
        assert prefix == out.text


def test_logprobs_with_a_regex(tiny_llm):
    params = [constrained(seed=s, max_tokens=8, logprobs=5, regex=r"[0-9]{3}")
              for s in range(6)]
    outs = tiny_llm.generate(["digits"] * len(params), params, use_tqdm=False)
    for o in outs:
        out = o.outputs[0]
        assert out.finish_reason == "stop" and len(out.text) == 3 and out.text.isdigit()
        for token, entry in zip(out.token_ids, out.logprobs):
            assert math.isfinite(entry[token].logprob)
            for lp in entry.values():
                if math.isfinite(lp.logprob):
                    assert lp.decoded_token.isascii() and lp.decoded_token.isdigit()
        assert out.cumulative_logprob == pytest.approx(
            sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)), rel=1e-5)


# -- a grammar longer than the budget ------------------------------------------------------


@pytest.mark.timeout(300)
def test_max_tokens_too_small_ends_with_length(tiny_llm):
    long_choice = "the quick brown fox jumps over a lazy dog while seven wizards"
    cases = [dict(choice=[long_choice]), dict(regex=r"x{50}"),
             dict(json={"type": "array", "items": {"type": "integer"}, "minItems": 30})]
    params = [constrained(seed=s, max_tokens=k, **c)
              for c in cases for s, k in ((0, 1), (1, 3), (2, 6))]
    outs = tiny_llm.generate(["y"] * len(params), params, use_tqdm=False)
    for p, o in zip(params, outs):
        out = o.outputs[0]
        assert out.finish_reason == "length" and len(out.token_ids) == p.max_tokens
        assert replay(tiny_llm, p.structured_outputs, out.token_ids) == (True, False)
    for o in outs[:3]:
        assert long_choice.startswith(o.outputs[0].text)
    for o in outs[3:6]:
        assert set(o.outputs[0].text) == {"x"}
    # No max_tokens: the grammar runs into max_model_len, and ends there too.
    out = tiny_llm.generate("y", constrained(seed=3, max_tokens=None, regex=r"x{400}"),
                            use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == TINY_ENGINE[
        "max_model_len"]


# -- streaming, abort, the grammar cache ---------------------------------------------------


def test_streamed_outputs_end_as_the_batch_ones(tiny_llm):
    """Step by step (CUMULATIVE outputs) a constrained request's text only grows, and
    ends as LLM.generate's for the same seed."""
    params = mixed_constrained(6, seed=70)
    prompts = token_prompts(len(params), seed=4)
    batch = [o.outputs[0].text for o in tiny_llm.generate(prompts, params, use_tqdm=False)]
    engine = tiny_llm.llm_engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"stream-{i}", prompt, p)
    seen: dict[str, list[str]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out.outputs[0].text)
    for i, text in enumerate(batch):
        steps = seen[f"stream-{i}"]
        assert steps[-1] == text
        assert all(b.startswith(a) for a, b in zip(steps, steps[1:]))
    assert params[0].output_kind is RequestOutputKind.CUMULATIVE


def test_abort_a_constrained_request(tiny_llm):
    engine = tiny_llm.llm_engine
    engine.add_request("abort-me", "the lazy dog", constrained(seed=1, max_tokens=80,
                                                               regex=r"[a-z]{70}"))
    for _ in range(4):
        engine.step()
    engine.abort_request("abort-me")
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0


def test_grammars_are_compiled_once_per_constraint(tiny_llm):
    """A constraint compiles up to `copies` times (requests take the copies in turn),
    then never again; another whitespace option is another grammar."""
    manager = tiny_llm.llm_engine.engine_core.structured_output_manager
    schema = {"type": "object", "properties": {"cache_test": {"type": "string",
                                                             "maxLength": 3}},
              "required": ["cache_test"], "additionalProperties": False}
    before = manager.num_compiled
    same = [constrained(seed=s, max_tokens=30, json=schema, disable_any_whitespace=True)
            for s in range(4)]
    for _ in range(2):
        outs = tiny_llm.generate(["x"] * 4, same, use_tqdm=False)
        assert manager.num_compiled == before + min(manager.copies, 4)
        for p, o in zip(same, outs):
            meets(p.structured_outputs, o.outputs[0].text)
    tiny_llm.generate("x", constrained(seed=0, max_tokens=30, json=schema), use_tqdm=False)
    assert manager.num_compiled == before + min(manager.copies, 4) + 1
