"""pythonic: `[f(a=1), g(b="x")]` calls, read with `ast` (literal values only)."""
from __future__ import annotations

import json

import pytest
from tool_stream_helpers import calls_of, check_streaming, parse

from jaxllm.entrypoints.openai.tool_parsers import ToolParserManager

PARSER = ToolParserManager.get_tool_parser("pythonic")

TRICKY = ('[note(text="a (b) [c] {d} \\"q\\" it\'s", raw=r\'\\d+\\)\', multi="""line1\n'
          'line2 with ) and \'\'\' inside""", empty=\'\', more="")]')


@pytest.mark.parametrize("text, content, calls", [
    ("[get_weather(city='Paris', unit=\"c\")]", None,
     [("get_weather", '{"city": "Paris", "unit": "c"}')]),
    ('[get_weather(city="San Francisco", metric=True), get_time(timezone=\'America/'
     'Los_Angeles\', formats=["iso", "unix"])]', None,
     [("get_weather", '{"city": "San Francisco", "metric": true}'),
      ("get_time", '{"timezone": "America/Los_Angeles", "formats": ["iso", "unix"]}')]),
    ('[search(query="café ☕ 東京", filters={"tags": ("a", "b"), "max": 3, "score": -1.5}, '
     'exact=None)]', None, [("search", json.dumps(
         {"query": "café ☕ 東京", "filters": {"tags": ["a", "b"], "max": 3, "score": -1.5},
          "exact": None}, ensure_ascii=False))]),
    ("[ping()]", None, [("ping", "{}")]),
    ("  [ ping( ) , ping() ]  ", None, [("ping", "{}"), ("ping", "{}")]),
    (TRICKY, None, [("note", json.dumps({
        "text": 'a (b) [c] {d} "q" it\'s', "raw": "\\d+\\)",
        "multi": "line1\nline2 with ) and ''' inside", "empty": "", "more": ""},
        ensure_ascii=False))]),
    ("[math.sqrt(x=2)]", None, [("math.sqrt", '{"x": 2}')]),
    ("[f(a=1),]", None, [("f", '{"a": 1}')]),
    ("[f(a=1)]\nI called f for you.", "I called f for you.", [("f", '{"a": 1}')]),
    ("[f(a=1), g(b=[1, 2])", None, [("f", '{"a": 1}'), ("g", '{"b": [1, 2]}')]),  # no "]"
])
def test_calls(text, content, calls):
    info = parse(PARSER, text)
    assert info.tools_called and calls_of(info) == calls
    assert info.content == content
    check_streaming(PARSER, text)


@pytest.mark.parametrize("text, held", [
    ("The answer is [1, 2, 3].", ""),
    ("[1, 2, 3]", ""),
    ("[Paris] is a city", ""),
    ("[]", ""),
    ('[get_weather("Paris")]', ""),          # positional: not a call we can name
    ("[f(x=os.getcwd())]", ""),              # not a literal
    ("[f(x=1+2)]", ""),
    ("[f(x={1, 2})]", ""),                   # a set: no JSON for it
    ("[f(x=1e999)]", ""),                    # inf: no JSON for it
    ("[f(**kw)]", ""),
    ("[f(a=1]", ""),
    ("[get_weather(city='Par", "[get_weather(city='Par"),   # cut by max_tokens
    ("[get_weather", "[get_weather"),
])
def test_content(text, held):
    info = parse(PARSER, text)
    assert not info.tools_called and info.content == text.strip()
    check_streaming(PARSER, text, held=held)


def test_a_malformed_call_keeps_the_calls_before_it():
    for text in ("[f(a=1), g(1)]", "[f(a=1) g(1)]"):
        info = parse(PARSER, text)
        assert calls_of(info) == [("f", '{"a": 1}')] and info.content == "g(1)]"
        check_streaming(PARSER, text)
    cut = "[f(a=1), g(b='x"
    info = parse(PARSER, cut)
    assert calls_of(info) == [("f", '{"a": 1}')] and info.content == "g(b='x"
    check_streaming(PARSER, cut, held="g(b='x")


def test_each_call_streams_when_it_closes():
    text = "[a(x=1), b(y=2)]"
    parser, previous, seen = PARSER(), "", []
    for ch in text:
        delta = parser.extract_tool_calls_streaming(previous, previous + ch, ch)
        previous += ch
        if delta:
            seen += [(len(previous), c.function.name) for c in delta.tool_calls]
    assert seen == [(text.index(")") + 1, "a"), (text.rindex(")") + 1, "b")]
