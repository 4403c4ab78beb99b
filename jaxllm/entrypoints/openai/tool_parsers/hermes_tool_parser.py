"""Hermes / Qwen2.5 / Qwen3 tool calls (--tool-call-parser hermes):

    Let me check.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"tz": "CET"}}
    </tool_call>

Text outside the blocks is content. The name streams as soon as it is read, the
arguments as they are written. A last block whose </tool_call> never came (the reply
ended) still counts when its JSON is complete.
"""
from __future__ import annotations

from jaxllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParserManager
from jaxllm.entrypoints.openai.tool_parsers.json_stream import CallObject
from jaxllm.entrypoints.openai.tool_parsers.utils import (
    ScanningToolParser, keep_special_tokens)
from jaxllm.streaming_text import partial_tag_start

START, END = "<tool_call>", "</tool_call>"


@ToolParserManager.register_module("hermes")
class Hermes2ProToolParser(ScanningToolParser):

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        self.state = "text"             # text | body (the JSON) | close (</tool_call>)
        self.call: CallObject | None = None
        self.call_start = 0

    def adjust_request(self, request):
        # Hermes-2-Pro/-3 mark <tool_call> a special token: decoded with
        # skip_special_tokens it would vanish and the call read as plain JSON content.
        # (Qwen's tokenizers show it either way; their requests are left alone.)
        return keep_special_tokens(request, self.tokenizer, (START, END))

    def _scan(self, final: bool) -> None:
        while not self.raw:
            step = {"text": self._text, "body": self._body, "close": self._close}[self.state]
            if not step(final):
                return

    def _text(self, final: bool) -> bool:
        i = self.text.find(START, self.pos)
        if i == -1:
            self._content(len(self.text) if final
                          else partial_tag_start(self.text, self.pos, (START,)))
            return False
        self._content(i)
        self.call_start, self.pos = i, i + len(START)
        self.call, self.state = CallObject(), "body"
        return True

    def _body(self, final: bool) -> bool:
        rest = self.call.feed(self.text[self.pos:])
        self._call_events(self.call)
        if self.call.error:
            self._fail(self.call_start)
            return False
        if self.call.done:
            self.pos, self.state = len(self.text) - len(rest), "close"
            return True
        self.pos = len(self.text)
        if final:
            if self.call.finish():
                self._end_call()
            else:
                self._fail(self.call_start)
        return False

    def _close(self, final: bool) -> bool:
        j = self._skip_ws(self.pos)
        tail = self.text[j:]
        if tail.startswith(END):
            self.pos, self.state = j + len(END), "text"
            self._end_call()
            return True
        if END.startswith(tail):            # nothing yet, or part of </tool_call>
            if final:                       # the reply ended without it: still a call
                self.pos = len(self.text)
                self._end_call()
            return False
        self._fail(self.call_start)
        return False
