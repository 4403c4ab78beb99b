"""`jaxllm serve --runner pooling`: the OpenAI server over the pooling engine.

The engine runs on one worker thread of the server process (no engine process: a
pooling step keeps no state between requests). Requests that arrive while a batch
runs wait in a queue and go into the next one together, so many small concurrent
/v1/embeddings calls share steps. Generation routes answer 400.

    app = build_pooling_app(AsyncPoolingEngine(PoolingEngine(config)), config)
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading

import numpy as np
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import jaxllm
from jaxllm.config import EngineConfig
from jaxllm.entrypoints.openai.errors import EXCEPTION_HANDLERS, bad_request
from jaxllm.entrypoints.openai.protocol import parse_request
from jaxllm.entrypoints.openai.serving_embedding import EmbeddingRequest, OpenAIServingEmbedding
from jaxllm.entrypoints.openai.serving_models import OpenAIServingModels
from jaxllm.pooling.params import PoolingParams

logger = logging.getLogger(__name__)

# Most tokens gathered into one batch from the queue: a few full steps.
BATCH_TOKENS = 1 << 17


class AsyncPoolingEngine:
    """PoolingEngine behind an asyncio API: `await embed(prompts, params)`."""

    def __init__(self, engine):
        self.engine = engine
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="jaxllm-pooling", daemon=True)
        self._thread.start()

    async def embed(self, prompts: list, params: PoolingParams):
        """(float32 vectors [n, dims], token ids per prompt); InputError for bad input."""
        self.engine.check_params(params)
        ids = self.engine.tokenize(prompts, params)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put((ids, params, loop, future))
        vectors = await future
        return vectors[:, :params.dimensions or self.engine.info.hidden_size], ids

    def shutdown(self) -> None:
        self._queue.put(None)
        self._thread.join(10)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch, tokens = [item], sum(len(t) for t in item[0])
            while tokens < BATCH_TOKENS:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                batch.append(nxt)
                tokens += sum(len(t) for t in nxt[0])
            self._run(batch)

    def _run(self, batch) -> None:
        engine = self.engine
        ids = [t for item in batch for t in item[0]]
        dims = np.concatenate([np.full(len(item[0]), item[1].dimensions or
                                       engine.info.hidden_size, np.int32) for item in batch])
        norm = np.concatenate([np.full(len(item[0]), engine.info.normalize if item[1].normalize
                                       is None else item[1].normalize, bool) for item in batch])
        try:
            vectors = engine.runner.run(ids, dims, norm)
        except Exception as e:     # every waiting request gets the error (a 500)
            logger.exception("pooling step failed")
            for _, _, loop, future in batch:
                loop.call_soon_threadsafe(_set, future, None, e)
            return
        start = 0
        for item_ids, _, loop, future in batch:
            loop.call_soon_threadsafe(_set, future, vectors[start:start + len(item_ids)], None)
            start += len(item_ids)


def _set(future, result, error) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def build_pooling_app(engine: AsyncPoolingEngine, config: EngineConfig) -> Starlette:
    from jaxllm.entrypoints.openai.api_server import APIKeyMiddleware, _read_json
    inner = engine.engine
    names = config.model.served_model_name or (inner.model_name,)
    models = OpenAIServingModels(names, config.model.model or names[0], inner.max_model_len)
    embedding = OpenAIServingEmbedding(engine, models)

    async def embeddings(request: Request) -> Response:
        return await embedding.create(parse_request(EmbeddingRequest, await _read_json(request)))

    def not_generative(api: str):
        async def endpoint(request: Request) -> Response:
            raise bad_request(
                f"The model does not support {api} API: it is served with --runner pooling "
                "(embeddings only); use /v1/embeddings, or serve a generative model with "
                "--runner generate.", param="model", code="model_not_generative")
        return endpoint

    async def list_models(request: Request) -> Response:
        return JSONResponse(models.list_models())

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def version(request: Request) -> Response:
        return JSONResponse({"version": jaxllm.__version__})

    routes = [
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/completions", not_generative("Completions"), methods=["POST"]),
        Route("/v1/chat/completions", not_generative("Chat Completions"), methods=["POST"]),
        Route("/v1/models", list_models),
        Route("/health", health),
        Route("/version", version),
    ]
    middleware = []
    if config.server.api_key:
        middleware.append(Middleware(APIKeyMiddleware, api_key=config.server.api_key))
    return Starlette(routes=routes, middleware=middleware, exception_handlers=EXCEPTION_HANDLERS)


def run_pooling_server(config: EngineConfig) -> int:
    """Load the pooling engine, then serve on config.server.host:port until stopped."""
    import uvicorn
    from jaxllm.pooling.engine import PoolingEngine
    engine = AsyncPoolingEngine(PoolingEngine(config))
    try:
        app = build_pooling_app(engine, config)
        server = uvicorn.Server(uvicorn.Config(app, host=config.server.host,
                                               port=config.server.port, log_level="info",
                                               timeout_graceful_shutdown=5))
        try:
            server.run()
        except KeyboardInterrupt:
            pass
    finally:
        engine.shutdown()
    return 0
