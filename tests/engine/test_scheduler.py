"""Scheduler tests: no model, no jax (the fake runner and checks: sched_util.py)."""

import random
import subprocess
import sys
from pathlib import Path

import pytest
from sched_util import SP, FakeRunner, check_no_leak, make_scheduler, run, step, workload

from jaxllm.engine import block_pool
from jaxllm.engine.request import Request, RequestStatus

REPO = Path(__file__).resolve().parents[2]


# -- budgets and chunking ---------------------------------------------------------------


def test_token_budget_and_max_num_seqs():
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=10)
    outputs, steps = run(sched, workload(num=10))
    assert max(len(s.scheduled) for s in steps) == 3
    assert max(s.num_batched_tokens for s in steps) == 10
    assert all(len(outputs[f"r{i}"]) == r.sampling_params.max_tokens
               for i, r in enumerate(workload(num=10)))


def test_long_prompt_is_chunked_while_decodes_continue():
    sched = make_scheduler(max_num_batched_tokens=16)
    runner = FakeRunner(sched)
    for i in range(3):
        sched.add_request(Request(f"d{i}", [1, 2, 3], SP(max_tokens=20)))
    step(sched, runner)
    sched.add_request(Request("long", list(range(1, 51)), SP(max_tokens=2)))
    chunks = []
    for _ in range(4):
        out = step(sched, runner)
        by_id = {s.request_id: s for s in out.scheduled}
        assert [len(by_id[f"d{i}"].token_ids) for i in range(3)] == [1, 1, 1]
        assert all(by_id[f"d{i}"].do_sample for i in range(3))
        chunks.append((len(by_id["long"].token_ids), by_id["long"].do_sample))
    assert chunks == [(13, False), (13, False), (13, False), (11, True)]
    assert sched.requests["long"].num_output_tokens == 1


def test_without_chunked_prefill_a_prompt_waits_to_go_whole():
    sched = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    runner = FakeRunner(sched)
    sched.add_request(Request("a", list(range(1, 11)), SP(max_tokens=3)))
    sched.add_request(Request("b", list(range(1, 11)), SP(max_tokens=3)))
    out = step(sched, runner)
    assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("a", 10)]
    out = step(sched, runner)
    assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("a", 1), ("b", 10)]


# -- prefix caching -----------------------------------------------------------------------


def test_shared_system_prompt_hits_and_shares_blocks():
    sched = make_scheduler(enable_prefix_caching=True)
    runner = FakeRunner(sched)
    system = list(range(1, 13))  # three full blocks
    sched.add_request(Request("a", system + [50, 51, 52], SP(max_tokens=4)))
    step(sched, runner)
    sched.add_request(Request("b", system + [60, 61, 62], SP(max_tokens=4)))
    out = step(sched, runner)
    a, b = (next(s for s in out.scheduled if s.request_id == rid) for rid in "ab")
    assert b.num_computed_tokens == 12 and b.token_ids == [60, 61, 62]
    assert b.block_table[:3] == a.block_table[:3] and b.block_table[3] != a.block_table[3]
    assert all(sched.block_pool.ref_cnt(blk) == 2 for blk in b.block_table[:3])
    assert sched.requests["b"].num_cached_tokens == 12
    assert sched.block_pool.prefix_cache_queries == 30
    assert sched.block_pool.prefix_cache_hits == 12
    while sched.has_unfinished_requests():
        step(sched, runner)
    check_no_leak(sched)


def test_whole_prompt_is_never_a_hit():
    sched = make_scheduler(enable_prefix_caching=True)
    runner = FakeRunner(sched)
    sched.add_request(Request("a", list(range(1, 9)), SP(max_tokens=1)))
    step(sched, runner)
    sched.add_request(Request("b", list(range(1, 9)), SP(max_tokens=1)))
    out = step(sched, runner)
    assert out.scheduled[0].num_computed_tokens == 4 and out.scheduled[0].token_ids == [5, 6, 7, 8]


def test_hash_collision_is_a_miss(monkeypatch):
    monkeypatch.setattr(block_pool, "hash_block_tokens", lambda parent, tokens: 0)
    reqs = workload(seed=3, num=8, shared_prefix=range(1, 10))
    expected, _ = run(make_scheduler(), workload(seed=3, num=8, shared_prefix=range(1, 10)))
    sched = make_scheduler(enable_prefix_caching=True, max_num_batched_tokens=24)
    outputs, _ = run(sched, reqs)
    assert outputs == expected
    sched.add_request(Request("x", list(range(50, 60)), SP(max_tokens=1)))
    out = sched.schedule()
    assert out.scheduled[0].num_computed_tokens == 0


