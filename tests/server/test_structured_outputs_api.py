"""Structured outputs through the API: the three spellings of a constraint
(``response_format``, ``structured_outputs``, ``guided_*``) -> StructuredOutputsParams;
every malformed constraint a 400 naming the field, with nothing sent to the engine;
then outputs that follow the constraint, on the tiny model and the default model,
through the `openai` SDK."""
from __future__ import annotations

import json
import re

import httpx
import openai
import pydantic
import pytest
from jsonschema import Draft202012Validator
from server_helpers import MODEL, validate

from jaxllm.entrypoints.openai.errors import APIError
from jaxllm.entrypoints.openai.protocol import (
    ChatCompletionRequest, CompletionRequest, parse_request)
from jaxllm.sampling_params import StructuredOutputsParams

MESSAGES = [{"role": "user", "content": "hi"}]
CHAT = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "temperature": 0}
COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "temperature": 0}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def json_schema_format(schema=SCHEMA, **extra) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, **extra}}


def constraint(body: dict, cls=ChatCompletionRequest) -> StructuredOutputsParams | None:
    base = {"messages": MESSAGES} if cls is ChatCompletionRequest else {"prompt": "x"}
    return parse_request(cls, {**base, **body}).to_sampling_params().structured_outputs


# (request fields, the StructuredOutputsParams they make)
PARSED = [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"response_format": json_schema_format(strict=True, description="d")},
     StructuredOutputsParams(json=SCHEMA)),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputsParams(json=SCHEMA)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, StructuredOutputsParams(json=SCHEMA)),
    ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutputsParams(regex="[a-z]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}},
     StructuredOutputsParams(choice=["yes", "no"])),
    ({"structured_outputs": {"grammar": 'start: "a" | "b"'}},
     StructuredOutputsParams(grammar='start: "a" | "b"')),
    ({"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
     StructuredOutputsParams(json_object=True, disable_any_whitespace=True)),
    ({"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True,
                             "whitespace_pattern": " ?"}},
     StructuredOutputsParams(json=SCHEMA, disable_additional_properties=True,
                             whitespace_pattern=" ?")),
    ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " ?"}},
     StructuredOutputsParams(json=SCHEMA, whitespace_pattern=" ?")),
    ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
    ({"guided_json": json.dumps(SCHEMA), "guided_whitespace_pattern": "[ ]?"},
     StructuredOutputsParams(json=SCHEMA, whitespace_pattern="[ ]?")),
    ({"guided_regex": r"\d{3}", "guided_decoding_backend": "xgrammar"},
     StructuredOutputsParams(regex=r"\d{3}")),
    ({"guided_choice": ["a", "b"]}, StructuredOutputsParams(choice=["a", "b"])),
    ({"guided_grammar": 'root ::= "a"'}, StructuredOutputsParams(grammar='root ::= "a"')),
    # Options in structured_outputs with the constraint in response_format.
    ({"response_format": json_schema_format(),
      "structured_outputs": {"disable_any_whitespace": True}},
     StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)),
    ({"response_format": {"type": "text"}, "guided_regex": "a+"},
     StructuredOutputsParams(regex="a+")),
]


@pytest.mark.parametrize("cls", [ChatCompletionRequest, CompletionRequest])
@pytest.mark.parametrize("body,expected", PARSED, ids=[str(i) for i in range(len(PARSED))])
def test_request_fields_to_structured_outputs_params(cls, body, expected):
    assert constraint(body, cls) == expected


def test_other_fields_unchanged_by_a_constraint():
    params = parse_request(CompletionRequest, {
        "prompt": "x", "max_tokens": 5, "temperature": 0.5, "seed": 1, "n": 2,
        "guided_choice": ["a"]}).to_sampling_params()
    assert (params.max_tokens, params.temperature, params.seed, params.n) == (5, 0.5, 1, 2)
    assert params.structured_outputs.choice == ["a"]


