"""The OpenAI-compatible HTTP server: a Starlette app over an AsyncLLM (the engine in
its own process, `jaxllm serve`'s default, or on a thread of this process with
--disable-frontend-multiprocessing: the app does not tell them apart).

    run_server(config)                       # what `jaxllm serve` calls
    app = build_app(AsyncLLM.from_engine(llm_engine), config)
    with serve_in_background(app) as url:    # tests: uvicorn on 127.0.0.1, a free port
        ...
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import jaxllm
from jaxllm.config import EngineConfig
from jaxllm.engine.async_llm import AsyncLLM
from jaxllm.engine.core_client import SpawnedEngine, spawn_engine
from jaxllm.entrypoints.openai.errors import EXCEPTION_HANDLERS, APIError, bad_request, engine_dead
from jaxllm.entrypoints.openai.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, parse_request)
from jaxllm.entrypoints.openai.serving_chat import OpenAIServingChat
from jaxllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from jaxllm.entrypoints.openai.serving_models import OpenAIServingModels
from jaxllm.generation_config import get_diff_sampling_param
from jaxllm.metrics import StatLogger

logger = logging.getLogger(__name__)


# Once the engine died: seconds for the answers in flight to go out before the exit.
DEAD_ENGINE_GRACE_S = 1.0


def build_app(engine: AsyncLLM, config: EngineConfig, *,
              log_stats_interval: float = 5.0,
              on_engine_dead: Callable[[], None] | None = None) -> Starlette:
    """The app: routes, OpenAI-shaped errors, --api-key on /v1, the stats log.
    `on_engine_dead`: called once the engine has died (run_server stops the server
    then, so that a supervisor restarts it)."""
    llm = engine.engine   # the EngineInfo
    # The front end's own tokenizer (no engine thread uses it), with the chat
    # template the engine loaded (--chat-template's if given).
    tokenizer = llm.tokenizer
    names = config.model.served_model_name or (llm.model_name,)
    models = OpenAIServingModels(names, config.model.model or names[0], llm.max_model_len)
    server = config.server
    # The model's generation config (--generation-config), logged when it sets any.
    defaults = get_diff_sampling_param(config.model)
    chat = OpenAIServingChat(engine, models, tokenizer, server.enable_auto_tool_choice,
                             server.tool_call_parser, server.reasoning_parser, defaults)
    completion = OpenAIServingCompletion(engine, models, tokenizer, defaults)

    def json_route(path: str, model: type, handler) -> Route:
        async def endpoint(request: Request) -> Response:
            if engine.is_dead:
                raise engine_dead()
            parsed = parse_request(model, await _read_json(request))
            return await _cancel_on_disconnect(request, handler(parsed))
        return Route(path, endpoint, methods=["POST"])

    async def tokenize(req: TokenizeRequest) -> Response:
        models.check(req.model)
        if req.messages is not None:
            ids = chat.render([m.to_template_dict() for m in req.messages],
                              req.add_generation_prompt)
        else:
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = tokenizer(req.prompt, add_special_tokens=add_special).input_ids
        strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": models.max_model_len,
                             "tokens": ids, "token_strs": strs})

    async def detokenize(req: DetokenizeRequest) -> Response:
        models.check(req.model)
        if any(not 0 <= t < len(tokenizer) for t in req.tokens):
            raise bad_request(f"token ids must be in [0, {len(tokenizer)}).", param="tokens")
        return JSONResponse({"prompt": tokenizer.decode(req.tokens)})

    async def list_models(request: Request) -> Response:
        if engine.is_dead:
            raise engine_dead()
        return JSONResponse(models.list_models())

    async def health(request: Request) -> Response:
        if engine.is_dead:
            raise engine_dead()
        return Response(status_code=200)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def version(request: Request) -> Response:
        return JSONResponse({"version": jaxllm.__version__})

    async def embeddings(request: Request) -> Response:
        raise bad_request("The model does not support Embeddings API: it is served with "
                          "--runner generate; serve an embedding model with --runner pooling "
                          "for /v1/embeddings.", param="model", code="model_not_embedding")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        tasks = [asyncio.create_task(StatLogger(engine.metrics, log_stats_interval).run())]
        if on_engine_dead is not None:
            tasks.append(asyncio.create_task(_watch_engine(engine, on_engine_dead)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()

    routes = [
        json_route("/v1/chat/completions", ChatCompletionRequest, chat.create),
        json_route("/v1/completions", CompletionRequest, completion.create),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/models", list_models),
        json_route("/tokenize", TokenizeRequest, tokenize),
        json_route("/detokenize", DetokenizeRequest, detokenize),
        Route("/health", health),
        Route("/metrics", metrics),
        Route("/version", version),
    ]
    middleware = []
    if config.server.api_key:
        middleware.append(Middleware(APIKeyMiddleware, api_key=config.server.api_key))
    return Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                     exception_handlers=EXCEPTION_HANDLERS)


async def _watch_engine(engine, on_dead: Callable[[], None]) -> None:
    """Call `on_dead` once the engine is dead and the answers in flight (each request
    got its 5xx when the engine died) had time to go out."""
    while not engine.is_dead:
        await asyncio.sleep(0.2)
    logger.error("the engine is dead (%s): the server stops", engine.dead_error)
    await asyncio.sleep(DEAD_ENGINE_GRACE_S)
    on_dead()


def run_server(config: EngineConfig, *, log_stats_interval: float = 5.0,
               spawned: SpawnedEngine | None = None, started: float | None = None) -> int:
    """Build the engine, then serve on config.server.host:port until stopped. Returns
    the exit status: 0 when stopped, 1 when the engine died (as vLLM's server exits,
    so that a supervisor or a liveness probe brings it back).

    spawned: the engine process, if the caller started it already (`jaxllm serve`
    does, before importing this module); started: time.perf_counter() at the launch,
    where the start-up timeline logged once the server listens begins."""
    timeline = _Timeline(time.perf_counter() if started is None else started)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.server.disable_frontend_multiprocessing:
        timeline.mark("launch_s")
        engine = AsyncLLM.from_config(config, multiprocess=False)
        timeline.mark("engine_s")
    else:
        spawned = spawned or spawn_engine(config)
        timeline.mark("launch_s", spawned.spawned_at)
        # While the engine loads: what unpickling its tokenizer would import (seconds).
        from transformers import PreTrainedTokenizerFast  # noqa: F401
        timeline.mark("imports_s")
        engine = AsyncLLM.from_config(config, multiprocess=True, spawned=spawned)
        timeline.mark("engine_wait_s", time.perf_counter() - engine.engine_core.ready_message_s)
        timeline.mark("ready_message_s")
    server = None

    def stop() -> None:
        server.should_exit = True

    try:
        app = build_app(engine, config, log_stats_interval=log_stats_interval,
                        on_engine_dead=stop)
        # Open streams get a few seconds to finish on Ctrl-C, then are cut.
        server = _Server(uvicorn.Config(app, host=config.server.host, port=config.server.port,
                                        log_level="info", timeout_graceful_shutdown=5),
                         on_started=lambda: timeline.log("uvicorn_s"))
        timeline.mark("app_s")
        try:
            server.run()
        except KeyboardInterrupt:   # uvicorn re-raises the Ctrl-C it handled; as uvicorn.run
            pass
    finally:
        engine.shutdown()
    return 1 if engine.is_dead else 0


class _Timeline:
    """The server process's start-up phases, logged as one line once it listens."""

    def __init__(self, started: float):
        self.started = self.last = started
        self.phases: dict[str, float] = {}

    def mark(self, phase: str, at: float | None = None) -> None:
        """The phase since the last mark ends now (or ``at``, a time.perf_counter())."""
        now = time.perf_counter() if at is None else at
        self.phases[phase] = now - self.last
        self.last = now

    def log(self, phase: str) -> None:
        self.mark(phase)
        logger.info("server ready in %.1f s (%s)", self.last - self.started,
                    ", ".join(f"{k} {v:.1f}" for k, v in self.phases.items()))


