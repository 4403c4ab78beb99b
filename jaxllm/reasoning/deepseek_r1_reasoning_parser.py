"""DeepSeek-R1's reasoning (--reasoning-parser deepseek_r1): `<think>` (which its
template puts in the prompt), reasoning, `</think>`, answer. The reply is reasoning
until </think>, all of it when none comes; a <think> the model writes anyway at the
start is dropped. Also the parser for templates that always open the block in the
prompt, such as Qwen3-Thinking-2507's.
"""
from __future__ import annotations

from jaxllm.reasoning.abstract_reasoning_parser import ReasoningParserManager
from jaxllm.reasoning.basic_parsers import BaseThinkingReasoningParser


@ReasoningParserManager.register_module("deepseek_r1")
class DeepSeekR1ReasoningParser(BaseThinkingReasoningParser):

    def untagged(self) -> str:
        return "reasoning"
