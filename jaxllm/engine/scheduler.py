"""Token-budget continuous batching (vLLM v1 semantics), pure Python.

There are no prefill/decode phases: each request wants
``num_tokens - num_computed_tokens`` tokens, and every step hands out at most
``max_num_batched_tokens`` of them, RUNNING requests first, then swapped-out ones,
then WAITING ones in the policy's order (request_queue.py: fcfs, or priority). Chunked
prefill is what happens when a prompt's want exceeds the budget left.

When blocks run out, the last running request is preempted: the newest under fcfs,
the lowest priority (largest (priority, arrival_time), vLLM's choice) under priority,
as the running list is kept in that order. By recompute (free its blocks, back to the
waiting queue) or by swap (copy its blocks to CPU blocks; see KVCacheManager.swap_out
for when it falls back to recompute).

The n samples of one prompt (Requests with the same ``parent_id``) share the prompt's full
blocks even with prefix caching off (see kv_cache_manager). A sample waits while a sibling
is still computing those blocks, so it finds them cached instead of computing its own copy.

Async scheduling (vLLM's): ``schedule()`` advances ``num_computed_tokens`` as soon as a step
is scheduled, and a request whose step will sample holds an *output placeholder* until
``update_from_output()`` brings the token. So step N+1 can be scheduled while step N runs: a
placeholder is fed as ``PLACEHOLDER_TOKEN_ID``, which the runner replaces on the device by
the token step N sampled. A request whose pending tokens already reach its length cap is not
scheduled again. An EOS or stop string seen late costs one wasted token of compute; the
scheduler is never wrong about KV, because every device step runs in launch order.

Speculation: a decoding request's drafts (``Request.spec_token_ids``, from the engine
core) are scheduled after its token, with slots (and ``num_lookahead_tokens`` more for
a draft model's own KV), counted as computed until ``update_from_output`` takes back
the rejected ones' slots. Only synchronous steps carry drafts.

Contract: every ``schedule()`` is followed by one ``update_from_output()`` for it, in
order; at most one scheduled step may be waiting for its update when ``schedule()``
is called (sync engines update before scheduling again, async ones one step later).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field

from jaxllm.engine.block_pool import BlockPool
from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.engine.request import Request, RequestStatus, live_request
from jaxllm.engine.request_queue import SchedulingPolicy, create_request_queue, priority_key
from jaxllm.engine.scheduler_checks import (PREEMPTION_MODES, append_tokens,
                                            reaches_length_cap, spec_tokens_to_verify,
                                            validate_args, validate_request)
PLACEHOLDER_TOKEN_ID = -1   # a token sampled by the previous step, not read back yet


@dataclass
class ScheduledRequest:
    request_id: str
    token_ids: list[int]        # tokens fed this step; PLACEHOLDER_TOKEN_ID = not read back yet
    num_computed_tokens: int    # position of token_ids[0]; tokens before it are in the KV cache
    block_table: list[int]      # all block ids of this request, in order
    do_sample: bool             # after this step every known token is computed: sample one
    output_index: int           # len(output_token_ids) at schedule time (seeded sampling)
    # Draft tokens at the end of token_ids, verified by this step (speculative decoding).
    spec_token_ids: list[int] = field(default_factory=list)
    serial: int | None = None   # the Request's (None: not checked), see Request.serial
    admitted: bool = False      # admitted (or resumed, swapped in) by this step's schedule


class KVCacheLostError(RuntimeError):
    """A step failed after its KV pool was donated to it (a program read from disk
    that could not run; the runner compiled it again and allocated a zeroed pool):
    every sequence's KV must be computed again (Scheduler.recompute_all)."""


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)   # batch order
    num_batched_tokens: int = 0
    # Both performed by the runner BEFORE the step. A step never has both kinds.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)   # (gpu, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)    # (cpu, gpu)
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)  # since the previous schedule


