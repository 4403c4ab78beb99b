"""JSON read incrementally and written in one canonical form.

Models write arguments with any spacing and escaping (`{"a":1}`, `{ "a" : 1.0 }`,
`"\\u00e9"`); OpenAI clients get one JSON string. Streamed fragments must add up to the
whole-reply arguments exactly, so both paths go through `JsonStreamer`: it re-writes raw
JSON as `json.dumps(value, ensure_ascii=False)` would (", " and ": " separators, strings
re-escaped, numbers through float/int), emitting each token as soon as it is certain.
The output of any split of the input is the same text. Strings are read leniently
(raw control characters are accepted, as json.loads(strict=False) does).
"""
from __future__ import annotations

import json
import math
import re
from json.encoder import encode_basestring      # what json.dumps(ensure_ascii=False) uses

_STRING_RUN = re.compile(r'[^"\\]*')
_ATOM = re.compile(r"[-+.\w]*")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_HEX4 = re.compile(r"[0-9a-fA-F]{4}")
_LOW_SURROGATE = re.compile(r"\\u[dD][c-fC-F][0-9a-fA-F]{2}")
_PARTIAL_ESCAPE = re.compile(r"\\(?:u[0-9a-fA-F]{0,3})?")
_WS = " \t\r\n"


def _escape_end(s: str, i: int) -> int:
    """End of the escape sequence at s[i] ("\\"): an index, -1 if s ends inside it
    (or where a low surrogate may still follow), -2 if it is not JSON."""
    if i + 1 >= len(s):
        return -1
    if s[i + 1] in '"\\/bfnrt':
        return i + 2
    if s[i + 1] != "u":
        return -2
    if len(s) < i + 6:
        return -1 if all(c in "0123456789abcdefABCDEF" for c in s[i + 2:]) else -2
    if not _HEX4.fullmatch(s, i + 2, i + 6):
        return -2
    if not 0xD800 <= int(s[i + 2:i + 6], 16) <= 0xDBFF:
        return i + 6
    rest = s[i + 6:i + 12]      # a high surrogate: pair it with a low one if one follows
    if len(rest) < 6 and (not rest or _PARTIAL_ESCAPE.fullmatch(rest)):
        return -1
    return i + 12 if _LOW_SURROGATE.fullmatch(rest) else i + 6


def _atom(token: str) -> str | None:
    """The canonical text of a literal or number, None if it is neither."""
    if token in ("true", "false", "null"):
        return token
    if not _NUMBER.fullmatch(token):
        return None
    value = json.loads(token)
    return None if isinstance(value, float) and math.isinf(value) else json.dumps(value)


class JsonStreamer:
    """One JSON value, fed raw text in pieces; `feed` returns the canonical text that is
    certain so far and, once the value is complete, the raw text after it.

    A number or literal is certain only when a delimiter follows, so a bare top-level
    number stays pending; every caller here reads strings, objects and arrays."""

    def __init__(self):
        self.stack: list[str] = []      # open "{" / "["
        self.state = "value"            # value | value_or_close | key | key_or_close |
        self.in_key = False             # colon | after | string
        self.first = ""                 # the value's first character
        self.pending = ""               # raw text not decided yet (an escape, an atom)
        self.done = False
        self.error = False

    def feed(self, raw: str) -> tuple[str, str]:
        s, self.pending = self.pending + raw, ""
        out: list[str] = []
        i, n = 0, len(s)
        while i < n and not self.done and not self.error:
            if self.state == "string":
                i = self._string(s, i, out)
                continue
            c = s[i]
            if c in _WS:
                i += 1
                continue
            if not self.first:
                self.first = c
            i = self._structural(s, i, out)
        return "".join(out), (s[i:] if self.done else "")

    def _string(self, s: str, i: int, out: list[str]) -> int:
        m = _STRING_RUN.match(s, i)
        if m.end() > i:
            out.append(encode_basestring(m.group())[1:-1])
        i = m.end()
        if i >= len(s):
            return i
        if s[i] == '"':
            out.append('"')
            if self.in_key:
                self.state = "colon"
            else:
                self._end_value()
            return i + 1
        j = _escape_end(s, i)
        if j == -1:
            self.pending = s[i:]
            return len(s)
        if j == -2:
            self.error = True
            return i
        out.append(encode_basestring(json.loads('"' + s[i:j] + '"'))[1:-1])
        return j

    def _structural(self, s: str, i: int, out: list[str]) -> int:
        c, state = s[i], self.state
        if state in ("value", "value_or_close"):
            if c == "]" and state == "value_or_close":
                return self._close(c, out, i)
            if c in "{[":
                self.stack.append(c)
                out.append(c)
                self.state = "key_or_close" if c == "{" else "value_or_close"
                return i + 1
            if c == '"':
                out.append(c)
                self.state, self.in_key = "string", False
                return i + 1
            m = _ATOM.match(s, i)
            if m.end() == len(s):
                self.pending = s[i:]
                return len(s)
            text = _atom(m.group())
            if text is None:
                self.error = True
                return i
            out.append(text)
            self._end_value()
            return m.end()
        if state in ("key", "key_or_close"):
            if c == "}" and state == "key_or_close":
                return self._close(c, out, i)
            if c == '"':
                out.append(c)
                self.state, self.in_key = "string", True
                return i + 1
        elif state == "colon" and c == ":":
            out.append(": ")
            self.state = "value"
            return i + 1
        elif state == "after":
            if c == ",":
                out.append(", ")
                self.state = "key" if self.stack[-1] == "{" else "value"
                return i + 1
            if c == {"{": "}", "[": "]"}[self.stack[-1]]:
                return self._close(c, out, i)
        self.error = True
        return i

    def _close(self, c: str, out: list[str], i: int) -> int:
        self.stack.pop()
        out.append(c)
        self._end_value()
        return i + 1

    def _end_value(self) -> None:
        if self.stack:
            self.state = "after"
        else:
            self.done = True


