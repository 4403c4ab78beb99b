"""The engine's side of structured outputs: grammars compiled off the engine thread
and cached by constraint, a matcher per request, and each step's token bitmask.

A constrained request waits in the scheduler's queue while its grammar compiles (on
this manager's thread; about a millisecond for a schema, so a new schema never stalls
the running requests). Each step with a constrained row runs its model first; the
engine core then reads back the previous step (whose tokens advance the matchers) and
asks `start_bitmask` for this step's masks while the device computes the logits,
so the masks cost no device time. Masks are i32[S, ceil(V/32)], bit v of row s set
when token v is allowed; unconstrained rows are all ones.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from jaxllm.structured_output import backend_guidance
from jaxllm.structured_output.request import StructuredOutputRequest

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 1024
# The interpreter's GIL switch interval once a constrained request arrives (Python's
# default is 5 ms). The mask thread takes the GIL back after each llguidance call while
# the engine thread runs Python for the next step; each such handoff waits up to this
# long, and at the default it put the masks on the step's critical path.
GIL_SWITCH_INTERVAL_S = 0.001
# The rows from which one parallel consume beats consuming one by one: the parallel
# call's handoff to llguidance's threads costs ~0.1-0.2 ms, a row ~1.6-4.5 us (2 cores).
PARALLEL_ACCEPT_ROWS = 128


def mask_threads() -> int:
    """llguidance threads for the masks: half the cores, at most 8. More did not make a
    256-row mask faster on the H200's 16-core host, and each one takes a core from the
    engine thread, which sets the pace of a large batch."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


