"""Qwen3's reasoning (--reasoning-parser qwen3): `<think>...</think>answer`.

Qwen3 opens the block itself when thinking; with enable_thinking false its template
puts an empty block in the prompt and the reply has no tags: all content. The
Thinking-2507 templates open the block in the prompt: the reply starts inside it and
the text before </think> is reasoning. A reply without <think> is therefore
reasoning only if a </think> comes; told the prompt (set_prompt), the parser knows
at once, and streams it without holding it back.
"""
from __future__ import annotations

from jaxllm.reasoning.abstract_reasoning_parser import ReasoningParserManager
from jaxllm.reasoning.basic_parsers import BaseThinkingReasoningParser


@ReasoningParserManager.register_module("qwen3")
class Qwen3ReasoningParser(BaseThinkingReasoningParser):

    def untagged(self) -> str:
        if self.prompt_in_reasoning is None:
            return "undecided"
        return "reasoning" if self.prompt_in_reasoning else "content"
