"""Request bodies of the OpenAI-compatible API, validated with pydantic.

Every model forbids unknown fields, so a field we do not implement is a 400 naming
it, never silently dropped. OpenAI fields that clients commonly send with their
default value (``tools: []``, ``logit_bias: {}``) are declared, and accepted only
with that value (``DEFAULT_ONLY``).

A structured-output constraint comes in one of three spellings: OpenAI's
``response_format``, vLLM's ``structured_outputs`` object, or vLLM's legacy
``guided_*`` fields. A request gives at most one constraint; it becomes
``SamplingParams.structured_outputs`` after the grammar library has checked it, so a
bad schema, regex or grammar is a 400 naming the field as the client spelled it.
"""
from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from jaxllm.entrypoints.openai.errors import APIError, bad_request
from jaxllm.entrypoints.openai.chat_tools import check_tools
from jaxllm.entrypoints.openai.structured_outputs import structured_outputs_params
from jaxllm.sampling_params import MAX_LOGPROBS, SamplingParams


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # field -> the values it may have (anything else is "not supported").
    DEFAULT_ONLY: ClassVar[dict[str, tuple]] = {}

    def check_supported(self) -> None:
        for name, allowed in self.DEFAULT_ONLY.items():
            if getattr(self, name) not in allowed:
                raise bad_request(f"'{name}' is not supported by this server; leave it unset.",
                                  param=name, code="unsupported_parameter")


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    include_obfuscation: bool | None = None

    DEFAULT_ONLY: ClassVar[dict[str, tuple]] = {"include_obfuscation": (None, False)}


