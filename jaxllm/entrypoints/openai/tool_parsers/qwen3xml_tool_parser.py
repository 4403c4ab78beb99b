"""Qwen3-Coder's XML tool calls (--tool-call-parser qwen3_xml):

    <tool_call>
    <function=write_file>
    <parameter=path>
    src/app.py
    </parameter>
    <parameter=overwrite>
    true
    </parameter>
    </function>
    </tool_call>

One newline after <parameter=P> and one before </parameter> are layout, not value.
A value is a string unless the tool's JSON schema (request.tools) types the parameter
integer/number/boolean/object/array (or null): then it is JSON-decoded, and stays a
string when it does not decode. Arguments stream as JSON as the values are written
(vLLM #30439: Qwen3-Coder arguments not streamed): string values character by
character, typed ones whole when they end. Also read: a <function=...> without the
<tool_call> around it, a </parameter> left out, several functions in one block.
"""
from __future__ import annotations

import ast
import json
from json.encoder import encode_basestring

from jaxllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParserManager
from jaxllm.entrypoints.openai.tool_parsers.utils import (
    ScanningToolParser, find_first, keep_special_tokens, tool_parameters)
from jaxllm.streaming_text import partial_tag_start

TOOL_CALL, END_TOOL_CALL = "<tool_call>", "</tool_call>"
FUNCTION, END_FUNCTION = "<function=", "</function>"
PARAMETER, END_PARAMETER = "<parameter=", "</parameter>"
VALUE_ENDS = (END_PARAMETER, PARAMETER, END_FUNCTION)


def parameter_types(request, function: str, parameter: str) -> set[str]:
    """The JSON-schema types the request's tool allows for the parameter (type, a list
    of types, anyOf/oneOf); empty when unknown."""
    schema = tool_parameters(request, function) or {}
    properties = schema.get("properties")
    spec = properties.get(parameter) if isinstance(properties, dict) else None
    types: set[str] = set()
    stack = [spec]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        kind = node.get("type")
        types.update([kind] if isinstance(kind, str) else kind if isinstance(kind, list) else [])
        for key in ("anyOf", "oneOf"):
            stack.extend(node.get(key) or [])
    return types


def _reject_constant(name: str):
    raise ValueError(name)                      # NaN / Infinity are not JSON


def convert(value: str, types: set[str]):
    """A non-string parameter's value: JSON-decoded; the string itself if it is not
    JSON (Python literals such as True or {'a': 1} are read too)."""
    decoded = _decode(value, types)
    try:
        json.dumps(decoded, allow_nan=False)
    except ValueError:                          # 1e999 reads as inf: not JSON
        return value
    return decoded


def _decode(value: str, types: set[str]):
    text = value.strip()
    try:
        decoded = json.loads(text, parse_constant=_reject_constant)
    except ValueError:
        decoded = value
        if "boolean" in types and text.lower() in ("true", "false"):
            decoded = text.lower() == "true"
        elif types & {"object", "array"}:
            try:
                literal = ast.literal_eval(text)
                json.dumps(literal)             # a set or bytes: not JSON
                decoded = literal
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                pass
    if "integer" in types and isinstance(decoded, float) and decoded.is_integer():
        decoded = int(decoded)
    return decoded


def _tag_name(text: str, start: int, final: bool) -> tuple[int, str | None]:
    """The name of <function=NAME> / <parameter=NAME> from text[start:]: (index of ">",
    name); (-1, None) while it may still come; (-2, None) when malformed."""
    end = text.find(">", start)
    name = text[start:end if end != -1 else len(text)]
    if "\n" in name or "<" in name:
        return -2, None
    if end == -1:
        return (-2 if final else -1), None
    name = name.strip()
    return (end, name) if name else (-2, None)