class MaskBuffers:
    """Host bitmasks, two per height, used in turn (only by the mask thread). A new
    array each step cost its allocation and an all-ones fill under the GIL (4 MB at
    256 rows of a 128k vocabulary), which the engine thread waited for. A buffer is
    taken again two masks of its height later, when the engine has read back the
    step that used it, so its upload has reached the device; rows it filled then
    and does not fill now go back to all ones, the rows filled now are written
    whole by llguidance."""

    def __init__(self, width: int):
        self.width = width
        self._slots: dict[int, list] = {}     # height -> [[buffer, rows filled]] * 2

    def take(self, height: int, rows: list[int]) -> np.ndarray:
        slot = self._slots.get(height)
        if slot is None:
            slot = self._slots[height] = [
                [np.full((height, self.width), -1, np.int32), []] for _ in range(2)]
        slot.reverse()
        entry = slot[0]
        stale = set(entry[1]).difference(rows)
        if stale:
            entry[0][sorted(stale)] = -1
        entry[1] = rows
        return entry[0]


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None = None,
                 num_threads: int | None = None):
        self.vocab_size = vocab_size
        self.mask_width = -(-vocab_size // 32)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="jaxllm-grammar")
        # llguidance's view of the tokenizer takes ~1 s at 150k tokens: built on the
        # grammar thread at start-up, so the first constrained request does not wait.
        self._tokenizer = self._pool.submit(backend_guidance.make_tokenizer, tokenizer,
                                            vocab_size, eos_token_id)
        self._num_threads = num_threads or mask_threads()
        self._filler = None
        # Masks on a thread of their own (llguidance's threads under it drop the GIL),
        # never queued behind a grammar compile.
        self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="jaxllm-masks")
        self._buffers = MaskBuffers(self.mask_width)
        # key -> [requests so far, compiled copies (Futures of pristine matchers)]
        self._grammars: OrderedDict[str, list] = OrderedDict()
        self._validated: OrderedDict[str, None] = OrderedDict()     # keys that passed
        self.copies = max(1, min(16, os.cpu_count() or 1))
        self._lock = threading.Lock()
        # Prometheus counters (seconds): compiling grammars, computing masks.
        self.compile_seconds = 0.0
        self.mask_seconds = 0.0
        self.mask_wait_seconds = 0.0      # the engine thread blocked on a bitmask
        self.gil_switch_interval = GIL_SWITCH_INTERVAL_S
        self.num_compiled = 0

    def validate(self, params) -> None:
        """ValueError naming the field for a constraint that cannot compile, checked
        against the model's vocabulary too (waits for it in the first second of a start).
        A constraint that passed is not checked again (~0.2 ms each: 128 requests of one
        schema added at once delayed the first step by ~20 ms)."""
        try:
            key = params.key
        except (TypeError, ValueError):     # not JSON (the Python API): llguidance says why
            key = None
        with self._lock:
            if key in self._validated:
                self._validated.move_to_end(key)
                return
        backend_guidance.validate(params, self._tokenizer.result())
        if key is None:
            return
        with self._lock:
            self._validated[key] = None
            while len(self._validated) > MAX_CACHED_GRAMMARS:
                self._validated.popitem(last=False)

    def set_mask_threads(self, threads: int) -> None:
        """Compute the masks on this many llguidance threads from now on (benchmarks)."""
        if self._filler is None or self._filler.threads != threads:
            self._filler = backend_guidance.MaskFiller(threads)

    def set_tokenizer(self, lltokenizer) -> None:
        """Use this llguidance tokenizer instead (benchmarks on a dummy-weight folder,
        whose placeholder tokenizer has no real vocabulary)."""
        done: Future = Future()
        done.set_result(lltokenizer)
        self._tokenizer = done
        with self._lock:
            self._validated.clear()     # checked against the old vocabulary

    def new_request(self, request_id: str, params) -> StructuredOutputRequest:
        """A request's grammar state; its grammar compiles now unless cached.

        A grammar is compiled up to `copies` times, and requests take copies of them
        in turn: the matchers copied from one compiled grammar share its lexer behind
        one lock, so masks of one schema's rows computed in parallel need several."""
        key = params.key
        if sys.getswitchinterval() > self.gil_switch_interval:
            sys.setswitchinterval(self.gil_switch_interval)
        with self._lock:
            entry = self._grammars.get(key)
            if entry is None or any(f.done() and f.exception() is not None for f in entry[1]):
                entry = self._grammars[key] = [0, []]
                while len(self._grammars) > MAX_CACHED_GRAMMARS:
                    self._grammars.popitem(last=False)
            self._grammars.move_to_end(key)
            turn, compiled = entry[0] % self.copies, entry[1]
            entry[0] += 1
            if turn == len(compiled):
                compiled.append(self._pool.submit(self._compile, params))
            grammar = compiled[turn]
        return StructuredOutputRequest(request_id, grammar)

    def _compile(self, params):
        t0 = time.perf_counter()
        spec = backend_guidance.grammar_spec(params)
        matcher = backend_guidance.new_matcher(self._tokenizer.result(), spec)
        self.compile_seconds += time.perf_counter() - t0
        self.num_compiled += 1
        return matcher

    def constrained_rows(self, scheduled, requests: dict) -> list[tuple]:
        """A step's rows that sample under a grammar, as (row, request id, grammar);
        [] at once while no constrained request ever came. Taken right after the
        step is scheduled, once: the step's masks and, once it is read back, its
        accept_tokens use the same list (a request that finished in between only
        has its row's mask and token computed for nothing)."""
        if not self._grammars:
            return []
        rows = []
        for i, r in enumerate(scheduled):
            if r.do_sample:
                req = requests.get(r.request_id)
                grammar = None if req is None else req.structured_output_request
                if grammar is not None and grammar.matcher is not None:
                    rows.append((i, r.request_id, grammar))
        return rows

    def start_bitmask(self, rows: list[tuple], height: int, upload) -> Future:
        """The step's grammar bitmask i32[height, W] (height >= the scheduled rows;
        rows not in `rows` (constrained_rows'), and rows whose grammar failed, all
        ones), computed on the mask thread, then `upload(mask)`'s result (the device
        copy). The rows' matchers are taken now; none may advance until the result
        is read, and the upload must have reached the device before the step after
        next starts its masks (the engine reads each step back before that)."""
        pairs = [(grammar.matcher, i) for i, _, grammar in rows if grammar.error is None]
        return self._mask_pool.submit(lambda: upload(self._fill(pairs, height)))

    def bitmask(self, future: Future):
        """A started bitmask's result (the engine thread waits for it)."""
        t0 = time.perf_counter()
        try:
            return future.result()
        finally:
            self.mask_wait_seconds += time.perf_counter() - t0

    def accept_tokens(self, rows: list[tuple], sampled: dict) -> None:
        """Advance the matchers of a step's constrained rows (its constrained_rows) by
        their sampled tokens (`sampled`: request id -> token), all in one llguidance
        call on the mask threads, ahead of the scheduler's update_from_output, whose
        accept(token) then only reads the result. One by one on the engine thread,
        256 rows cost ~1 ms per step. Fewer rows than PARALLEL_ACCEPT_ROWS are left
        to the scheduler. Called between a step's masks, never during one: the rows'
        matchers are the masks' too."""
        if len(rows) < PARALLEL_ACCEPT_ROWS:
            return
        grammars, pairs = [], []
        for _, request_id, grammar in rows:
            token = sampled.get(request_id)
            if isinstance(token, int):      # constrained rows never verify drafts
                grammars.append(grammar)
                pairs.append((grammar.matcher, token))
        if len(pairs) >= PARALLEL_ACCEPT_ROWS:
            for grammar, (_, token), ok in zip(grammars, pairs,
                                                self._mask_filler().consume(pairs)):
                grammar.accepted_ahead(token, ok)

    def _mask_filler(self) -> backend_guidance.MaskFiller:
        if self._filler is None:
            self._filler = backend_guidance.MaskFiller(self._num_threads)
        return self._filler

    def _fill(self, pairs: list[tuple], height: int) -> np.ndarray:
        t0 = time.perf_counter()
        mask = self._buffers.take(height, [i for _, i in pairs])
        if pairs:
            self._mask_filler().fill(pairs, mask)
        self.mask_seconds += time.perf_counter() - t0
        return mask

    def wait_for_grammars(self, timeout: float) -> None:
        """Block up to `timeout` s for a compiling grammar (when nothing else runs)."""
        with self._lock:
            pending = [g for _, copies in self._grammars.values() for g in copies
                       if not g.done()]
        if pending:
            from concurrent.futures import FIRST_COMPLETED, wait
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._mask_pool.shutdown(wait=False, cancel_futures=True)
