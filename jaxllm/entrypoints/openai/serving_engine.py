"""What chat and completions share: starting generations (engine errors -> 400/503),
merging the outputs of several prompts, per-choice deltas for streaming, usage, SSE.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.responses import Response

from jaxllm.engine.async_llm import AsyncLLM, EngineDeadError, EngineOverloadedError
from jaxllm.entrypoints.openai.errors import APIError, bad_request, engine_dead, overloaded
from jaxllm.entrypoints.openai.serving_models import OpenAIServingModels

logger = logging.getLogger(__name__)


class OpenAIServing:
    """Base of the chat and completion handlers."""

    id_prefix = "cmpl"

    def __init__(self, engine: AsyncLLM, models: OpenAIServingModels, tokenizer,
                 default_sampling_params: dict | None = None):
        self.engine = engine
        self.models = models
        self.tokenizer = tokenizer   # the server's own copy: the engine thread uses its own
        # The model's generation config (--generation-config): for fields a request
        # leaves unset (generation_config.py).
        self.default_sampling_params = default_sampling_params or {}

    def default_max_tokens(self, params, num_prompt_tokens: int) -> None:
        """A request without max_tokens takes the generation config's, cut to the
        context the prompt leaves (vLLM's get_max_tokens)."""
        value = self.default_sampling_params.get("max_tokens")
        if params.max_tokens is not None or value is None:
            return
        room = self.models.max_model_len - num_prompt_tokens
        params.max_tokens = max(min(value, room) if room >= 1 else value, params.min_tokens)

    def token_text(self, token_id: int, logprob) -> str:
        """A token as logprobs show it (the engine's decoding, else ours)."""
        if logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id])

    def new_request(self) -> tuple[str, int]:
        """(response id, created)."""
        return f"{self.id_prefix}-{uuid.uuid4().hex}", int(time.time())

    async def start(self, request_id: str, prompts: list, params,
                    prompt_param: str, priority: int = 0) -> "Generation":
        """Add one request per prompt; return once each has its first output.

        Errors the engine raises on add become 400 (too long, bad token ids) or 503,
        a full waiting queue a 429, before any response is sent. Whatever was added
        is aborted on failure.
        """
        if self.engine.is_dead:
            raise engine_dead()
        gens = [self.engine.generate(f"{request_id}-{i}", p, params, priority)
                for i, p in enumerate(prompts)]
        tasks = [asyncio.ensure_future(anext(g)) for g in gens]
        try:
            firsts = await asyncio.gather(*tasks)
        except BaseException as e:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await Generation([], gens).close()
            if isinstance(e, EngineDeadError):
                raise engine_dead() from e
            if isinstance(e, EngineOverloadedError):
                self.engine.metrics.record_rejected("max_waiting_requests")   # per API request
                raise overloaded(str(e)) from e
            if isinstance(e, ValueError):
                code = "context_length_exceeded" if "maximum context length" in str(e) else None
                # Checks that need the model (its vocabulary) name their field first.
                field = next((f for f in ("structured_outputs", "stop_token_ids", "priority")
                              if str(e).startswith(f)), None)
                param = field or prompt_param
                raise bad_request(str(e), param=param, code=code) from e
            raise
        return Generation(firsts, gens)


class Generation:
    """The outputs of one API request: one engine request per prompt.

    ``close()`` must run when the response is done or abandoned: it aborts whatever
    is unfinished, so a client that goes away frees its KV blocks at once.
    """

    def __init__(self, firsts: list, gens: list[AsyncIterator]):
        self.finals = list(firsts)   # latest output per prompt
        self._gens = gens
        self._iter: AsyncIterator | None = None

    def outputs(self) -> AsyncIterator[tuple[int, object]]:
        """(prompt index, latest RequestOutput), the first outputs included."""
        self._iter = self._outputs()
        return self._iter

    async def _outputs(self):
        for i, out in enumerate(self.finals):
            yield i, out
        merged = _merge(self._gens, [not o.finished for o in self.finals])
        try:
            async for i, out in merged:
                self.finals[i] = out
                yield i, out
        finally:
            await merged.aclose()

    async def wait(self) -> list:
        """Run to the end; the final output of each prompt."""
        async for _ in self.outputs():
            pass
        return self.finals

    async def close(self) -> None:
        if self._iter is not None:
            await self._iter.aclose()
        for gen in self._gens:
            await gen.aclose()   # aborts the request if it is not finished

    def usage(self) -> dict:
        prompt = sum(len(o.prompt_token_ids or ()) for o in self.finals)
        completion = sum(len(c.token_ids) for o in self.finals for c in o.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}


