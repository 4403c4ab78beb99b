"""Llama 3.1/3.2/3.3 JSON tool calls (--tool-call-parser llama3_json):

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

The reply is calls when it starts (after whitespace) with <|python_tag|> or "{": one
JSON object per call, "parameters" or "arguments", several separated by ";". Anything
else is content; so is text after the last call. <|python_tag|> is a special token:
with skip_special_tokens the reply starts at the "{", which reads the same.
"""
from __future__ import annotations

from jaxllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParserManager
from jaxllm.entrypoints.openai.tool_parsers.json_stream import CallObject
from jaxllm.entrypoints.openai.tool_parsers.utils import ScanningToolParser

PYTHON_TAG = "<|python_tag|>"


@ToolParserManager.register_module("llama3_json")
class Llama3JsonToolParser(ScanningToolParser):

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        self.state = "start"        # start | object | body | between | text
        self.call: CallObject | None = None
        self.call_start = 0

    def _scan(self, final: bool) -> None:
        steps = {"start": self._start, "object": self._object, "body": self._body,
                 "between": self._between, "text": self._text}
        while not self.raw and steps[self.state](final):
            pass

    def _start(self, final: bool) -> bool:
        j = self._skip_ws(self.pos)
        tail = self.text[j:]
        if not final and (not tail or (PYTHON_TAG.startswith(tail) and tail != PYTHON_TAG)):
            return False
        self.call_start = j
        if tail.startswith(PYTHON_TAG):
            self.pos, self.state = j + len(PYTHON_TAG), "object"
        else:
            self.state = "object" if tail.startswith("{") else "text"
        return True

    def _object(self, final: bool) -> bool:
        j = self._skip_ws(self.pos)
        if j == len(self.text) and not final:
            return False
        if not self.text.startswith("{", j):
            self._fail(self.call_start)
            return False
        self.pos, self.call, self.state = j, CallObject(), "body"
        return True

    def _body(self, final: bool) -> bool:
        return self._feed_call(final, "between")

    def _between(self, final: bool) -> bool:
        j = self._skip_ws(self.pos)
        if j == len(self.text):
            return False
        if self.text[j] == ";":
            self.pos = self.call_start = j + 1
            self.state = "object"
        else:
            self.state = "text"
        return True

    def _text(self, final: bool) -> bool:
        self._content(len(self.text))
        return False