class Scheduler:
    def __init__(
        self,
        *,
        block_size: int,
        num_gpu_blocks: int, num_cpu_blocks: int = 0,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        enable_prefix_caching: bool = True,
        preemption_mode: str = "recompute",
        policy: str = "fcfs",
        num_lookahead_tokens: int = 0,
    ) -> None:
        validate_args(block_size, num_gpu_blocks, num_cpu_blocks, max_num_seqs,
                       max_num_batched_tokens, max_model_len, preemption_mode, policy)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.enable_prefix_caching = enable_prefix_caching
        self.preemption_mode = preemption_mode
        self.num_lookahead_tokens = num_lookahead_tokens
        self.policy = SchedulingPolicy(policy)
        self.kv_cache_manager = KVCacheManager(block_size, num_gpu_blocks, num_cpu_blocks,
                                               enable_prefix_caching)
        self.requests: dict[str, Request] = {}     # unfinished requests by id
        self.waiting = create_request_queue(self.policy)
        # fcfs: admission order; priority: priority_key order (see _start_running).
        self.running: list[Request] = []
        self.swapped = create_request_queue(self.policy)
        self._finished_req_ids: list[str] = []
        self.num_preemptions_total = 0

    # -- requests in and out --------------------------------------------------------

    def add_request(self, request: Request) -> None:
        validate_request(self, request)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add_request(request)

    def finish_requests(self, request_ids: str | Iterable[str],
                        finished_status: RequestStatus) -> None:
        """Finish requests from outside (abort, stop string). Unknown ids are ignored."""
        assert RequestStatus.is_finished(finished_status), finished_status
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self._remove_queued(request, request.status)
            request.status = finished_status
            self._free_request(request)

    def _remove_queued(self, request: Request, status: RequestStatus) -> None:
        """Take a waiting, preempted or swapped request out of its queue."""
        if status is RequestStatus.SWAPPED:
            self.swapped.remove_request(request)
        else:
            self.waiting.remove_request(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    @property
    def block_pool(self) -> BlockPool:
        """For metrics: get_usage(), prefix_cache_queries / prefix_cache_hits."""
        return self.kv_cache_manager.block_pool

    def recompute_all(self, lost: SchedulerOutput) -> None:
        """The device's KV pool was lost with step `lost` (see KVCacheLostError):
        forget that step, and every running request computes its tokens again, as a
        recompute preemption does. Swapped requests keep their host copies."""
        for sched in lost.scheduled:
            request = self.requests.get(sched.request_id)
            if request is not None and sched.do_sample:
                request.num_output_placeholders -= 1
        for request in reversed(self.running):
            self.num_preemptions_total += 1
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = 0
            request.status = RequestStatus.PREEMPTED
            self.waiting.prepend_request(request)
        self.running = []
        self.kv_cache_manager.block_pool.reset_prefix_cache()

    # -- one step ---------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_req_ids)
        self._finished_req_ids = []
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        # A step that had to preempt admits nobody (the pool is full). This also keeps
        # swap-ins and swap-outs in different steps, so the runner's copy order and
        # blocks freed by one direction and reused by the other cannot clash.
        if not out.preempted_request_ids:
            budget = self._schedule_swapped(out, budget)
            # Swapped requests go first: admitting new ones would starve them.
            if not self.swapped:
                self._schedule_waiting(out, budget)
        return out

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           sampled: dict[str, int | list[int]]) -> list[Request]:
        """Advance the scheduled requests; return those that got new tokens. A list
        (speculation: the accepted drafts, then the step's own token) is cut to the
        tokens appended when one of them ends the request."""
        updated, any_finished = [], False
        for sched in scheduler_output.scheduled:
            request = live_request(self.requests, sched)
            if request is None:
                continue  # finished (aborted, stop string) after it was scheduled
            status = request.status
            stopped = False
            if sched.do_sample:
                # Also for a request preempted since: the token came from valid KV.
                request.num_output_placeholders -= 1
                tokens = sampled[sched.request_id]
                if not isinstance(tokens, list):
                    tokens = (tokens,)
                elif status is RequestStatus.RUNNING:      # the rejected drafts' slots
                    request.num_computed_tokens -= len(sched.spec_token_ids) + 1 - len(tokens)
                stopped = append_tokens(request, tokens, self.max_model_len)
                updated.append(request)
            if status is RequestStatus.RUNNING:
                self.kv_cache_manager.cache_blocks(request)
            if stopped:
                if status is RequestStatus.RUNNING:
                    any_finished = True
                else:
                    self._remove_queued(request, status)
                self._free_request(request)
        if any_finished:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        return updated

    # -- scheduling passes --------------------------------------------------------------

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(_num_wanted(request), budget)
            if num_new == 0 or reaches_length_cap(request, self.max_model_len):
                i += 1   # its in-flight token is its last (or nothing to do yet)
                continue
            spec = request.spec_token_ids and spec_tokens_to_verify(
                request, num_new, budget, self.max_model_len)
            lookahead = self.num_lookahead_tokens if spec else 0
            if not self._allocate_or_preempt(request, num_new + len(spec) + lookahead, out):
                break  # it preempted itself: it was the last running request
            self._add_scheduled(out, request, num_new, spec)
            budget -= num_new + len(spec)
            i += 1
        return budget

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        # Victims come from the tail, which this step has not scheduled yet.
        while not self.kv_cache_manager.allocate_slots(request, num_new):
            victim = self.running.pop()
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.num_preemptions_total += 1
        request.spec_token_ids = []     # drafted for KV it no longer has
        out.preempted_request_ids.append(request.request_id)
        if self.preemption_mode == "swap":
            pairs = self.kv_cache_manager.swap_out(request)
            if pairs is not None:
                out.blocks_to_swap_out.extend(pairs)
                request.status = RequestStatus.SWAPPED
                # Front (fcfs): later preemptions hit older (higher-priority) requests.
                self.swapped.prepend_request(request)
                return
        self.kv_cache_manager.free(request)
        # Outputs so far are kept and recomputed as part of the request's tokens.
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.prepend_request(request)

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.swapped.peek_request()
            if request.num_output_placeholders:
                break  # preempted with a token in flight: resume once it is read back
            num_new = min(_num_wanted(request), budget)
            pairs = self.kv_cache_manager.swap_in(request, num_new)
            if pairs is None:
                break
            self.swapped.pop_request()
            out.blocks_to_swap_in.extend(pairs)
            self._start_running(out, request, num_new)
            budget -= num_new
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        sharing = {r.parent_id for r in self.running if self._computing_shared_prompt(r)}
        held_back = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek_request()
            if request.num_output_placeholders:
                break  # preempted with a token in flight: resume once it is read back
            grammar = request.structured_output_request
            if (request.parent_id is not None and request.parent_id in sharing) or (
                    grammar is not None and not grammar.is_ready()):
                # Keeps its place (see module doc), or waits for its grammar to compile.
                held_back.append(self.waiting.pop_request())
                continue
            num_new = self._admit(request, budget)
            if num_new == 0:
                break  # nobody overtakes a request that does not fit (vLLM)
            self.waiting.pop_request()
            self._start_running(out, request, num_new)
            budget -= num_new
            if self._computing_shared_prompt(request):
                sharing.add(request.parent_id)
        self.waiting.prepend_requests(held_back)

    def _admit(self, request: Request, budget: int) -> int:
        """Allocate a waiting request's blocks; tokens to schedule, 0 if it must wait."""
        hit = self.kv_cache_manager.get_computed_blocks(request)
        num_hit = len(hit.block_ids) * self.block_size
        num_new = request.num_tokens - num_hit
        if num_new > budget:
            # Without chunked prefill a prompt goes whole. Only a recompute-preempted
            # request (prompt + outputs) can outgrow the whole budget; it is chunked.
            if not self.enable_chunked_prefill and num_new <= self.max_num_batched_tokens:
                return 0
            num_new = budget
        if not self.kv_cache_manager.allocate_slots(request, num_new, hit):
            return 0
        request.num_computed_tokens = num_hit
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit
        if self.enable_prefix_caching:
            self.block_pool.record_prefix_query(request.num_tokens, num_hit)
        return num_new

    def _start_running(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        request.status = RequestStatus.RUNNING
        if self.policy is SchedulingPolicy.PRIORITY:
            # Sorted, so the tail is vLLM's victim, max(running, key=priority_key), and
            # never one this step scheduled before the request that needs the blocks.
            bisect.insort(self.running, request, key=priority_key)
        else:
            self.running.append(request)
        self._add_scheduled(out, request, num_new, admitted=True)

    def _add_scheduled(self, out: SchedulerOutput, request: Request, num_new: int,
                       spec: list[int] = (), admitted: bool = False) -> None:
        start = request.num_computed_tokens
        end = start + num_new
        all_ids, pending = request.all_token_ids, request.num_output_placeholders
        num_tokens, spec = len(all_ids), list(spec) if spec else []
        # Behind an async step a decode row knows none of its tokens: built unsliced.
        token_ids = [PLACEHOLDER_TOKEN_ID] * num_new if start >= num_tokens else (
            all_ids[start:min(end, num_tokens)] + [PLACEHOLDER_TOKEN_ID] * max(end - num_tokens, 0))
        do_sample = end == num_tokens + pending
        out.scheduled.append(ScheduledRequest(
            request.request_id, token_ids + spec if spec else token_ids, start,
            self.kv_cache_manager.get_block_table(request), do_sample,
            len(request.output_token_ids) + pending, spec, request.serial, admitted))
        out.num_batched_tokens += num_new + len(spec)
        # Drafts count as computed until update_from_output rejects some; cache_blocks
        # only registers blocks of known tokens, never a draft.
        request.num_computed_tokens = end + len(spec)
        if do_sample:
            request.num_output_placeholders += 1
        # Registered now, not after the step: a later request (even in this step) that
        # hits these blocks reads them after this step's KV writes, in launch order.
        self.kv_cache_manager.cache_blocks(request)

    def _computing_shared_prompt(self, request: Request) -> bool:
        """True while a sample computes prompt blocks its siblings will reuse (until
        they are registered in the cache, after the step that computes them)."""
        if request.parent_id is None:
            return False
        shared_blocks = (request.num_prompt_tokens - 1) // self.block_size
        return self.kv_cache_manager.num_cached_blocks(request) < shared_blocks

    # -- finishing -----------------------------------------------------------------------

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._finished_req_ids.append(request.request_id)


def _num_wanted(request: Request) -> int:
    """Tokens the request still needs computed, a pending output included."""
    return (len(request.all_token_ids) + request.num_output_placeholders
            - request.num_computed_tokens)
