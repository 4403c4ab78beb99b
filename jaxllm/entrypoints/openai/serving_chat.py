"""POST /v1/chat/completions: the chat template (with the request's tools), then one
engine request; tool calls and reasoning are parsed out of the reply (chat_tools)."""
from __future__ import annotations

from starlette.responses import JSONResponse, Response

from jaxllm.entrypoints.openai.chat_tools import (ChoiceParser, forced_constraint,
                                                  template_tools, tool_mode)
from jaxllm.entrypoints.openai.errors import bad_request
from jaxllm.entrypoints.openai.protocol import ChatCompletionRequest
from jaxllm.entrypoints.openai.serving_engine import (
    ChoiceDelta, DeltaTracker, Generation, OpenAIServing, clamp_logprob, sse, sse_response)


class OpenAIServingChat(OpenAIServing):
    id_prefix = "chatcmpl"

    def __init__(self, engine, models, tokenizer, enable_auto_tool_choice: bool = False,
                 tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                 default_sampling_params: dict | None = None):
        super().__init__(engine, models, tokenizer, default_sampling_params)
        from jaxllm.entrypoints.openai.tool_parsers import ToolParserManager
        from jaxllm.reasoning import ReasoningParserManager
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tool_parser = tool_call_parser and ToolParserManager.get_tool_parser(
            tool_call_parser)
        self.reasoning_parser = reasoning_parser and \
            ReasoningParserManager.get_reasoning_parser(reasoning_parser)

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        """Prompt token ids of a conversation, through the tokenizer's chat template."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("The model has no chat template; start the server with "
                              "--chat-template FILE.", param="messages")
        kwargs = {k: v for k, v in (template_kwargs or {}).items()
                  if k not in ("conversation", "messages", "tokenize", "tools")}
        kwargs.setdefault("add_generation_prompt", add_generation_prompt)
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      **kwargs)
        except Exception as e:  # noqa: BLE001 - a template may reject a conversation
            raise bad_request(f"The chat template failed on these messages: {e}",
                              param="messages") from e
        # The template writes the special tokens (BOS) itself, as in vLLM.
        return self.tokenizer(text, add_special_tokens=False).input_ids

    async def create(self, request: ChatCompletionRequest) -> Response:
        self.models.check(request.model)
        params = self._sampling_params(request)
        prompt_ids = self.render([m.to_template_dict() for m in request.messages],
                                 tools=template_tools(request),
                                 template_kwargs=request.chat_template_kwargs)
        self.default_max_tokens(params, len(prompt_ids))
        request_id, created = self.new_request()
        generation = await self.start(request_id, [prompt_ids], params, "messages",
                                      priority=request.priority)
        head = {"id": request_id, "created": created, "model": self.models.model_name}
        top_n = params.logprobs
        parsing = tool_mode(request) != "none" or self.reasoning_parser
        # A reasoning parser reads the prompt's end: a template may open the thinking block.
        prompt_end = self.tokenizer.decode(prompt_ids[-64:]) if self.reasoning_parser else ""
        if request.stream:
            events = self._stream(generation, head, params.n, top_n, request.include_usage,
                                  (request, prompt_end) if parsing else None)
            return sse_response(events, generation)
        try:
            (final,) = await generation.wait()
        finally:
            await generation.close()
        choices = []
        for c in final.outputs:
            message = {"role": "assistant", "content": c.text, "refusal": None}
            finish_reason = c.finish_reason
            if parsing:
                parser = self._choice_parser(request, prompt_end)
                message = parser.message(c.text)
                finish_reason = parser.finish_reason(finish_reason, "tool_calls" in message)
            choices.append({"index": c.index, "message": message,
                            "logprobs": self._logprobs(c, 0, top_n),
                            "finish_reason": finish_reason, "stop_reason": c.stop_reason})
        return JSONResponse({**head, "object": "chat.completion", "choices": choices,
                             "usage": generation.usage()})

    def _sampling_params(self, request: ChatCompletionRequest):
        """The request's SamplingParams; a required or named tool choice constrains the
        output to its calls (so it cannot also carry another constraint)."""
        mode = tool_mode(request)
        if mode == "auto" and not (self.enable_auto_tool_choice and self.tool_parser):
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and '
                              '--tool-call-parser to be set', param="tool_choice")
        if mode == "auto":
            request = self.tool_parser(self.tokenizer).adjust_request(request)
        params = request.to_sampling_params(self.default_sampling_params)
        forced = forced_constraint(request)
        if forced is not None:
            if params.structured_outputs is not None:
                raise bad_request("tool_choice 'required' or a named function already "
                                  "constrains the output; drop response_format / "
                                  "structured_outputs / guided_*", param="tool_choice")
            params.structured_outputs = forced
        return params

    def _choice_parser(self, request, prompt_end: str) -> ChoiceParser:
        return ChoiceParser(request, self.tool_parser, self.reasoning_parser, self.tokenizer,
                            prompt_end)

    async def _stream(self, generation: Generation, head: dict, n: int, top_n: int | None,
                      include_usage: bool, parsing_request=None):
        head = {**head, "object": "chat.completion.chunk"}
        tracker = DeltaTracker(n)
        parsers: dict[int, ChoiceParser] = {}
        async for prompt_index, output in generation.outputs():
            for delta in tracker.deltas(prompt_index, output):
                if delta.first:   # OpenAI opens each choice with the role
                    yield sse({**head, "choices": [{
                        "index": delta.index, "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None}]})
                if parsing_request is None:
                    yield sse({**head, "choices": [self._chunk_choice(delta, top_n)]})
                    continue
                parser = parsers.get(delta.index) or parsers.setdefault(
                    delta.index, self._choice_parser(*parsing_request))
                c = delta.completion
                fields = parser.delta(delta.text, c.finish_reason is not None)
                if fields or c.finish_reason is not None:
                    choice = self._chunk_choice(delta, top_n)
                    choice["delta"] = fields
                    choice["finish_reason"] = parser.finish_reason(c.finish_reason, parser.called)
                    yield sse({**head, "choices": [choice]})
        if include_usage:
            yield sse({**head, "choices": [], "usage": generation.usage()})

    def _chunk_choice(self, delta: ChoiceDelta, top_n: int | None) -> dict:
        c = delta.completion
        choice = {"index": delta.index, "delta": {"content": delta.text},
                  "logprobs": self._logprobs(c, delta.token_start, top_n),
                  "finish_reason": c.finish_reason}
        if c.finish_reason is not None:
            choice["stop_reason"] = c.stop_reason
        return choice

    def _logprobs(self, completion, start: int, top_n: int | None) -> dict | None:
        """OpenAI's chat logprobs for ``completion.token_ids[start:]``."""
        if top_n is None or completion.logprobs is None:
            return None
        content = []
        for token_id, entry in zip(completion.token_ids[start:], completion.logprobs[start:]):
            top = sorted((lp.rank, tid, lp) for tid, lp in entry.items()
                         if lp.rank is not None and lp.rank <= top_n)
            content.append({**self._token(token_id, entry[token_id]),
                            "top_logprobs": [self._token(tid, lp) for _, tid, lp in top]})
        return {"content": content, "refusal": None}

    def _token(self, token_id: int, logprob) -> dict:
        token = self.token_text(token_id, logprob)
        return {"token": token, "logprob": clamp_logprob(logprob.logprob),
                "bytes": list(token.encode("utf-8"))}