def canonical_json(raw: str) -> str | None:
    """The canonical text of one complete JSON value with nothing after it, else None."""
    streamer = JsonStreamer()
    out, rest = streamer.feed(raw + " ")        # the space ends a bare number
    return out if streamer.done and not rest.strip() else None


class CallObject:
    """One call written as a JSON object, `{"name": "f", "arguments": {...}}`, fed raw
    text in pieces. `events` collects ("name", name) once the name is read, then
    ("arguments", fragment)s: streamed as read when the name came first and the
    arguments are an object (what models write), else in one piece. Arguments may also
    be a string holding a JSON object; none at all are "{}". Other keys are skipped. A
    missing final "}" is forgiven: once name and arguments are read, anything but "," or
    "}" ends the object (`feed` returns it as the text after the object)."""

    def __init__(self, argument_keys: tuple[str, ...] = ("arguments", "parameters")):
        self.argument_keys = argument_keys
        self.state = "open"             # open | first_key | key | colon | value | after
        self.sub: JsonStreamer | None = None
        self.role = ""                  # what sub reads: key | name | arguments | skip
        self.parts: list[str] = []      # sub's canonical text (unless streamed)
        self.key: str | None = None
        self.name: str | None = None
        self.arguments: str | None = None
        self.streaming = False
        self.events: list[tuple[str, str]] = []
        self.done = False
        self.error = False

    def feed(self, raw: str) -> str:
        """Reads raw; returns the text after the object once it is complete, else ''."""
        s = raw
        while s and not (self.done or self.error):
            if self.sub is not None:
                s = self._feed_sub(s)
            elif s[0] in _WS:
                s = s.lstrip(_WS)
            else:
                s = self._step(s)
        return s if self.done else ""

    def finish(self) -> bool:
        """At the end of the text: whether the object is complete (its "}" may be left out)."""
        if not self.done and not self.error and self.sub is None and self.state == "after" \
                and self.name is not None and self.arguments is not None:
            self.done = True
        return self.done

    def _step(self, s: str) -> str:
        c, state = s[0], self.state
        if state == "open" and c == "{":
            self.state = "first_key"
            return s[1:]
        if state in ("first_key", "key") and c == '"':
            self._read("key")
            return s
        if state == "colon" and c == ":":
            self.state = "value"
            return s[1:]
        if state == "value":
            if self.key == "name" and self.name is None:
                self._read("name")
            elif self.key in self.argument_keys and self.arguments is None and not self.streaming:
                self._read("arguments")
                self.streaming = self.name is not None and c == "{"
            else:
                self._read("skip")
            return s
        if state in ("first_key", "after") and c == "}":
            self._close()
            return s[1:]
        if state == "after" and c == ",":
            self.state = "key"
            return s[1:]
        if state == "after" and self.name is not None and self.arguments is not None:
            self.done = True            # the "}" left out
            return s
        self.error = True
        return s

    def _read(self, role: str) -> None:
        self.sub, self.role, self.parts = JsonStreamer(), role, []

    def _feed_sub(self, s: str) -> str:
        sub = self.sub
        out, rest = sub.feed(s)
        if self.streaming and self.role == "arguments" and out:
            self.events.append(("arguments", out))
        if sub.error:
            self.error = True
            return ""
        self.parts.append(out)
        if not sub.done:
            return ""
        self.sub, self.state = None, "after"
        text = "".join(self.parts)
        if self.role == "key":
            self.key, self.state = json.loads(text), "colon"
        elif self.role == "name":
            self._got_name(json.loads(text))
        elif self.role == "arguments":
            self._got_arguments(text, sub.first)
        return rest

    def _got_name(self, name) -> None:
        if not isinstance(name, str) or not name:
            self.error = True
            return
        self.name = name
        self.events.append(("name", name))
        if self.arguments is not None:          # they came first
            self.events.append(("arguments", self.arguments))

    def _got_arguments(self, text: str, first: str) -> None:
        if first == '"':                        # a string holding the JSON object
            text = canonical_json(json.loads(text)) or ""
        if not text.startswith("{"):
            self.error = True
            return
        self.arguments = text
        if self.name is not None and not self.streaming:
            self.events.append(("arguments", text))

    def _close(self) -> None:
        if self.name is None:
            self.error = True
            return
        if self.arguments is None:
            self.arguments = "{}"
            self.events.append(("arguments", "{}"))
        self.done = True
