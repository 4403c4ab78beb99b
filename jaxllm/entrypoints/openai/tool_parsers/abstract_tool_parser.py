"""What a tool-call parser is: the model's text in, OpenAI tool calls out, once for a
whole reply and incrementally for a stream. One parser object serves one request (the
streaming method keeps its state on it)."""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Callable


def make_tool_call_id() -> str:
    """OpenAI-style id of a call: "call_" and 24 random alphanumerics."""
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    return "call_" + "".join(secrets.choice(alphabet) for _ in range(24))


@dataclass
class FunctionCall:
    name: str
    arguments: str              # a JSON object, as a string (OpenAI's shape)


@dataclass
class ToolCall:
    function: FunctionCall
    id: str = field(default_factory=make_tool_call_id)
    type: str = "function"


@dataclass
class ExtractedToolCallInformation:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None          # the text outside the calls (None when there is none)


@dataclass
class DeltaFunctionCall:
    name: str | None = None
    arguments: str | None = None


@dataclass
class DeltaToolCall:
    """One call's part of a streamed delta: its first delta carries index, id, type and
    name; later ones only index and an arguments fragment."""
    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


@dataclass
class DeltaMessage:
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


class ToolParser:
    """Subclass per format and register with @ToolParserManager.register_module(name).

    extract_tool_calls: the whole reply. A reply that looks like a call but does not
    parse comes back as content, tools_called False (never an exception).
    extract_tool_calls_streaming: called per streamed piece with the text so far before
    it (previous_text), after it (current_text) and the piece (delta_text); returns what
    to send now, or None to send nothing yet (text that may still turn into a call is
    held back). Concatenated, the content and argument fragments it returns equal what
    extract_tool_calls gives for the final text."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer

    def adjust_request(self, request):
        """The request as this parser needs it (e.g. special tokens kept in the text)."""
        return request

    def extract_tool_calls(self, model_output: str, request=None) -> ExtractedToolCallInformation:
        raise NotImplementedError

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str,
                                     delta_text: str, request=None) -> DeltaMessage | None:
        raise NotImplementedError


class ToolParserManager:
    """name -> parser class (vLLM's --tool-call-parser names)."""
    tool_parsers: dict[str, type[ToolParser]] = {}

    @classmethod
    def register_module(cls, name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
        def register(parser: type[ToolParser]) -> type[ToolParser]:
            cls.tool_parsers[name] = parser
            return parser
        return register

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        if name not in cls.tool_parsers:
            raise KeyError(f"unknown tool call parser {name!r}; known: "
                           f"{', '.join(sorted(cls.tool_parsers))}")
        return cls.tool_parsers[name]