# -- preemption -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("chunked", [True, False])
def test_preemption_gives_the_same_outputs(mode, prefix_caching, chunked):
    shared = range(1, 6) if prefix_caching else ()
    expected, _ = run(make_scheduler(), workload(seed=1, shared_prefix=shared))
    sched = make_scheduler(num_gpu_blocks=14, num_cpu_blocks=64, max_num_batched_tokens=24,
                           preemption_mode=mode, enable_prefix_caching=prefix_caching,
                           enable_chunked_prefill=chunked)
    outputs, steps = run(sched, workload(seed=1, shared_prefix=shared))
    assert outputs == expected
    assert sched.num_preemptions_total > 0
    swapped_out = sum(len(s.blocks_to_swap_out) for s in steps)
    swapped_in = sum(len(s.blocks_to_swap_in) for s in steps)
    assert swapped_in == swapped_out
    assert (swapped_out > 0) == (mode == "swap")


def test_swap_falls_back_to_recompute_when_cpu_is_full():
    expected, _ = run(make_scheduler(), workload(seed=2))
    sched = make_scheduler(num_gpu_blocks=12, num_cpu_blocks=2, max_num_batched_tokens=24,
                           preemption_mode="swap")
    outputs, steps = run(sched, workload(seed=2))
    assert outputs == expected
    recomputed = sum(len(s.preempted_request_ids) for s in steps if not s.blocks_to_swap_out)
    assert recomputed > 0


def test_swap_pairs_are_consistent():
    sched = make_scheduler(num_gpu_blocks=14, num_cpu_blocks=64, preemption_mode="swap")
    _, steps = run(sched, workload(seed=4))
    held: dict[int, int] = {}   # cpu block -> gpu block it holds
    for out in steps:
        cpus = [c for _, c in out.blocks_to_swap_out]
        assert len(set(cpus)) == len(cpus) and not set(cpus) & set(held)
        held.update((c, g) for g, c in out.blocks_to_swap_out)
        gpus = [g for _, g in out.blocks_to_swap_in]
        assert len(set(gpus)) == len(gpus)
        for c, _ in out.blocks_to_swap_in:
            del held[c]
    assert not held and any(s.blocks_to_swap_in for s in steps)


def test_recompute_keeps_outputs_and_goes_to_the_front():
    sched = make_scheduler(num_gpu_blocks=6, max_num_batched_tokens=64)
    runner = FakeRunner(sched)
    sched.add_request(Request("a", list(range(1, 9)), SP(max_tokens=12)))
    sched.add_request(Request("b", list(range(11, 19)), SP(max_tokens=12)))
    sched.add_request(Request("c", [1, 2], SP(max_tokens=1)))
    for _ in range(10):
        if "b" in step(sched, runner).preempted_request_ids:
            break
    else:
        pytest.fail("b was never preempted")
    b = sched.requests["b"]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_output_tokens > 0 and sched.waiting[0] is b


def test_recompute_past_the_budget_is_chunked_even_without_chunked_prefill():
    # b is preempted holding 13 tokens (prompt + outputs) > max_num_batched_tokens.
    def reqs():
        return [Request(rid, list(range(i, i + 10)), SP(max_tokens=10))
                for i, rid in ((1, "a"), (20, "b"))]
    expected, _ = run(make_scheduler(), reqs())
    sched = make_scheduler(num_gpu_blocks=8, max_num_batched_tokens=12,
                           enable_chunked_prefill=False)
    outputs, steps = run(sched, reqs())
    assert outputs == expected and sched.num_preemptions_total > 0
    assert any(s.request_id == "b" and len(s.token_ids) == 12 and not s.do_sample
               for out in steps for s in out.scheduled)


# -- finishing and aborts -------------------------------------------------------------------


def test_stop_conditions():
    sched = make_scheduler(max_model_len=13, max_num_batched_tokens=64)
    cases = {  # prompts of 10 tokens
        "eos": (SP(), [7], "stop", None),
        "min": (SP(min_tokens=2), [7, 7], "stop", None),
        "ignore": (SP(max_tokens=2, ignore_eos=True), [7, 7], "length", None),
        "stopid": (SP(stop_token_ids=[9]), [5, 9], "stop", 9),
        "len": (SP(max_tokens=2), [5, 5], "length", None),
        "model_len": (SP(max_tokens=None), [5, 5, 5], "length", None),
    }
    reqs = {rid: Request(rid, list(range(10)), sp, eos_token_id=7)
            for rid, (sp, *_) in cases.items()}
    for r in reqs.values():
        sched.add_request(r)
    finished = []
    for i in range(3):
        out = sched.schedule()
        finished += out.finished_request_ids
        sampled = {s.request_id: cases[s.request_id][1][i] for s in out.scheduled}
        sched.update_from_output(out, sampled)
    for rid, (_, tokens, reason, stop_reason) in cases.items():
        assert reqs[rid].output_token_ids == tokens and reqs[rid].is_finished()
        assert reqs[rid].get_finished_reason() == reason and reqs[rid].stop_reason == stop_reason
    finished += sched.schedule().finished_request_ids
    assert sorted(finished) == sorted(cases)
    check_no_leak(sched)


