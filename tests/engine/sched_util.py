"""The scheduler tests' fakes: a runner that keeps a KV "cache" of token ids per (block,
slot) and samples from the context it reads back from that cache, so a wrong block (bad
prefix hit, lost swap) shows up as a failed check or other outputs; the invariants
checked after every step; small workloads. No model, no jax."""

import random
from dataclasses import dataclass, field

from jaxllm.engine.request import Request
from jaxllm.engine.scheduler import Scheduler, SchedulerOutput


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
