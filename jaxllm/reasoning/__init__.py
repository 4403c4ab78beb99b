"""Reasoning parsers (--reasoning-parser): the thinking text apart from the answer."""
from jaxllm.reasoning.abstract_reasoning_parser import (  # noqa: F401
    ReasoningParser, ReasoningParserManager)
