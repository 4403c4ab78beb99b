"""POST /v1/chat/completions: the chat template, then one engine request."""
from __future__ import annotations

from starlette.responses import JSONResponse, Response

from jaxllm.entrypoints.openai.errors import bad_request
from jaxllm.entrypoints.openai.protocol import ChatCompletionRequest
from jaxllm.entrypoints.openai.serving_engine import (
    ChoiceDelta, DeltaTracker, Generation, OpenAIServing, clamp_logprob, sse, sse_response)


class OpenAIServingChat(OpenAIServing):
    id_prefix = "chatcmpl"

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Prompt token ids of a conversation, through the tokenizer's chat template."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("The model has no chat template; start the server with "
                              "--chat-template FILE.", param="messages")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - a template may reject a conversation
            raise bad_request(f"The chat template failed on these messages: {e}",
                              param="messages") from e
        # The template writes the special tokens (BOS) itself, as in vLLM.
        return self.tokenizer(text, add_special_tokens=False).input_ids

    async def create(self, request: ChatCompletionRequest) -> Response:
        self.models.check(request.model)
        params = request.to_sampling_params()
        prompt_ids = self.render([m.to_template_dict() for m in request.messages])
        request_id, created = self.new_request()
        generation = await self.start(request_id, [prompt_ids], params, "messages")
        head = {"id": request_id, "created": created, "model": self.models.model_name}
        top_n = params.logprobs
        if request.stream:
            events = self._stream(generation, head, params.n, top_n, request.include_usage)
            return sse_response(events, generation)
        try:
            (final,) = await generation.wait()
        finally:
            await generation.close()
        choices = [{
            "index": c.index,
            "message": {"role": "assistant", "content": c.text, "refusal": None},
            "logprobs": self._logprobs(c, 0, top_n),
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
        } for c in final.outputs]
        return JSONResponse({**head, "object": "chat.completion", "choices": choices,
                             "usage": generation.usage()})

    async def _stream(self, generation: Generation, head: dict, n: int, top_n: int | None,
                      include_usage: bool):
        head = {**head, "object": "chat.completion.chunk"}
        tracker = DeltaTracker(n)
        async for prompt_index, output in generation.outputs():
            for delta in tracker.deltas(prompt_index, output):
                if delta.first:   # OpenAI opens each choice with the role
                    yield sse({**head, "choices": [{
                        "index": delta.index, "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None}]})
                yield sse({**head, "choices": [self._chunk_choice(delta, top_n)]})
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
