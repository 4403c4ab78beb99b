"""Mistral tool calls (--tool-call-parser mistral), by tokenizer version:

    v3/v7 (Mistral-7B-v0.3, Nemo, Small-3.1):
        [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "..."}]
    v11 (Mistral-Small-3.2):
        [TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}[TOOL_CALLS]...
    v13+ (Magistral-2509, Ministral-3, Devstral-2, Medium-3.5, Small-4):
        [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

Text before (or between) the calls is content. The name form is also read without
[ARGS] (`[TOOL_CALLS]get_weather{...}`). [TOOL_CALLS], [CALL_ID] and [ARGS] are
special tokens, so the request keeps them in the text. Ids are Mistral's: 9
alphanumerics (the model's own [CALL_ID] when it writes one), as its chat templates
require of the ids they get back.
"""
from __future__ import annotations

import re
import secrets
import string

from jaxllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParserManager
from jaxllm.entrypoints.openai.tool_parsers.json_stream import CallObject, JsonStreamer
from jaxllm.entrypoints.openai.tool_parsers.utils import (
    ScanningToolParser, keep_special_tokens)
from jaxllm.streaming_text import partial_tag_start

TOOL_CALLS, CALL_ID, ARGS = "[TOOL_CALLS]", "[CALL_ID]", "[ARGS]"
_NAME = re.compile(r"[\w.\-]*")
_ID = re.compile(r"[A-Za-z0-9]*")
_ALPHANUMERIC = string.ascii_letters + string.digits


def make_mistral_tool_call_id() -> str:
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


@ToolParserManager.register_module("mistral")
class MistralToolParser(ScanningToolParser):

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        # text | tag (after [TOOL_CALLS]) | item | object | sep (array form) | name | args
        self.state = "text"
        self.in_array = False
        self.first_item = False
        self.call: CallObject | None = None
        self.args: JsonStreamer | None = None
        self.call_start = 0

    def adjust_request(self, request):
        return keep_special_tokens(request, self.tokenizer, (TOOL_CALLS, ARGS, CALL_ID))

    def make_id(self) -> str:
        return make_mistral_tool_call_id()

    def _scan(self, final: bool) -> None:
        steps = {"text": self._text, "tag": self._tag, "item": self._item,
                 "object": self._object, "sep": self._sep, "name": self._name,
                 "args": self._args}
        while not self.raw and steps[self.state](final):
            pass

    def _text(self, final: bool) -> bool:
        i = self.text.find(TOOL_CALLS, self.pos)
        if i == -1:
            self._content(len(self.text) if final
                          else partial_tag_start(self.text, self.pos, (TOOL_CALLS,)))
            return False
        self._content(i)
        self.call_start, self.pos, self.state = i, i + len(TOOL_CALLS), "tag"
        return True

    def _next_char(self, final: bool) -> str | None:
        """The next non-space character (pos moves to it); None while there is none
        yet, and fails the call when the reply ends there."""
        self.pos = self._skip_ws(self.pos)
        if self.pos < len(self.text):
            return self.text[self.pos]
        if final:
            self._fail(self.call_start)
        return None

    def _tag(self, final: bool) -> bool:
        c = self._next_char(final)
        if c is None:
            return False
        self.in_array = self.first_item = c == "["
        if c == "[":
            self.pos += 1
            self.state = "item"
        else:
            self.state = "object" if c == "{" else "name"
            self.call = CallObject()
        return True

    def _item(self, final: bool) -> bool:
        c = self._next_char(final)
        if c is None:
            return False
        if not self.first_item:                 # a later item fails on its own
            self.call_start = self.pos
        self.first_item = False
        if c != "{":
            self._fail(self.call_start)
            return False
        self.call, self.state = CallObject(), "object"
        return True

    def _object(self, final: bool) -> bool:
        return self._feed_call(final, "sep" if self.in_array else "text")

    def _sep(self, final: bool) -> bool:
        j = self._skip_ws(self.pos)
        if j == len(self.text):
            return False                        # "]" may come; a reply cut here is whole
        self.pos = j + 1
        if self.text[j] == ",":
            self.state = "item"
        elif self.text[j] == "]":
            self.state = "text"
        else:
            self._fail(j)
        return self.state != "sep"

    def _name(self, final: bool) -> bool:
        text = self.text
        end = _NAME.match(text, self.pos).end()
        call_id = None
        if text.startswith(CALL_ID, end):
            id_end = _ID.match(text, end + len(CALL_ID)).end()
            call_id = text[end + len(CALL_ID):id_end]
            marker = id_end
        else:
            marker = end
        if text.startswith(ARGS, marker):
            args_start = marker + len(ARGS)
        elif call_id is None and text.startswith("{", marker):
            args_start = marker
        else:
            tail = text[marker:]
            waiting = marker == len(text) or ARGS.startswith(tail) or \
                (call_id is None and CALL_ID.startswith(tail))
            if final or not waiting:
                self._fail(self.call_start)
            return False
        name = text[self.pos:end]
        brace = self._skip_ws(args_start)
        if brace == len(text) and not final:
            return False                        # the arguments must be an object
        if not name or not text.startswith("{", brace):
            self._fail(self.call_start)
            return False
        valid_id = call_id if call_id and len(call_id) == 9 else None
        self._begin_call(name, valid_id)
        self.pos, self.args, self.state = brace, JsonStreamer(), "args"
        return True

    def _args(self, final: bool) -> bool:
        out, rest = self.args.feed(self.text[self.pos:])
        self._arguments(out)
        if self.args.error or (final and not self.args.done):
            self._fail(self.call_start)
            return False
        if not self.args.done:
            self.pos = len(self.text)
            return False
        self.pos = len(self.text) - len(rest)
        self._end_call()
        self.state = "text"
        return True
