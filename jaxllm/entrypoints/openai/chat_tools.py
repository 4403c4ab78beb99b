"""Tool calls and reasoning in chat completions.

`tool_choice` modes: "none" (plain text), "auto" (the model's own text, parsed by the
--tool-call-parser), "required" and a named function (forced: the output is
constrained to a JSON array of calls, or to the function's arguments, so the
arguments always parse and match the schema, as vLLM does). The --reasoning-parser
splits the thinking text off first; what follows it is the content the tool parser
reads. `ChoiceParser` turns one choice's text into OpenAI's message, whole or as
stream deltas; at the end of a stream it sends what the incremental parsers held
back, so the streamed pieces add up to the whole message.
"""
from __future__ import annotations

import json
from typing import Any

from jaxllm.entrypoints.openai.errors import bad_request
from jaxllm.entrypoints.openai.tool_parsers import make_tool_call_id
from jaxllm.sampling_params import StructuredOutputsParams


def tool_mode(request) -> str:
    """none | auto | required | named."""
    choice = request.tool_choice
    if not request.tools or choice == "none":
        return "none"
    if choice is None or choice == "auto":
        return "auto"
    return "required" if choice == "required" else "named"


def check_tools(request) -> None:
    """400s naming the field: a choice without tools, a named function not in tools,
    a function whose parameters are not a JSON schema the grammar library takes."""
    from jaxllm.structured_output import validate
    tools, choice = request.tools or [], request.tool_choice
    if choice not in (None, "none") and not tools:
        raise bad_request("'tool_choice' needs 'tools'.", param="tool_choice")
    names = [t.function.name for t in tools]
    if hasattr(choice, "function") and choice.function.name not in names:
        raise bad_request(f"tool_choice names the function {choice.function.name!r}, which "
                          f"is not in 'tools' ({', '.join(names) or 'none'}).",
                          param="tool_choice.function.name")
    for i, tool in enumerate(tools):
        if tool.function.parameters is not None:
            try:
                validate(StructuredOutputsParams(json=tool.function.parameters))
            except ValueError as e:
                message = str(e).replace("structured_outputs.json", "the parameters")
                raise bad_request(f"tools[{i}].function.parameters: {message}",
                                  param=f"tools.{i}.function.parameters") from None


def template_tools(request) -> list[dict] | None:
    """The tools as chat templates take them (HF apply_chat_template(tools=...))."""
    if not request.tools:
        return None
    return [t.model_dump(exclude_none=True) for t in request.tools]


def forced_constraint(request) -> StructuredOutputsParams | None:
    """The structured output that forces the call(s) of "required" or a named choice."""
    mode = tool_mode(request)
    if mode == "named":
        name = request.tool_choice.function.name
        fn = next(t.function for t in request.tools if t.function.name == name)
        return StructuredOutputsParams(json=fn.parameters or {"type": "object"},
                                       disable_any_whitespace=True)
    if mode != "required":
        return None
    items = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"enum": [t.function.name]},
                             "parameters": t.function.parameters or {"type": "object"}}}
             for t in request.tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if request.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def _call_dict(index: int | None, call_id: str, name: str, arguments: str) -> dict:
    out = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    return out if index is None else {"index": index, **out}


