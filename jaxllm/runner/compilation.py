"""The compilation manager: which programs the runner dispatches to (every bucket's
step and the sampler variants), made ready by loading them from the executable store
or compiling them (CompileQueue), and called with a check of the first run of each
program read from disk.

A program read from a file (the store, or jax's persistent cache) that fails its first
run is treated as a corrupt entry: removed from the store, compiled again, logged
once. A step that failed had the KV pool donated to it: the runner allocates a new
one and KVCacheLostError tells the engine core to have every request recompute. A
sampler that failed had the token buffer donated to it, whose rows the next step reads
only after this sampler writes them: the runner calls it again on a new one.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import jax

from jaxllm.engine.scheduler import KVCacheLostError
from jaxllm.runner.buckets import pick
from jaxllm.runner.executable_store import ExecutableStore, Loaded, peak_bytes

logger = logging.getLogger(__name__)


_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_hits = threading.local()      # jax records the event on the compiling thread
_listening = False


def _count_hit(event: str, **_) -> None:
    if event == _HIT_EVENT:
        _hits.n = getattr(_hits, "n", 0) + 1


def compile_fresh_or_cached(lowered) -> tuple[Any, bool]:
    """(lowered.compile(), whether jax's persistent cache served it)."""
    global _listening
    if not _listening:
        _listening = True
        jax.monitoring.register_event_listener(_count_hit)
    before = getattr(_hits, "n", 0)
    compiled = lowered.compile()
    return compiled, getattr(_hits, "n", 0) > before


@dataclass
class Program:
    """One program of the warm-up. `name`: how the runner finds it at dispatch (with
    its static arguments); `args`: the traced arguments its store key covers (arrays
    or ShapeDtypeStructs; the step's weights are in the store's static part);
    `jitted(*call_args)`: the call it compiles."""
    name: tuple
    args: tuple
    jitted: Any                     # a jax.jit function
    call_args: tuple

    def trace(self):
        return self.jitted.trace(*self.call_args)

    def lower(self):
        return self.trace().lower()


class CompileQueue:
    """Programs made ready while the caller goes on: each is loaded from the store,
    else lowered on the calling thread (Python, under the GIL) and its XLA compile
    handed at once to one of `compile_workers` threads (XLA compiles outside the
    GIL), so compiling overlaps the next programs' lowering. Lowering keeps the
    given order, so the programs, and jax's persistent-cache keys, are the same on
    every start. Each compiled program is saved to the store."""

    def __init__(self, store: ExecutableStore | None, compile_workers: int,
                 load_workers: int = 1):
        self.store = store
        self.load_workers = load_workers
        self._pool = ThreadPoolExecutor(max(1, compile_workers))
        self._futures: dict[tuple, Future] = {}
        self.num_lowered, self.t_lower = 0, 0.0     # and the seconds spent at it

    def __contains__(self, name: tuple) -> bool:
        return name in self._futures

    def submit(self, programs: list[Program], defer=None) -> list[Program]:
        """Start every program not already queued (by name; the first of a name wins);
        returns once all are lowered. `defer(name)`: programs the store lacks that are
        neither lowered nor queued, but returned (every one the store has is loaded).

        Loading runs on `load_workers` threads: on the CPU backend deserializing holds
        the GIL (measured: a second thread made 4 loads slower, 5.3 s against 4.4 s)."""
        unique: dict[tuple, Program] = {}
        for p in programs:
            if p.name not in self._futures:
                unique.setdefault(p.name, p)
        programs = list(unique.values())
        keys = {p.name: self.store.key(p.name, p.args) for p in programs} if self.store else {}
        loaded = {}
        if self.store and programs:
            with ThreadPoolExecutor(max(1, min(self.load_workers, len(programs)))) as pool:
                loads = pool.map(lambda p: self.store.load(keys[p.name]), programs)
                loaded = {p.name: x for p, x in zip(programs, loads) if x is not None}
        deferred = []
        for p in programs:
            if p.name in loaded:
                self._futures[p.name] = Future()
                self._futures[p.name].set_result(loaded[p.name])
                continue
            if defer is not None and defer(p.name):
                deferred.append(p)
                continue
            t0 = time.perf_counter()
            lowered = p.lower()
            self.num_lowered += 1
            self.t_lower += time.perf_counter() - t0
            self._futures[p.name] = self._pool.submit(self._compile, lowered, keys.get(p.name))
        return deferred

    def _compile(self, lowered, key: str | None) -> Loaded:
        compiled, cached = compile_fresh_or_cached(lowered)
        loaded = Loaded(compiled, peak_bytes(compiled), from_disk=cached)
        if self.store and not cached:       # see the module docstring
            self.store.save(key, compiled, loaded.peak_bytes)
        return loaded

    def result(self, name: tuple) -> Loaded:
        return self._futures[name].result()

    def results(self) -> dict[tuple, Loaded]:
        """name -> Loaded for every program queued, once all are ready; closes the
        queue (an error of any compile is raised here)."""
        try:
            out = {name: future.result() for name, future in self._futures.items()}
        finally:
            self._pool.shutdown()
        if self.store:
            self.store.prune()
        return out

    def cancel(self) -> None:
        """Drop what is not compiling yet (the programs are stale) and close."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def first_requests_only(plan, prompt_tokens: int = 64):
    """A warm-up `defer` for a CPU start: what first requests need is compiled before
    the engine is ready (the smallest decode bucket, the prefill bucket of a
    `prompt_tokens` prompt, which smaller prompts use until theirs is ready, and the
    greedy and plain random samplers of those buckets); the rest compile after. On
    the 2-core machine every bucket of the default model took over two minutes."""
    first = {("step", plan.seq_buckets[0], plan.seq_buckets[0], True),
             ("step", pick(list(plan.token_buckets), min(prompt_tokens,
                                                         plan.token_buckets[-1])),
              plan.max_seqs, False)}
    first_rows = {plan.seq_buckets[0], plan.max_seqs}

    def defer(name: tuple) -> bool:
        if name[0] == "sample":
            _, rows, flags = name
            plain = not (flags.num_logprobs or flags.use_bitmask or flags.use_penalties
                         or flags.use_top_k_top_p_min_p)
            return not (rows in first_rows and plain)
        return name not in first
    return defer


class ProgramReplaced(RuntimeError):
    """A sampler read from disk failed its first run and was compiled again: the
    token buffer donated to that run is gone, so the caller calls again with a new
    one (rebuild made it)."""


class CompilationManager:
    """name -> compiled program for dispatch: ("step", T, S, decode_only) and
    ("sample", S, flags). `rebuild(name)` gives a name's Program again (after the
    runner allocated anew the buffers the failed run took)."""

    def __init__(self, store: ExecutableStore | None, compile_workers: int, load_workers: int,
                 rebuild: Callable[[tuple], Program], check_first_runs: bool = True):
        self.store = store
        self.compile_workers, self.load_workers = compile_workers, load_workers
        self.rebuild = rebuild
        self.programs: dict[tuple, Any] = {}
        self.unverified: set[tuple] = set()    # read from a file, not run yet
        self.replaced: set[tuple] = set()      # compiled again once: a failure is real
        # Multi-host: a recovery on one process only would desynchronize the others,
        # so there a failed first run stays fatal.
        self.check_first_runs = check_first_runs
        # Compiles started by the KV sizing for a pool of queue_blocks; see warm_up.
        self.queue: CompileQueue | None = None
        self.queue_blocks = 0
        # Programs compiling after the warm-up (warm_up's `defer`): name -> Future.
        self.background: dict[tuple, Future] = {}
        self._urgent: list[tuple] = []      # the next ones the background compiles

    def new_queue(self) -> CompileQueue:
        return CompileQueue(self.store, self.compile_workers, self.load_workers)

    def keep(self, loaded: dict[tuple, Loaded]) -> None:
        for name, x in loaded.items():
            self.programs[name] = x.compiled
            if x.from_disk and self.check_first_runs:
                self.unverified.add(name)

    def queue_programs(self, num_blocks: int, programs: list[Program]) -> None:
        """A fresh queue (any earlier one is stale) started on `programs`."""
        if self.queue is not None:
            self.queue.cancel()
        self.queue, self.queue_blocks = self.new_queue(), num_blocks
        self.queue.submit(programs)

    def settle_queue(self, num_blocks: int, collect: bool) -> None:
        """After the KV sizing: drop a queue made for another pool size; with
        `collect` (no warm-up follows) keep what it compiled."""
        if self.queue is not None and self.queue_blocks != num_blocks:
            self.queue.cancel()
            self.queue = None
        if self.queue is not None and collect:
            self.keep(self.queue.results())
            self.queue = None

    def warm_up(self, programs: list[Program], defer=None) -> tuple[int, CompileQueue]:
        """Have `programs` ready (those the KV sizing queued are collected, not lowered
        again); returns (how many programs are ready, the queue). `defer(name)`:
        programs the store lacks that compile afterwards on a background thread
        instead (a step that needs one first waits for it, and it jumps the line)."""
        queue, self.queue = self.queue or self.new_queue(), None
        deferred = queue.submit([p for p in programs
                                 if p.name not in self.programs and p.name not in queue], defer)
        loaded = queue.results()
        self.keep(loaded)
        if deferred:
            self._compile_in_background(deferred)
        return len(loaded), queue

    def _compile_in_background(self, programs: list[Program]) -> None:
        pending = {p.name: p for p in programs}
        self.background.update({name: Future() for name in pending})

        def run():
            t0, queue = time.perf_counter(), self.new_queue()
            order = list(pending)
            # Not a daemon: at exit it stops after the program in hand (the main thread
            # is no longer alive, or the futures machinery refuses new work), so no XLA
            # compile is cut off mid-way by the interpreter's shutdown.
            while order and threading.main_thread().is_alive():
                urgent = [n for n in self._urgent if n in pending]
                name = urgent[0] if urgent else order[0]
                order.remove(name)
                try:
                    queue.submit([pending.pop(name)])
                    self.keep({name: queue.result(name)})
                    self.background.pop(name).set_result(None)
                except RuntimeError:       # "cannot schedule new futures": exiting
                    break
                except Exception as e:     # noqa: BLE001 - the jit compiles it on use
                    logger.warning("background compile of %s failed: %s", name, str(e)[:200])
                    self.background.pop(name).set_exception(e)
            if order:
                return
            queue.results()
            logger.info("warm-up: %d more programs ready in %.1f s, compiled after the "
                        "engine was ready", len(programs), time.perf_counter() - t0)

        threading.Thread(target=run, name="jaxllm-warm-up").start()

    def ready_now(self, key: tuple) -> bool:
        """Whether `key` runs without waiting for a background compile."""
        return key in self.programs or key not in self.background

    def _wait_for_background(self, key: tuple) -> None:
        future = self.background.get(key)
        if future is not None:
            self._urgent.append(key)
            try:
                future.result()
            except Exception:      # noqa: BLE001 - logged; the jit compiles it below
                pass

    def call(self, key: tuple, args: tuple, jitted, jit_args: tuple):
        """The program for `key`, else the jit (which compiles on first use)."""
        compiled = self.programs.get(key)
        if compiled is None:
            self._wait_for_background(key)
            compiled = self.programs.get(key)
        if compiled is None:
            return jitted(*jit_args)
        try:
            out = compiled(*args)
            if key in self.unverified:      # its first run: wait for it to succeed
                jax.block_until_ready(out)
                self.unverified.discard(key)
            return out
        except (TypeError, ValueError) as e:
            if any(isinstance(a, jax.Array) and a.is_deleted() for a in jax.tree.leaves(args)):
                raise      # an argument already donated: the caller's bug, not the program's
            # Arguments unlike the warm-up's. Checked before the program runs, so
            # nothing was donated yet.
            logger.warning("%s: the warm-up's program rejects these arguments (%s); "
                           "using the jit from now on", key, str(e)[:300])
            del self.programs[key]
            return jitted(*jit_args)
        except jax.errors.JaxRuntimeError as e:
            if key not in self.unverified or key in self.replaced:
                raise
            self.replace(key, str(e))
        if key[0] == "step":     # the pool was donated to the failed run
            raise KVCacheLostError(f"the KV pool was donated to {key}'s failed run and "
                                   "is allocated anew")
        raise ProgramReplaced(key)     # a sampler: its token buffer went to the failed run

    def replace(self, key: tuple, reason: str) -> None:
        """Drop a program read from a file that failed its first run (and its store
        file), and compile it again."""
        self.unverified.discard(key)
        self.replaced.add(key)
        program = self.rebuild(key)
        if self.store is not None:
            self.store.evict(self.store.key(program.name, program.args), reason)
        else:
            logger.warning("%s failed its first run (%s); compiling it again", key,
                           reason[:200])
        queue = CompileQueue(self.store, 1)
        queue.submit([program])
        self.keep(queue.results())
