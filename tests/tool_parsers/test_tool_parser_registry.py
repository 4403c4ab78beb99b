"""The names vLLM users pass to --tool-call-parser, and the request as parsers read it."""
from __future__ import annotations

import pydantic
import pytest

from jaxllm.entrypoints.openai.tool_parsers import ToolParser, ToolParserManager
from jaxllm.entrypoints.openai.tool_parsers.utils import tool_parameters


def test_importing_the_package_registers_every_parser():
    names = {"hermes", "qwen3_xml", "llama3_json", "mistral", "pythonic"}
    assert names <= set(ToolParserManager.tool_parsers)
    for name in names:
        assert issubclass(ToolParserManager.get_tool_parser(name), ToolParser)
    with pytest.raises(KeyError, match="known: .*hermes"):
        ToolParserManager.get_tool_parser("nope")


class Function(pydantic.BaseModel):
    name: str
    parameters: dict | None = None


class Tool(pydantic.BaseModel):
    type: str = "function"
    function: Function


class Request(pydantic.BaseModel):
    tools: list[Tool] | None = None
    tool_choice: str | None = "auto"
    skip_special_tokens: bool | None = None


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}}


def test_tools_as_pydantic_models_or_dicts():
    as_models = Request(tools=[Tool(function=Function(name="f", parameters=SCHEMA))])
    as_dicts = {"tools": [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}]}
    assert tool_parameters(as_models, "f") == SCHEMA
    assert tool_parameters(as_dicts, "f") == SCHEMA
    assert tool_parameters(as_models, "g") is None
    assert tool_parameters(Request(), "f") is None and tool_parameters(None, "f") is None
    parser = ToolParserManager.get_tool_parser("qwen3_xml")()
    text = "<tool_call>\n<function=f>\n<parameter=n>\n5\n</parameter>\n</function>\n</tool_call>"
    assert parser.extract_tool_calls(text, as_models).tool_calls[0].function.arguments == '{"n": 5}'


@pytest.mark.parametrize("name, keeps", [
    ("hermes", True), ("qwen3_xml", True), ("mistral", True),
    ("llama3_json", False), ("pythonic", False)])
def test_adjust_request_on_the_pydantic_request(name, keeps):
    request = Request(tools=[Tool(function=Function(name="f"))])
    out = ToolParserManager.get_tool_parser(name)().adjust_request(request)
    assert out is request and request.skip_special_tokens is (False if keeps else None)
    plain = Request()              # no tools: nothing to keep them for
    ToolParserManager.get_tool_parser(name)().adjust_request(plain)
    assert plain.skip_special_tokens is None


def _tokenizer(special: bool):
    """A word-level tokenizer whose call markers are added tokens, special or not."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    markers = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"]
    if special:
        fast.add_special_tokens({"additional_special_tokens": markers})
    else:
        fast.add_tokens(markers)
    return fast


@pytest.mark.parametrize("special", [False, True])
@pytest.mark.parametrize("name", ["hermes", "qwen3_xml", "mistral"])
def test_special_tokens_kept_only_when_the_markers_are_special(name, special):
    request = Request(tools=[Tool(function=Function(name="f"))])
    ToolParserManager.get_tool_parser(name)(_tokenizer(special)).adjust_request(request)
    assert request.skip_special_tokens is (False if special else None)
