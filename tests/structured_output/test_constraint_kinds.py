"""Every kind of constraint through the batch API: regex outputs full-match, choice
outputs are one of the choices, Lark and GBNF grammar outputs match a regex equivalent,
on the default model and the tiny random Llama; one LLM.generate with a different
constraint per prompt keeps each row to its own constraint."""
from __future__ import annotations

import pytest
from constraint_cases import CASES
from structured_helpers import constrained, meets, replay

from jaxllm import SamplingParams


def check(llm, cases, seeds, max_tokens):
    """Every case with every seed in one batch: each finishes, meets its constraint and
    replays through a fresh matcher. -> the distinct texts per constraint."""
    prompts, params, regexes = [], [], []
    for prompt, constraint, regex in cases:
        for seed in seeds:
            prompts.append(prompt)
            params.append(constrained(seed=seed, max_tokens=max_tokens, **constraint))
            regexes.append(regex)
    outs = llm.generate(prompts, params, use_tqdm=False)
    texts = {}
    for p, regex, o in zip(params, regexes, outs):
        out = o.outputs[0]
        assert out.finish_reason == "stop", (p.structured_outputs, out.text)
        meets(p.structured_outputs, out.text, regex)
        assert replay(llm, p.structured_outputs, out.token_ids) == (True, True)
        texts.setdefault(p.structured_outputs.key, set()).add(out.text)
    return texts


def test_every_kind_default_model(default_llm):
    texts = check(default_llm, CASES, seeds=range(2), max_tokens=40)
    assert sum(len(t) for t in texts.values()) > len(CASES)   # the seeds vary the samples


def test_every_kind_tiny_model(tiny_llm):
    texts = check(tiny_llm, CASES, seeds=range(6), max_tokens=60)
    assert sum(len(t) for t in texts.values()) > 2 * len(CASES)


def test_greedy_constrained(tiny_llm):
    """Temperature 0 goes through the all-greedy sampler: the mask applies there too,
    and the output is the same each time."""
    params = [constrained(seed=None, temperature=0.0, max_tokens=80, **c) for _, c, _ in CASES]
    prompts = [p for p, _, _ in CASES]
    first = tiny_llm.generate(prompts, params, use_tqdm=False)
    again = tiny_llm.generate(prompts, params, use_tqdm=False)
    for (_, _, regex), p, a, b in zip(CASES, params, first, again):
        assert a.outputs[0].finish_reason == "stop"
        meets(p.structured_outputs, a.outputs[0].text, regex)
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_batch_api_keeps_each_row_to_its_constraint(default_llm):
    """Neighbouring rows with disjoint alphabets (digits, letters, a choice, free text):
    a mask landing on the wrong row would show. Results come back in input order."""
    digits = dict(regex=r"[0-9]{4,6}")
    letters = dict(regex=r"[a-z]{4,6}")
    choice = dict(choice=["Paris", "London"])
    prompts = ["Numbers: ", "Letters: ", "Capital of France: ", "Once upon a time",
               "Numbers: ", "Letters: "]
    params = [constrained(seed=1, max_tokens=12, **digits),
              constrained(seed=2, max_tokens=12, **letters),
              constrained(seed=3, max_tokens=12, **choice),
              SamplingParams(temperature=0, max_tokens=8),
              constrained(seed=4, temperature=0.0, max_tokens=12, **digits),
              constrained(seed=5, max_tokens=12, **letters)]
    outs = default_llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    for p, o in zip(params, outs):
        if p.structured_outputs is not None:
            assert o.outputs[0].finish_reason == "stop"
            meets(p.structured_outputs, o.outputs[0].text)
    alone = default_llm.generate(prompts[3], params[3], use_tqdm=False)[0]
    assert outs[3].outputs[0].token_ids == alone.outputs[0].token_ids


@pytest.mark.parametrize("choices", [["yes", "no"], ["alpha", "alphabet", "alphabetical"]])
def test_choice_prefixes(tiny_llm, choices):
    """Choices that are prefixes of each other: each can be chosen, and the output is
    always exactly one of them."""
    params = [constrained(seed=s, max_tokens=16, choice=choices) for s in range(24)]
    outs = tiny_llm.generate(["pick one"] * len(params), params, use_tqdm=False)
    got = {o.outputs[0].text for o in outs}
    assert got <= set(choices) and len(got) >= 2, got
