"""Reasoning in <think>...</think> (the Qwen3 and DeepSeek-R1 parsers).

A reply that starts with <think> is reasoning up to </think> (all of it when the
block never closes: max_tokens cut it). One that does not may already be inside a
block the chat template opened in the prompt; each parser says what it is then
(`untagged`): "reasoning" up to </think>, "content", or "undecided" (reasoning if a
</think> comes, else content; a stream holds such text back until it knows). Both
parts are stripped of surrounding whitespace; an empty part is None. The stream and
the whole reply go through the same rules, so the streamed pieces add up to
extract_reasoning of the final text.
"""
from __future__ import annotations

from jaxllm.reasoning.abstract_reasoning_parser import ReasoningParser
from jaxllm.streaming_text import TextStream, partial_tag_start


class BaseThinkingReasoningParser(ReasoningParser):
    start_token = "<think>"
    end_token = "</think>"

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        self.prompt_in_reasoning: bool | None = None    # None: not told
        self.state = "start"            # start | reasoning | undecided | content
        self.pos = 0                    # the text before it is read
        self.scan = 0                   # no </think> starts before it
        self._reasoning, self._content = TextStream(), TextStream()

    def set_prompt(self, prompt: str) -> None:
        self.prompt_in_reasoning = prompt.rfind(self.start_token) > prompt.rfind(self.end_token)

    def untagged(self) -> str:
        """What a reply without the opening tag is: reasoning | content | undecided."""
        raise NotImplementedError

    def extract_reasoning(self, model_output: str, request=None) -> tuple[str | None, str | None]:
        body = model_output.lstrip()
        mode = "reasoning" if body.startswith(self.start_token) else self.untagged()
        if body.startswith(self.start_token):
            body = body[len(self.start_token):]
        reasoning, end, content = body.partition(self.end_token)
        if mode == "content" or (mode == "undecided" and not end):
            return None, model_output.strip() or None
        return reasoning.strip() or None, content.strip() or None

    def extract_reasoning_streaming(self, previous_text: str, current_text: str,
                                    delta_text: str) -> tuple[str | None, str | None]:
        reasoning, content = [], []
        text = current_text
        while True:
            if self.state == "start":
                body = text.lstrip()
                if len(body) < len(self.start_token) and self.start_token.startswith(body):
                    break                   # may still be <think>
                if body.startswith(self.start_token):
                    self.pos = len(text) - len(body) + len(self.start_token)
                    self.state = "reasoning"
                else:
                    self.state = self.untagged()
            elif self.state == "content":
                content.append(self._content.push(text[self.pos:]))
                self.pos = len(text)
                break
            else:
                end = text.find(self.end_token, max(self.pos, self.scan))
                if end == -1:
                    self.scan = max(self.pos, len(text) - len(self.end_token) + 1)
                    if self.state == "reasoning":
                        hold = partial_tag_start(text, self.pos, (self.end_token,))
                        reasoning.append(self._reasoning.push(text[self.pos:hold]))
                        self.pos = hold
                    break
                reasoning.append(self._reasoning.push(text[self.pos:end]))
                self.pos, self.state = end + len(self.end_token), "content"
        return "".join(reasoning) or None, "".join(content) or None
