"""MPAsyncLLMEngine: AsyncLLMEngine's API with the LLMEngine in a process of its own.

As in vLLM V1, the engine core (scheduling, launching steps, detokenizing) and the
server (the asyncio loop writing an SSE chunk per request per step) then share no
GIL. The engine process is spawned, never forked, and is the only one that imports
a jax backend (multi-host, it is also the one that joins jax.distributed)::

    server process                                engine process (run_engine_core)
    generate / abort -> commands -> writer thread --pipe--> apply, step()
    asyncio queues <- reader thread (one post a batch) <--pipe-- one message a step

Outputs cross as deltas: new token ids, new text, new logprobs, and the prompt once.
Whole cumulative RequestOutputs grow with the sequence (256 of 1000 prompt + 1000
output tokens pickle to 3 MB: 27 ms to pickle, 37 ms to unpickle, each step); the
reader thread rebuilds them, so consumers get what the in-thread engine gives.

If the engine process dies, every request gets ``EngineDeadError`` and ``is_dead``
turns true (the server answers 503), as when AsyncLLMEngine's thread dies.
"""
from __future__ import annotations

import asyncio
import copy
import logging
import multiprocessing
import pickle
import queue
import signal
import threading
import time
import traceback
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Callable

from jaxllm.engine.async_engine import _ACCEPTED, EngineDeadError, _OutputQueue, _post
from jaxllm.engine.output_wire import OutputDecoder
from jaxllm.metrics import EngineMetrics

logger = logging.getLogger(__name__)

# Commands to one message from the server process: tokenized as one batch.
WRITE_CHUNK = 64

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@dataclass
class EngineInfo:
    """What the server reads from ``engine.engine``, sent once the engine is ready."""
    tokenizer: Any              # with the chat template the engine loaded
    model_name: str
    max_model_len: int
    eos_token_id: int | None


@dataclass
class SpawnedEngine:
    """An engine process spawned and still loading: `jaxllm serve` spawns it before
    its own imports, so that they overlap the engine's start-up."""
    process: multiprocessing.process.BaseProcess
    commands_conn: Any           # commands to the engine process
    outputs_conn: Any            # its messages
    spawned_at: float            # time.perf_counter() here


def spawn_engine(config, setup: Callable | None = None) -> SpawnedEngine:
    """Start the engine process (see MPAsyncLLMEngine for ``setup``); it is a daemon,
    so it ends with this process if nobody waits for it."""
    ctx = multiprocessing.get_context("spawn")   # jax must never be forked
    child_commands, commands_conn = ctx.Pipe(duplex=False)
    outputs_conn, child_outputs = ctx.Pipe(duplex=False)
    process = ctx.Process(
        target=run_engine_core, name="jaxllm-engine-core", daemon=True,
        args=(config, child_commands, child_outputs, setup,
              logging.getLogger().getEffectiveLevel(), time.time()))
    spawned_at = time.perf_counter()
    process.start()
    child_commands.close()   # so that the engine process's exit reads as EOF here
    child_outputs.close()
    return SpawnedEngine(process, commands_conn, outputs_conn, spawned_at)


