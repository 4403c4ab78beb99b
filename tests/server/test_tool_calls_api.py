"""Tool calls and reasoning through the OpenAI API (issue 18): a tiny random model
behind a server started as vLLM users start Qwen3 (--enable-auto-tool-choice
--tool-call-parser hermes --reasoning-parser qwen3), with a Qwen-like chat template.

Random weights never write a call on their own: named and required choices are forced
by the server; for `auto` and reasoning the test forces the model's text with a regex
(structured outputs), so the parsers see exactly what a real model would write."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import openai
import pytest
from jsonschema import Draft202012Validator
from server_helpers import MODEL, sse_events, validate

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False,
                                       "required": ["zone"],
                                       "properties": {"zone": {"enum": ["utc", "cet"]}}}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "weather in Paris?"}]
HERMES_CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
               '\n</tool_call>')

# Tools rendered by name only: the tiny model's context is 512 tokens.
TEMPLATE = """{%- if tools %}<|im_start|>system
<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}
{%- for c in m.tool_calls %}<tool_call>
{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""


@pytest.fixture(scope="module")
def tools_server(tiny_model, tmp_path_factory):
    from jaxllm.config import engine_config_from_flat
    from jaxllm.engine.async_llm import AsyncLLM
    from jaxllm.entrypoints.openai.api_server import build_app, serve_in_background
    folder, _ = tiny_model("llama")
    template = tmp_path_factory.mktemp("template") / "qwen_like.jinja"
    template.write_text(TEMPLATE)
    config = engine_config_from_flat(
        model=folder, chat_template=str(template), max_model_len=512, max_num_seqs=8,
        max_num_batched_tokens=64, num_gpu_blocks_override=128, enforce_eager=True,
        served_model_name=(MODEL,), enable_auto_tool_choice=True, tool_call_parser="hermes",
        reasoning_parser="qwen3")
    engine = AsyncLLM.from_config(config, multiprocess=False)
    try:
        with serve_in_background(build_app(engine, config)) as url:
            yield url
    finally:
        engine.shutdown()


@pytest.fixture
def client(tools_server):
    with openai.OpenAI(base_url=f"{tools_server}/v1", api_key="unused", max_retries=0,
                       timeout=120) as c:
        yield c


def chat(client, **kwargs):
    return client.chat.completions.create(model=kwargs.pop("model", MODEL),
                                          messages=kwargs.pop("messages", ASK), **kwargs)


def streamed(client, **kwargs) -> tuple[dict, str | None]:
    """A streamed chat reassembled: {"content", "reasoning", "calls": [[id, name, args]]}."""
    out = {"content": "", "reasoning": "", "calls": []}
    finish = None
    for chunk in chat(client, stream=True, **kwargs):
        for choice in chunk.choices:
            d = choice.delta
            out["content"] += d.content or ""
            out["reasoning"] += getattr(d, "reasoning", None) or ""
            for call in d.tool_calls or []:
                if call.id is not None:        # a call's first delta: index, id, name
                    assert call.index == len(out["calls"]) and call.function.name
                    out["calls"].append([call.id, call.function.name, ""])
                else:
                    assert call.function.name is None
                out["calls"][call.index][2] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return out, finish


def check_call(name: str, arguments: str) -> None:
    Draft202012Validator(SCHEMAS[name]).validate(json.loads(arguments))


@pytest.mark.parametrize("temperature", [0, 1])
def test_named_choice_returns_a_valid_call(client, temperature):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(tools=TOOLS, tool_choice=choice, temperature=temperature, seed=3,
                  max_tokens=60)
    out = chat(client, **kwargs)
    message = out.choices[0].message
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    check_call("get_weather", call.function.arguments)
    stream, _ = streamed(client, **kwargs)
    assert [c[1:] for c in stream["calls"]] == [["get_weather", call.function.arguments]]


@pytest.mark.parametrize("temperature", [0, 1])
def test_required_choice_returns_valid_calls(client, temperature):
    kwargs = dict(tools=TOOLS, tool_choice="required", temperature=temperature, seed=5,
                  max_tokens=120, parallel_tool_calls=False)
    out = chat(client, **kwargs)
    (call,) = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls"
    check_call(call.function.name, call.function.arguments)
    stream, finish = streamed(client, **kwargs)
    assert [c[1:] for c in stream["calls"]] == [[call.function.name, call.function.arguments]]
    assert finish == "tool_calls"


def test_required_choice_cut_by_max_tokens_is_text(client):
    """Random weights keep adding calls to the array: cut by max_tokens, the reply is
    the text so far with finish_reason length, as for any constrained output."""
    out = chat(client, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=30)
    choice = out.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content.startswith('[{"name":"get_')


def test_none_returns_no_calls(client):
    out = chat(client, tools=TOOLS, tool_choice="none", max_tokens=120,
               extra_body={"guided_regex": re.escape(HERMES_CALL)})
    message = out.choices[0].message
    assert not message.tool_calls and message.content == HERMES_CALL


def test_auto_parses_the_models_call(client):
    """The model writes a hermes call (forced by a regex): a call, finish_reason
    tool_calls, the text before it as content; streamed the same."""
    text = "Let me check." + HERMES_CALL
    kwargs = dict(tools=TOOLS, max_tokens=80, temperature=0,
                  extra_body={"guided_regex": re.escape(text)})
    out = chat(client, **kwargs)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls"
    (call,) = message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    assert message.content == "Let me check."
    stream, finish = streamed(client, **kwargs)
    assert finish == "tool_calls" and stream["content"] == "Let me check."
    assert [c[1:] for c in stream["calls"]] == [["get_weather", call.function.arguments]]


def test_malformed_call_under_auto_is_content(client):
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'
    out = chat(client, tools=TOOLS, max_tokens=80, temperature=0,
               extra_body={"guided_regex": re.escape(text)})
    message = out.choices[0].message
    assert not message.tool_calls and message.content == text
    assert out.choices[0].finish_reason == "stop"


def test_a_tool_result_turn_renders_and_answers(client):
    turns = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    out = chat(client, messages=turns, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert out.choices[0].message.content is not None
    longer = out.usage.prompt_tokens
    assert longer > chat(client, tools=TOOLS, tool_choice="none", max_tokens=1).usage.prompt_tokens


def test_template_gets_tools_and_calls_as_objects(tiny_model, tmp_path):
    """What the chat template is given: the tools, and a call's arguments as an object
    (a template's tojson would otherwise quote the JSON string a second time)."""
    from jaxllm.entrypoints.openai.chat_tools import template_tools
    from jaxllm.entrypoints.openai.protocol import ChatCompletionRequest
    from jaxllm.entrypoints.openai.serving_chat import OpenAIServingChat
    from jaxllm.tokenizer import get_tokenizer
    tok = get_tokenizer(tiny_model("llama")[0])
    tok.chat_template = TEMPLATE
    request = ChatCompletionRequest.model_validate({"messages": ASK + [
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "get_time", "arguments": '{"zone": "utc"}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "12:00"}], "tools": TOOLS})
    serving = OpenAIServingChat(None, None, tok)
    ids = serving.render([m.to_template_dict() for m in request.messages],
                         tools=template_tools(request))
    text = tok.decode(ids)
    assert "<tools>get_weather;get_time;</tools>" in text
    assert "<tool_response>12:00</tool_response>" in text
    assert '{"name": "get_time", "arguments": {"zone": "utc"}}' in text


def test_reasoning_is_split_from_the_answer(client):
    text = "<think>the user wants a greeting</think>hello there"
    kwargs = dict(max_tokens=60, temperature=0, extra_body={"guided_regex": re.escape(text)})
    message = chat(client, **kwargs).choices[0].message.model_dump()
    assert message["reasoning"] == message["reasoning_content"] == "the user wants a greeting"
    assert message["content"] == "hello there"
    stream, _ = streamed(client, **kwargs)
    assert stream["reasoning"] == "the user wants a greeting"
    assert stream["content"] == "hello there"


def test_enable_thinking_false_is_honoured(client):
    """chat_template_kwargs reach the template (an empty think block in the prompt);
    a reply without a think block is all content."""
    on = chat(client, max_tokens=1)
    off = chat(client, max_tokens=40, extra_body={
        "chat_template_kwargs": {"enable_thinking": False}, "guided_regex": "plain answer"})
    assert off.usage.prompt_tokens > on.usage.prompt_tokens
    message = off.choices[0].message.model_dump()
    assert message["content"] == "plain answer" and message.get("reasoning") is None


def test_reasoning_turn_accepted_under_either_name(client):
    for field in ("reasoning", "reasoning_content"):
        turns = ASK + [{"role": "assistant", "content": "hi", field: "thought"},
                       {"role": "user", "content": "and?"}]
        assert chat(client, messages=turns, max_tokens=1).choices[0].message is not None


@pytest.mark.parametrize("body,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "frob"}}}}}]},
     "tools.0.function.parameters"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "maybe"}, "parallel_tool_calls"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"tools": [{"type": "function"}]}, "tools.0.function"),
])
def test_bad_tool_requests_are_400(tools_server, body, param):
    response = httpx.post(f"{tools_server}/v1/chat/completions", timeout=60,
                          json={"model": MODEL, "messages": ASK, "max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_auto_without_the_flag_is_vllms_400(client_plain):
    with pytest.raises(openai.BadRequestError) as e:
        client_plain.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                             max_tokens=2)
    assert "--enable-auto-tool-choice" in str(e.value) and e.value.body["param"] == "tool_choice"


@pytest.fixture
def client_plain(server_url):
    with openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_auto_tool_choice_without_a_parser_is_one_line_and_exit_2():
    done = subprocess.run([sys.executable, "-m", "jaxllm.entrypoints.cli", "serve",
                           "--enable-auto-tool-choice"], capture_output=True, text=True,
                          timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "tool_call_parser" in lines[0], \
        done.stderr


@pytest.mark.parametrize("flag", ["--tool-call-parser", "--reasoning-parser"])
def test_unknown_parser_is_one_line_and_exit_2(flag):
    done = subprocess.run([sys.executable, "-m", "jaxllm.entrypoints.cli", "serve", flag, "nope"],
                          capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "known:" in lines[0], done.stderr
    assert ("hermes" in lines[0]) if "tool" in flag else ("qwen3" in lines[0])


def test_responses_follow_openais_schema(tools_server):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 40, "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    url = f"{tools_server}/v1/chat/completions"
    whole = httpx.post(url, timeout=60, json=body).json()
    validate("CreateChatCompletionResponse", whole)
    assert whole["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_time"
    for event in sse_events(httpx.post(url, timeout=60, json={**body, "stream": True})):
        validate("CreateChatCompletionStreamResponse", event, nullable_finish_reason=True)


def test_langchain_bind_tools_and_structured_output(tools_server):
    """LangChain's ChatOpenAI: bind_tools with a forced tool, with_structured_output."""
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, ConfigDict, Field

    class Forecast(BaseModel):
        # No extra keys (additionalProperties false): random weights would add them.
        model_config = ConfigDict(extra="forbid")
        city: str = Field(max_length=12)
        days: int = Field(ge=1, le=7)
    llm = ChatOpenAI(base_url=f"{tools_server}/v1", api_key="unused", model=MODEL,
                     temperature=0, max_tokens=60, max_retries=0)
    message = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather"
    Draft202012Validator(SCHEMAS["get_weather"]).validate(call["args"])
    # Through a forced tool call (compact JSON: random weights would loop on whitespace).
    forecast = llm.with_structured_output(Forecast, method="function_calling").invoke(
        "a forecast, as JSON")
    assert isinstance(forecast, Forecast)


@pytest.mark.parametrize("temperature", [0, 1])
def test_default_model_forced_calls(default_client, temperature):
    kwargs = dict(model=default_client.models.list().data[0].id, tools=TOOLS, max_tokens=80,
                  temperature=temperature, seed=11)
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        out = chat(default_client, tool_choice=choice, parallel_tool_calls=False, **kwargs)
        (call,) = out.choices[0].message.tool_calls
        check_call(call.function.name, call.function.arguments)
        stream, _ = streamed(default_client, tool_choice=choice, parallel_tool_calls=False,
                             **kwargs)
        assert [c[1:] for c in stream["calls"]] == [[call.function.name,
                                                     call.function.arguments]]


def test_default_model_langchain_structured_output(default_client):
    """with_structured_output's default method (response_format json_schema)."""
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=24)
        population_millions: int = Field(ge=0, le=40)
    llm = ChatOpenAI(base_url=f"{default_client.url}/v1", api_key="unused",
                     model=default_client.models.list().data[0].id, temperature=0,
                     max_tokens=80, max_retries=0)
    city = llm.with_structured_output(City).invoke("A city in France and its population.")
    assert isinstance(city, City)
