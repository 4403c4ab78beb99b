"""Multi-host serving through JAX's multi-controller runtime.

Every process runs the same program over one Mesh spanning them all
(`jax.distributed`). Process 0, the leader, runs the scheduler and the server; its
executor broadcasts each step's `execute_model` arguments (the SchedulerOutput, its
requests and their seeds) before running it, and every other process, a follower,
calls its own executor's `execute_model` with them. Input preparation is
deterministic, so all processes launch the same programs, and so the same
collectives, in the same order.

Start-up (loading, KV pool, warm-up) is the same program on every process already.
How to launch: docs/multi_host.md.
"""
from __future__ import annotations

import atexit
import pickle

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxllm.config import ConfigError, EngineConfig, ParallelConfig

# Broadcast payloads are padded to a power of two words (at least this many), so the
# broadcast compiles for a handful of sizes only.
_MIN_WORDS = 1024


def initialize(parallel: ParallelConfig) -> None:
    """Join the multi-controller runtime when num_processes > 1; a no-op otherwise or
    when already joined. Must run before anything else touches a JAX backend."""
    if parallel.num_processes <= 1 or jax.distributed.is_initialized():
        return
    if not parallel.coordinator_address:
        raise ConfigError(
            f"num_processes={parallel.num_processes} needs --coordinator-address "
            "(host:port of process 0, the same on every process)")
    if not 0 <= parallel.process_id < parallel.num_processes:
        raise ConfigError(
            f"process_id={parallel.process_id}: must be in 0..{parallel.num_processes - 1}")
    jax.distributed.initialize(parallel.coordinator_address, parallel.num_processes,
                               parallel.process_id)


def check_config(config: EngineConfig) -> None:
    """Settings a multi-process engine does not support."""
    if config.parallel.num_processes > 1 and config.scheduler.preemption_mode == "swap":
        raise ConfigError("preemption_mode=swap is not supported with num_processes > 1 "
                          "(the KV pool spans hosts); use --preemption-mode recompute")


def is_leader() -> bool:
    return jax.process_index() == 0


def agree_min(value: int) -> int:
    """The smallest `value` over all processes (e.g. KV blocks each could fit)."""
    if jax.process_count() == 1:
        return value
    return int(np.min(multihost_utils.process_allgather(np.int32(value))))


class Leader:
    """Process 0's side: sends each step's execute_model arguments to the followers."""

    def __init__(self):
        self.closed = False
        atexit.register(self.close)

    def send(self, kind: str, *payload) -> None:
        _broadcast(pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL))

    def close(self) -> None:
        """Release the followers (they return from `follow`)."""
        if not self.closed:
            self.closed = True
            self.send("stop")


def leader() -> Leader | None:
    """A Leader on process 0 of a multi-process run, else None."""
    return Leader() if jax.process_count() > 1 and is_leader() else None


def follow(executor) -> int:
    """Replay the leader's steps on `executor` (built from the same config) until it
    stops. Returns the number of steps run."""
    steps, handle = 0, None
    while True:
        kind, payload = pickle.loads(_broadcast(None))
        if kind == "stop":
            return steps
        if kind == "execute":      # (SchedulerOutput, requests, seeds, defer_sample)
            handle = executor.execute_model(*payload)
            steps += 1
        elif kind == "sample_tokens":     # (grammar bitmask,) for the deferred step
            executor.sample_tokens(handle, *payload)
        else:
            raise RuntimeError(f"unknown message {kind!r} from the leader")


def _broadcast(data: bytes | None) -> bytes:
    """The leader passes its bytes, followers None; every process gets the leader's."""
    size = multihost_utils.broadcast_one_to_all(np.array([len(data or b"")], np.int32))
    size = int(size[0])
    words = max(_MIN_WORDS, 1 << max(0, (-(-size // 4) - 1).bit_length()))
    buf = np.zeros(words, np.int32)
    if data is not None:
        buf.view(np.uint8)[:size] = np.frombuffer(data, np.uint8)
    buf = multihost_utils.broadcast_one_to_all(buf)
    return np.asarray(buf).view(np.uint8)[:size].tobytes()
