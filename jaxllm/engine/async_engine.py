"""AsyncLLMEngine: the LLMEngine driven from asyncio, for the server.

The LLMEngine is not thread-safe, so one engine thread owns it: it applies the adds
and aborts that the event loop queued, steps, and hands each request's outputs to
that request's asyncio queue with ``loop.call_soon_threadsafe``. The event loop
never calls the engine and never blocks on it. When there is nothing to do the
thread sleeps on a condition variable; queuing a command wakes it.

Outputs are cumulative (the whole text so far), so a consumer that fell behind
skips to the newest one. If the engine raises, the thread dies, every request gets
``EngineDeadError`` and ``is_dead`` turns true (the server then answers 503).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

from jaxllm.metrics import EngineMetrics

logger = logging.getLogger(__name__)

_ACCEPTED = object()   # first item of a request's queue: the engine took the request


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (an exception in a step, or shutdown)."""


class AsyncLLMEngine:
    """Wraps an ``LLMEngine`` (or anything with its API) and starts its thread."""

    def __init__(self, engine: Any, metrics: EngineMetrics | None = None):
        self.engine = engine
        self.metrics = metrics or EngineMetrics(engine.model_name)
        self.dead_error: BaseException | None = None
        self._cond = threading.Condition()
        self._commands: list[tuple] = []          # ("add", ...) / ("abort", id), in order
        self._queues: dict[str, _OutputQueue] = {}  # engine thread only
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="jaxllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config) -> "AsyncLLMEngine":
        from jaxllm.engine.llm_engine import LLMEngine
        return cls(LLMEngine.from_config(config))

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    # ------------------------------------------------------------ event-loop side
    async def generate(self, request_id: str, prompt, params) -> AsyncIterator[Any]:
        """Add a request and yield its (cumulative) RequestOutputs until finished.

        The request is added on the first ``__anext__``; a ValueError from the
        engine (too long, bad token ids) is raised there. Closing or cancelling the
        iterator before the last output aborts the request, freeing its KV blocks.
        """
        queue = _OutputQueue(asyncio.get_running_loop())
        finished = False
        try:
            with self._cond:
                self._raise_if_dead()
                self._commands.append(("add", request_id, prompt, params, time.time(), queue))
                self._cond.notify()
            await queue.get()   # _ACCEPTED, or the engine's error raised
            while not finished:
                output = await queue.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._cond:
            if not self._stopped and self.dead_error is None:
                self._commands.append(("abort", request_id))
                self._cond.notify()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the thread after its current step; pending requests get EngineDeadError."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout)

    def _raise_if_dead(self) -> None:
        if self.dead_error is not None or self._stopped:
            raise EngineDeadError(f"the engine is not running: {self.dead_error!r}")

    # ------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            self.metrics.update_stats(self.engine.get_stats())
            while (commands := self._wait_for_work()) is not None:
                if commands:   # new requests show as waiting before a long step
                    self._apply(commands)
                    self.metrics.update_stats(self.engine.get_stats())
                if self.engine.has_unfinished_requests():
                    self._deliver(self.engine.step())
                    self.metrics.update_stats(self.engine.get_stats())
        except BaseException as e:  # noqa: BLE001 - any failure kills the engine
            logger.exception("engine thread died")
            with self._cond:
                self.dead_error = e
            self._fail_all(EngineDeadError(f"the engine died: {e!r}"))
        else:
            self._fail_all(EngineDeadError("the engine was shut down"))

    def _wait_for_work(self) -> list[tuple] | None:
        with self._cond:
            while not (self._commands or self._stopped or self.engine.has_unfinished_requests()):
                self._cond.wait()
            if self._stopped:
                return None
            commands, self._commands = self._commands, []
            return commands

    def _apply(self, commands: list[tuple]) -> None:
        for command in commands:
            if command[0] == "abort":
                if self._queues.pop(command[1], None) is not None:
                    self.engine.abort_request(command[1])
                    self.metrics.record_abort(command[1])
                continue
            _, request_id, prompt, params, arrival_time, queue = command
            try:
                self.engine.add_request(request_id, prompt, params, arrival_time=arrival_time)
            except Exception as e:  # noqa: BLE001 - a bad request fails alone
                _post([(queue, e)])
                continue
            self._queues[request_id] = queue
            self.metrics.record_arrival(request_id, arrival_time, params.n)
            _post([(queue, _ACCEPTED)])

    def _deliver(self, outputs: list) -> None:
        now = time.time()
        posts = []
        for output in outputs:
            queue = self._queues.get(output.request_id)
            if queue is None:   # aborted meanwhile
                continue
            self.metrics.record_output(output, now)
            if output.finished:
                del self._queues[output.request_id]
            posts.append((queue, output))
        _post(posts)

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            queues = list(self._queues.values())
            queues += [c[5] for c in self._commands if c[0] == "add"]
            self._queues, self._commands = {}, []
        _post([(queue, error) for queue in queues])


class _OutputQueue:
    """One request's outputs, filled from the engine thread, read on its loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
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
    """Put items into their queues from the engine thread: one wake-up per loop."""
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