def test_abort_waiting_running_and_between_schedule_and_update():
    sched = make_scheduler(max_num_seqs=1)
    for rid in "abc":
        sched.add_request(Request(rid, [1, 2, 3, 4, 5], SP()))
    out = sched.schedule()
    sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    sched.update_from_output(out, {"a": 1})
    out = sched.schedule()
    assert out.finished_request_ids == ["b"] and sched.num_waiting == 1
    sched.finish_requests(["a", "nope"], RequestStatus.FINISHED_ABORTED)
    assert sched.update_from_output(out, {"a": 1}) == []
    sched.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)
    assert sched.schedule().finished_request_ids == ["a", "c"]
    check_no_leak(sched)


def test_abort_swapped_and_random_aborts_never_leak():
    rng = random.Random(5)
    for trial in range(4):
        sched = make_scheduler(num_gpu_blocks=14, num_cpu_blocks=16, max_num_batched_tokens=24,
                               preemption_mode="swap", enable_prefix_caching=trial % 2 == 1)
        runner = FakeRunner(sched)
        for r in workload(seed=trial, num=12, shared_prefix=range(1, 6)):
            sched.add_request(r)
        aborted_swapped = False
        while sched.has_unfinished_requests():
            if sched.swapped and not aborted_swapped:
                sched.finish_requests(sched.swapped[-1].request_id, RequestStatus.FINISHED_ABORTED)
                aborted_swapped = True
            elif rng.random() < 0.1:
                sched.finish_requests(rng.choice(list(sched.requests)),
                                      RequestStatus.FINISHED_ABORTED)
            step(sched, runner)
        assert aborted_swapped
        check_no_leak(sched)


# -- validation ---------------------------------------------------------------------------------


def test_add_request_validation():
    sched = make_scheduler(max_model_len=20, num_gpu_blocks=5, max_num_batched_tokens=8,
                           enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(Request("a", list(range(21)), SP()))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        sched.add_request(Request("a", list(range(9)), SP()))
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request(Request("a", list(range(8)), SP(max_tokens=12)))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(Request("a", [], SP()))
    sched.add_request(Request("a", list(range(8)), SP(max_tokens=9)))  # 16 tokens of KV
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(Request("a", [1], SP()))
    with pytest.raises(ValueError, match="preemption_mode"):
        make_scheduler(preemption_mode="drop")


# -- n samples -----------------------------------------------------------------------------------


def test_siblings_share_prompt_blocks_without_prefix_caching():
    sched = make_scheduler(enable_prefix_caching=False)
    runner = FakeRunner(sched)
    prompt = list(range(1, 11))  # two full blocks to share, the third recomputed
    for i in range(3):
        sched.add_request(Request(f"{i}_p", prompt, SP(max_tokens=5), parent_id="p"))
    sched.add_request(Request("q", prompt, SP(max_tokens=5)))
    out = step(sched, runner)
    # The siblings hit the blocks 0_p computes in this very step (registered when it
    # was scheduled; each layer writes before it reads).
    assert [s.request_id for s in out.scheduled] == ["0_p", "1_p", "2_p", "q"]
    by_id = {s.request_id: s for s in out.scheduled}
    first = by_id["0_p"].block_table
    for rid in ("1_p", "2_p"):
        assert by_id[rid].num_computed_tokens == 8 and by_id[rid].token_ids == [9, 10]
        assert by_id[rid].block_table[:2] == first[:2] and by_id[rid].block_table[2] != first[2]
    assert all(sched.block_pool.ref_cnt(b) == 3 for b in first[:2])
    assert sched.requests["q"].num_cached_tokens == 0
    assert sched.block_pool.prefix_cache_queries == 0   # stats are for global caching only
    while sched.has_unfinished_requests():
        step(sched, runner)
    check_no_leak(sched)


def test_chunked_sibling_waits_for_the_shared_prompt():
    """A sibling does not compute its own copy of prompt blocks the first sample is
    still computing over several chunks; it is admitted once they are registered."""
    sched = make_scheduler(enable_prefix_caching=False, max_num_batched_tokens=8)
    runner = FakeRunner(sched)
    prompt = list(range(1, 19))  # four full blocks, chunked over three steps
    for i in range(2):
        sched.add_request(Request(f"{i}_p", prompt, SP(max_tokens=3), parent_id="p"))
    assert [s.request_id for s in step(sched, runner).scheduled] == ["0_p"]
    assert [s.request_id for s in step(sched, runner).scheduled] == ["0_p"]
    out = step(sched, runner)
    sib = {s.request_id: s for s in out.scheduled}["1_p"]
    assert sib.num_computed_tokens == 16 and sib.token_ids == [17, 18]
    while sched.has_unfinished_requests():
        step(sched, runner)
    check_no_leak(sched)


def test_scheduler_does_not_import_jax():
    code = "import sys, jaxllm.engine.scheduler; assert 'jax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
