"""Scheduler tests: no model, no jax. A fake runner keeps a KV "cache" of token ids
per (block, slot) and samples from the context it reads back from that cache, so a
wrong block (bad prefix hit, lost swap) shows up as a failed check or other outputs.
"""

import random
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from jaxllm.engine import block_pool
from jaxllm.engine.request import Request, RequestStatus
from jaxllm.engine.scheduler import PLACEHOLDER_TOKEN_ID, Scheduler, SchedulerOutput

REPO = Path(__file__).resolve().parents[2]


@dataclass
class SP:
    """Stand-in for jaxllm.sampling_params.SamplingParams (the fields we read)."""
    max_tokens: int | None = 16
    n: int = 1
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)


def make_scheduler(**overrides) -> Scheduler:
    args = dict(block_size=4, num_gpu_blocks=256, num_cpu_blocks=0, max_num_seqs=8,
                max_num_batched_tokens=32, max_model_len=128, enable_chunked_prefill=True,
                enable_prefix_caching=False, preemption_mode="recompute")
    args.update(overrides)
    return Scheduler(**args)


def next_token(context: tuple[int, ...]) -> int:
    return 100 + hash(context) % 50


class FakeRunner:
    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.bs = sched.block_size
        self.gpu: dict[tuple[int, int], int] = {}   # (block, offset) -> token
        self.cpu: dict[int, list] = {}

    def slot(self, s, pos):
        return s.block_table[pos // self.bs], pos % self.bs

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        assert not (out.blocks_to_swap_out and out.blocks_to_swap_in)
        for gpu, cpu in out.blocks_to_swap_out:
            self.cpu[cpu] = [self.gpu.get((gpu, o)) for o in range(self.bs)]
        for cpu, gpu in out.blocks_to_swap_in:
            for o, token in enumerate(self.cpu.pop(cpu)):
                self.gpu[(gpu, o)] = token
        written = set()
        for s in out.scheduled:
            assert len(s.block_table) * self.bs >= s.num_computed_tokens + len(s.token_ids)
            for j, token in enumerate(s.token_ids):
                slot = self.slot(s, s.num_computed_tokens + j)
                # Never the null block, never a slot twice; a shared block only when a
                # later request of this step hit it in the prefix cache (its key pins
                # the tokens; the readers' contexts are checked below).
                assert slot[0] != 0 and slot not in written
                pool = self.sched.block_pool
                assert pool.ref_cnt(slot[0]) == 1 or pool.blocks[slot[0]].cache_key is not None
                written.add(slot)
                self.gpu[slot] = token
        sampled = {}
        for s in out.scheduled:
            n = s.num_computed_tokens + len(s.token_ids)
            context = tuple(self.gpu[self.slot(s, p)] for p in range(n))
            expect = self.host_tokens(s.request_id, n)
            assert list(context[:len(expect)]) == expect
            if s.do_sample:
                sampled[s.request_id] = next_token(context)
        return sampled

    def host_tokens(self, request_id, n):
        return self.sched.requests[request_id].all_token_ids[:n]


def check_invariants(sched: Scheduler) -> None:
    """Every GPU/CPU block is free or held, with ref counts matching the holders."""
    kv = sched.kv_cache_manager
    pool = kv.block_pool
    holders = [0] * pool.num_blocks
    for table in kv.req_blocks.values():
        for b in table:
            holders[b] += 1
    for b in range(1, pool.num_blocks):
        assert pool.ref_cnt(b) == holders[b], b
    assert pool.get_num_free_blocks() == sum(1 for h in holders[1:] if h == 0)
    cpu = list(kv.cpu_free) + [c for t in kv.req_cpu_blocks.values() for c in t]
    assert sorted(cpu) == list(range(kv.num_cpu_blocks))
    assert set(kv.req_cpu_blocks) == {r.request_id for r in sched.swapped}
    assert len(sched.running) <= sched.max_num_seqs


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    lens = [len(s.token_ids) for s in out.scheduled]
    assert out.num_batched_tokens == sum(lens) <= sched.max_num_batched_tokens
    assert all(lens) and len(out.scheduled) <= sched.max_num_seqs
    assert len({s.request_id for s in out.scheduled}) == len(out.scheduled)
    check_invariants(sched)


def check_no_leak(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    assert not sched.has_unfinished_requests()
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_usable_blocks
    assert len(kv.cpu_free) == kv.num_cpu_blocks
    assert not kv.req_blocks and not kv.req_cpu_blocks
    check_invariants(sched)


def step(sched, runner):
    out = sched.schedule()
    check_step(sched, out)
    sched.update_from_output(out, runner.execute(out))
    return out


def run(sched, requests, max_steps=3000):
    runner = FakeRunner(sched)
    for r in requests:
        sched.add_request(r)
    steps = []
    while sched.has_unfinished_requests():
        steps.append(step(sched, runner))
        assert len(steps) < max_steps, "no progress"
    check_no_leak(sched)
    return {r.request_id: r.output_token_ids for r in requests}, steps


def workload(seed=0, num=10, shared_prefix=()):
    """Random prompts; the even-numbered ones start with shared_prefix."""
    rng = random.Random(seed)
    return [Request(f"r{i}", list(shared_prefix if i % 2 == 0 else ())
                    + [rng.randrange(1, 99) for _ in range(rng.randint(3, 14))],
                    SP(max_tokens=rng.randint(6, 14)), arrival_time=float(i))
            for i in range(num)]


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


def random_requests(rng, num):
    """Prompts from a few shared prefixes; some grouped as n samples of one parent."""
    prefixes = [list(range(1, rng.randint(2, 12))), list(range(40, 47)), []]
    requests, group_prompts = [], {}
    for i in range(num):
        parent = f"p{i // 3}" if rng.random() < 0.4 else None
        prompt = rng.choice(prefixes) + [rng.randrange(1, 99) for _ in range(rng.randint(1, 16))]
        if parent is not None:
            prompt = group_prompts.setdefault(parent, prompt)
        rid = f"{i}_{parent}" if parent else f"r{i}"
        requests.append(Request(rid, prompt, SP(max_tokens=rng.randint(1, 14)), parent_id=parent))
    return requests


def random_scheduler(rng) -> Scheduler:
    block_size = rng.choice([1, 2, 4, 8])
    chunked = rng.random() < 0.5
    return make_scheduler(
        block_size=block_size, max_num_seqs=rng.randint(1, 8), max_model_len=64,
        num_gpu_blocks=1 + -(-40 // block_size) + rng.randint(0, 10),
        num_cpu_blocks=rng.choice([0, 3, 50]), enable_chunked_prefill=chunked,
        max_num_batched_tokens=rng.randint(1, 60) if chunked else rng.randint(40, 60),
        enable_prefix_caching=rng.random() < 0.5, preemption_mode=rng.choice(["recompute", "swap"]))


@pytest.mark.parametrize("seed", range(40))
def test_random_configs_match_reference(seed):
    rng = random.Random(seed)
    num = rng.randint(1, 16)
    expected, _ = run(make_scheduler(max_model_len=64), random_requests(random.Random(seed), num))
    outputs, _ = run(random_scheduler(rng), random_requests(random.Random(seed), num))
    assert outputs == expected


# -- async scheduling ------------------------------------------------------------------------


class AsyncFakeRunner(FakeRunner):
    """Runs step N+1 before the host has read step N: placeholders take the token the
    previous step sampled, as the real runner's device buffer does."""

    def __init__(self, sched):
        super().__init__(sched)
        self.last: dict[str, int] = {}

    def execute(self, out):
        for s in out.scheduled:
            if PLACEHOLDER_TOKEN_ID in s.token_ids:
                assert s.token_ids.index(PLACEHOLDER_TOKEN_ID) == len(s.token_ids) - 1
                s.token_ids = s.token_ids[:-1] + [self.last[s.request_id]]
        self.known = {s.request_id: self.sched.requests[s.request_id].num_tokens
                      for s in out.scheduled}
        self.last = super().execute(out)
        return self.last

    def host_tokens(self, request_id, n):
        return self.sched.requests[request_id].all_token_ids[:min(n, self.known[request_id])]


def run_async(sched, requests, max_steps=3000):
    """The async engine's loop: schedule and launch step N+1, then read back step N."""
    runner = AsyncFakeRunner(sched)
    for r in requests:
        sched.add_request(r)
    pending, steps = None, 0
    while sched.has_unfinished_requests() or pending:
        out = sched.schedule()
        check_step(sched, out)
        launched = (out, runner.execute(out)) if out.scheduled else None
        if pending:
            sched.update_from_output(*pending)
        pending = launched
        steps += 1
        assert steps < max_steps, "no progress"
    check_no_leak(sched)
    return {r.request_id: r.output_token_ids for r in requests}


@pytest.mark.parametrize("seed", range(40))
def test_async_scheduling_matches_sync(seed):
    """Random configs (preemption both ways, chunking, prefix caching, n samples) and
    an EOS that ends some requests early: the same tokens as one step at a time."""
    rng = random.Random(seed)
    num = rng.randint(1, 16)

    def requests():
        reqs = random_requests(random.Random(seed), num)
        for r in reqs:
            r.eos_token_id = 100 + seed % 50
        return reqs
    expected, _ = run(make_scheduler(max_model_len=64), requests())
    assert run_async(random_scheduler(rng), requests()) == expected


def test_async_never_schedules_past_the_length_cap():
    sched = make_scheduler()
    runner = AsyncFakeRunner(sched)
    sched.add_request(req := Request("a", [1, 2, 3], SP(max_tokens=2)))
    first = sched.schedule()                       # prefill, samples token 1
    assert first.scheduled[0].do_sample
    runner.execute(first)
    second = sched.schedule()                      # token 1 not read back yet
    assert second.scheduled[0].token_ids == [PLACEHOLDER_TOKEN_ID]
    assert second.scheduled[0].output_index == 1
    runner.execute(second)
    sched.update_from_output(first, {"a": 120})
    assert not sched.schedule().scheduled          # token 2, in flight, is its last
    sched.update_from_output(second, {"a": 121})
    assert sched.requests == {} and req.output_token_ids == [120, 121]
    assert req.get_finished_reason() == "length"
    check_no_leak(sched)