class MPAsyncLLMEngine:
    """Starts the engine process (or takes one from spawn_engine) and waits until its
    engine is built (an error there is raised here, the engine process's traceback as
    its cause).

    ``setup``: a picklable callable run on the LLMEngine in the engine process once
    it is built (benchmarks swap the device for a simulated one with it).
    ``ready_message_s``: the seconds its ready message took to read (unpickle).
    """

    def __init__(self, config, metrics: EngineMetrics | None = None,
                 setup: Callable | None = None, spawned: SpawnedEngine | None = None):
        spawned = spawned or spawn_engine(config, setup)
        self.process = spawned.process
        self._commands_conn, self._outputs_conn = spawned.commands_conn, spawned.outputs_conn
        try:
            self.engine, stats = self._wait_until_ready()
        except BaseException as e:
            # A failed start exits by itself; on Ctrl-C there is nothing to wait for.
            self._stop_process(0 if isinstance(e, KeyboardInterrupt) else 5, quiet=True)
            self._commands_conn.close()
            self._outputs_conn.close()
            raise
        self.metrics = metrics or EngineMetrics(self.engine.model_name)
        self.metrics.update_stats(stats)
        self.dead_error: BaseException | None = None
        self._cond = threading.Condition()
        self._commands: list[tuple] = []             # sent in order by the writer thread
        self._queues: dict[str, _OutputQueue] = {}   # requests in the engine, by id
        self._decoder = OutputDecoder()             # reader thread only
        self._writer_tokenizer = self.engine.tokenizer   # a copy once the writer starts
        self._stopped = False
        self._writer = threading.Thread(target=self._write, name="jaxllm-core-writer",
                                        daemon=True)
        self._reader = threading.Thread(target=self._read, name="jaxllm-core-reader",
                                        daemon=True)
        self._writer.start()
        self._reader.start()

    @classmethod
    def from_config(cls, config) -> "MPAsyncLLMEngine":
        return cls(config)

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    # ------------------------------------------------------------ event-loop side
    async def generate(self, request_id: str, prompt, params) -> AsyncIterator[Any]:
        """Add a request and yield its (cumulative) RequestOutputs until finished.

        As AsyncLLMEngine.generate: the engine's ValueError for a bad request is
        raised by the first ``__anext__``; closing or cancelling the iterator before
        the last output aborts the request in the engine process."""
        queue = _OutputQueue(asyncio.get_running_loop())
        finished = False
        try:
            with self._cond:
                self._raise_if_dead()
                if request_id in self._queues:
                    raise ValueError(f"request id {request_id!r} is already in use")
                self._queues[request_id] = queue
                self._send(("add", request_id, prompt, params, time.time()))
            await queue.get()   # _ACCEPTED, or the engine's error raised
            while not finished:
                output = await queue.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self._abort(request_id, queue)

    def abort(self, request_id: str) -> None:
        self._abort(request_id, None)

    def _abort(self, request_id: str, queue: _OutputQueue | None) -> None:
        with self._cond:
            mine = self._queues.get(request_id)
            if mine is None or (queue is not None and mine is not queue):
                return   # finished, failed, aborted already, or another request's id
            del self._queues[request_id]
            self.metrics.record_abort(request_id)
            self._send(("abort", request_id))

    def _send(self, command: tuple) -> None:
        """Queue a command for the writer thread (the caller holds _cond)."""
        self._commands.append(command)
        self._cond.notify_all()

    def _raise_if_dead(self) -> None:
        if self.dead_error is not None or self._stopped:
            raise EngineDeadError(f"the engine is not running: {self.dead_error!r}")

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the engine process to stop (after its current step), then terminate
        it if it has not within ``timeout``; pending requests get EngineDeadError."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._stop_process(timeout)
        self._writer.join(timeout)
        self._reader.join(timeout)
        self._commands_conn.close()
        self._outputs_conn.close()

    def _stop_process(self, timeout: float, quiet: bool = False) -> None:
        self.process.join(timeout)
        if self.process.is_alive():
            if not quiet:
                logger.warning("the engine process did not stop in %.0f s: terminating it",
                               timeout)
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    # ------------------------------------------------------------ start-up
    def _wait_until_ready(self) -> tuple[EngineInfo, Any]:
        try:
            message = self._outputs_conn.recv_bytes()
        except EOFError:
            raise RuntimeError(f"the engine process exited while starting "
                               f"({self._exit_status()}); its log is above") from None
        t1 = time.perf_counter()
        kind, *payload = pickle.loads(message)   # the tokenizer: tenths of a second
        self.ready_message_s = time.perf_counter() - t1
        if kind == "failed":
            raise _remote_error(*payload)
        return payload[0], payload[1]

    def _exit_status(self) -> str:
        self.process.join(5)
        code = self.process.exitcode
        if code is None:
            return "still running"
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"

    # ------------------------------------------------------------ writer and reader
    def _write(self) -> None:
        """Send queued commands, up to WRITE_CHUNK to a message: a full pipe (a step's
        worth of long prompts) blocks this thread, not the event loop. Text prompts
        are tokenized here, as vLLM's front end does, not between the engine's steps;
        a chunk at a time, so the first requests of a burst do not wait for the whole
        burst's tokenization (the rate-inf benchmark sends token ids: not measured)."""
        # A copy of its own: a fast tokenizer used from two threads at once can fail
        # ("Already borrowed"), and the event loop uses the engine's copy.
        try:
            self._writer_tokenizer = copy.deepcopy(self.engine.tokenizer)
        except Exception:  # noqa: BLE001 - not copyable: encode under the shared one
            self._writer_tokenizer = self.engine.tokenizer
        while True:
            with self._cond:
                while not (self._commands or self._stopped or self.dead_error):
                    self._cond.wait()
                commands = self._commands[:WRITE_CHUNK]
                del self._commands[:WRITE_CHUNK]
                stopping = self._stopped and not self._commands
                dead = self.dead_error is not None
            try:
                if dead:
                    return
                if commands:
                    self._commands_conn.send(self._tokenized(commands))
                if stopping:
                    self._commands_conn.send([("shutdown",)])
                    return
            except OSError:    # the engine process is gone; the reader reports it
                return

    def _tokenized(self, commands: list[tuple]) -> list[tuple]:
        """The commands, each add's text prompt as {"prompt", "prompt_token_ids"}
        (the engine's own tokenizer, shipped here at start-up, so the same ids),
        encoded as one batch: a fast tokenizer encodes a batch in parallel."""
        texts = {}
        for i, command in enumerate(commands):
            prompt = command[2] if command[0] == "add" else None
            if isinstance(prompt, dict) and "prompt_token_ids" not in prompt:
                prompt = prompt.get("prompt")
            if isinstance(prompt, str):
                texts[i] = prompt
        if not texts:
            return commands
        tokenizer = self._writer_tokenizer
        try:
            ids = tokenizer(list(texts.values()))["input_ids"]
        except Exception:  # noqa: BLE001 - one at a time, the engine raising for the bad
            ids = [_encode_or_none(tokenizer, text) for text in texts.values()]
        out = list(commands)
        for (i, text), token_ids in zip(texts.items(), ids):
            if token_ids is not None:
                out[i] = out[i][:2] + ({"prompt": text, "prompt_token_ids": token_ids},) \
                    + out[i][3:]
        return out

    def _read(self) -> None:
        """Deliver the engine process's messages until its pipe closes."""
        try:
            while True:
                kind, *payload = self._outputs_conn.recv()
                if kind == "outputs":
                    self._on_outputs(*payload)
                elif kind == "added":
                    self._on_added(*payload)
                elif kind == "failed":
                    error = _remote_error(*payload)
                    logger.error("the engine process died:\n%s", payload[1])
                    self._fail_all(EngineDeadError(f"the engine died: {error!r}"), error)
                    return
        except (EOFError, OSError):
            pass
        with self._cond:
            stopped = self._stopped
        if stopped:
            self._fail_all(EngineDeadError("the engine was shut down"))
        else:
            error = EngineDeadError(f"the engine process exited ({self._exit_status()})")
            logger.error("%s", error)
            self._fail_all(error, error)

    def _on_added(self, added: list[tuple], aborted: list[str], stats) -> None:
        for request_id in aborted:   # no output follows an abort
            self._decoder.forget(request_id)
        self.metrics.update_stats(stats)
        posts = []
        with self._cond:
            for request_id, error, arrival_time, n in added:
                queue = self._queues.get(request_id)
                if error is not None:
                    if queue is not None:
                        del self._queues[request_id]
                        posts.append((queue, error))
                    continue
                self.metrics.record_arrival(request_id, arrival_time, n)
                if queue is None:   # aborted before the engine took it
                    self.metrics.record_abort(request_id)
                else:
                    posts.append((queue, _ACCEPTED))
        _post(posts)

    def _on_outputs(self, deltas: list[tuple], stats) -> None:
        self.metrics.update_stats(stats)
        outputs = [self._decoder.decode(delta) for delta in deltas]
        now = time.time()
        posts = []
        with self._cond:
            for output in outputs:
                if output is None:
                    continue
                queue = self._queues.get(output.request_id)
                if queue is None:   # aborted meanwhile
                    self._decoder.forget(output.request_id)
                    continue
                self.metrics.record_output(output, now)
                if output.finished:
                    del self._queues[output.request_id]
                posts.append((queue, output))
        _post(posts)

    def _fail_all(self, error: BaseException, dead: BaseException | None = None) -> None:
        with self._cond:
            if dead is not None and self.dead_error is None:
                self.dead_error = dead
            queues = list(self._queues.values())
            self._queues, self._commands = {}, []
            self._cond.notify_all()
        _post([(queue, error) for queue in queues])


