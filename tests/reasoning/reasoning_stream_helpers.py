"""Streams a reply through a reasoning parser in every way it can arrive."""
from __future__ import annotations

from stream_splits import splits  # noqa: F401  (the tests import it from here)


def stream(parser, pieces) -> tuple[str, str]:
    reasoning, content, previous = "", "", ""
    for piece in pieces:
        current = previous + piece
        r, c = parser.extract_reasoning_streaming(previous, current, piece)
        previous = current
        assert r != "" and c != "", "empty pieces instead of None"
        reasoning += r or ""
        content += c or ""
    return reasoning, content


def check_streaming(parser_cls, text: str, prompt: str | None = None, held: str = "") -> None:
    """Every split streams what extract_reasoning gives for the whole reply, except
    `held`: the content's end that only the end of the reply decides (the server
    sends it from the whole-reply parse)."""
    def make():
        parser = parser_cls()
        if prompt is not None:
            parser.set_prompt(prompt)
        return parser

    want_r, want_c = make().extract_reasoning(text)
    for pieces in splits(text):
        parser = make()
        reasoning, content = stream(parser, pieces)
        assert reasoning == (want_r or ""), (pieces, reasoning)
        assert content + held == (want_c or ""), (pieces, content)
        assert parser.extract_reasoning(text) == (want_r, want_c)
