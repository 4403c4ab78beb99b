"""What a reasoning parser is: the model's text in, (reasoning, content) out, once for
a whole reply and incrementally for a stream. One parser object serves one request."""
from __future__ import annotations

from typing import Callable


class ReasoningParser:
    """Subclass per format; register with @ReasoningParserManager.register_module(name).

    extract_reasoning: (reasoning or None, content or None) of a whole reply.
    extract_reasoning_streaming: per streamed piece (text before it, after it, the
    piece) -> (reasoning piece or None, content piece or None); concatenated they equal
    extract_reasoning of the final text. Text that may still be a tag is held back."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer

    def set_prompt(self, prompt: str) -> None:
        """Optional, before the first piece: the rendered prompt, for parsers whose
        reasoning block the chat template may open in the prompt (then the reply
        starts inside it, without the opening tag). Parsers that need not know ignore it."""

    def extract_reasoning(self, model_output: str, request=None) -> tuple[str | None, str | None]:
        raise NotImplementedError

    def extract_reasoning_streaming(self, previous_text: str, current_text: str,
                                    delta_text: str) -> tuple[str | None, str | None]:
        raise NotImplementedError


class ReasoningParserManager:
    reasoning_parsers: dict[str, type[ReasoningParser]] = {}

    @classmethod
    def register_module(cls, name: str) -> Callable[[type], type]:
        def register(parser: type) -> type:
            cls.reasoning_parsers[name] = parser
            return parser
        return register

    @classmethod
    def get_reasoning_parser(cls, name: str) -> type[ReasoningParser]:
        if name not in cls.reasoning_parsers:
            raise KeyError(f"unknown reasoning parser {name!r}; known: "
                           f"{', '.join(sorted(cls.reasoning_parsers))}")
        return cls.reasoning_parsers[name]
