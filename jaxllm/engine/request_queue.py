"""The order in which waiting requests are admitted: vLLM's scheduling policies.

- ``fcfs``: arrival order; a preempted request goes back to the front.
- ``priority``: the lowest ``Request.priority`` first, ties by ``arrival_time`` (then
  by the order added, so the n samples of one prompt keep theirs); a preempted request
  goes back in at its place in that order, not to the front.

The scheduler keeps its swapped-out requests in a queue of the same policy. Pure
Python, as the scheduler.
"""
from __future__ import annotations

import enum
import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Iterator

from jaxllm.engine.request import Request


class SchedulingPolicy(enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


SCHEDULING_POLICIES = tuple(p.value for p in SchedulingPolicy)


def priority_key(request: Request) -> tuple[int, float]:
    """Smaller runs first; the running request with the largest key is preempted first."""
    return request.priority, request.arrival_time


class FCFSRequestQueue(deque):
    """A deque of Requests (indexing works, as before policies existed)."""

    def add_request(self, request: Request) -> None:
        self.append(request)

    def pop_request(self) -> Request:
        return self.popleft()

    def peek_request(self) -> Request:
        return self[0]

    def prepend_request(self, request: Request) -> None:
        self.appendleft(request)

    def prepend_requests(self, requests: list[Request]) -> None:
        """Put `requests` back at the front, in their order."""
        self.extendleft(reversed(requests))

    def remove_request(self, request: Request) -> None:
        self.remove(request)


class PriorityRequestQueue:
    """A heap ordered by (priority, arrival_time, order added)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._order = itertools.count()

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, (*priority_key(request), next(self._order), request))

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def peek_request(self) -> Request:
        return self._heap[0][-1]

    # There is no front in a priority queue: a request returns to its place.
    prepend_request = add_request

    def prepend_requests(self, requests: list[Request]) -> None:
        for request in requests:
            self.add_request(request)

    def remove_request(self, request: Request) -> None:
        self.remove_requests((request,))

    def remove_requests(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        self._heap = [entry for entry in self._heap if id(entry[-1]) not in gone]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In priority order."""
        return (entry[-1] for entry in sorted(self._heap, key=lambda e: e[:3]))


RequestQueue = FCFSRequestQueue | PriorityRequestQueue


def create_request_queue(policy: SchedulingPolicy) -> RequestQueue:
    if policy is SchedulingPolicy.PRIORITY:
        return PriorityRequestQueue()
    return FCFSRequestQueue()
