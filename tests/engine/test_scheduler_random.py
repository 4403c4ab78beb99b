"""Random scheduler configurations against one reference configuration, one step at a
time and with async scheduling (step N + 1 launched before step N is read back)."""

import random

import pytest
from sched_util import FakeRunner, SP, check_no_leak, check_step, make_scheduler, run

from jaxllm.engine.request import Request
from jaxllm.engine.scheduler import PLACEHOLDER_TOKEN_ID, Scheduler


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
