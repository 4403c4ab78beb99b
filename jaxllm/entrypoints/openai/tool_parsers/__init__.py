"""Tool-call parsers (--tool-call-parser): one module per format, registered by name
when this package is imported."""
from jaxllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (  # noqa: F401
    DeltaFunctionCall, DeltaMessage, DeltaToolCall, ExtractedToolCallInformation,
    FunctionCall, ToolCall, ToolParser, ToolParserManager, make_tool_call_id)
from jaxllm.entrypoints.openai.tool_parsers import (  # noqa: F401  (they register)
    hermes_tool_parser, llama3_json_tool_parser, mistral_tool_parser, pythonic_tool_parser,
    qwen3xml_tool_parser)
