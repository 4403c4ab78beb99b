"""EngineCore: the scheduler and the executor, one step at a time. No jax here.

step() = schedule -> execute_model (launched, not waited for) -> update_from_output
-> the step's sampled tokens. With async scheduling (the default) a step launches
step N+1 before it reads back step N, so the host's scheduling and input preparation
overlap the device; each call returns the tokens of the step the previous call
launched. Penalties read a request's output tokens on the host, so a step holding
such a request is read back before the next one is scheduled. A step with a
structured-output request launches its model, reads the previous step back (its
tokens advance the grammars) and has its grammar bitmask computed on other threads
while this one returns the outputs and schedules again; its sampler launches at the
start of the next step, before the next model. The device runs the model meanwhile,
so masks cost neither the device nor this thread.

Speculative decoding (the executor's ``speculative_config``): a step that drafts reads
the previous step back first (the drafts need its tokens) and has the executor's
proposer draft for the requests that decode next (``Request.spec_token_ids``);
spec_decode/policy.py decides which requests draft (none while too many run, or for
those whose drafts were rarely accepted). A step that verifies drafts is read back
before step() returns; any other step, one whose proposer drafted nothing included,
runs async. Constrained requests never draft (their masks would have to follow every
draft).
"""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from jaxllm.engine.request import Request, RequestStatus
from jaxllm.engine.scheduler import KVCacheLostError, Scheduler, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class SampleResult:
    """A sampled token as the runner reads it back (and the engine process sends it)."""
    token_id: int
    logprob: float
    rank: int
    top_ids: list[int] | None = None      # best first, MAX_LOGPROBS long
    top_logprobs: list[float] | None = None


@dataclass
class EngineCoreOutputs:
    """One step's results: (Request, SampleResult) for each request that got a new
    token, and prompt logprob rows by request id."""
    sampled: list[tuple[Request, SampleResult]] = field(default_factory=list)
    prompt_logprobs: dict = field(default_factory=dict)


