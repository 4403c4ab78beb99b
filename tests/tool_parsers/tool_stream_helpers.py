"""Streams a reply through a tool parser in every way it can arrive, and checks the
OpenAI delta protocol and the agreement with the whole-reply parse."""
from __future__ import annotations

import json

from stream_splits import splits  # noqa: F401  (the tests import it from here)

from jaxllm.entrypoints.openai.tool_parsers import ExtractedToolCallInformation


def stream(parser, pieces, request=None) -> tuple[str, list[dict]]:
    """(content, calls [{id, name, arguments}]) reassembled from the deltas, checking
    that each call's first delta, and only it, has id, type and name, and that calls
    are numbered 0, 1, ... in order."""
    content, calls, previous = "", [], ""
    for piece in pieces:
        current = previous + piece
        delta = parser.extract_tool_calls_streaming(previous, current, piece, request)
        previous = current
        if delta is None:
            continue
        assert delta.content or delta.tool_calls, "an empty delta instead of None"
        content += delta.content or ""
        for call in delta.tool_calls:
            fn = call.function
            if call.index == len(calls):
                assert call.id and call.type == "function" and fn is not None and fn.name
                calls.append({"id": call.id, "name": fn.name, "arguments": fn.arguments or ""})
            else:
                assert call.index == len(calls) - 1, "arguments for a call before the last"
                assert call.id is None and call.type is None and fn.name is None
                assert fn.arguments, "a delta with no arguments"
                calls[call.index]["arguments"] += fn.arguments
    return content, calls


def parse(parser_cls, text: str, request=None) -> ExtractedToolCallInformation:
    info = parser_cls().extract_tool_calls(text, request)
    assert info.tools_called == bool(info.tool_calls)
    for call in info.tool_calls:
        assert call.type == "function" and call.id
        args = json.loads(call.function.arguments)
        assert isinstance(args, dict)
    return info


def calls_of(info: ExtractedToolCallInformation) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in info.tool_calls]


def check_streaming(parser_cls, text: str, request=None, dangling: bool = False,
                    held: str = "") -> None:
    """Every split streams the whole-reply result: the same content and, per call,
    the same name and arguments. `held`: the content's end that the stream keeps
    back because only the end of the reply decides it (a trailing "<tool_ca", a
    block that never closed); the server sends it from the whole-reply parse.
    `dangling`: the reply is malformed only after a call's name went out, so that
    one call may have streamed too (it cannot be taken back)."""
    expected = parse(parser_cls, text, request)
    want = calls_of(expected)
    for pieces in splits(text):
        parser = parser_cls()
        content, calls = stream(parser, pieces, request)
        got = [(c["name"], c["arguments"]) for c in calls]
        assert content + held == (expected.content or ""), (pieces, content)
        if dangling:
            assert got[:len(want)] == want and len(got) <= len(want) + 1, (pieces, got)
        else:
            assert got == want, (pieces, got)
        # The whole-reply parse on the streaming parser keeps the streamed ids.
        again = parser.extract_tool_calls(text, request)
        assert [c.id for c in again.tool_calls] == [c["id"] for c in calls][:len(want)]