@ToolParserManager.register_module("qwen3_xml")
class Qwen3XMLToolParser(ScanningToolParser):

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        self.state = "text"     # text | block | function | body | parameter | value | after
        self.in_block = False   # inside <tool_call>
        self.call_start = 0
        self.function = ""
        self.count = 0          # parameters written in this call
        self.string = True      # the value is a JSON string (streamed as written)
        self.types: set[str] = set()
        self.value_start = self.emitted = self.scan_from = 0

    def adjust_request(self, request):
        # As hermes: special tokens kept only if the tokenizer would hide the tags.
        return keep_special_tokens(request, self.tokenizer, (TOOL_CALL, END_TOOL_CALL))

    def _scan(self, final: bool) -> None:
        steps = {"text": self._text, "block": self._block, "function": self._function,
                 "body": self._body, "parameter": self._parameter, "value": self._value,
                 "after": self._after}
        while not self.raw and steps[self.state](final):
            pass

    def _expect(self, final: bool, tags: tuple[str, ...]) -> tuple[int, str]:
        """(index, tag) of the tag that comes next after whitespace; (-1, "") while it
        may still come; (-2, "") when something else comes."""
        j = self._skip_ws(self.pos)
        for tag in tags:
            if self.text.startswith(tag, j):
                return j, tag
        tail = self.text[j:]
        if not final and any(tag.startswith(tail) for tag in tags):
            return -1, ""
        return -2, ""

    def _text(self, final: bool) -> bool:
        i, tag = find_first(self.text, self.pos, (TOOL_CALL, FUNCTION))
        if i == -1:
            self._content(len(self.text) if final else
                          partial_tag_start(self.text, self.pos, (TOOL_CALL, FUNCTION)))
            return False
        self._content(i)
        self.call_start, self.pos, self.in_block = i, i + len(tag), tag == TOOL_CALL
        self.state = "block" if tag == TOOL_CALL else "function"
        return True

    def _block(self, final: bool) -> bool:
        j, tag = self._expect(final, (FUNCTION,))
        if j == -2:
            self._fail(self.call_start)
        if j < 0:
            return False
        self.pos, self.state = j + len(FUNCTION), "function"
        return True

    def _function(self, final: bool) -> bool:
        end, name = _tag_name(self.text, self.pos, final)
        if end == -2:
            self._fail(self.call_start)
        if end < 0:
            return False
        self.function, self.count = name, 0
        self._begin_call(name)
        self._arguments("{")
        self.pos, self.state = end + 1, "body"
        return True

    def _body(self, final: bool) -> bool:
        j, tag = self._expect(final, (PARAMETER, END_FUNCTION))
        if j == -2:
            self._fail(self.call_start)
        if j < 0:
            return False
        self.pos = j + len(tag)
        if tag == PARAMETER:
            self.state = "parameter"
        else:
            self._arguments("}")
            self._end_call()
            self.state = "after" if self.in_block else "text"
        return True

    def _parameter(self, final: bool) -> bool:
        end, name = _tag_name(self.text, self.pos, final)
        if end == -2:
            self._fail(self.call_start)
        if end < 0:
            return False
        self.types = parameter_types(self.request, self.function, name)
        self.string = not self.types or "string" in self.types
        key = encode_basestring(name)
        self._arguments((", " if self.count else "") + key + ": " + ('"' if self.string else ""))
        self.count += 1
        self.pos = self.value_start = self.emitted = self.scan_from = end + 1
        self.state = "value"
        return True

    def _value(self, final: bool) -> bool:
        text, start = self.text, self.value_start
        if self.emitted == start and len(text) > start and text[start] == "\n":
            self.emitted = start + 1            # the layout newline after the tag
        i, tag = find_first(text, self.scan_from, VALUE_ENDS)
        if i == -1:
            if final:
                self._fail(self.call_start)     # cut off inside a value
                return False
            hold = partial_tag_start(text, self.emitted, VALUE_ENDS)
            if hold > self.emitted and text[hold - 1] == "\n":
                hold -= 1                       # may be the layout newline before the end
            if self.string:
                self._arguments(encode_basestring(text[self.emitted:hold])[1:-1])
                self.emitted = hold
            self.scan_from = max(self.emitted, hold)
            return False
        end = i - 1 if i - 1 >= max(self.emitted, start) and text[i - 1] == "\n" else i
        if self.string:
            self._arguments(encode_basestring(text[self.emitted:end])[1:])
        else:
            value = convert(text[self.emitted:end], self.types)
            self._arguments(json.dumps(value, ensure_ascii=False))
        self.pos = i + len(tag) if tag == END_PARAMETER else i
        self.state = "body"
        return True

    def _after(self, final: bool) -> bool:
        j, tag = self._expect(final, (END_TOOL_CALL, FUNCTION))
        if j == -1 or (j == -2 and final and self._skip_ws(self.pos) == len(self.text)):
            return False                        # </tool_call> may still come, or never will
        if j == -2:                             # the call is whole; what follows is text
            self.state = "text"
            return True
        self.pos = j + len(tag)
        if tag == FUNCTION:
            self.call_start, self.state = j, "function"
        else:
            self.state = "text"
        return True
