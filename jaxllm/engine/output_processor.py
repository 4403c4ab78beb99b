"""OutputProcessor: the engine core's sampled tokens -> what users get.

Per request it holds the text state: incremental detokenization, stop strings, the
logprobs entries, the fan-in of the `n` samples into one RequestOutput, and the
request's metrics. It builds outputs in two forms from the same state: whole
RequestOutputs (LLM.generate, the in-thread server) and deltas in `output_wire`'s
layout (the engine process sends those). A sample that hits a stop string is
handed to `finish_stopped` (the engine core finishes it) before the outputs are built.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from jaxllm.engine.detokenizer import IncrementalDetokenizer
from jaxllm.engine.output_wire import pack_metrics
from jaxllm.engine.request import Request, RequestStatus
from jaxllm.outputs import CompletionOutput, RequestOutput, make_logprobs_entry
from jaxllm.sampling_params import RequestOutputKind, SamplingParams

# Under module names: reading an Enum's member goes through its metaclass (~10x a
# global's read), and these are compared for every request on every step.
_FINAL_ONLY, _STOPPED = RequestOutputKind.FINAL_ONLY, RequestStatus.FINISHED_STOPPED


@dataclass
class RequestMetrics:
    """A request's times (``time.time()``; vLLM's RequestStateStats): its arrival at
    the server, its first schedule, the steps of its first and latest tokens, its
    finish. /metrics derives vLLM's queue, prefill, decode and inference times from
    them (``jaxllm.metrics``)."""
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    def copy(self) -> RequestMetrics:
        # Not dataclasses.replace: that costs ~1 us, once per request per step.
        return RequestMetrics(**self.__dict__)


@dataclass
class _Sample:
    """One of the n samples of a request: its Request and its text state."""
    request: Request
    detok: IncrementalDetokenizer
    cumulative_logprob: float = 0.0
    logprobs: list | None = None
    # What a delta has sent of it: text chars, token ids, logprob entries.
    sent: tuple[int, int, int] = (0, 0, 0)


@dataclass
class _Group:
    """A user request: its prompt and its n samples."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_Sample]
    metrics: RequestMetrics
    prompt_logprobs: list | None = None   # vLLM's shape: None, then a dict per token
    header_sent: bool = False              # a delta sent the prompt part


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.groups: dict[str, _Group] = {}
        self._samples: dict[str, tuple[_Sample, _Group]] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, requests: list[Request], arrival_time: float) -> None:
        """A user request and the engine Requests of its n samples."""
        group = _Group(request_id, prompt, prompt_token_ids, params, [],
                       RequestMetrics(arrival_time),
                       [None] * len(prompt_token_ids) if params.prompt_logprobs is not None
                       else None)
        for req in requests:
            sample = _Sample(req, IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params),
                             logprobs=[] if params.logprobs is not None else None)
            group.samples.append(sample)
            self._samples[req.request_id] = (sample, group)
        self.groups[request_id] = group

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a user request; returns its samples' engine request ids."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return []
        ids = [s.request.request_id for s in group.samples]
        for sid in ids:
            self._samples.pop(sid, None)
        return ids

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self.groups)

    def process_outputs(self, core_outputs, finish_stopped: Callable[[list[str]], None],
                        delta: bool = False) -> list:
        """Record an engine core step's outputs (EngineCoreOutputs), finish the samples
        that hit a stop string (`finish_stopped(ids)`), and build the output of every
        request the step touched (only finished ones for FINAL_ONLY requests):
        RequestOutputs, or deltas with `delta`."""
        self._record_prompt_logprobs(core_outputs.prompt_logprobs)
        touched: dict[str, _Group] = {}
        stopped = []
        now = time.time()
        for req, sampled in core_outputs.sampled:
            entry = self._samples.get(req.request_id)
            if entry is None:
                continue      # aborted while its step ran
            sample, group = entry
            if stopped and stopped[-1] == req.request_id:
                # Speculation gave it several tokens and a stop string ended it at an
                # earlier one: plain decoding would not have made this one.
                req.truncate_output(req.num_output_tokens - 1)
                continue
            if self._record_token(sample, sampled):
                stopped.append(req.request_id)
            m = group.metrics
            m.first_scheduled_time = m.first_scheduled_time or req.first_scheduled_time
            m.first_token_time = m.first_token_time or now
            m.last_token_time = now
            touched[group.request_id] = group
        if stopped:
            finish_stopped(stopped)
        make = self._make_delta if delta else self._make_output
        return [make(g) for g in touched.values()
                if g.params.output_kind is not _FINAL_ONLY or _finished(g)]

    def _record_prompt_logprobs(self, per_request: dict) -> None:
        for sid, rows in per_request.items():
            entry = self._samples.get(sid)
            if entry is None:
                continue   # aborted while its step ran
            group = entry[1]
            k = group.params.prompt_logprobs
            for pos, lp, rank, top_ids, top_lps in rows:
                group.prompt_logprobs[pos] = make_logprobs_entry(
                    group.prompt_token_ids[pos], lp, rank, top_ids, top_lps, k,
                    self._decode_one)

    def _record_token(self, sample: _Sample, res) -> bool:
        """True when the new token completes a stop string of a running request."""
        req = sample.request
        sample.cumulative_logprob += res.logprob
        if sample.logprobs is not None:
            sample.logprobs.append(make_logprobs_entry(
                res.token_id, res.logprob, res.rank, res.top_ids or [], res.top_logprobs or [],
                req.sampling_params.logprobs, self._decode_one))
        if req.status is _STOPPED and (
                res.token_id == req.eos_token_id
                or res.token_id in (req.sampling_params.stop_token_ids or ())):
            return False     # vLLM's: the stopping token's text is not output
        stop = sample.detok.update((res.token_id,))
        if stop is not None and not req.is_finished():
            req.stop_reason = stop
            return True
        return False

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _make_output(self, group: _Group) -> RequestOutput:
        outs = []
        for i, s in enumerate(group.samples):
            req = s.request
            finished = req.is_finished()
            outs.append(CompletionOutput(
                index=i, text=s.detok.get_next_output_text(finished, delta=False),
                token_ids=list(req.output_token_ids),
                cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                logprobs=s.logprobs, finish_reason=req.get_finished_reason(),
                stop_reason=req.stop_reason))
        finished = self._retire_if_finished(group)
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids,
                             group.prompt_logprobs, outs, finished,
                             num_cached_tokens=_num_cached(group),
                             metrics=group.metrics.copy())

    def _make_delta(self, group: _Group) -> tuple:
        """The group's output as a delta (``output_wire`` has the layout). The text
        only grows: the detokenizer holds back what a stop string could take away."""
        header = None
        if not group.header_sent:
            header = (group.prompt, group.prompt_token_ids, group.prompt_logprobs)
            group.header_sent = True
        completions = []
        for s in group.samples:
            req = s.request
            chars, num_ids, num_logprobs = s.sent
            text = s.detok.get_next_output_text(req.is_finished(), delta=True)
            ids = req.output_token_ids
            logprobs = None
            if s.logprobs is not None:
                logprobs = s.logprobs[num_logprobs:]
                num_logprobs = len(s.logprobs)
            s.sent = (chars + len(text), len(ids), num_logprobs)
            completions.append((chars, text, ids[num_ids:],
                                s.cumulative_logprob if s.logprobs is not None else None,
                                logprobs, req.get_finished_reason(), req.stop_reason))
        finished = self._retire_if_finished(group)
        return (group.request_id, header, completions, finished, _num_cached(group),
                pack_metrics(group.metrics))

    def _retire_if_finished(self, group: _Group) -> bool:
        finished = _finished(group)
        if finished:
            group.metrics.finished_time = time.time()
            self.abort_request(group.request_id)
        return finished


def _finished(group: _Group) -> bool:
    """Every sample finished (a loop, not all() over a generator: asked of every
    request every step)."""
    for s in group.samples:
        if not s.request.is_finished():
            return False
    return True


def _num_cached(group: _Group) -> int:
    """The samples' largest prefix hit, 0 if none (a loop: asked of every output)."""
    best = 0
    for s in group.samples:
        if s.request.num_cached_tokens > best:
            best = s.request.num_cached_tokens
    return best

