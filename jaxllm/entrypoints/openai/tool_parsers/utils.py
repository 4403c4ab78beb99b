"""What the tool parsers share: one scanner per format serves the whole reply and the
stream alike, so the streamed pieces add up to the whole-reply result by construction.

`ScanningToolParser._scan(final)` reads `self.text` from `self.pos` on, as far as it
can be sure, and reports what it finds through `_content`, `_begin_call`,
`_arguments`, `_end_call` and `_fail`. Streaming runs it on each longer prefix
(final=False: text that may still become a tag waits); the whole reply runs it once
with final=True. Content is stripped (`TextStream`); a call that turns out malformed
makes the text from its start on content, and the calls before it are kept.
"""
from __future__ import annotations

from jaxllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    DeltaFunctionCall, DeltaMessage, DeltaToolCall, ExtractedToolCallInformation,
    FunctionCall, ToolCall, ToolParser, make_tool_call_id)
from jaxllm.streaming_text import TextStream


def find_first(text: str, start: int, tags: tuple[str, ...]) -> tuple[int, str]:
    """(index, tag) of the first of the tags in text[start:]; (-1, "") if none."""
    best, found = -1, ""
    for tag in tags:
        i = text.find(tag, start)
        if i != -1 and (best == -1 or i < best):
            best, found = i, tag
    return best, found


def _field(obj, name: str):
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def tool_parameters(request, name: str) -> dict | None:
    """The JSON schema of the parameters of the request's tool `name` (tools as dicts
    in OpenAI's shape or as pydantic models); None without a request or such a tool."""
    for tool in _field(request, "tools") or []:
        function = _field(tool, "function")
        if function is not None and _field(function, "name") == name:
            parameters = _field(function, "parameters")
            return parameters if isinstance(parameters, dict) else None
    return None


def _survives_skipping(tokenizer, marker: str) -> bool:
    """Whether text decoded with skip_special_tokens still shows the marker."""
    try:
        ids = tokenizer.encode(marker, add_special_tokens=False)
        return marker in tokenizer.decode(ids, skip_special_tokens=True)
    except Exception:       # a tokenizer without HF's API: assume it would vanish
        return False


def keep_special_tokens(request, tokenizer=None, markers: tuple[str, ...] = ()):
    """Decode with special tokens kept while the model may call tools, when a call
    marker is a special token (Mistral's [TOOL_CALLS]; <tool_call> in Hermes-2-Pro's
    tokenizer): text decoded with skip_special_tokens would lose it, and the call with
    it. Left alone when the tokenizer shows every marker anyway (Qwen's <tool_call> is
    a plain added token), since kept special tokens also put others, such as the
    end-of-turn token, into the text."""
    if request is None or not hasattr(request, "skip_special_tokens") \
            or not _field(request, "tools") or _field(request, "tool_choice") == "none":
        return request
    if tokenizer is not None and markers and \
            all(_survives_skipping(tokenizer, m) for m in markers):
        return request
    request.skip_special_tokens = False
    return request


class ScanningToolParser(ToolParser):
    """A format as one scanner (see the module docstring); subclasses write `_scan`."""

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        self.request = None
        self.text = ""
        self.pos = 0                    # text before it is read
        self.raw = False                # a call was malformed: the rest is content
        self.calls: list[dict] = []     # id, name, arguments (fragments), complete
        self._out = TextStream()
        self._content_parts: list[str] = []
        self._delta_calls: dict[int, DeltaToolCall] = {}

    def _scan(self, final: bool) -> None:
        raise NotImplementedError

    def make_id(self) -> str:
        return make_tool_call_id()

    # ------------------------------------------------------------ what _scan reports
    def _content(self, end: int) -> None:
        """text[pos:end] is content."""
        piece = self._out.push(self.text[self.pos:end])
        self.pos = max(self.pos, end)
        if piece:
            self._content_parts.append(piece)

    def _begin_call(self, name: str, call_id: str | None = None) -> None:
        index = len(self.calls)
        call = {"id": call_id or self.make_id(), "name": name, "arguments": [],
                "complete": False}
        self.calls.append(call)
        self._delta_calls[index] = DeltaToolCall(
            index=index, id=call["id"], type="function",
            function=DeltaFunctionCall(name=name, arguments=""))

    def _arguments(self, fragment: str) -> None:
        if not fragment:
            return
        index = len(self.calls) - 1
        self.calls[index]["arguments"].append(fragment)
        delta = self._delta_calls.setdefault(
            index, DeltaToolCall(index=index, function=DeltaFunctionCall(arguments="")))
        delta.function.arguments += fragment

    def _end_call(self) -> None:
        self.calls[-1]["complete"] = True

    def _call_events(self, obj) -> None:
        """Report what a CallObject (json_stream) read since the last time."""
        for kind, value in obj.events:
            if kind == "name":
                self._begin_call(value)
            else:
                self._arguments(value)
        obj.events.clear()

    def _skip_ws(self, start: int) -> int:
        end = len(self.text)
        while start < end and self.text[start].isspace():
            start += 1
        return start

    def _fail(self, start: int) -> None:
        """The call that began at text[start] is malformed: all from there is content."""
        self.raw, self.pos = True, start

    def _feed_call(self, final: bool, next_state: str) -> bool:
        """Feed the text after pos to the open JSON call object (self.call); once it is
        complete, end the call and go on in `next_state`. False: wait for more text
        (or the call failed)."""
        rest = self.call.feed(self.text[self.pos:])
        self._call_events(self.call)
        if self.call.error or (final and not self.call.done and not self.call.finish()):
            self._fail(self.call_start)
            return False
        if not self.call.done:
            self.pos = len(self.text)
            return False
        self.pos = len(self.text) - len(rest)
        self._end_call()
        self.state = next_state
        return True

    # ------------------------------------------------------------ the two paths
    def _run(self, text: str, final: bool) -> None:
        self.text = text
        if not self.raw:
            self._scan(final)
        if self.raw:
            self._content(len(text))

    def extract_tool_calls(self, model_output: str, request=None) -> ExtractedToolCallInformation:
        scanner = type(self)(self.tokenizer)
        scanner.request = request
        scanner._run(model_output, final=True)
        calls = [c for c in scanner.calls if c["complete"]]
        if model_output.startswith(self.text):      # the ids this object streamed
            for call, streamed in zip(calls, self.calls):
                if call["name"] == streamed["name"]:
                    call["id"] = streamed["id"]
        return ExtractedToolCallInformation(
            tools_called=bool(calls),
            tool_calls=[ToolCall(FunctionCall(c["name"], "".join(c["arguments"])), id=c["id"])
                        for c in calls],
            content="".join(scanner._content_parts) or None)

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str,
                                     delta_text: str, request=None) -> DeltaMessage | None:
        self.request = request
        self._run(current_text, final=False)
        content = "".join(self._content_parts) or None
        calls = [self._delta_calls[i] for i in sorted(self._delta_calls)]
        self._content_parts, self._delta_calls = [], {}
        if content is None and not calls:
            return None
        return DeltaMessage(content=content, tool_calls=calls)
