"""mistral: [TOOL_CALLS] as each tokenizer version writes it (v3/v7 JSON array, v11
name[CALL_ID]id[ARGS]{...}, v13+ name[ARGS]{...})."""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from tool_stream_helpers import calls_of, check_streaming, parse

from jaxllm.entrypoints.openai.tool_parsers import ToolParserManager

PARSER = ToolParserManager.get_tool_parser("mistral")

V3 = ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Zürich"}, "id": "abcDEF123"}, '
      '{"name": "get_weather", "arguments": {"city": "Bern"}, "id": "xyzXYZ789"}]')
V11 = ('[TOOL_CALLS]get_weather[CALL_ID]abcDEF123[ARGS]{"city": "Zürich"}'
       '[TOOL_CALLS]get_weather[CALL_ID]xyzXYZ789[ARGS]{"city": "Bern"}')
V13 = ('[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich", "unit": "c"}'
       '[TOOL_CALLS]search[ARGS]{"query": "café \\"best\\"", "filters": {"tags": ["a", "b"], '
       '"max": 3}}')
SEARCH = ("search", '{"query": "café \\"best\\"", "filters": {"tags": ["a", "b"], "max": 3}}')
ZURICH, BERN = ("get_weather", '{"city": "Zürich"}'), ("get_weather", '{"city": "Bern"}')


@pytest.mark.parametrize("text, content, calls", [
    (V3, None, [ZURICH, BERN]),
    ('[TOOL_CALLS] [{"name":"get_weather","arguments":{"city":"Zürich"}}]', None, [ZURICH]),
    ('[TOOL_CALLS]{"name": "get_weather", "arguments": {"city": "Bern"}}', None, [BERN]),
    (V11, None, [ZURICH, BERN]),
    (V13, None, [("get_weather", '{"city": "Zürich", "unit": "c"}'), SEARCH]),
    ('Let me look that up.[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich"}',
     "Let me look that up.", [ZURICH]),
    ('[TOOL_CALLS]get_weather{"city": "Bern"}', None, [BERN]),         # no [ARGS] token
    ('[TOOL_CALLS]get_time[ARGS]{}', None, [("get_time", "{}")]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Bern"}\nDone.', "Done.", [BERN]),
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Bern"}}', None, [BERN]),
])
def test_calls(text, content, calls):
    info = parse(PARSER, text)
    assert info.tools_called and calls_of(info) == calls
    assert info.content == content
    check_streaming(PARSER, text)


def test_ids_are_mistral_ids():
    for call in parse(PARSER, V13).tool_calls + parse(PARSER, V3).tool_calls:
        assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id)
    assert [c.id for c in parse(PARSER, V11).tool_calls] == ["abcDEF123", "xyzXYZ789"]


@pytest.mark.parametrize("text, held", [
    ("Paris is the capital of France.", ""),
    ("Brackets [TOOL] and [TOOLS] [TOOL_CALL] are text.", ""),
    ("[TOOL_CALLS]not a call", ""),
    ("[TOOL_CALLS][]", ""),
    ('[TOOL_CALLS]get_weather[ARGS]["Bern"]', ""),
    ("[TOOL_CALLS]", "[TOOL_CALLS]"),
    ("Almost [TOOL_CAL", " [TOOL_CAL"),
    ("[TOOL_CALLS]get_wea", "[TOOL_CALLS]get_wea"),
])
def test_content(text, held):
    info = parse(PARSER, text)
    assert not info.tools_called and info.content == text.strip()
    check_streaming(PARSER, text, held=held)


CUT = '[TOOL_CALLS]get_weather[ARGS]{"city": "Par'


@pytest.mark.parametrize("text, held", [
    ('[TOOL_CALLS]get_weather[ARGS]{"city": Paris}', ""),
    ('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1,}}]', ""),
    (CUT, CUT),
])
def test_malformed_after_the_name_is_content(text, held):
    info = parse(PARSER, text)
    assert not info.tools_called and info.content == text.strip()
    check_streaming(PARSER, text, dangling=True, held=held)


@pytest.mark.parametrize("text, content", [
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Bern"}[TOOL_CALLS]??', "[TOOL_CALLS]??"),
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Bern"}}, 42]', "42]"),
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Bern"}}; {}]', "; {}]"),
])
def test_a_malformed_call_keeps_the_calls_before_it(text, content):
    info = parse(PARSER, text)
    assert calls_of(info) == [BERN] and info.content == content
    check_streaming(PARSER, text)


def test_a_call_id_that_is_not_mistral_s_is_replaced():
    info = parse(PARSER, '[TOOL_CALLS]get_weather[CALL_ID]abc[ARGS]{"city": "Bern"}')
    assert calls_of(info) == [BERN] and re.fullmatch(r"[A-Za-z0-9]{9}", info.tool_calls[0].id)
    assert info.tool_calls[0].id != "abc"


def test_adjust_request_keeps_special_tokens():
    request = SimpleNamespace(tools=[{}], tool_choice="auto", skip_special_tokens=True)
    assert PARSER().adjust_request(request).skip_special_tokens is False
