"""The engine-core clients: how ``AsyncLLM`` reaches the LLMEngine. Two transports,
one contract; the clients only move commands in and outputs out (the per-request
queues, metrics and death bookkeeping are AsyncLLM's):

- ``InprocClient``: the LLMEngine stepped on a thread of this process
  (--disable-frontend-multiprocessing).
- ``MPClient``: the LLMEngine in a process of its own (``core_proc``), `jaxllm serve`'s
  default. As in vLLM V1, the engine core (scheduling, launching steps, detokenizing)
  and the server (the asyncio loop writing an SSE chunk per request per step) then
  share no GIL. The engine process is spawned, never forked, and is the only one that
  imports a jax backend (multi-host, it is also the one that joins jax.distributed)::

    server process                                engine process (core_proc)
    add / abort -> commands -> writer thread --pipe--> apply, step_deltas()
    AsyncLLM.on_* <- reader thread (OutputDecoder) <--pipe-- one message a step

  Outputs cross as deltas (``output_wire``); the reader thread rebuilds the
  cumulative RequestOutputs, so AsyncLLM gets what the in-process engine gives.

A client, once ``start(handler)`` ran, calls from its own thread, in order:
``handler.on_added(added, stats)`` after each batch of commands applied (added: (id,
error or None, arrival time, n) per add), ``handler.on_outputs(outputs, stats)`` after
each step, and ``handler.on_dead(error)`` once, when it stops (error None: shut down).
"""
from __future__ import annotations

import copy
import logging
import multiprocessing
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jaxllm.engine.core_proc import (EngineInfo, apply_commands, engine_stats, exit_status,
                                     run_engine_core)
from jaxllm.engine.output_wire import OutputDecoder

logger = logging.getLogger(__name__)

# Commands to one message from the server process: tokenized as one batch.
WRITE_CHUNK = 64


class EngineDeadError(RuntimeError):
    """The engine has stopped (an exception in a step, its process gone, or shutdown)."""


class EngineCoreClient:
    """The contract (see the module's docstring). ``info``: the EngineInfo; ``stats``:
    the engine's stats before any request; ``process``: the engine process, if any."""

    info: EngineInfo
    stats: Any
    process: multiprocessing.process.BaseProcess | None = None

    def start(self, handler) -> None:
        raise NotImplementedError

    def add_request(self, request_id: str, prompt, params, arrival_time: float,
                    priority: int = 0) -> None:
        self._send(("add", request_id, prompt, params, arrival_time, priority))

    def abort_request(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def _send(self, command: tuple) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify_all()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop after the current step; the handler's on_dead(None) follows."""
        raise NotImplementedError


class InprocClient(EngineCoreClient):
    """The LLMEngine (or anything with its API) on a thread of this process. It is not
    thread-safe, so the thread owns it: it applies the queued commands, steps, and
    hands the outputs over; with nothing to do it sleeps on a condition variable,
    which a command wakes."""

    def __init__(self, engine):
        self.engine = engine
        # The front end's copy: a Rust tokenizer used from two threads at once can
        # fail with "Already borrowed", and this thread decodes with the engine's.
        self.info = EngineInfo.of(engine, copy.deepcopy(engine.tokenizer))
        self.stats = engine_stats(engine)
        self._cond = threading.Condition()
        self._commands: list[tuple] = []
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="jaxllm-engine", daemon=True)

    @classmethod
    def from_config(cls, config, setup: Callable | None = None) -> "InprocClient":
        from jaxllm.engine.llm_engine import LLMEngine
        engine = LLMEngine.from_config(config)
        if setup is not None:
            setup(engine)
        return cls(engine)

    def start(self, handler) -> None:
        self._handler = handler
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        engine, handler = self.engine, self._handler
        try:
            while (commands := self._wait_for_work()) is not None:
                if commands:   # new requests show as waiting before a long step
                    added, _ = apply_commands(engine, commands)
                    handler.on_added(added, engine_stats(engine))
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    handler.on_outputs(outputs, engine_stats(engine))
        except BaseException as e:  # noqa: BLE001 - any failure kills the engine
            logger.exception("engine thread died")
            handler.on_dead(e)
        else:
            handler.on_dead(None)

    def _wait_for_work(self) -> list[tuple] | None:
        with self._cond:
            while not (self._commands or self._stopped or self.engine.has_unfinished_requests()):
                self._cond.wait()
            if self._stopped:
                return None
            commands, self._commands = self._commands, []
            return commands


@dataclass
class SpawnedEngine:
    """An engine process spawned and still loading: `jaxllm serve` spawns it before
    its own imports, so that they overlap the engine's start-up."""
    process: multiprocessing.process.BaseProcess
    commands_conn: Any           # commands to the engine process
    outputs_conn: Any            # its messages
    spawned_at: float            # time.perf_counter() here


