"""Random replies, stitched from pieces of every format or mutated from valid ones:
no parser raises, every call it returns has a JSON object for arguments, the stream
does not depend on how the text is split, and what streamed is a prefix of the
whole-reply result (plus at most one call malformed after its name went out)."""
from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
from tool_stream_helpers import stream

from jaxllm.entrypoints.openai.tool_parsers import ToolParserManager

PIECES = [
    "<tool_call>", "</tool_call>", "\n", " ", "<function=f>", "</function>", "<parameter=n>",
    "</parameter>", "<parameter=s>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "abcDEF123",
    "<|python_tag|>", ";", "[", "]", "(", ")", "{", "}", ",", ":", '"', "'", "\\", "name",
    '"name"', '"arguments"', '"parameters"', '"f"', "f", "x=1", "y='a)'", "1", "-2.5e3",
    "true", "null", "NaN", "é", "東京", "😀", "<", ">", "text", '{"name": "f", "arguments": ',
    '{"a": [1, {"b": "c"}]}', "[f(a=1)]", "<think>", "</think>", '\\"', "\\u00e9", "\\ud83d",
]
REQUEST = SimpleNamespace(tools=[{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}}}}])
VALID = {
    "hermes": ['Sure.\n<tool_call>\n{"name": "f", "arguments": {"s": "é \\"x\\"", "n": [1, {}]}}'
               '\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'],
    "qwen3_xml": ["Ok.\n<tool_call>\n<function=f>\n<parameter=n>\n3\n</parameter>\n<parameter=s>"
                  "\na < b\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=g>"
                  "\n</function>\n</tool_call>"],
    "llama3_json": ['<|python_tag|>{"name": "f", "parameters": {"n": 1}}; '
                    '{"name": "g", "arguments": {"s": ["東京"]}}'],
    "mistral": ['Hm.[TOOL_CALLS]f[ARGS]{"n": 1}[TOOL_CALLS]g[CALL_ID]abcDEF123[ARGS]{}',
                '[TOOL_CALLS][{"name": "f", "arguments": {"n": 1}}, '
                '{"name": "g", "arguments": {}}]'],
    "pythonic": ["[f(n=1, s='a)'), g(x=[1, {'a': (2, 3)}], y=\"\"\"q\"\"\")]"],
}
NAMES = list(VALID)


def _reply(rng: random.Random) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 25)))


def _without_ids(result) -> tuple[str, list[tuple[str, str]]]:
    content, calls = result
    return content, [(c["name"], c["arguments"]) for c in calls]


def _random_split(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 6)))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def _mutant(rng: random.Random, text: str) -> str:
    for _ in range(rng.randint(1, 3)):
        k, op = rng.randrange(len(text) + 1), rng.randrange(3)
        if op == 0:
            text = text[:k] + text[k + rng.randint(1, 5):]
        elif op == 1:
            text = text[:k] + rng.choice(PIECES) + text[k:]
        else:
            a, b = sorted((k, rng.randrange(len(text) + 1)))
            text = text[:b] + text[a:b] + text[b:]
    return text


@pytest.mark.parametrize("mutants", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_random_replies(name, mutants):
    parser_cls = ToolParserManager.get_tool_parser(name)
    rng = random.Random(name)
    for _ in range(300):
        text = _mutant(rng, rng.choice(VALID[name])) if mutants else _reply(rng)
        request = REQUEST if rng.random() < 0.5 else None
        info = parser_cls().extract_tool_calls(text, request)
        for call in info.tool_calls:
            assert isinstance(json.loads(call.function.arguments), dict), text
        by_char = _without_ids(stream(parser_cls(), list(text), request))
        assert by_char == _without_ids(stream(parser_cls(), _random_split(rng, text), request))
        content, calls = by_char
        assert (info.content or "").startswith(content), text
        final = [(c.function.name, c.function.arguments) for c in info.tool_calls]
        assert calls[:len(final)] == final and len(calls) <= len(final) + 1, text


@pytest.mark.parametrize("name", NAMES)
def test_the_replies_mutated_are_valid(name):
    for text in VALID[name]:
        info = ToolParserManager.get_tool_parser(name)().extract_tool_calls(text, REQUEST)
        assert [c.function.name for c in info.tool_calls] == ["f", "g"]
