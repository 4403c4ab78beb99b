"""POST /v1/completions: one engine request per prompt (text or token ids)."""
from __future__ import annotations

from starlette.responses import JSONResponse, Response

from jaxllm.entrypoints.openai.errors import bad_request
from jaxllm.entrypoints.openai.protocol import CompletionRequest
from jaxllm.entrypoints.openai.serving_engine import (
    DeltaTracker, Generation, OpenAIServing, clamp_logprob, sse, sse_response)


class OpenAIServingCompletion(OpenAIServing):
    id_prefix = "cmpl"

    async def create(self, request: CompletionRequest) -> Response:
        self.models.check(request.model)
        if request.echo and request.logprobs is not None:
            raise bad_request("'echo' together with 'logprobs' is not supported by this "
                              "server (it needs prompt logprobs).", param="echo",
                              code="unsupported_parameter")
        params = request.to_sampling_params(self.default_sampling_params)
        if params.max_tokens is None and "max_tokens" in self.default_sampling_params:
            # max_tokens: null; one value for all prompts, fitted to the longest.
            self.default_max_tokens(params, max(map(self._num_tokens, request.prompt_list())))
        request_id, created = self.new_request()
        generation = await self.start(request_id, request.prompt_list(), params, "prompt",
                                      priority=request.priority)
        head = {"id": request_id, "object": "text_completion", "created": created,
                "model": self.models.model_name}
        if request.stream:
            events = self._stream(generation, head, request, params.n)
            return sse_response(events, generation)
        try:
            finals = await generation.wait()
        finally:
            await generation.close()
        choices = []
        for prompt_index, output in enumerate(finals):
            echo = self._echo(output) if request.echo else ""
            choices += [self._choice(prompt_index * params.n + c.index, echo + c.text, c, 0,
                                     request.logprobs, len(echo)) for c in output.outputs]
        return JSONResponse({**head, "choices": choices, "usage": generation.usage()})

    async def _stream(self, generation: Generation, head: dict, request: CompletionRequest,
                      n: int):
        tracker = DeltaTracker(n)
        async for prompt_index, output in generation.outputs():
            for delta in tracker.deltas(prompt_index, output):
                echo = self._echo(output) if request.echo and delta.first else ""
                offset = len(delta.completion.text) - len(delta.text)
                choice = self._choice(delta.index, echo + delta.text, delta.completion,
                                      delta.token_start, request.logprobs, offset + len(echo))
                yield sse({**head, "choices": [choice]})
        if request.include_usage:
            yield sse({**head, "choices": [], "usage": generation.usage()})

    def _num_tokens(self, prompt) -> int:
        return len(prompt) if isinstance(prompt, list) else len(self.tokenizer.encode(prompt))

    def _echo(self, output) -> str:
        if output.prompt is not None:
            return output.prompt
        return self.tokenizer.decode(output.prompt_token_ids)

    def _choice(self, index: int, text: str, completion, token_start: int,
                top_n: int | None, text_offset: int) -> dict:
        return {"index": index, "text": text,
                "logprobs": self._logprobs(completion, token_start, top_n, text_offset),
                "finish_reason": completion.finish_reason,
                "stop_reason": completion.stop_reason}

    def _logprobs(self, completion, start: int, top_n: int | None, offset: int) -> dict | None:
        """OpenAI's legacy completion logprobs for ``completion.token_ids[start:]``."""
        if top_n is None or completion.logprobs is None:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, entry in zip(completion.token_ids[start:], completion.logprobs[start:]):
            token = self.token_text(token_id, entry[token_id])
            out["tokens"].append(token)
            out["token_logprobs"].append(clamp_logprob(entry[token_id].logprob))
            out["top_logprobs"].append(self._top_dict(entry))
            out["text_offset"].append(offset)
            offset += len(token)
        return out

    def _top_dict(self, entry: dict) -> dict[str, float]:
        """The top-N and the sampled token (as vLLM), keyed by text: tokens that
        decode alike (partial UTF-8 bytes) keep the best logprob."""
        top: dict[str, float] = {}
        for token_id, logprob in entry.items():
            text = self.token_text(token_id, logprob)
            top[text] = max(top.get(text, -9999.0), clamp_logprob(logprob.logprob))
        return top