class ChoiceParser:
    """One choice's text -> OpenAI's message fields (content, reasoning, tool_calls)."""

    def __init__(self, request, tool_parser_cls=None, reasoning_parser_cls=None, tokenizer=None,
                 prompt_end: str = ""):
        self.request = request
        self.mode = tool_mode(request)
        self.tools = tool_parser_cls(tokenizer) if self.mode == "auto" and tool_parser_cls \
            else None
        self.reasoner = reasoning_parser_cls(tokenizer) if reasoning_parser_cls else None
        if self.reasoner is not None:
            self.reasoner.set_prompt(prompt_end)
        # What a stream has sent: text, reasoning, content fed on, content, calls.
        self._text = self._reasoning = self._content_in = self._content = ""
        self._calls: list[list] = []          # [id, name, arguments sent]

    # ------------------------------------------------------------ whole replies
    def _split(self, text: str) -> tuple[str | None, str]:
        if self.reasoner is None:
            return None, text
        reasoning, content = self.reasoner.extract_reasoning(text, self.request)
        return reasoning, content or ""

    def _calls_of(self, content: str) -> tuple[list[tuple[str, str]], str | None]:
        """([(name, arguments)], content left) of the content after reasoning."""
        if self.mode == "named":
            return [(self.request.tool_choice.function.name, content)], None
        if self.mode == "required":
            try:
                calls = json.loads(content)
                return [(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                        for c in calls], None
            except (ValueError, TypeError, KeyError):
                return [], content          # cut by max_tokens: the text as it is
        if self.tools is not None:
            info = self.tools.extract_tool_calls(content, self.request)
            calls = [(c.function.name, c.function.arguments) for c in info.tool_calls]
            # The parser's content either way: its stream adds up to it (stripped).
            return (calls if info.tools_called else []), info.content or ""
        return [], content

    def message(self, text: str) -> dict:
        reasoning, content = self._split(text)
        calls, content = self._calls_of(content)
        if calls and not content:
            content = None              # OpenAI: a reply of calls only has no content
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        if calls:
            message["tool_calls"] = [_call_dict(None, make_tool_call_id(), n, a)
                                     for n, a in calls]
        if reasoning is not None:
            message["reasoning"] = message["reasoning_content"] = reasoning
        return message

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """vLLM's: "tool_calls" when auto parsing found calls, or a required choice ended."""
        if reason is not None and called and (
                self.mode == "auto" or (self.mode == "required" and reason == "stop")):
            return "tool_calls"
        return reason

    # ------------------------------------------------------------ streams
    @property
    def called(self) -> bool:
        return bool(self._calls)

    def delta(self, piece: str, finished: bool) -> dict:
        """The delta fields for a new piece of text (and, when finished, for what was
        held back); {} when there is nothing to send yet."""
        previous, self._text = self._text, self._text + piece
        out: dict[str, Any] = {}
        content_piece = piece
        if self.reasoner is not None:
            reasoning, content_piece = self.reasoner.extract_reasoning_streaming(
                previous, self._text, piece)
            reasoning, content_piece = reasoning or "", content_piece or ""
            if finished:       # what the incremental parser held back
                final_r, final_c = self._split(self._text)
                sent, fed = self._reasoning + reasoning, self._content_in + content_piece
                if (final_r or "").startswith(sent):
                    reasoning += (final_r or "")[len(sent):]
                if final_c.startswith(fed):
                    content_piece += final_c[len(fed):]
            if reasoning:
                self._reasoning += reasoning
                out["reasoning"] = out["reasoning_content"] = reasoning
        self._content_stage(content_piece or "", finished, out)
        return out

    def _content_stage(self, piece: str, finished: bool, out: dict) -> None:
        previous, self._content_in = self._content_in, self._content_in + piece
        if self.mode == "none" or (self.mode == "auto" and self.tools is None):
            self._send_content(piece, out)
        elif self.mode == "named":
            if not self._calls:
                self._calls.append(
                    [make_tool_call_id(), self.request.tool_choice.function.name, ""])
                out["tool_calls"] = [_call_dict(0, self._calls[0][0], self._calls[0][1], "")]
            self._send_arguments(0, self._calls[0][2] + piece, out)
        elif self.mode == "auto":
            delta = self.tools.extract_tool_calls_streaming(previous, self._content_in, piece,
                                                            self.request)
            if delta is not None:
                self._send_content(delta.content or "", out)
                for call in delta.tool_calls:
                    self._stream_call(call, out)
        if finished and self.mode != "none":
            self._reconcile(out)

    def _send_content(self, text: str, out: dict) -> None:
        if text:
            self._content += text
            out["content"] = out.get("content", "") + text

    def _stream_call(self, call, out: dict) -> None:
        while call.index >= len(self._calls):
            self._calls.append([call.id or make_tool_call_id(), None, ""])
        entry = self._calls[call.index]
        fn = call.function
        if fn is not None and fn.name and entry[1] is None:
            entry[1] = fn.name
            out.setdefault("tool_calls", []).append(_call_dict(call.index, entry[0], fn.name, ""))
        if fn is not None and fn.arguments:
            self._send_arguments(call.index, entry[2] + fn.arguments, out)

    def _send_arguments(self, index: int, arguments: str, out: dict) -> None:
        entry = self._calls[index]
        if arguments.startswith(entry[2]) and len(arguments) > len(entry[2]):
            fragment, entry[2] = arguments[len(entry[2]):], arguments
            calls = out.setdefault("tool_calls", [])
            mine = next((c for c in calls if c["index"] == index), None)
            if mine is None:
                calls.append({"index": index, "function": {"arguments": fragment}})
            else:
                mine["function"]["arguments"] += fragment

    def _reconcile(self, out: dict) -> None:
        """At the end: whatever the whole-reply parse has that was not sent yet."""
        calls, content = self._calls_of(self._content_in)
        if content and content.startswith(self._content):
            self._send_content(content[len(self._content):], out)
        for i, (name, arguments) in enumerate(calls):
            if i >= len(self._calls) or self._calls[i][1] is None:
                if i >= len(self._calls):
                    self._calls.append([make_tool_call_id(), None, ""])
                self._calls[i][1] = name
                out.setdefault("tool_calls", []).append(
                    _call_dict(i, self._calls[i][0], name, ""))
            self._send_arguments(i, arguments, out)
