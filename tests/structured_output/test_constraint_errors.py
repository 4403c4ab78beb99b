"""Bad constraints are rejected with a ValueError naming the field: at add_request for
what only the grammar library can judge (a bad regex, schema or grammar), when the
parameters are built for the rest (two constraints, none, JSON that does not parse);
nothing of a rejected request or batch stays in the engine."""
from __future__ import annotations

import re

import pytest
from structured_helpers import constrained

from jaxllm import SamplingParams
from jaxllm.sampling_params import StructuredOutputsParams

BAD = [
    (dict(regex="(ab"), "structured_outputs.regex"),
    (dict(regex="a{3,1}"), "structured_outputs.regex"),
    (dict(regex="["), "structured_outputs.regex"),
    (dict(json={"type": "foo"}), "structured_outputs.json"),
    (dict(json={"type": "object", "properties": "nope"}), "structured_outputs.json"),
    (dict(json={"type": "string", "pattern": "(("}), "structured_outputs.json"),
    (dict(json={"type": "array", "minItems": 3, "maxItems": 1}), "structured_outputs.json"),
    (dict(json={"$ref": "#/definitions/missing"}), "structured_outputs.json"),
    (dict(grammar="start: foo"), "structured_outputs.grammar"),
    (dict(grammar="root ::= [z-a]"), "structured_outputs.grammar"),
    (dict(grammar='root ::= "a'), "structured_outputs.grammar"),
]


@pytest.mark.parametrize("constraint,field", BAD, ids=[f"{f.split('.')[1]}-{i}"
                                                       for i, (_, f) in enumerate(BAD)])
def test_rejected_at_add_request(tiny_llm, constraint, field):
    engine = tiny_llm.llm_engine
    params = constrained(**constraint)      # only the grammar library can tell
    with pytest.raises(ValueError, match=re.escape(field)):
        engine.add_request("bad", "hello", params)
    assert not engine.has_unfinished_requests()
    # The id was not taken, and the engine still serves it.
    engine.add_request("bad", "hello", SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()


def test_a_bad_constraint_rejects_the_whole_batch(tiny_llm):
    good = constrained(seed=1, max_tokens=8, regex=r"[a-z]{3}")
    with pytest.raises(ValueError, match=re.escape("structured_outputs.regex")):
        tiny_llm.generate(["a", "b", "c"], [good, good, constrained(n=3, regex="(")],
                          use_tqdm=False)
    engine = tiny_llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.get_num_unfinished_requests() == 0
    out = tiny_llm.generate("a", good, use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(r"[a-z]{3}", out.text)


@pytest.mark.parametrize("constraint,message", [
    (dict(regex="a", choice=["b"]), "exactly one constraint"),
    (dict(json={"type": "object"}, json_object=True), "exactly one constraint"),
    (dict(), "exactly one constraint"),
    (dict(json='{"type": '), "structured_outputs.json is not valid JSON"),
    (dict(choice=[]), "structured_outputs.choice"),
    (dict(choice=["a", ""]), "structured_outputs.choice"),
    (dict(regex=""), "structured_outputs.regex"),
])
def test_rejected_when_built(constraint, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputsParams(**constraint)
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(structured_outputs=constraint)     # the dict form, as the server


def test_bad_whitespace_pattern_names_its_field(tiny_llm):
    with pytest.raises(ValueError, match=re.escape("structured_outputs.whitespace_pattern")):
        tiny_llm.llm_engine.add_request("ws", "x", constrained(json={"type": "object"},
                                                               whitespace_pattern="("))
    assert not tiny_llm.llm_engine.has_unfinished_requests()


# A grammar valid without a tokenizer but not with the engine's (an unknown special
# token, a token id past the vocabulary): add_request checks it against the vocabulary.
@pytest.mark.parametrize("grammar", ['start: "a" <|no_such_token|> "b"', 'start: "a" <[100000]>'])
def test_grammar_the_tokenizer_rejects(tiny_llm, grammar):
    engine = tiny_llm.llm_engine
    try:
        with pytest.raises(ValueError, match=re.escape("structured_outputs.grammar")):
            tiny_llm.generate("x", constrained(seed=0, max_tokens=8, grammar=grammar),
                              use_tqdm=False)
    finally:
        assert not engine.has_unfinished_requests()