def spawn_engine(config, setup: Callable | None = None) -> SpawnedEngine:
    """Start the engine process (see MPClient for ``setup``); it is a daemon, so it
    ends with this process if nobody waits for it."""
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


class MPClient(EngineCoreClient):
    """Starts the engine process (or takes one from spawn_engine) and waits until its
    engine is built (an error there is raised here, the engine process's traceback as
    its cause).

    ``setup``: a picklable callable run on the LLMEngine in the engine process once
    it is built (benchmarks swap the device for a simulated one with it).
    ``ready_message_s``: the seconds its ready message took to read (unpickle).
    """

    def __init__(self, config, setup: Callable | None = None,
                 spawned: SpawnedEngine | None = None):
        spawned = spawned or spawn_engine(config, setup)
        self.process = spawned.process
        self._commands_conn, self._outputs_conn = spawned.commands_conn, spawned.outputs_conn
        try:
            self.info, self.stats = self._wait_until_ready()
        except BaseException as e:
            # A failed start exits by itself; on Ctrl-C there is nothing to wait for.
            self._stop_process(0 if isinstance(e, KeyboardInterrupt) else 5, quiet=True)
            self._commands_conn.close()
            self._outputs_conn.close()
            raise
        self._cond = threading.Condition()
        self._commands: list[tuple] = []             # sent in order by the writer thread
        self._decoder = OutputDecoder()             # reader thread only
        self._writer_tokenizer = self.info.tokenizer   # a copy once the writer starts
        self._stopped = self._dead = False
        self._writer = threading.Thread(target=self._write, name="jaxllm-core-writer",
                                        daemon=True)
        self._reader = threading.Thread(target=self._read, name="jaxllm-core-reader",
                                        daemon=True)

    def start(self, handler) -> None:
        self._handler = handler
        self._writer.start()
        self._reader.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the engine process to stop (after its current step), then terminate
        it if it has not within ``timeout``."""
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
        return exit_status(self.process)

    # ------------------------------------------------------------ writer and reader
    def _write(self) -> None:
        """Send queued commands, up to WRITE_CHUNK to a message: a full pipe (a step's
        worth of long prompts) blocks this thread, not the event loop. Text prompts
        are tokenized here, as vLLM's front end does, not between the engine's steps;
        a chunk at a time, so the first requests of a burst do not wait for the whole
        burst's tokenization (the rate-inf benchmark sends token ids: not measured)."""
        # A copy of its own: a fast tokenizer used from two threads at once can fail
        # ("Already borrowed"), and the event loop uses info.tokenizer.
        try:
            self._writer_tokenizer = copy.deepcopy(self.info.tokenizer)
        except Exception:  # noqa: BLE001 - not copyable: encode under the shared one
            self._writer_tokenizer = self.info.tokenizer
        while True:
            with self._cond:
                while not (self._commands or self._stopped or self._dead):
                    self._cond.wait()
                commands = self._commands[:WRITE_CHUNK]
                del self._commands[:WRITE_CHUNK]
                stopping = self._stopped and not self._commands
                dead = self._dead
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
        """Hand the engine process's messages over until its pipe closes. A request
        aborted here still has deltas in flight; the engine process's acknowledgement
        of the abort (after them) makes the decoder forget it."""
        handler, decoder = self._handler, self._decoder
        try:
            while True:
                kind, *payload = self._outputs_conn.recv()
                if kind == "outputs":
                    deltas, stats = payload
                    outputs = [decoder.decode(delta) for delta in deltas]
                    handler.on_outputs([o for o in outputs if o is not None], stats)
                elif kind == "added":
                    added, aborted, stats = payload
                    for request_id in aborted:   # no output follows an abort
                        decoder.forget(request_id)
                    handler.on_added(added, stats)
                elif kind == "failed":
                    logger.error("the engine process died:\n%s", payload[1])
                    self._die(_remote_error(*payload))
                    return
        except (EOFError, OSError):
            pass
        with self._cond:
            stopped = self._stopped
        if stopped:
            self._die(None)
        else:
            error = EngineDeadError(f"the engine process exited ({self._exit_status()})")
            logger.error("%s", error)
            self._die(error)

    def _die(self, error: BaseException | None) -> None:
        with self._cond:
            self._dead = True
            self._commands = []
            self._cond.notify_all()
        self._handler.on_dead(error)


def _encode_or_none(tokenizer, text: str) -> list[int] | None:
    try:
        return tokenizer.encode(text)
    except Exception:  # noqa: BLE001 - the engine process raises it for the request
        return None


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