async def _merge(gens: list[AsyncIterator], live: list[bool]):
    """Interleave several output iterators as their items come."""
    if len(gens) == 1:   # the common case needs no tasks
        if live[0]:
            async for out in gens[0]:
                yield 0, out
        return
    pending = {asyncio.ensure_future(anext(g)): i for i, g in enumerate(gens) if live[i]}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                out = task.result()
                if not out.finished:
                    pending[asyncio.ensure_future(anext(gens[i]))] = i
                yield i, out
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


@dataclass
class ChoiceDelta:
    """What is new in one choice since it was last streamed."""
    index: int                # choice index: prompt index * n + completion index
    completion: object        # the CompletionOutput
    text: str                 # new text
    token_start: int          # completion.token_ids[token_start:] are new
    first: bool               # nothing of this choice was streamed before


class DeltaTracker:
    """Remembers how much of each choice was streamed, to cut out what is new."""

    def __init__(self, n: int):
        self.n = n
        self._sent: dict[int, tuple[int, int]] = {}   # choice -> (chars, tokens) streamed
        self._done: set[int] = set()

    def deltas(self, prompt_index: int, output) -> list[ChoiceDelta]:
        """A delta per choice with new tokens or that just finished."""
        out = []
        for completion in output.outputs:
            index = prompt_index * self.n + completion.index
            chars, tokens = self._sent.get(index, (0, 0))
            finished = completion.finish_reason is not None
            if index in self._done or not (finished or len(completion.token_ids) > tokens):
                continue
            out.append(ChoiceDelta(index, completion, completion.text[chars:], tokens,
                                   index not in self._sent))
            self._sent[index] = (len(completion.text), len(completion.token_ids))
            if finished:
                self._done.add(index)
        return out


def sse(data: dict | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(
        data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n"


async def sse_with_errors(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """The events, an error event if they fail, then ``data: [DONE]``."""
    try:
        async for event in events:
            yield event
    except EngineDeadError:
        yield sse(engine_dead().body())
    except APIError as e:
        yield sse(e.body())
    except Exception as e:  # noqa: BLE001 - the client must learn the stream broke
        logger.exception("stream failed")
        yield sse(APIError(500, f"Internal server error: {e!r}").body())
    yield sse("[DONE]")


class _SSEResponse(Response):
    """Server-sent events straight onto ASGI ``send``; runs ``on_close`` however the
    stream ends, client disconnect included.

    Not starlette's StreamingResponse: its task group cost more Python time per
    chunk than the rest of the streaming path (measured with 256 streams), and that
    time is taken from the engine thread, which shares the GIL."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close):
        # No Response.__init__: it would add "content-length: 0" for the empty body.
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
        self.events = events
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        watch = asyncio.ensure_future(_until_disconnect(receive))
        try:
            await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not pump.done():          # the client went away: stop streaming
                pump.cancel()
            await asyncio.gather(pump, watch, return_exceptions=True)
            await self.events.aclose()
            await self.on_close()
        if not pump.cancelled() and pump.exception() is not None:
            raise pump.exception()

    async def _pump(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        async for event in self.events:
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _until_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def sse_response(events: AsyncIterator[str], generation: Generation) -> Response:
    return _SSEResponse(sse_with_errors(events), generation.close)


def clamp_logprob(value: float) -> float:
    """OpenAI's floor for "very unlikely"; also keeps -inf out of JSON."""
    return max(value, -9999.0)