# ---------------------------------------------------------------- engine process

def run_engine_core(config, commands, outputs, setup=None, log_level=logging.INFO,
                    spawned_at: float | None = None) -> None:
    """The engine process: build the LLMEngine, say ready, then serve commands.
    spawned_at: time.time() when the server process spawned this one."""
    started = time.time()
    # Ctrl-C reaches the whole process group; the server process decides when the
    # engine stops (after streams had their grace period).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=LOG_FORMAT)
    if logging.getLogger("jax").level == logging.NOTSET:
        logging.getLogger("jax").setLevel(logging.WARNING)
    try:
        seconds = {"spawn_s": started - (spawned_at or started)}   # interpreter, imports
        t = time.perf_counter()
        from jaxllm.config_file import prepare_launch
        from jaxllm.engine.llm_engine import LLMEngine
        seconds["imports_s"] = time.perf_counter() - t
        t = time.perf_counter()
        prepare_launch(config)   # the compile cache, jax.distributed, the device checks
        seconds["launch_s"] = time.perf_counter() - t
        t = time.perf_counter()
        engine = LLMEngine(config)
        if setup is not None:
            setup(engine)
        seconds["engine_s"] = time.perf_counter() - t
        t = time.perf_counter()
        info = EngineInfo(engine.tokenizer, engine.model_name, engine.max_model_len,
                          engine.eos_token_id)
        outputs.send(("ready", info, engine.get_stats()))
        seconds["ready_message_s"] = time.perf_counter() - t   # until the server reads it
        logger.info("engine core ready %.1f s after its spawn (%s)",
                    time.time() - (spawned_at or started),
                    ", ".join(f"{k} {v:.1f}" for k, v in seconds.items()))
    except BaseException as e:  # noqa: BLE001 - reported to the server process
        outputs.send(("failed", *_describe(e)))
        raise SystemExit(1)
    try:
        EngineCore(engine, commands, outputs).run()
    except BaseException as e:  # noqa: BLE001 - a failed step kills the engine
        try:
            outputs.send(("failed", *_describe(e)))
        except OSError:
            pass
        raise SystemExit(1)


