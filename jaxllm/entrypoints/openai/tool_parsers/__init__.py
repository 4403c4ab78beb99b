"""Tool-call parsers (--tool-call-parser): one module per format, registered by name."""
from jaxllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (  # noqa: F401
    DeltaFunctionCall, DeltaMessage, DeltaToolCall, ExtractedToolCallInformation,
    FunctionCall, ToolCall, ToolParser, ToolParserManager, make_tool_call_id)