class JsonSchemaResponseFormat(OpenAIBaseModel):
    """``response_format.json_schema``. ``strict`` is accepted and changes nothing: the
    schema is always enforced."""
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None

    def check_supported(self) -> None:
        if self.type != "json_schema":
            if self.json_schema is not None:
                raise bad_request("'response_format.json_schema' needs type 'json_schema'.",
                                  param="response_format.json_schema")
            return
        missing = ("response_format.json_schema" if self.json_schema is None else
                   "response_format.json_schema.schema"
                   if self.json_schema.json_schema is None else None)
        if missing:
            raise bad_request(f"Missing required parameter: '{missing}'.", param=missing,
                              code="missing_required_parameter")


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's ``structured_outputs`` field: StructuredOutputsParams' fields."""
    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None


class _SamplingRequest(OpenAIBaseModel):
    """Fields shared by chat and completions: OpenAI's, then vLLM's extras."""

    model: str | None = None
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None   # accepted and ignored, as vLLM does
    # Lower runs first under --scheduling-policy priority; != 0 on fcfs is a 400 (vLLM).
    priority: int = 0

    _SAMPLING_FIELDS: ClassVar[tuple[str, ...]] = (
        "n", "temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty",
        "top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos", "min_tokens",
        "skip_special_tokens", "include_stop_str_in_output")

    DEFAULT_ONLY: ClassVar[dict[str, tuple]] = {"logit_bias": (None, {})}

    def check_supported(self) -> None:
        super().check_supported()
        if self.stream_options is not None:
            if not self.stream:
                raise bad_request("'stream_options' is only allowed when 'stream' is true.",
                                  param="stream_options")
            self.stream_options.check_supported()
        if self.response_format is not None:
            self.response_format.check_supported()

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, defaults: dict | None = None, **extra) -> SamplingParams:
        """SamplingParams from the fields that are set, then ``defaults`` (the model's
        generation config, --generation-config) for those left null, then
        SamplingParams' own; ``extra`` is passed as is. ValueError -> 400 naming the
        field."""
        kwargs = {name: getattr(self, name) for name in self._SAMPLING_FIELDS
                  if getattr(self, name) is not None}
        for name, value in (defaults or {}).items():
            if name != "max_tokens":    # the handlers fit it to the prompt
                kwargs.setdefault(name, value)
        kwargs.update(extra, structured_outputs=structured_outputs_params(self))
        try:
            return SamplingParams(**kwargs)
        except ValueError as e:
            message = str(e).removeprefix("SamplingParams.")
            param = message.split(" ", 1)[0]
            raise bad_request(message, param=param if param in kwargs else None) from e


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None     # an assistant turn's calls
    tool_call_id: str | None = None                    # a tool turn: the call it answers
    # An assistant turn's thinking, under either name clients send it back with.
    reasoning: str | None = None
    reasoning_content: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content):
        if isinstance(content, list):
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"content part of type {part.get('type')!r} is not "
                                     "supported; only {'type': 'text', 'text': ...} is")
        return content

    def to_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):   # parts -> one string, as vLLM does
            content = "\n".join(part["text"] for part in content)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [_template_tool_call(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        thinking = self.reasoning_content if self.reasoning_content is not None \
            else self.reasoning
        if thinking is not None:        # Qwen3's template reads reasoning_content
            out["reasoning_content"] = out["reasoning"] = thinking
        return out


def _template_tool_call(call: dict) -> dict:
    """A call as chat templates read it: arguments as an object (templates that
    serialize them with tojson would quote a string twice)."""
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except ValueError:
            pass
    return {**call, "function": function}


class FunctionDefinition(OpenAIBaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[ChatCompletionToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None    # vLLM's, e.g. enable_thinking
    # OpenAI fields accepted only with their default value.
    functions: list | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    store: bool | None = None
    metadata: Any = None
    reasoning_effort: Any = None
    service_tier: str | None = None
    web_search_options: Any = None

    DEFAULT_ONLY: ClassVar[dict[str, tuple]] = {
        **_SamplingRequest.DEFAULT_ONLY,
        "functions": (None, []), "function_call": (None, "none"),
        "modalities": (None, ["text"]),
        "audio": (None,), "prediction": (None,), "store": (None, False), "metadata": (None,),
        "reasoning_effort": (None,), "service_tier": (None, "auto", "default"),
        "web_search_options": (None,),
    }

    def check_supported(self) -> None:
        super().check_supported()
        if not self.messages:
            raise bad_request("'messages' must not be empty.", param="messages")
        if self.top_logprobs and not self.logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs': true.", param="top_logprobs")
        check_tools(self)

    def to_sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        top = (self.top_logprobs or 0) if self.logprobs else None
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise bad_request(f"'top_logprobs' must be in [0, {MAX_LOGPROBS}], got {top}.",
                              param="top_logprobs")
        max_tokens = self.max_completion_tokens
        return self.sampling_params(
            defaults, max_tokens=self.max_tokens if max_tokens is None else max_tokens,
            logprobs=top)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    DEFAULT_ONLY: ClassVar[dict[str, tuple]] = {**_SamplingRequest.DEFAULT_ONLY,
                                                 "suffix": (None,)}

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, prompt):
        def is_ids(p):
            return isinstance(p, list) and all(type(t) is int for t in p)
        if not (isinstance(prompt, str) or is_ids(prompt) or (isinstance(prompt, list) and (
                all(isinstance(p, str) for p in prompt) or all(is_ids(p) for p in prompt)))):
            raise ValueError("must be a string, a list of strings, a list of token ids, or a "
                             "list of token-id lists")
        return prompt

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise bad_request("'best_of' is not supported by this server (only best_of == n).",
                              param="best_of", code="unsupported_parameter")
        if not self.prompt or any(p == [] or p == "" for p in self.prompt_list()):
            raise bad_request("'prompt' must not be empty.", param="prompt")

    def prompt_list(self) -> list[str | list[int]]:
        """The prompts: one string or token-id list per choice group."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        return list(prompt)

    def to_sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        return self.sampling_params(defaults, max_tokens=self.max_tokens,
                                    logprobs=self.logprobs)


class TokenizeRequest(OpenAIBaseModel):
    """vLLM's /tokenize: either ``prompt`` or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None   # default: True for prompt, False for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("give exactly one of 'prompt' and 'messages'.", param="prompt")


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


def parse_request(cls: type[OpenAIBaseModel], body: Any) -> OpenAIBaseModel:
    """Validate a JSON body into ``cls``; any problem is an APIError (400)."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    try:
        request = cls.model_validate(body)
    except ValidationError as e:
        raise _from_validation_error(e) from None
    request.check_supported()
    return request


def _from_validation_error(exc: ValidationError) -> APIError:
    error = exc.errors(include_url=False)[0]
    loc = [str(part) for part in error["loc"] if not _is_type_tag(part)]
    param = ".".join(loc) or None
    if error["type"] == "extra_forbidden":
        return bad_request(f"Unsupported parameter: '{param}' is not supported by this server.",
                           param=param, code="unsupported_parameter")
    if error["type"] == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param=param,
                           code="missing_required_parameter")
    return bad_request(f"Invalid value for '{param}': {error['msg']}.", param=param,
                       code="invalid_value")


def _is_type_tag(part) -> bool:
    """Pydantic puts union member names (``list[int]``, ``str``) into error locations."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool")
                                      or "[" in part or part.startswith("function-"))
