"""A step's device launches on a thread of their own, so the engine thread's host
work runs while the runtime launches the step.

Launching a compiled step holds the GIL while jax takes its ~300 arguments, then
releases it while the runtime enqueues the step's CUDA graph (PjRt's execute and
cuGraphLaunch: ~1.7 ms of the ~2-3 ms launch on the H200's host). On the engine
thread that release bought nothing: nothing else had work ready. With a launcher,
the engine thread prepares every input of the step (all of its Python), hands the
launch over, waits only until the launcher is at the model's launch (the previous
step's deferred sampler, if any, launched before it), and then reads back the step
before, builds its outputs and schedules the next while the runtime launches.

Order: one thread runs the launches in the order they were handed over, so the
device receives them in that order, and the launches' reads and writes of the
runner's device state (the KV pool, the sampled-token buffer) happen in that order.
The engine thread joins the last launch before it touches that state itself and
before it reads a handle's outputs (`wait_launched`).
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor


_THREAD = "jaxllm-launch_0"      # the launcher's thread (ThreadPoolExecutor's naming)


class Launcher:
    def __init__(self):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="jaxllm-launch")
        self._last: Future | None = None

    def submit(self, handle, dispatch) -> None:
        """Run dispatch(at_model) on the launcher thread, as `handle.launched`;
        return once it calls at_model() (just before it launches the model) or ends."""
        ready = threading.Event()

        def run():
            try:
                dispatch(ready.set)
            finally:
                ready.set()
        handle.launched = self._last = self._pool.submit(run)
        ready.wait()

    def join(self) -> None:
        """Wait for the last launch handed over; its error, if it failed."""
        last, self._last = self._last, None
        if last is not None:
            last.result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


def wait_launched(handle) -> None:
    """Wait for a handle's launch (its error, if it failed); at once on the launcher
    thread, where every launch handed over before the running one has ended and the
    running one is the caller."""
    launched = getattr(handle, "launched", None)
    if launched is not None and threading.current_thread().name != _THREAD:
        launched.result()