class EngineCore:
    """`executor`: the device side (execute_model, get_output); see executor/."""

    def __init__(self, scheduler: Scheduler, executor, async_scheduling: bool = True,
                 structured_output_manager=None):
        self.scheduler = scheduler
        self.executor = executor
        self.spec_config = getattr(executor, "speculative_config", None)
        self.spec_stats = self.spec_policy = None
        if self.spec_config is not None:
            from jaxllm.spec_decode.metrics import SpecDecodingStats
            from jaxllm.spec_decode.policy import spec_policy
            self.spec_stats = SpecDecodingStats(self.spec_config.num_speculative_tokens)
            self.spec_policy = spec_policy(self.spec_config)
        self.async_scheduling = async_scheduling
        self.structured_output_manager = structured_output_manager
        self.seeds: dict[str, int] = {}     # request id -> its sampling seed
        # Launched, not read back: (its SchedulerOutput, handle, constrained rows).
        self._in_flight: tuple[SchedulerOutput, Any, list] | None = None
        # A launched step whose sampler waits for its grammar bitmask: (handle, Future).
        self._pending_mask: tuple[Any, Any] | None = None

    def add_request(self, request: Request, seed: int) -> None:
        self.seeds[request.request_id] = seed
        constraint = getattr(request.sampling_params, "structured_outputs", None)
        if constraint is not None:
            if self.structured_output_manager is None:
                raise ValueError("structured outputs need the engine's tokenizer")
            request.structured_output_request = self.structured_output_manager.new_request(
                request.request_id, constraint)
        self.scheduler.add_request(request)

    def call_utility(self, fn, *args):
        """fn(self, *args): benchmarks and tests reach the core's parts this way
        whether it runs here or in a process of its own (core_mp.py)."""
        return fn(self, *args)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        request_ids = list(request_ids)
        self.scheduler.finish_requests(request_ids, status)
        for rid in request_ids:
            self.seeds.pop(rid, None)

    def step(self) -> EngineCoreOutputs:
        previous, self._in_flight = self._in_flight, None
        outputs = EngineCoreOutputs()
        drafting = self._drafting()
        if previous is not None and (drafting or not self._can_schedule_ahead(previous[0])):
            outputs, previous = self._update(*previous), None
            drafting = self._drafting(again=True)      # those the update left running
        if drafting:
            self._propose(drafting)
        so = self.scheduler.schedule()
        constrained = self._constrained_rows(so)
        # A sampler waiting for its bitmask launches once this step's inputs are ready,
        # before this step's model (which reads its tokens).
        finish = None if self._pending_mask is None else functools.partial(
            self._finish_sampling, self._pending_mask[0])
        launched = self._launch(so, constrained, finish)
        if previous is not None:
            outputs = self._update(*previous)
        if launched is not None and constrained:
            self._start_masks(*launched)           # after the previous step's tokens
        if launched is None and previous is None and self.scheduler.has_unfinished_requests():
            self._wait_for_grammars()
        # A step runs async unless it verifies drafts (none: n-gram found no match, or
        # the drafts are a request's left from a step that had no room for it).
        if launched is not None and self.async_scheduling and not _verifies(so):
            self._in_flight = launched
        elif launched is not None:
            done = self._update(*launched)
            outputs.sampled += done.sampled
            outputs.prompt_logprobs.update(done.prompt_logprobs)
        return outputs

    def _drafting(self, again: bool = False) -> list[Request]:
        """The running requests that draft this step (spec_decode/policy.py)."""
        if self.spec_policy is None:
            return []
        return self.spec_policy.drafting(self.scheduler.running, _may_speculate, again)

    def _propose(self, reqs: list[Request]) -> None:
        """Have the executor's proposer draft for `reqs` (see the module doc)."""
        k = self.spec_config.num_speculative_tokens
        tables = [self.scheduler.kv_cache_manager.get_block_table(r) for r in reqs]
        for req, drafts in zip(reqs, self.executor.propose_drafts(reqs, [k] * len(reqs),
                                                                   tables)):
            req.spec_token_ids = list(drafts)
            if not drafts:
                self.spec_policy.observe(req.request_id, 0)

    def _can_schedule_ahead(self, so: SchedulerOutput) -> bool:
        requests = self.scheduler.requests
        return not any(requests[r.request_id].sampling_params.uses_penalties
                       for r in so.scheduled if r.request_id in requests)

    def _constrained_rows(self, so: SchedulerOutput) -> list:
        """The step's rows that sample under a grammar (the manager's constrained_rows)."""
        som = self.structured_output_manager
        return [] if som is None else som.constrained_rows(so.scheduled, self.scheduler.requests)

    def _start_masks(self, so: SchedulerOutput, handle, rows: list) -> None:
        """Have the grammar bitmask of a step whose model is running computed (and
        copied to the device) on the manager's threads, while this thread goes on (the
        outputs, the next schedule and inputs)."""
        som = self.structured_output_manager
        if len(handle.scheduled) != len(so.scheduled):
            # Another request verifies drafts (one row per draft): the handle's rows.
            rows = som.constrained_rows(handle.scheduled, self.scheduler.requests)
        self._pending_mask = handle, som.start_bitmask(
            rows, self.executor.sampler_rows(handle), self.executor.upload_bitmask)

    def _finish_sampling(self, handle) -> None:
        """Launch the sampler of a step that waits for its grammar bitmask."""
        if self._pending_mask is not None and self._pending_mask[0] is handle:
            bitmask = self.structured_output_manager.bitmask(self._pending_mask[1])
            self._pending_mask = None
            self.executor.sample_tokens(handle, bitmask)

    def _wait_for_grammars(self) -> None:
        """Nothing ran: the waiting requests may be held for their grammars."""
        if self.structured_output_manager is not None:
            self.structured_output_manager.wait_for_grammars(0.05)

    def _launch(self, so: SchedulerOutput, constrained: list, before_dispatch=None):
        """(so, handle, constrained) of a launched step; a step with constrained rows
        leaves its sampler for its bitmask."""
        if not so.scheduled:
            return None
        now = time.time()
        requests = {r.request_id: self.scheduler.requests[r.request_id] for r in so.scheduled}
        for req in requests.values():
            req.first_scheduled_time = req.first_scheduled_time or now
        try:
            return so, self.executor.execute_model(
                so, requests, {rid: self.seeds[rid] for rid in requests}, bool(constrained),
                before_dispatch), constrained
        except KVCacheLostError as e:
            logger.warning("%s: %d running requests compute their KV again", e,
                           self.scheduler.num_running)
            self.scheduler.recompute_all(so)
            return None

    def _update(self, so: SchedulerOutput, handle, constrained: list) -> EngineCoreOutputs:
        """Read a launched step back and advance the scheduler with its tokens
        (`constrained`: the step's rows under a grammar)."""
        self._finish_sampling(handle)
        results, prompt_logprobs = self.executor.get_output(handle)
        tokens = {rid: [x.token_id for x in r] if isinstance(r, list) else r.token_id
                  for rid, r in results.items()}
        if self.spec_policy is not None:
            for r in so.scheduled:
                if r.spec_token_ids and r.request_id in results:
                    accepted = len(results[r.request_id]) - 1
                    self.spec_stats.observe(len(r.spec_token_ids), accepted)
                    self.spec_policy.observe(r.request_id, accepted)
            self.spec_policy.forget(so.finished_request_ids)
        if constrained:
            self.structured_output_manager.accept_tokens(constrained, tokens)
        updated = self.scheduler.update_from_output(so, tokens)
        out = EngineCoreOutputs(prompt_logprobs=prompt_logprobs)
        for req in updated:
            if req.is_finished():
                self.seeds.pop(req.request_id, None)
            res = results[req.request_id]
            if isinstance(res, list):     # cut by the scheduler to the tokens appended
                out.sampled += [(req, x) for x in res[:len(tokens[req.request_id])]]
            else:
                out.sampled.append((req, res))
        return out


def _may_speculate(request: Request) -> bool:
    """It decodes next (every known token but the newest computed, counting one in
    flight as known), unconstrained."""
    return (request.num_computed_tokens == request.num_tokens - 1
            + request.num_output_placeholders
            and request.structured_output_request is None)


def _verifies(so: SchedulerOutput) -> bool:
    return any(r.spec_token_ids for r in so.scheduled)
