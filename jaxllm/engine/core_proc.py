"""The engine process: build the LLMEngine, say ready, then apply the server's
commands and send each step's outputs as deltas (``output_wire``), until told to stop
or the server process is gone. Spawned by ``core_client.spawn_engine``; its messages:

    ("ready", EngineInfo, stats)            once the engine is built
    ("added", added, aborted, stats)        a batch of commands applied (before a step)
    ("outputs", deltas, stats)              one step
    ("failed", exception or None, traceback text)   start-up or a step failed: it exits

It imports no jax before ``run_engine_core`` builds the engine, and nothing of the
front end (``core_client``, ``async_llm``).
"""
from __future__ import annotations

import gc
import logging
import pickle
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@dataclass
class EngineInfo:
    """What the front end reads from ``AsyncLLM.engine``: sent once the engine process
    is ready, or taken from the LLMEngine in this process. The tokenizer is the front
    end's own (it carries the chat template the engine loaded, --chat-template's if
    given): no engine thread uses it."""
    tokenizer: Any
    model_name: str
    max_model_len: int
    eos_token_id: int | None

    @classmethod
    def of(cls, engine, tokenizer=None) -> "EngineInfo":
        return cls(engine.tokenizer if tokenizer is None else tokenizer, engine.model_name,
                   engine.max_model_len, getattr(engine, "eos_token_id", None))


def engine_stats(engine):
    """``engine.get_stats()``; with speculative decoding on, with ``spec_decoding`` too:
    a copy of the engine core's counters (``EngineCore.spec_stats``), as the snapshot
    is read on another thread, or pickled, while the engine counts on."""
    stats = engine.get_stats()
    spec = getattr(getattr(engine, "engine_core", None), "spec_stats", None)
    if spec is not None:
        stats.spec_decoding = spec.snapshot()
    return stats


def apply_commands(engine, commands: list[tuple],
                   wrap_error: Callable[[Exception], Exception] = lambda e: e
                   ) -> tuple[list[tuple], list[str]]:
    """Apply ("add", id, prompt, params, arrival, priority) and ("abort", id) commands
    in order: ((request id, error or None, arrival, n) per add, the ids aborted). A bad
    request fails alone: its error (through ``wrap_error``) goes back with its add."""
    added, aborted = [], []
    for command in commands:
        if command[0] == "abort":
            engine.abort_request(command[1])
            aborted.append(command[1])
            continue
        _, request_id, prompt, params, arrival_time, priority = command
        try:
            engine.add_request(request_id, prompt, params, arrival_time=arrival_time,
                               priority=priority)
            error = None
        except Exception as e:  # noqa: BLE001 - a bad request fails alone
            error = wrap_error(e)
        added.append((request_id, error, arrival_time, getattr(params, "n", 1)))
    return added, aborted


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
        # This process serves one engine for its life, so what start-up built (weights'
        # pytrees, jax's caches, the tokenizer: ~200k objects) leaves the collector,
        # whose full passes walked it all (1-3 ms per step at 256 rows on average). Not
        # where engines come and go in one process (LLM objects, tests): objects frozen
        # there that later become cyclic garbage would never be collected.
        gc.collect()
        gc.freeze()
        seconds["engine_s"] = time.perf_counter() - t
        t = time.perf_counter()
        outputs.send(("ready", EngineInfo.of(engine), engine_stats(engine)))
        seconds["ready_message_s"] = time.perf_counter() - t   # until the server reads it
        logger.info("engine core ready %.1f s after its spawn (%s)",
                    time.time() - (spawned_at or started),
                    ", ".join(f"{k} {v:.1f}" for k, v in seconds.items()))
    except BaseException as e:  # noqa: BLE001 - reported to the server process
        outputs.send(("failed", *_describe(e)))
        raise SystemExit(1)
    try:
        EngineCoreProc(engine, commands, outputs).run()
    except BaseException as e:  # noqa: BLE001 - a failed step kills the engine
        send_failure(outputs, e)
        raise SystemExit(1)


class EngineCoreProc:
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
                    added, aborted = apply_commands(self.engine, commands, _picklable)
                    self._send(("added", added, aborted, engine_stats(self.engine)))
                    seconds["commands"] += time.perf_counter() - t0
                if self.engine.has_unfinished_requests():
                    t1 = time.perf_counter()
                    deltas = self.engine.step_deltas()
                    seconds["steps"] += time.perf_counter() - t1
                    self._steps += 1
                    self._send(("outputs", deltas, engine_stats(self.engine)))
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


def send_failure(outputs, e: BaseException) -> None:
    """("failed", ...) to the other process, if it is still there to read it."""
    try:
        outputs.send(("failed", *_describe(e)))
    except OSError:
        pass


def exit_status(process) -> str:
    """How a spawned engine process ended, in words (waits up to 5 s for it)."""
    process.join(5)
    code = process.exitcode
    if code is None:
        return "still running"
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


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