BAD_REGEX = "a(b"
# (id, request fields, param, code); each is tried on chat and on completions.
ERRORS = [
    ("json_schema-missing", {"response_format": {"type": "json_schema"}},
     "response_format.json_schema", "missing_required_parameter"),
    ("json_schema-no-schema", {"response_format": {"type": "json_schema",
                                                   "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "missing_required_parameter"),
    ("json_schema-no-name", {"response_format": {"type": "json_schema",
                                                 "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name", "missing_required_parameter"),
    ("json_schema-unknown-key", {"response_format": json_schema_format(foo=1)},
     "response_format.json_schema.foo", "unsupported_parameter"),
    ("json_schema-with-text", {"response_format": {"type": "text",
                                                   "json_schema": {"name": "x"}}},
     "response_format.json_schema", None),
    ("response_format-type", {"response_format": {"type": "yaml"}}, "response_format.type",
     "invalid_value"),
    ("response_format-schema-type", {"response_format": json_schema_format(schema=[1])},
     "response_format.json_schema.schema", "invalid_value"),
    ("schema-rejected", {"response_format": json_schema_format(schema={"type": "foo"})},
     "response_format.json_schema.schema", None),
    ("schema-bad-bound", {"structured_outputs": {"json": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": "x"}}}}},
     "structured_outputs.json", None),
    ("schema-bad-ref", {"guided_json": {"$ref": "#/nope"}}, "guided_json", None),
    ("schema-not-json", {"guided_json": "{not json"}, "guided_json", None),
    ("regex-rejected", {"guided_regex": BAD_REGEX}, "guided_regex", None),
    ("regex-rejected-so", {"structured_outputs": {"regex": BAD_REGEX}},
     "structured_outputs.regex", None),
    ("grammar-rejected", {"guided_grammar": "start: undefined_rule"}, "guided_grammar", None),
    ("choice-empty", {"guided_choice": []}, "guided_choice", None),
    ("choice-empty-string", {"structured_outputs": {"choice": ["a", ""]}},
     "structured_outputs.choice", None),
    ("whitespace-rejected", {"guided_json": SCHEMA, "guided_whitespace_pattern": "(("},
     "guided_whitespace_pattern", None),
    ("whitespace-alone", {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", None),
    ("whitespace-twice", {"structured_outputs": {"regex": "a", "whitespace_pattern": " "},
                          "guided_whitespace_pattern": " "}, "guided_whitespace_pattern", None),
    ("unknown-key", {"structured_outputs": {"regex": "a", "backend": "x"}},
     "structured_outputs.backend", "unsupported_parameter"),
    ("no-constraint", {"structured_outputs": {}}, "structured_outputs", None),
    ("options-only", {"structured_outputs": {"disable_any_whitespace": True}},
     "structured_outputs", None),
    ("two-in-structured_outputs", {"structured_outputs": {"regex": "a", "choice": ["a"]}},
     "structured_outputs.choice", None),
    ("response_format-and-guided", {"response_format": json_schema_format(),
                                    "guided_regex": "a"}, "guided_regex", None),
    ("json_object-and-structured_outputs", {"response_format": {"type": "json_object"},
                                            "structured_outputs": {"json": SCHEMA}},
     "structured_outputs.json", None),
    ("structured_outputs-and-guided", {"structured_outputs": {"regex": "a"},
                                       "guided_choice": ["a"]}, "guided_choice", None),
    ("two-guided", {"guided_regex": "a", "guided_grammar": 'start: "a"'}, "guided_grammar",
     None),
    ("regex-type", {"guided_regex": 5}, "guided_regex", "invalid_value"),
    ("choice-type", {"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice",
     "invalid_value"),
    ("json-type", {"guided_json": 5}, "guided_json", "invalid_value"),
    ("structured_outputs-type", {"structured_outputs": "json"}, "structured_outputs",
     "invalid_value"),
    ("json_object-type", {"structured_outputs": {"json_object": "maybe"}},
     "structured_outputs.json_object", "invalid_value"),
]


@pytest.mark.parametrize("cls", [ChatCompletionRequest, CompletionRequest])
@pytest.mark.parametrize("name,body,param,code", ERRORS, ids=[e[0] for e in ERRORS])
def test_bad_constraint_is_400_naming_the_field(cls, name, body, param, code):
    with pytest.raises(APIError) as error:
        constraint(body, cls)
    e = error.value
    assert (e.status, e.param, e.code) == (400, param, code), e.message
    assert e.message


@pytest.fixture
def engine_calls(async_engine, monkeypatch):
    """The prompts the server hands to the engine, recorded."""
    calls = []
    generate = async_engine.generate

    def spy(request_id, prompt, params, *args, **kwargs):
        calls.append(params)
        return generate(request_id, prompt, params, *args, **kwargs)

    monkeypatch.setattr(async_engine, "generate", spy)
    return calls


@pytest.mark.parametrize("path,base", [("/v1/chat/completions", CHAT),
                                       ("/v1/completions", COMPLETION)], ids=["chat", "cmpl"])
@pytest.mark.parametrize("name,body,param,code", ERRORS, ids=[e[0] for e in ERRORS])
def test_bad_constraint_over_http_reaches_no_engine(server_url, engine_calls, path, base, name,
                                                    body, param, code):
    for stream in (False, True):
        r = httpx.post(f"{server_url}{path}", json={**base, **body, "stream": stream},
                       timeout=60)
        assert r.status_code == 400, r.text
        validate("ErrorResponse", r.json())
        error = r.json()["error"]
        assert (error["type"], error["param"], error["code"]) == \
            ("invalid_request_error", param, code), error
        assert error["message"]
    assert engine_calls == []


def test_valid_constraint_reaches_the_engine(server_url, engine_calls):
    r = httpx.post(f"{server_url}/v1/completions", timeout=60,
                   json={**COMPLETION, "guided_regex": "[ab]+", "max_tokens": 2})
    assert r.status_code == 200, r.text
    (params,) = engine_calls
    assert params.structured_outputs == StructuredOutputsParams(regex="[ab]+")


def test_sdk_raises_bad_request_with_param(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                       response_format=json_schema_format({"type": "foo"}))
    assert bad.value.body["param"] == "response_format.json_schema.schema"
    assert "not a valid JSON schema" in bad.value.body["message"]
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                  extra_body={"guided_regex": BAD_REGEX})
    assert bad.value.body["param"] == "guided_regex"


# -- Outputs that follow the constraint (the engine's masks, end to end). ---------------

PHONE = r"[0-9]{3}-[0-9]{4}"
CHOICES = ["yes", "no", "maybe"]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                  "maxItems": 3}}}


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    population_millions: int = pydantic.Field(ge=0, le=40)


def test_tiny_model_follows_constraints(client):
    """Random weights at temperature 1: only the masks make the outputs conform."""
    for seed in range(3):
        out = client.completions.create(model=MODEL, prompt="the", max_tokens=40, n=2,
                                        temperature=1, seed=seed,
                                        extra_body={"guided_regex": PHONE})
        assert all(re.fullmatch(PHONE, c.text) and c.finish_reason == "stop"
                   for c in out.choices), out.choices
        out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20,
                                             temperature=1, seed=seed,
                                             extra_body={"guided_choice": CHOICES})
        assert out.choices[0].message.content in CHOICES
        out = client.completions.create(
            model=MODEL, prompt="the", max_tokens=200, temperature=1, seed=seed,
            extra_body={"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}})
        assert out.choices[0].finish_reason == "stop", out.choices[0]
        Draft202012Validator(PERSON).validate(json.loads(out.choices[0].text))


def test_engine_process_follows_constraints(server_config, client):
    """As `jaxllm serve` runs: the engine in its own process; the same outputs as the
    in-thread engine for the same seeds."""
    from jaxllm.engine.async_llm import AsyncLLM
    from jaxllm.entrypoints.openai.api_server import build_app, serve_in_background
    engine = AsyncLLM.from_config(server_config, multiprocess=True)
    try:
        with serve_in_background(build_app(engine, server_config)) as url, openai.OpenAI(
                base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as mp:
            for seed, extra in enumerate([{"guided_regex": PHONE},
                                          {"structured_outputs": {"choice": CHOICES}}]):
                kwargs = dict(model=MODEL, prompt="the", max_tokens=20, temperature=1,
                              seed=seed, extra_body=extra)
                text = mp.completions.create(**kwargs).choices[0].text
                assert re.fullmatch(PHONE, text) or text in CHOICES, text
                assert text == client.completions.create(**kwargs).choices[0].text
    finally:
        engine.shutdown()


def test_sdk_parse_gives_a_pydantic_object(default_client):
    completion = default_client.chat.completions.parse(
        model=MODEL, response_format=City, max_tokens=100, temperature=0,
        messages=[{"role": "user", "content": "Name a city in France, as JSON."}])
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, City), completion.choices[0].message.content
    assert completion.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("field", ["guided_regex", "structured_outputs"])
def test_regex_output_full_matches(default_client, field):
    extra = {"guided_regex": PHONE} if field == "guided_regex" else \
        {"structured_outputs": {"regex": PHONE}}
    for seed in range(3):
        chat = default_client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Give me a phone number."}],
            max_tokens=30, temperature=1, seed=seed, extra_body=extra)
        assert re.fullmatch(PHONE, chat.choices[0].message.content), chat.choices[0]
        text = default_client.completions.create(
            model=MODEL, prompt="Call me at", max_tokens=30, temperature=1, seed=seed,
            extra_body=extra).choices[0].text
        assert re.fullmatch(PHONE, text), text


def test_choice_output_is_one_of_the_choices(default_client):
    for seed in range(3):
        for extra in ({"guided_choice": CHOICES}, {"structured_outputs": {"choice": CHOICES}}):
            chat = default_client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}],
                max_tokens=10, temperature=1, seed=seed, extra_body=extra)
            assert chat.choices[0].message.content in CHOICES
            assert chat.choices[0].finish_reason == "stop"


def test_stream_equals_whole_for_a_seed(default_client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "A person, as JSON."}],
                  max_tokens=80, temperature=1, seed=7,
                  response_format=json_schema_format(PERSON))
    whole = default_client.chat.completions.create(**kwargs).choices[0]
    chunks = [c for c in default_client.chat.completions.create(stream=True, **kwargs)
              if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.message.content
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    if whole.finish_reason == "stop":
        Draft202012Validator(PERSON).validate(json.loads(whole.message.content))


def test_completions_json_schema_validates(default_client):
    finished = 0
    for seed in range(4):
        choice = default_client.completions.create(
            model=MODEL, prompt="A person, as JSON:", max_tokens=120, temperature=1,
            seed=seed, extra_body={"structured_outputs": {"json": PERSON}}).choices[0]
        if choice.finish_reason == "stop":
            Draft202012Validator(PERSON).validate(json.loads(choice.text))
            finished += 1
    assert finished >= 3


def test_json_object_output_is_an_object(default_client):
    choice = default_client.chat.completions.create(
        model=MODEL, max_tokens=120, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user",
                   "content": "Describe a person (name and age) as a JSON object."}],
        extra_body={"structured_outputs": {"disable_any_whitespace": True}}).choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(json.loads(choice.message.content), dict)
    assert not re.search(r"[\n\t]", choice.message.content)   # no whitespace between tokens


def test_metrics_count_grammars_and_mask_time(client):
    """Prometheus exposes the grammar compiles and the seconds spent on masks."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    client.completions.create(model=MODEL, prompt="the", max_tokens=8, temperature=1, seed=5,
                              extra_body={"guided_regex": "[0-9]{6}"})
    base = str(client.base_url).rstrip("/").removesuffix("/v1")
    samples = {s.name: s.value for f in text_string_to_metric_families(
        httpx.get(f"{base}/metrics").text) for s in f.samples}
    assert samples["jaxllm:structured_output_grammars_compiled_total"] >= 1
    assert samples["jaxllm:structured_output_mask_seconds_total"] > 0
    assert samples["jaxllm:structured_output_compile_seconds_total"] > 0
