"""Reasoning parsers (--reasoning-parser): the thinking text apart from the answer;
importing this package registers every one."""
from jaxllm.reasoning.abstract_reasoning_parser import (  # noqa: F401
    ReasoningParser, ReasoningParserManager)
from jaxllm.reasoning import (  # noqa: F401  (they register)
    deepseek_r1_reasoning_parser, qwen3_reasoning_parser)