class EngineCore:
    """The engine process's loop: apply commands, step, send the step's outputs."""

    def __init__(self, engine, commands, outputs):
        self.engine = engine
        self.commands = commands
        self.outputs = outputs
        # Messages go out on a thread of their own: a server process busy writing
        # SSE chunks lets the pipe fill, and a blocking send would then stall the
        # engine (and the device) until it drains.
        self._pending: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="jaxllm-core-sender",
                                        daemon=True)
        self._sender.start()
        self._steps, self._most_pending = 0, 0
        self._seconds = {"steps": 0.0, "commands": 0.0, "busy": 0.0}

    def run(self) -> None:
        seconds = self._seconds
        try:
            while (commands := self._receive()) is not None:
                t0 = time.perf_counter()
                if commands:   # acknowledged before a long step: bad requests fail at once
                    added, aborted = self._apply(commands)
                    self._send(("added", added, aborted, self.engine.get_stats()))
                    seconds["commands"] += time.perf_counter() - t0
                if self.engine.has_unfinished_requests():
                    t1 = time.perf_counter()
                    deltas = self.engine.step_deltas()
                    seconds["steps"] += time.perf_counter() - t1
                    self._steps += 1
                    self._send(("outputs", deltas, self.engine.get_stats()))
                    seconds["busy"] += time.perf_counter() - t0
        finally:
            self._pending.put(None)     # flush what is queued, then stop the sender
            self._sender.join()
            # busy: loop turns that stepped, from the commands' receipt on; what is
            # neither steps nor commands is the loop's own (stats, queueing outputs).
            logger.info("engine core: %d steps, %.1f s in steps, %.1f s applying commands, "
                        "%.1f s busy; at most %d messages waiting for the server process",
                        self._steps, seconds["steps"], seconds["commands"], seconds["busy"],
                        self._most_pending)

    def _send(self, message: tuple) -> None:
        self._pending.put(message)
        self._most_pending = max(self._most_pending, self._pending.qsize())

    def _send_loop(self) -> None:
        while (message := self._pending.get()) is not None:
            try:
                self.outputs.send(message)
            except OSError:    # the server process is gone; the loop sees it too
                return

    def _receive(self) -> list[tuple] | None:
        """The commands sent since the last call, waiting for some while there is
        nothing to step. None: stop (asked to, or the server process is gone)."""
        commands = []
        try:
            if not self.engine.has_unfinished_requests():
                commands += self.commands.recv()
            while self.commands.poll():
                commands += self.commands.recv()
        except (EOFError, OSError):
            return None
        if any(command[0] == "shutdown" for command in commands):
            return None
        return commands

    def _apply(self, commands: list[tuple]) -> tuple[list[tuple], list[str]]:
        """Adds and aborts, in order: ((request id, error or None, arrival, n) per
        add, the ids aborted)."""
        added, aborted = [], []
        for command in commands:
            if command[0] == "abort":
                self.engine.abort_request(command[1])
                aborted.append(command[1])
                continue
            _, request_id, prompt, params, arrival_time = command
            try:
                self.engine.add_request(request_id, prompt, params, arrival_time=arrival_time)
                error = None
            except Exception as e:  # noqa: BLE001 - a bad request fails alone
                error = _picklable(e)
            added.append((request_id, error, arrival_time, getattr(params, "n", 1)))
        return added, aborted


def _encode_or_none(tokenizer, text: str) -> list[int] | None:
    try:
        return tokenizer.encode(text)
    except Exception:  # noqa: BLE001 - the engine process raises it for the request
        return None


def _describe(e: BaseException) -> tuple[BaseException | None, str]:
    """(the exception if it pickles, else None; its traceback text)."""
    text = "".join(traceback.format_exception(e))
    try:
        pickle.dumps(e)
    except Exception:  # noqa: BLE001
        return None, text
    return e, text


def _picklable(e: Exception) -> Exception:
    try:
        pickle.dumps(e)
        return e
    except Exception:  # noqa: BLE001
        return RuntimeError(repr(e))


class _RemoteTraceback(Exception):
    """The engine process's traceback, shown as the cause of its error here."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f"\n\"\"\"\n{self.text}\"\"\""


def _remote_error(error: BaseException | None, text: str) -> BaseException:
    if error is None:
        last = text.strip().splitlines()[-1] if text.strip() else "unknown error"
        error = RuntimeError(f"the engine process failed: {last}")
    error.__cause__ = _RemoteTraceback(text)
    return error
