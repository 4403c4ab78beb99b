"""Scheduling policies (engine/request_queue.py) on a real Scheduler with a small fake
KV cache, no model: vLLM's priority semantics (lower `priority` first, ties by arrival;
preemption takes the lowest priority, latest arrival first) and fcfs unchanged."""

import pytest
from sched_util import SP, FakeRunner, check_no_leak, make_scheduler, step

from jaxllm.engine.request import Request
from jaxllm.engine.request_queue import PriorityRequestQueue


def admission_order(sched, requests) -> list[str]:
    """Run to the end; the ids in the order each was first scheduled."""
    runner = FakeRunner(sched)
    for r in requests:
        sched.add_request(r)
    order = []
    while sched.has_unfinished_requests():
        for s in step(sched, runner).scheduled:
            if s.request_id not in order:
                order.append(s.request_id)
    check_no_leak(sched)
    return order


# (id, priority, arrival): arrival order is the list order.
MIXED = [("a", 3, 0.0), ("b", 1, 1.0), ("c", 2, 2.0), ("d", 1, 3.0), ("e", 0, 4.0),
         ("f", -5, 5.0)]


def mixed_requests():
    return [Request(rid, [1, 2, 3, 4, 5], SP(max_tokens=4), arrival_time=t, priority=p)
            for rid, p, t in MIXED]


def test_priority_admits_lowest_value_first_ties_by_arrival():
    sched = make_scheduler(max_num_seqs=1, policy="priority")
    assert admission_order(sched, mixed_requests()) == ["f", "e", "b", "d", "c", "a"]


def test_fcfs_ignores_priority():
    sched = make_scheduler(max_num_seqs=1)
    assert admission_order(sched, mixed_requests()) == ["a", "b", "c", "d", "e", "f"]


def test_a_later_high_priority_request_overtakes_the_waiting_ones():
    sched = make_scheduler(max_num_seqs=1, policy="priority")
    runner = FakeRunner(sched)
    for i in range(3):
        sched.add_request(Request(f"low{i}", [1, 2, 3], SP(max_tokens=3), arrival_time=i,
                                  priority=5))
    step(sched, runner)                      # low0 runs
    sched.add_request(Request("urgent", [7, 8], SP(max_tokens=3), arrival_time=9, priority=0))
    order = []
    while sched.has_unfinished_requests():
        for s in step(sched, runner).scheduled:
            if s.request_id not in order:
                order.append(s.request_id)
    assert order == ["low0", "urgent", "low1", "low2"]


def fill_until_preemption(policy: str, priorities: list[int], late: bool = False):
    """Three 4-token prompts, growing one block every 4 tokens into a 6-block cache:
    the first preemption's victims. late: the last one arrives after a step."""
    sched = make_scheduler(num_gpu_blocks=7, max_num_seqs=3, policy=policy)
    runner = FakeRunner(sched)
    requests = [Request(f"r{i}", [1, 2, 3, 4], SP(max_tokens=20), arrival_time=i, priority=p)
                for i, p in enumerate(priorities)]
    for r in requests[:-1] if late else requests:
        sched.add_request(r)
    if late:
        step(sched, runner)
        sched.add_request(requests[-1])
    for _ in range(60):
        out = step(sched, runner)
        if out.preempted_request_ids:
            break
    else:
        pytest.fail("no preemption")
    victim = out.preempted_request_ids
    while sched.has_unfinished_requests():  # and it still finishes, blocks all freed
        step(sched, runner)
    check_no_leak(sched)
    return victim


@pytest.mark.parametrize("priorities, victim", [
    ([0, 5, 1], ["r1"]),        # the largest priority value, though not the newest
    ([5, 0, 0], ["r0"]),        # ... even the oldest
    ([2, 2, 2], ["r2"]),        # ties: the latest arrival
    ([0, 3, 3], ["r2"]),        # a tie at the lowest priority: the later one
])
def test_preemption_takes_the_lowest_priority_first(priorities, victim):
    assert fill_until_preemption("priority", priorities) == victim


def test_preemption_spares_a_later_admitted_high_priority_request():
    # r2 joins the running batch last; vLLM's victim is max((priority, arrival)): r1.
    assert fill_until_preemption("priority", [5, 5, 0], late=True) == ["r1"]
    assert fill_until_preemption("fcfs", [5, 5, 0], late=True) == ["r2"]


def test_fcfs_preempts_the_newest_whatever_its_priority():
    assert fill_until_preemption("fcfs", [0, 5, 1]) == ["r2"]


def test_a_preempted_request_returns_at_its_priority_not_the_front():
    queue = PriorityRequestQueue()
    for rid, p, t in [("x", 1, 0.0), ("y", 4, 1.0), ("z", 2, 2.0)]:
        queue.add_request(Request(rid, [1], SP(), arrival_time=t, priority=p))
    y = next(r for r in queue if r.request_id == "y")
    queue.remove_request(y)
    queue.prepend_request(y)          # what a recompute preemption does
    assert [r.request_id for r in queue] == ["x", "z", "y"]
    assert queue.pop_request().request_id == "x" and len(queue) == 2


def test_running_requests_are_kept_in_priority_order():
    sched = make_scheduler(policy="priority")
    runner = FakeRunner(sched)
    for i, p in enumerate([4, 1, 3, 0]):
        sched.add_request(Request(f"r{i}", [1, 2], SP(max_tokens=8), arrival_time=i,
                                  priority=p))
    step(sched, runner)
    sched.add_request(Request("r4", [1, 2], SP(max_tokens=8), arrival_time=9, priority=2))
    step(sched, runner)
    assert [r.request_id for r in sched.running] == ["r3", "r1", "r4", "r2", "r0"]


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="policy='lifo'"):
        make_scheduler(policy="lifo")
