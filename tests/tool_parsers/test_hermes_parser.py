"""hermes: Qwen2.5/Qwen3/Hermes `<tool_call>` JSON blocks, on replies as those models
write them."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from tool_stream_helpers import calls_of, check_streaming, parse

from jaxllm.entrypoints.openai.tool_parsers import ToolParserManager

PARSER = ToolParserManager.get_tool_parser("hermes")

WEATHER = ('<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Boston, MA", '
           '"unit": "fahrenheit"}}\n</tool_call>')
TWO = ("I'll check both cities for you.\n\n"
       '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
       '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京", "days": 3}}\n</tool_call>')
UNICODE = ('<tool_call>\n{"name": "send_message", "arguments": {"to": "José", "text": '
           '"Caf\\u00e9 \\u2615 at 5? \\"Yes\\" \\\\o/ \\ud83d\\ude00\\nSee you", '
           '"raw": "naïve 😀"}}\n</tool_call>')
NESTED = ('<tool_call>\n{"name": "search_products", "arguments": {"query": "laptop", "filter": '
          '{"tags": ["a", "b"], "price": {"min": 1.5e3, "max": -2, "cur": "EUR"}}, '
          '"flags": [true, false, null], "page": 0}}\n</tool_call>')
COMPACT = '<tool_call>{"name":"f","arguments":{"a":1,"b":[{}, []]}}</tool_call>'
AROUND = ('Let me look that up.\n<tool_call>\n{"name": "lookup", "arguments": {"id": 7}}\n'
          '</tool_call>\nI will report back once I have the result.')


@pytest.mark.parametrize("text, content, calls", [
    (WEATHER, None,
     [("get_current_weather", '{"location": "Boston, MA", "unit": "fahrenheit"}')]),
    (TWO, "I'll check both cities for you.",
     [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "東京", "days": 3}')]),
    (UNICODE, None, [("send_message", json.dumps(
        {"to": "José", "text": 'Café ☕ at 5? "Yes" \\o/ 😀\nSee you', "raw": "naïve 😀"},
        ensure_ascii=False))]),
    (NESTED, None, [("search_products", json.dumps(
        {"query": "laptop", "filter": {"tags": ["a", "b"],
                                       "price": {"min": 1500.0, "max": -2, "cur": "EUR"}},
         "flags": [True, False, None], "page": 0}))]),
    (COMPACT, None, [("f", '{"a": 1, "b": [{}, []]}')]),
    (AROUND, "Let me look that up.\n\nI will report back once I have the result.",
     [("lookup", '{"id": 7}')]),
    # The reply ended before </tool_call>: the JSON is whole, so it is a call.
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n', None, [("f", '{"a": 1}')]),
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_', None, [("f", '{"a": 1}')]),
    # Key order, arguments as a string, no arguments, "parameters", the "}" left out.
    ('<tool_call>\n{"arguments": {"q": "x"}, "name": "search"}\n</tool_call>', None,
     [("search", '{"q": "x"}')]),
    ('<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>', None,
     [("f", '{"a": 1}')]),
    ('<tool_call>\n{"name": "now"}\n</tool_call>', None, [("now", "{}")]),
    ('<tool_call>\n{"name": "f", "parameters": {"x": "y"}}\n</tool_call>', None,
     [("f", '{"x": "y"}')]),
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>', None, [("f", '{"a": 1}')]),
    ('<tool_call>\n{"name": "f", "id": 5, "arguments": {}, "extra": [1, {"k": "}"}]}\n'
     '</tool_call>', None, [("f", "{}")]),
])
def test_calls(text, content, calls):
    info = parse(PARSER, text)
    assert info.tools_called and calls_of(info) == calls
    assert info.content == content
    check_streaming(PARSER, text)


@pytest.mark.parametrize("text, held", [
    ("The weather in Paris is sunny, 22 °C.", ""),
    ("No tags: x < y and <tools> or <tool_cal> are just text.", ""),
    ("", ""),
    ("   \n", ""),
    ("Ends with a partial tag <tool_ca", " <tool_ca"),
])
def test_plain_text(text, held):
    info = parse(PARSER, text)
    assert not info.tools_called and info.content == (text.strip() or None)
    check_streaming(PARSER, text, held=held)


@pytest.mark.parametrize("text, held", [
    ("<tool_call>\nnot json at all\n</tool_call>", ""),
    ("Sure.\n<tool_call>\n[1, 2, 3]\n</tool_call>", ""),
    ('<tool_call>\n{"nam": "f", "arguments": {}}\n</tool_call>', ""),
    ('<tool_call>\n{"name": 5, "arguments": {}}\n</tool_call>', ""),
    ("<tool_call>", "<tool_call>"),
    ("Hm.\n<tool_call>\n", "\n<tool_call>"),
])
def test_malformed_before_the_name_is_content(text, held):
    info = parse(PARSER, text)
    assert not info.tools_called and info.content == text.strip()
    check_streaming(PARSER, text, held=held)


CUT = '<tool_call>\n{"name": "f", "arguments": {"a": "cut by max_tokens'


@pytest.mark.parametrize("text, held", [
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1,,}}\n</tool_call>', ""),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"]}\n</tool_call>', ""),
    ('<tool_call>\n{"name": "f", "arguments": {"a": NaN}}\n</tool_call>', ""),
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}} trailing\n</tool_call>', ""),
    ('<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>', ""),
    (CUT, CUT),                 # only the end of the reply says it never closes
])
def test_malformed_after_the_name_is_content(text, held):
    info = parse(PARSER, text)
    assert not info.tools_called and info.content == text.strip()
    check_streaming(PARSER, text, dangling=True, held=held)


def test_a_malformed_call_keeps_the_calls_before_it():
    text = ('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\nbroken\n</tool_call>')
    info = parse(PARSER, text)
    assert calls_of(info) == [("a", "{}")]
    assert info.content == "<tool_call>\nbroken\n</tool_call>"
    check_streaming(PARSER, text)


def test_arguments_stream_before_the_call_ends():
    parser, sent = PARSER(), []
    previous = ""
    for ch in NESTED:
        delta = parser.extract_tool_calls_streaming(previous, previous + ch, ch)
        previous += ch
        if delta and delta.tool_calls and delta.tool_calls[0].function.arguments:
            sent.append(len(previous))
    assert len(sent) > 20 and sent[0] < len(NESTED) // 2


def test_adjust_request_keeps_special_tokens():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    request = SimpleNamespace(tools=tools, tool_choice="auto", skip_special_tokens=True)
    assert PARSER().adjust_request(request).skip_special_tokens is False
    request = SimpleNamespace(tools=tools, tool_choice="none", skip_special_tokens=True)
    assert PARSER().adjust_request(request).skip_special_tokens is True
    assert PARSER().adjust_request(None) is None
