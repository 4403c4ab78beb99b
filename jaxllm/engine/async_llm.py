"""AsyncLLM: the engine driven from asyncio, for the server (vLLM V1's front end).

One class over two transports (``core_client``): the LLMEngine on a thread of this
process (``InprocClient``) or in an engine process of its own (``MPClient``, `jaxllm
serve`'s default). Whichever it holds, AsyncLLM keeps the requests: one asyncio queue
per request, filled from the client's thread with ``loop.call_soon_threadsafe`` (one
wake-up per loop per batch); the event loop never calls the engine and never blocks
on it.

    llm = AsyncLLM.from_config(config)                   # the process unless
    async for output in llm.generate(id, prompt, params):  # --disable-frontend-mp...
        ...

Outputs are cumulative (the whole text so far), so a consumer that fell behind skips
to the newest one. If the engine dies (a step raised, its process is gone), every
request gets ``EngineDeadError`` and ``is_dead`` turns true (the server answers 503).

Overload (``max_waiting_requests``, --max-waiting-requests): a request that finds that
many requests waiting is refused at once with ``EngineOverloadedError`` (the server's
429), before anything reaches the engine. "Waiting" is counted here, not read from the
engine's stats: requests added and not yet given their first output (queued in the
engine, or in their prefill), counted under the same lock as the add, so a burst
arriving between two engine steps cannot slip past the bound.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from typing import Any

from jaxllm.engine.core_client import (EngineCoreClient, EngineDeadError, InprocClient,
                                       MPClient, SpawnedEngine)
from jaxllm.metrics import EngineMetrics

__all__ = ["AsyncLLM", "EngineDeadError", "EngineOverloadedError"]


class EngineOverloadedError(RuntimeError):
    """--max-waiting-requests requests wait already: this one was not added."""

_ACCEPTED = object()   # first item of a request's queue: the engine took the request


class AsyncLLM:
    """The server's engine: ``generate``, ``abort``, ``is_dead`` / ``dead_error``,
    ``shutdown``, ``metrics``, and ``engine`` (the EngineInfo: tokenizer, model name,
    max model length, EOS id). ``engine_core`` is the client."""

    def __init__(self, engine_core: EngineCoreClient, metrics: EngineMetrics | None = None,
                 max_waiting_requests: int | None = None):
        self.engine_core = engine_core
        self.engine = engine_core.info
        self.metrics = metrics or EngineMetrics(self.engine.model_name,
                                                self.engine.max_model_len)
        self.metrics.update_stats(engine_core.stats)
        self.dead_error: BaseException | None = None
        self._lock = threading.Lock()
        self._queues: dict[str, _OutputQueue] = {}   # requests in the engine, by id
        self._stopped = False
        self.max_waiting_requests = max_waiting_requests   # None: unbounded
        self.num_waiting_requests = 0   # queues whose request has no output yet
        engine_core.start(self)

    @classmethod
    def from_config(cls, config, *, multiprocess: bool | None = None,
                    setup: Callable | None = None, spawned: SpawnedEngine | None = None,
                    metrics: EngineMetrics | None = None) -> "AsyncLLM":
        """Build the engine: in an engine process (``spawned`` if it was started
        already) or, with ``multiprocess=False``, on a thread here. By default as
        `jaxllm serve`: the process unless --disable-frontend-multiprocessing.
        ``setup(llm_engine)`` runs once the LLMEngine is built (in the engine process
        there: it must pickle)."""
        if multiprocess is None:
            multiprocess = not config.server.disable_frontend_multiprocessing
        bound = config.server.max_waiting_requests
        if multiprocess:
            return cls(MPClient(config, setup=setup, spawned=spawned), metrics, bound)
        return cls(InprocClient.from_config(config, setup=setup), metrics, bound)

    @classmethod
    def from_engine(cls, engine, metrics: EngineMetrics | None = None,
                    max_waiting_requests: int | None = None) -> "AsyncLLM":
        """Over an LLMEngine already built (or anything with its API), on a thread."""
        return cls(InprocClient(engine), metrics, max_waiting_requests)

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    @property
    def process(self):
        """The engine process, or None when the engine runs on a thread here."""
        return self.engine_core.process

    # ------------------------------------------------------------ event-loop side
    async def generate(self, request_id: str, prompt, params,
                       priority: int = 0) -> AsyncIterator[Any]:
        """Add a request and yield its (cumulative) RequestOutputs until finished.

        The request is added on the first ``__anext__``; a ValueError from the
        engine (too long, bad token ids) is raised there. Closing or cancelling the
        iterator before the last output aborts the request, freeing its KV blocks.
        """
        queue = _OutputQueue(asyncio.get_running_loop(), getattr(params, "max_tokens", None))
        finished = False
        try:
            with self._lock:
                if self.dead_error is not None or self._stopped:
                    raise EngineDeadError(f"the engine is not running: {self.dead_error!r}")
                if request_id in self._queues:
                    raise ValueError(f"request id {request_id!r} is already in use")
                self._admit(queue)
                self._queues[request_id] = queue
                self.engine_core.add_request(request_id, prompt, params, time.time(), priority)
            await queue.get()   # _ACCEPTED, or the engine's error raised
            while not finished:
                output = await queue.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self._abort(request_id, queue)

    def _admit(self, queue: _OutputQueue) -> None:
        """Count the request as waiting, or refuse it (under the lock)."""
        bound = self.max_waiting_requests
        if bound is not None and self.num_waiting_requests >= bound:
            raise EngineOverloadedError(
                f"The server is overloaded: {self.num_waiting_requests} requests are waiting "
                f"(--max-waiting-requests {bound}); retry later.")
        queue.waiting = True
        self.num_waiting_requests += 1

    def _started(self, queue: _OutputQueue) -> None:
        """The request waits no more: it has output, failed or left (under the lock)."""
        if queue.waiting:
            queue.waiting = False
            self.num_waiting_requests -= 1

    def abort(self, request_id: str) -> None:
        self._abort(request_id, None)

    def _abort(self, request_id: str, queue: _OutputQueue | None) -> None:
        with self._lock:
            mine = self._queues.get(request_id)
            if mine is None or (queue is not None and mine is not queue):
                return   # finished, failed, aborted already, or another request's id
            del self._queues[request_id]
            self._started(mine)
            self.metrics.record_abort(request_id)
            self.engine_core.abort_request(request_id)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine after its current step (an engine process that has not
        within ``timeout`` is terminated); pending requests get EngineDeadError."""
        with self._lock:
            self._stopped = True
        self.engine_core.shutdown(timeout)

    # ------------------------------------------------------------ the client's thread
    def on_added(self, added: list[tuple], stats) -> None:
        """A batch of adds applied: (request id, error or None, arrival time, n) each."""
        self.metrics.update_stats(stats)
        posts = []
        with self._lock:
            for request_id, error, arrival_time, n in added:
                queue = self._queues.get(request_id)
                if error is not None:
                    if queue is not None:
                        del self._queues[request_id]
                        self._started(queue)
                        posts.append((queue, error))
                    continue
                self.metrics.record_arrival(request_id, arrival_time, n,
                                            queue.max_tokens if queue is not None else None)
                if queue is None:   # aborted before the engine took it
                    self.metrics.record_abort(request_id)
                else:
                    posts.append((queue, _ACCEPTED))
        _post(posts)

    def on_outputs(self, outputs: list, stats) -> None:
        """One step's RequestOutputs."""
        self.metrics.update_stats(stats)
        now = time.time()
        posts = []
        with self._lock:
            for output in outputs:
                queue = self._queues.get(output.request_id)
                if queue is None:   # aborted meanwhile
                    continue
                self._started(queue)
                self.metrics.record_output(output, now)
                if output.finished:
                    del self._queues[output.request_id]
                posts.append((queue, output))
            self.metrics.record_step()
        _post(posts)

    def on_dead(self, error: BaseException | None) -> None:
        """The engine stopped: shut down (None) or died of ``error``."""
        if error is None:
            failure = EngineDeadError("the engine was shut down")
        elif isinstance(error, EngineDeadError):
            failure = error
        else:
            failure = EngineDeadError(f"the engine died: {error!r}")
        with self._lock:
            if error is not None and self.dead_error is None:
                self.dead_error = error
            queues = list(self._queues.values())
            self._queues = {}
            self.num_waiting_requests = 0
        _post([(queue, failure) for queue in queues])


class _OutputQueue:
    """One request's outputs, filled from the client's thread, read on its loop
    (``max_tokens``: its parameter, for the metrics)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_tokens: int | None = None):
        self.loop = loop
        self.max_tokens = max_tokens
        self.waiting = False   # counted in AsyncLLM.num_waiting_requests
        self.queue: asyncio.Queue = asyncio.Queue()

    async def get(self) -> Any:
        item = await self.queue.get()
        # Outputs are cumulative: a reader that fell behind skips to the newest.
        while item is not _ACCEPTED and not isinstance(item, BaseException) \
                and not self.queue.empty():
            item = self.queue.get_nowait()
        if isinstance(item, BaseException):
            raise item
        return item


def _post(items: list[tuple[_OutputQueue, Any]]) -> None:
    """Put items into their queues from the client's thread: one wake-up per loop."""
    by_loop = defaultdict(list)
    for queue, item in items:
        by_loop[queue.loop].append((queue, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:   # the loop is closed: nobody is listening any more
            pass


def _put_all(batch: list[tuple[_OutputQueue, Any]]) -> None:
    for queue, item in batch:
        queue.queue.put_nowait(item)
