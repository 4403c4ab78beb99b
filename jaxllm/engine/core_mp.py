"""The engine core in a process of its own, under the offline LLMEngine (vLLM V1's
split; on with ``JAXLLM_ENABLE_MULTIPROCESSING=1``, vLLM's VLLM_ENABLE_V1_MULTIPROCESSING).

The engine process runs the EngineCore alone: it schedules, launches steps, reads
them back and advances the grammars, one step after another without waiting for
anyone. LLM's own process keeps everything else of the LLMEngine: tokenizing and
checking requests, fanning ``n`` out, detokenizing, stop strings, logprob entries and
the RequestOutputs (the OutputProcessor, on this process's own Request objects,
mirrored from the engine's records). At batch 256 that output work took 2-3 ms of the
engine thread's ~10 ms step cycle on the H200's host, where the device's step is
~10 ms: on one thread the host set the pace; here it runs beside the engine::

    LLM's process (LLMEngine, this client)            engine process (run_core)
    add_request  ---- ("add", Request, seed) -------->  EngineCore.add_request
    stop string, abort -- ("finish", ids, status) --->  EngineCore.finish_requests
    step(): records applied to the Requests <-- ("step", records, prompt logprobs,
            then the OutputProcessor                     stats), after every step

A stop string found here finishes the request here at once; the engine hears of it a
step or two later, and the tokens it made meanwhile are dropped (as in vLLM V1).
Messages from the engine process: ("ready", CoreInfo, stats), ("step", ...) and
("failed", exception or None, traceback text).
"""
from __future__ import annotations

import gc
import logging
import multiprocessing
import queue
import signal
import threading
import weakref

from jaxllm.engine.core import EngineCoreOutputs, SampleResult
from jaxllm.engine.core_client import _remote_error
from jaxllm.engine.core_proc import LOG_FORMAT, _describe, exit_status, send_failure
from jaxllm.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)

# Finish statuses on the wire (0: still running).
_STATUSES = (None, RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED,
             RequestStatus.FINISHED_ABORTED)
_CODES = {status: code for code, status in enumerate(_STATUSES) if status is not None}


def pack(outputs: EngineCoreOutputs) -> list[tuple]:
    """One step's (Request, SampleResult) pairs as plain tuples: (id, serial, token,
    logprob, rank, top ids, top logprobs, status code, stop reason, cached tokens,
    first scheduled time)."""
    records = []
    for req, res in outputs.sampled:
        code = _CODES[req.status] if req.is_finished() else 0
        records.append((req.request_id, req.serial, res.token_id, res.logprob, res.rank,
                        res.top_ids, res.top_logprobs, code, req.stop_reason,
                        req.num_cached_tokens, req.first_scheduled_time))
    return records