class _Server(uvicorn.Server):
    """uvicorn's server, calling ``on_started()`` once it listens."""

    def __init__(self, config: uvicorn.Config, on_started: Callable[[], None]):
        super().__init__(config)
        self.on_started = on_started

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            self.on_started()


@contextlib.contextmanager
def serve_in_background(app, host: str = "127.0.0.1", port: int = 0,
                        log_level: str = "warning") -> Iterator[str]:
    """Serve ``app`` with uvicorn in a thread; yield its base URL (port 0: a free one)."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("uvicorn did not start (see its log)")
        time.sleep(0.01)
    bound_port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound_port}"
    finally:
        server.should_exit = True
        thread.join(30)


class APIKeyMiddleware:
    """--api-key: every /v1 route needs ``Authorization: Bearer <key>`` (as in vLLM)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path == "/v1" or path.startswith("/v1/")):
            given = Headers(scope=scope).get("authorization", "").encode()
            if not hmac.compare_digest(given, self.expected):
                error = APIError(401, "Incorrect or missing API key; send it as "
                                      "'Authorization: Bearer <key>'.", code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _read_json(request: Request):
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"The request body is not valid JSON: {e}") from None


async def _cancel_on_disconnect(request: Request, handler) -> Response:
    """Run a handler; if the client goes away first, cancel it (which aborts its
    requests in the engine). Streaming responses watch for that themselves."""
    work = asyncio.ensure_future(handler)
    watch = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    if work.cancelled():
        return Response(status_code=499)   # nobody is there to read it
    return work.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
