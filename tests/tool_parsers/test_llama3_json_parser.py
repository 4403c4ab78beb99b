"""llama3_json: Llama 3.x JSON calls, with or without <|python_tag|>, ";"-separated."""
from __future__ import annotations

import pytest
from tool_stream_helpers import calls_of, check_streaming, parse

from jaxllm.entrypoints.openai.tool_parsers import ToolParserManager

PARSER = ToolParserManager.get_tool_parser("llama3_json")


@pytest.mark.parametrize("text, content, calls", [
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "San Francisco, CA"}}', None,
     [("get_weather", '{"city": "San Francisco, CA"}')]),
    ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None,
     [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    ('\n\n{"type": "function", "name": "get_time", "parameters": {}}', None,
     [("get_time", "{}")]),
    ('{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": [1, 2.5]}};'
     '{"name":"c","parameters":{"z":{"deep":{"er":null}}}}', None,
     [("a", '{"x": 1}'), ("b", '{"y": [1, 2.5]}'), ("c", '{"z": {"deep": {"er": null}}}')]),
    ('<|python_tag|>{"name": "translate", "parameters": {"text": "Grüße aus Köln \\u2764", '
     '"to": "日本語"}}', None,
     [("translate", '{"text": "Grüße aus Köln ❤", "to": "日本語"}')]),
    ('{"name": "lookup", "parameters": {"id": 7}}\n\nI looked it up.', "I looked it up.",
     [("lookup", '{"id": 7}')]),
    ('{"name": "f", "parameters": {"a": 1}', None, [("f", '{"a": 1}')]),      # "}" left out
    ('{"name": "f", "parameters": {"a": 1}};', None, [("f", '{"a": 1}')]),
])
def test_calls(text, content, calls):
    info = parse(PARSER, text)
    assert info.tools_called and calls_of(info) == calls
    assert info.content == content
    check_streaming(PARSER, text)


@pytest.mark.parametrize("text, held", [
    ("The capital of France is Paris.", ""),
    ('Sure! {"name": "get_weather", "parameters": {}}', ""),   # calls start the reply
    ('{"city": "Paris", "temperature": 21}', ""),              # JSON, but not a call
    ("<|python_tag|>brave_search.call(query=\"weather\")", ""),  # a built-in tool's code
    ("{not json}", ""),
    ("<|python_ta", "<|python_ta"),
])
def test_content(text, held):
    info = parse(PARSER, text)
    assert not info.tools_called and info.content == text.strip()
    check_streaming(PARSER, text, held=held)


CUT = '{"name": "f", "parameters": {"a": "cut'


@pytest.mark.parametrize("text, held", [
    ('{"name": "f", "parameters": {"a": }}', ""),
    ('<|python_tag|>{"name": "f", "parameters": {"a": 1]}', ""),
    (CUT, CUT),
])
def test_malformed_after_the_name_is_content(text, held):
    info = parse(PARSER, text)
    assert not info.tools_called and info.content == text.strip()
    check_streaming(PARSER, text, dangling=True, held=held)


def test_a_malformed_second_call_keeps_the_first():
    text = '{"name": "a", "parameters": {}}; oops'
    info = parse(PARSER, text)
    assert calls_of(info) == [("a", "{}")] and info.content == "oops"
    check_streaming(PARSER, text)


def test_special_tokens_are_not_needed():
    from types import SimpleNamespace
    request = SimpleNamespace(tools=[{}], tool_choice="auto", skip_special_tokens=True)
    assert PARSER().adjust_request(request).skip_special_tokens is True
