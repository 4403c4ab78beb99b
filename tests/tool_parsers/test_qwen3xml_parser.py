"""qwen3_xml: Qwen3-Coder's <function=...><parameter=...> calls, with the values typed
from the request's tool schemas."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from tool_stream_helpers import calls_of, check_streaming, parse

from jaxllm.entrypoints.openai.tool_parsers import ToolParserManager

PARSER = ToolParserManager.get_tool_parser("qwen3_xml")


def _tool(name, **properties):
    return {"type": "function", "function": {
        "name": name, "description": name,
        "parameters": {"type": "object", "properties": properties}}}


REQUEST = SimpleNamespace(skip_special_tokens=True, tool_choice="auto", tools=[
    _tool("get_weather", city={"type": "string"}, days={"type": "integer"},
          metric={"type": "boolean"}),
    _tool("write_file", path={"type": "string"}, content={"type": "string"},
          mode={"type": ["string", "null"]}),
    _tool("configure", config={"type": "object"}, items={"type": "array"},
          ratio={"type": "number"}, retries={"anyOf": [{"type": "integer"}, {"type": "null"}]}),
])


def _call(name, *params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


WEATHER = _call("get_weather", ("city", "Paris"), ("days", "3"), ("metric", "true"))
CODE = 'def greet(name):\n    return f"<b>{name}</b> \\\\ done"\n'
WRITE = _call("write_file", ("path", "src/app.py"), ("content", CODE))
CONFIG = _call("configure", ("config", '{"a": {"b": [1, 2]}, "c": "d"}'),
               ("items", "[1, 'two', None]"), ("ratio", "0.5"), ("retries", "null"))
TWO = "I'll fetch both.\n\n" + WEATHER + "\n" + _call("get_weather", ("city", "Zürich 東京 😀"))


@pytest.mark.parametrize("text, content, calls", [
    (WEATHER, None, [("get_weather", '{"city": "Paris", "days": 3, "metric": true}')]),
    (WRITE, None, [("write_file", json.dumps({"path": "src/app.py", "content": CODE}))]),
    (CONFIG, None, [("configure", '{"config": {"a": {"b": [1, 2]}, "c": "d"}, '
                                  '"items": [1, "two", null], "ratio": 0.5, "retries": null}')]),
    (TWO, "I'll fetch both.", [("get_weather", '{"city": "Paris", "days": 3, "metric": true}'),
                               ("get_weather", '{"city": "Zürich 東京 😀"}')]),
    # Not decodable as the schema's type: the string stays.
    (_call("get_weather", ("days", "three"), ("metric", "True")), None,
     [("get_weather", '{"days": "three", "metric": true}')]),
    (_call("configure", ("ratio", "1e999"), ("items", "{1, 2}"), ("config", "[1]")), None,
     [("configure", '{"ratio": "1e999", "items": "{1, 2}", "config": [1]}')]),
    # A parameter the schema does not know, "null" for a string|null one.
    (_call("write_file", ("other", "7"), ("mode", "null")), None,
     [("write_file", '{"other": "7", "mode": "null"}')]),
    # Quotes, backslashes, tags that are not tags, blank lines kept inside a value.
    (_call("write_file", ("content", '\n"a" \\ b < c </para </p>\n\n')), None,
     [("write_file", json.dumps({"content": '\n"a" \\ b < c </para </p>\n\n'}))]),
    # No parameters; no <tool_call> around the function; </parameter> left out.
    ("<tool_call>\n<function=ping>\n</function>\n</tool_call>", None, [("ping", "{}")]),
    ("<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>", None,
     [("get_weather", '{"city": "Rome"}')]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n<parameter=days>\n2\n"
     "</function>\n</tool_call>", None, [("get_weather", '{"city": "Oslo", "days": 2}')]),
    # Two functions in one block; the reply ending before </tool_call>.
    ("<tool_call>\n<function=ping>\n</function>\n<function=ping>\n</function>\n</tool_call>",
     None, [("ping", "{}"), ("ping", "{}")]),
    ("<tool_call>\n<function=ping>\n</function>\n", None, [("ping", "{}")]),
    # A value without the layout newlines, an empty one.
    ("<tool_call><function=get_weather><parameter=city>Lima</parameter><parameter=days>"
     "</parameter></function></tool_call>", None,
     [("get_weather", '{"city": "Lima", "days": ""}')]),
    (WEATHER + "\nThat should do it.", "That should do it.",
     [("get_weather", '{"city": "Paris", "days": 3, "metric": true}')]),
])
def test_calls(text, content, calls):
    info = parse(PARSER, text, REQUEST)
    assert info.tools_called and calls_of(info) == calls
    assert info.content == content
    check_streaming(PARSER, text, REQUEST)


def test_without_a_request_every_value_is_a_string():
    info = parse(PARSER, CONFIG)
    assert json.loads(info.tool_calls[0].function.arguments) == {
        "config": '{"a": {"b": [1, 2]}, "c": "d"}', "items": "[1, 'two', None]",
        "ratio": "0.5", "retries": "null"}
    check_streaming(PARSER, CONFIG)
    check_streaming(PARSER, TWO)


@pytest.mark.parametrize("text, held", [
    ("Plain answer: use <function> or <tool_calls> tags, a < b.", ""),
    ("Ends in a partial tag <funct", " <funct"),
    ("<tool_call>\nhello\n</tool_call>", ""),
    ("<tool_call>\n</tool_call>", ""),
    ("<tool_call>\n<function=get weather\nx>\n</function>\n</tool_call>", ""),
    ("<tool_call>\n<function=>\n</function>\n</tool_call>", ""),
    ("<tool_call>\n<function=get_wea", "<tool_call>\n<function=get_wea"),
])
def test_malformed_before_the_name_is_content(text, held):
    info = parse(PARSER, text, REQUEST)
    assert not info.tools_called and info.content == text.strip()
    check_streaming(PARSER, text, REQUEST, held=held)


CUT = "<tool_call>\n<function=write_file>\n<parameter=content>\nhalf a fi"


@pytest.mark.parametrize("text, held", [
    ("<tool_call>\n<function=f>\ntext in the body\n</function>\n</tool_call>", ""),
    ("<tool_call>\n<function=f>\n<parameter=a\nb>\nx\n</parameter>\n</function>", ""),
    (CUT, CUT),
])
def test_malformed_after_the_name_is_content(text, held):
    info = parse(PARSER, text, REQUEST)
    assert not info.tools_called and info.content == text.strip()
    check_streaming(PARSER, text, REQUEST, dangling=True, held=held)


def test_string_values_stream_as_they_are_written():
    """vLLM #30439: the arguments must not wait for </parameter> or </function>."""
    parser, previous, fragments = PARSER(), "", []
    end = WRITE.index("</parameter>\n</function>")
    for ch in WRITE[:end]:
        delta = parser.extract_tool_calls_streaming(previous, previous + ch, ch, REQUEST)
        previous += ch
        if delta and delta.tool_calls and delta.tool_calls[0].function.arguments:
            fragments.append(delta.tool_calls[0].function.arguments)
    streamed = "".join(fragments)
    assert streamed.startswith('{"path": "src/app.py", "content": "def greet(name):\\n')
    assert len(fragments) > len(CODE) // 2


def test_typed_values_go_out_whole():
    parser, previous, fragments = PARSER(), "", []
    for ch in WEATHER:
        delta = parser.extract_tool_calls_streaming(previous, previous + ch, ch, REQUEST)
        previous += ch
        if delta and delta.tool_calls:
            fragments.append(delta.tool_calls[0].function.arguments)
    assert "3" in fragments and "true" in fragments
