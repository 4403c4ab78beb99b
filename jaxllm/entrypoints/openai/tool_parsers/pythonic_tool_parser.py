"""Python-call-syntax tool calls (--tool-call-parser pythonic; Llama 3.2/4, ToolACE):

    [get_weather(city='Paris', unit="c"), search(query="café", filters={"max": 3})]

The reply is calls when it starts (after whitespace) with "[" and a name and "(";
else it is content, as is text after the "]". Arguments are keywords with literal
values only (read with `ast`: strings, numbers, True/False/None, lists, tuples, dicts),
written as JSON. A call streams whole (name and arguments in one delta) once its ")"
is read: its arguments cannot be known to be literals any earlier.
"""
from __future__ import annotations

import ast
import json
import re

from jaxllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParserManager
from jaxllm.entrypoints.openai.tool_parsers.utils import ScanningToolParser

_LIST_START = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_LIST_START_PREFIX = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?")
_OPEN, _CLOSE = "([{", ")]}"


class CallEnd:
    """Finds where a call expression that starts at `start` ends, across pieces:
    brackets counted outside string literals (quotes ' " and triple quotes)."""

    def __init__(self, start: int):
        self.k = start
        self.depth = 0
        self.quote = ""

    def advance(self, text: str) -> int | None:
        """The index after the call's ")"; None while it has not come; -1 when the
        brackets do not make one call."""
        while self.k < len(text):
            c = text[self.k]
            if self.quote:
                if c == "\\":
                    if self.k + 1 >= len(text):
                        return None
                    self.k += 2
                elif text.startswith(self.quote, self.k):
                    self.k += len(self.quote)
                    self.quote = ""
                elif len(self.quote) == 3 and self.quote.startswith(text[self.k:]):
                    return None                 # maybe the end of a triple quote
                else:
                    self.k += 1
                continue
            if c in "'\"":
                if (c * 3).startswith(text[self.k:]) and len(text) - self.k < 3:
                    return None                 # '' or ''' : not known yet
                self.quote = c * 3 if text.startswith(c * 3, self.k) else c
                self.k += len(self.quote)
                continue
            self.k += 1
            if c in _OPEN:
                self.depth += 1
            elif c in _CLOSE:
                self.depth -= 1
                if self.depth < 0 or (self.depth == 0 and c != ")"):
                    return -1
                if self.depth == 0:
                    return self.k
        return None


def _dotted(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def parse_call(source: str) -> tuple[str, str] | None:
    """(name, arguments as JSON) of one `name(key=literal, ...)`; None if it is not."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
        name = _dotted(node.func) if isinstance(node, ast.Call) else None
        if name is None or node.args or any(k.arg is None for k in node.keywords):
            return None
        values = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        return name, json.dumps(values, ensure_ascii=False, allow_nan=False)
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return None


@ToolParserManager.register_module("pythonic")
class PythonicToolParser(ScanningToolParser):

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        self.state = "start"        # start | call | after | text
        self.list_start = 0
        self.call_end: CallEnd | None = None

    def _scan(self, final: bool) -> None:
        steps = {"start": self._start, "call": self._call, "after": self._after,
                 "text": self._text}
        while not self.raw and steps[self.state](final):
            pass

    def _start(self, final: bool) -> bool:
        j = self._skip_ws(self.pos)
        if _LIST_START.match(self.text, j):
            self.list_start, self.pos, self.state = j, j + 1, "call"
            self.call_end = CallEnd(self._skip_ws(j + 1))
            return True
        if not final and (j == len(self.text) or _LIST_START_PREFIX.fullmatch(self.text, j)):
            return False
        self.state = "text"
        return True

    def _call(self, final: bool) -> bool:
        start = self._skip_ws(self.pos)
        if self.calls and self.text.startswith("]", start):      # [f(x=1),]
            self.pos, self.state = start + 1, "text"
            return True
        end = self.call_end.advance(self.text)
        if end is None and not final:
            return False
        parsed = parse_call(self.text[start:end]) if end and end > 0 else None
        if parsed is None:
            self._fail(self.list_start if not self.calls else start)
            return False
        self._begin_call(parsed[0])
        self._arguments(parsed[1])
        self._end_call()
        self.pos, self.state = end, "after"
        return True

    def _after(self, final: bool) -> bool:
        j = self._skip_ws(self.pos)
        if j == len(self.text):
            return False                        # "]" may come; a reply cut here is whole
        if self.text[j] not in ",]":
            self._fail(j)
            return False
        self.pos = j + 1
        if self.text[j] == ",":
            self.call_end, self.state = CallEnd(self._skip_ws(j + 1)), "call"
        else:
            self.state = "text"
        return True

    def _text(self, final: bool) -> bool:
        self._content(len(self.text))
        return False
