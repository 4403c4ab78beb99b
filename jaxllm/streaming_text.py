"""Helpers for parsers that read a model's reply as it streams (tool calls, reasoning)."""
from __future__ import annotations


class TextStream:
    """Text as streamed: leading whitespace dropped, trailing whitespace held until
    more text follows, so the pieces add up to the whole text's .strip()."""

    def __init__(self):
        self.started = False
        self.pending = ""

    def push(self, s: str) -> str:
        if not self.started:
            s = s.lstrip()
            if not s:
                return ""
            self.started = True
        s = self.pending + s
        body = s.rstrip()
        self.pending = s[len(body):]
        return body


def partial_tag_start(text: str, start: int, tags: tuple[str, ...]) -> int:
    """Where a tail of text[start:] that may be the beginning of one of the tags
    starts; len(text) when there is none."""
    longest = max(map(len, tags))
    for k in range(max(start, len(text) - longest + 1), len(text)):
        tail = text[k:]
        if any(tag.startswith(tail) for tag in tags):
            return k
    return len(text)
