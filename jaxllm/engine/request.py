"""Per-request state the scheduler tracks (vLLM v1 names).

A request is its token list (prompt + outputs so far) and ``num_computed_tokens``,
the length of the prefix whose KV is in the cache or being written by a launched
step. Prefill, chunked prefill and decode are all "catch ``num_computed_tokens`` up
to ``num_tokens`` (+ the output placeholders)".

No jax here: the scheduler imports this module and must stay pure Python.
"""

from __future__ import annotations

import enum
import itertools
import time
from typing import Any

_SERIALS = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()   # preempted by recompute; sits in the waiting queue
    SWAPPED = enum.auto()     # preempted by swap; its KV lives in CPU blocks
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return _is_finished(status)

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> str | None:
        return _finished_reason(status)


# The finished members under module names. Asked for every request on every step, so
# identity tests against globals: hashing an Enum member runs Python code, and reading
# RequestStatus.X goes through the enum's metaclass (each ~10x a global's read).
_STOPPED, _LENGTH_CAPPED, _ABORTED = (RequestStatus.FINISHED_STOPPED,
                                      RequestStatus.FINISHED_LENGTH_CAPPED,
                                      RequestStatus.FINISHED_ABORTED)


def _is_finished(status: RequestStatus) -> bool:
    return status is _STOPPED or status is _LENGTH_CAPPED or status is _ABORTED


# The strings are OpenAI's `finish_reason` values.
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


def _finished_reason(status: RequestStatus) -> str | None:
    # The dict only for a finished one (hashing a member is the slow part).
    return _FINISH_REASONS[status] if _is_finished(status) else None


class Request:
    """One sequence to generate.

    ``sampling_params`` is duck-typed (vLLM's SamplingParams fields): the scheduler
    reads ``max_tokens`` (None: up to max_model_len), ``min_tokens``, ``ignore_eos``
    and, if present, ``stop_token_ids``. ``parent_id`` is set on the n samples of one
    prompt (ids ``f"{i}_{parent_id}"``) so they share the prompt's KV blocks.
    ``priority`` orders requests under the priority policy (request_queue.py).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: Any,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        parent_id: str | None = None,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        # Tells this request from an earlier one under the same id (aborted while a
        # step of it was in flight): that step's token is not this one's.
        self.serial = next(_SERIALS)
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.parent_id = parent_id
        # Scheduling priority (vLLM's): lower runs first under the priority policy.
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.output_token_ids: list[int] = []
        # Prompt then outputs, kept as one list (extended by append_output_token).
        # Read-only for everyone else. A plain attribute, not a property: the scheduler
        # reads it (and len() of it) for every request on every step.
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        # Tokens whose KV is computed or being computed by a launched step: advanced
        # when a step is scheduled (vLLM v1), so the next step can be scheduled while
        # this one runs.
        self.num_computed_tokens = 0
        # Tokens sampled by a launched step but not yet read back (async scheduling):
        # 0 or 1. The next step feeds such a token from the device, never the host.
        self.num_output_placeholders = 0
        # Speculative decoding: draft tokens proposed after the last step, verified by
        # the next one (engine/core.py proposes; the scheduler consumes them).
        self.spec_token_ids: list[int] = []
        # Prefix-cache hit at first schedule, in tokens; -1 until then.
        self.num_cached_tokens = -1
        # Chained hashes of the full blocks of all_token_ids, filled lazily by the
        # KV cache manager. Full blocks never change, so the list only grows.
        self.block_hashes: list[int] = []
        self.first_scheduled_time: float | None = None     # set by the engine core
        # Structured outputs: the grammar's matcher (structured_output/request.py),
        # set by the engine core; None for an unconstrained request.
        self.structured_output_request: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int | None:
        return getattr(self.sampling_params, "max_tokens", None)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop the outputs after the first `num_output_tokens` (a stop string ended
        the request inside a step that accepted several speculated tokens)."""
        extra = self.num_output_tokens - num_output_tokens
        if extra > 0:
            del self.output_token_ids[num_output_tokens:]
            del self.all_token_ids[len(self.all_token_ids) - extra:]

    def is_finished(self) -> bool:
        return _is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return _finished_reason(self.status)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")


def live_request(requests: dict, scheduled) -> Request | None:
    """The live request a scheduled row (a ScheduledRequest) was made for: None when
    it finished since, or when its id now names a later request (Request.serial)."""
    request = requests.get(scheduled.request_id)
    if request is None or (scheduled.serial is not None
                           and scheduled.serial != request.serial):
        return None
    return request
