"""Randomly generated JSON schemas (constraint_cases.py) sampled at temperature 1 with many
seeds, on the default model (real weights) and the tiny random Llama: every output that
finishes ("stop") validates with jsonschema, every output's tokens replay through a
fresh matcher, the whitespace options hold, and most outputs finish within max_tokens.
"""
from __future__ import annotations

import collections
import json

import jsonschema
import pytest
from constraint_cases import random_schemas
from structured_helpers import constrained, meets, replay, whitespace_outside_strings

# The three whitespace modes: any (the default), none, and a pattern.
WHITESPACE = [dict(), dict(disable_any_whitespace=True), dict(whitespace_pattern=r" ?")]


def generate_for_schemas(llm, prompt, schemas, seeds, max_tokens, whitespace):
    params = [constrained(seed=seed, max_tokens=max_tokens, json=schema,
                          **whitespace[(i + seed) % len(whitespace)])
              for i, schema in enumerate(schemas) for seed in seeds]
    outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [1] * len(params)
    return [(p.structured_outputs, o.outputs[0]) for p, o in zip(params, outs)]


def check_outputs(llm, results, min_finished: float):
    counts = collections.Counter(c.finish_reason for _, c in results)
    assert set(counts) <= {"stop", "length"}, counts
    for constraint, out in results:
        accepted, complete = replay(llm, constraint, out.token_ids)
        assert accepted, (out.text, constraint.json)
        if out.finish_reason == "stop":
            assert complete, out.text
            meets(constraint, out.text)
            check_whitespace(constraint, out.text)
    assert counts["stop"] >= min_finished * len(results), counts
    return counts


def check_whitespace(constraint, text):
    runs = whitespace_outside_strings(text)
    if constraint.disable_any_whitespace:
        assert runs == [], text
    elif constraint.whitespace_pattern == r" ?":
        assert set(runs) <= {" "}, text


def test_random_schemas_default_model(default_llm):
    schemas = random_schemas(seed=1, count=8)
    results = generate_for_schemas(default_llm, "Here is a JSON object:\n", schemas,
                                   seeds=range(2), max_tokens=64, whitespace=WHITESPACE)
    check_outputs(default_llm, results, min_finished=0.75)


def test_random_schemas_tiny_model(tiny_llm):
    # A random model samples whitespace as readily as anything else: any whitespace
    # would rarely finish, so only none or a bounded pattern here.
    schemas = random_schemas(seed=2, count=40)
    results = generate_for_schemas(
        tiny_llm, "the quick brown fox", schemas, seeds=range(4), max_tokens=150,
        whitespace=WHITESPACE[1:] + [dict(whitespace_pattern=r"[ \n]{0,2}")])
    counts = check_outputs(tiny_llm, results, min_finished=0.9)
    # Not one fixed output: the seeds and schemas really vary what is sampled.
    assert len({c.text for _, c in results}) > 0.7 * len(results), counts


@pytest.mark.parametrize("which", ["default", "tiny"])
def test_json_object(which, request):
    llm = request.getfixturevalue(f"{which}_llm")
    whitespace = dict(disable_any_whitespace=True) if which == "tiny" else \
        dict(whitespace_pattern=r"[ ]?")
    params = [constrained(seed=s, max_tokens=64, json_object=True, **whitespace)
              for s in range(8)]
    outs = llm.generate(["A JSON object:"] * len(params), params, use_tqdm=False)
    finished = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
    assert len(finished) >= 3     # any object: free to run on, unlike the schemas
    for out in finished:
        assert isinstance(json.loads(out.text), dict)
    for p, o in zip(params, outs):
        assert replay(llm, p.structured_outputs, o.outputs[0].token_ids)[0]


def test_schema_generator_is_seeded_and_valid():
    a, b = random_schemas(seed=3, count=30), random_schemas(seed=3, count=30)
    assert a == b and a != random_schemas(seed=4, count=30)
    text = json.dumps(a)
    for word in ("minItems", "maxItems", "enum", "pattern", "minimum", "anyOf", "required"):
        assert word in text, word
    for schema in a:
        jsonschema.Draft202012Validator.check_schema(schema)