# ---------------------------------------------------------------- engine process
def run_core(config, commands, outputs, log_level=logging.INFO) -> None:
    """The engine process: build the engine core, say ready, then step while there is
    work, applying the commands between steps, until told to stop or the other
    process is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the LLM's process decides
    logging.basicConfig(level=log_level, format=LOG_FORMAT)
    try:
        from jaxllm.config_file import prepare_launch
        from jaxllm.engine.core_build import build_core, core_stats
        prepare_launch(config)
        core, info = build_core(config)
        # One engine for the process's life: what start-up built leaves the collector.
        gc.collect()
        gc.freeze()
        outputs.send(("ready", info, core_stats(core, info.num_gpu_blocks)))
    except BaseException as e:  # noqa: BLE001 - reported to the LLM's process
        outputs.send(("failed", *_describe(e)))
        raise SystemExit(1)
    try:
        _core_loop(core, info, commands, outputs)
    except BaseException as e:  # noqa: BLE001 - a failed step kills the engine
        send_failure(outputs, e)
        raise SystemExit(1)


def _core_loop(core, info, commands, outputs) -> None:
    from jaxllm.engine.core_build import core_stats
    # Sent from a thread of its own: the other process busy building outputs lets the
    # pipe fill, and a blocking send would stall the engine and the device.
    pending: queue.SimpleQueue = queue.SimpleQueue()

    def send_loop():
        while (message := pending.get()) is not None:
            try:
                outputs.send(message)
            except OSError:
                return
    sender = threading.Thread(target=send_loop, name="jaxllm-core-sender", daemon=True)
    sender.start()
    scheduler = core.scheduler
    try:
        while True:
            try:
                batches = [] if scheduler.has_unfinished_requests() else [commands.recv()]
                while commands.poll():
                    batches.append(commands.recv())
            except (EOFError, OSError):
                return
            for batch in batches:
                for command in batch:
                    if command[0] == "add":
                        core.add_request(command[1], command[2])
                    elif command[0] == "finish":
                        core.finish_requests(command[1], _STATUSES[command[2]])
                    elif command[0] == "call":
                        pending.put(("result", *_call(core, command[1], command[2])))
                    else:       # shutdown
                        return
            if scheduler.has_unfinished_requests():
                out = core.step()
                pending.put(("step", pack(out), out.prompt_logprobs,
                             core_stats(core, info.num_gpu_blocks)))
    finally:
        pending.put(None)
        sender.join()


def _call(core, fn, args) -> tuple:
    """(fn(core, *args), None), or (None, (exception or None, traceback text))."""
    try:
        return core.call_utility(fn, *args), None
    except Exception as e:  # noqa: BLE001 - raised in the LLM's process
        return None, _describe(e)


# ---------------------------------------------------------------- this process
class EngineCoreMPClient:
    """What the LLMEngine holds as its engine core when the core runs in the engine
    process: EngineCore's calls (add_request, finish_requests, step), with the
    Requests added here as the mirrors the records update."""

    def __init__(self, config):
        ctx = multiprocessing.get_context("spawn")   # jax must never be forked
        child_commands, self._commands = ctx.Pipe(duplex=False)
        self._outputs, child_outputs = ctx.Pipe(duplex=False)
        self.process = ctx.Process(
            target=run_core, name="jaxllm-engine-core", daemon=True,
            args=(config, child_commands, child_outputs,
                  logging.getLogger().getEffectiveLevel()))
        self.process.start()
        child_commands.close()      # so that the engine process's exit reads as EOF
        child_outputs.close()
        self._requests: dict[str, Request] = {}     # running in the engine, as known here
        self._queued: list[tuple] = []              # commands not sent yet
        self.stats = None
        self.structured_output_manager = None      # the LLMEngine's, for checks only
        self._finalizer = weakref.finalize(self, _stop, self.process, self._commands)

    def wait_until_ready(self):
        """The engine's CoreInfo once it is built (its start-up error, raised here)."""
        kind, *payload = self._receive("while starting")
        if kind == "failed":
            self.shutdown()
            raise _remote_error(*payload)
        info, self.stats = payload
        return info

    def add_request(self, request: Request, seed: int) -> None:
        self._requests[request.request_id] = request
        self._queued.append(("add", request, seed))

    def finish_requests(self, request_ids, status: RequestStatus) -> None:
        """Finished here at once (no later record changes them); the engine follows."""
        request_ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in request_ids:
            request = self._requests.pop(rid, None)
            if request is not None and not request.is_finished():
                request.status = status
        self._queued.append(("finish", request_ids, _CODES[status]))
        if status is RequestStatus.FINISHED_ABORTED:
            self._flush()     # nothing may step again here soon (generate raised)

    def call_utility(self, fn, *args):
        """fn(core, *args) run in the engine process (fn and args picklable), its
        result returned; only while no request runs (a step's records would come first)."""
        if self._requests:
            raise RuntimeError("call_utility: requests are running")
        self._queued.append(("call", fn, args))
        self._flush()
        # Steps of requests finished here before the engine heard of it come first.
        while (message := self._receive(""))[0] == "step":
            self.stats = message[3]
        kind, *payload = message
        if kind == "failed":
            self.shutdown()
            raise _remote_error(*payload)
        result, error = payload
        if error is not None:
            raise _remote_error(*error)
        return result

    def step(self) -> EngineCoreOutputs:
        """The records of the engine's next step, applied to the Requests here. One
        step per call, never merged: a stop string found in one step's tokens must
        finish its request before the next step's tokens are applied."""
        self._flush()
        out = EngineCoreOutputs()
        if not self._requests:
            return out
        kind, *payload = self._receive("")
        if kind == "failed":
            self.shutdown()
            raise _remote_error(*payload)
        records, out.prompt_logprobs, self.stats = payload
        self._apply(records, out.sampled)
        return out

    def _apply(self, records: list[tuple], sampled: list) -> None:
        requests, finished = self._requests, []
        for (rid, serial, token, logprob, rank, top_ids, top_lps, code, stop_reason,
             num_cached, first_scheduled) in records:
            request = requests.get(rid)
            if request is None or request.serial != serial:
                continue        # finished here already (stop string, abort)
            request.append_output_token(token)
            request.num_cached_tokens = num_cached
            request.first_scheduled_time = first_scheduled
            if code:   # a step's every record of it carries its status after the step
                request.status, request.stop_reason = _STATUSES[code], stop_reason
                finished.append(rid)
            sampled.append((request, SampleResult(token, logprob, rank, top_ids, top_lps)))
        for rid in finished:      # after the step's other tokens of it (speculation)
            requests.pop(rid, None)

    def _flush(self) -> None:
        if self._queued:
            commands, self._queued = self._queued, []
            try:
                self._commands.send(commands)
            except OSError:
                raise RuntimeError(f"the engine process is gone ({self._exit_status()})") \
                    from None

    def _receive(self, when: str) -> tuple:
        try:
            return self._outputs.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"the engine process exited {when}({self._exit_status()}); "
                               "its log is above") from None

    def _exit_status(self) -> str:
        return exit_status(self.process)

    def shutdown(self) -> None:
        self._finalizer()


def _stop(process, commands) -> None:
    """Ask the engine process to stop; terminate it if it has not within 10 s."""
    try:
        commands.send([("shutdown",)])
    except OSError:
        pass
    process.join(10)
    if process.is_alive():
        process.terminate()
        process.join(5)
    commands.close()

