"""A CPU start compiles what first requests need before the engine is ready and the
other buckets after: a step whose bucket is still compiling runs in a larger ready
bucket (a decode step as a mixed one), or waits for its program, which jumps the
queue. (That a warm start loads every program the store has, deferring none, is
tests/server/test_serve_restart.py's.)"""
from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.runner import compilation
from jaxllm.runner.buckets import BucketPlan
from jaxllm.runner.compilation import CompilationManager, Program, first_requests_only
from jaxllm.runner.sampler import SamplerFlags

PLAN = BucketPlan.build(max_num_batched_tokens=512, max_num_seqs=32)   # T 16..512, S 8..32


def test_first_requests_only_keeps_the_smallest_decode_and_one_prefill_bucket():
    defer = first_requests_only(PLAN)
    assert not defer(("step", 8, 8, True)) and not defer(("step", 64, 32, False))
    assert defer(("step", 16, 16, True)) and defer(("step", 16, 32, False))
    assert defer(("step", 128, 32, False))
    assert not defer(("sample", 8, SamplerFlags()))
    assert not defer(("sample", 32, SamplerFlags(all_greedy=True)))
    assert defer(("sample", 16, SamplerFlags()))
    assert defer(("sample", 8, SamplerFlags(num_logprobs=20)))
    assert defer(("sample", 32, SamplerFlags(use_top_k_top_p_min_p=True)))


def test_shape_for_takes_a_larger_ready_bucket():
    ready_set = {("step", 8, 8, True), ("step", 64, 32, False)}

    def ready(key):
        return key in ready_set
    assert PLAN.shape_for(5, 5, True, ready) == (8, 8, True)
    assert PLAN.shape_for(20, 3, False, ready) == (64, 32, False)     # 32 not ready
    assert PLAN.shape_for(12, 12, True, ready) == (64, 32, False)     # decode as mixed
    assert PLAN.shape_for(100, 4, False, ready) == (128, 32, False)   # none larger: wait
    assert PLAN.shape_for(12, 12, True) == (16, 16, True)             # no check: natural


def _programs(names):
    out = []
    for i, name in enumerate(names):
        x = jnp.zeros((4 + i,), jnp.float32)
        out.append(Program(name, (x,), jax.jit(lambda x, k=i + 2: x * k), (x,)))
    return out


def test_deferred_programs_compile_after_and_a_waiting_call_jumps_the_queue(monkeypatch):
    names = [("p", i) for i in range(6)]
    programs = _programs(names)
    order, release = [], threading.Event()
    real_submit = compilation.CompileQueue.submit

    def submit(self, progs, defer=None):
        if progs and progs[0].name[1] >= 1:       # background: hold until released
            release.wait(30)
            order.append(progs[0].name)
        return real_submit(self, progs, defer)
    monkeypatch.setattr(compilation.CompileQueue, "submit", submit)
    manager = CompilationManager(None, 1, 1, rebuild=None)
    num, _ = manager.warm_up(programs, defer=lambda name: name[1] >= 1)
    assert num == 1 and ("p", 0) in manager.programs
    assert set(manager.background) == set(names[1:])
    assert not manager.ready_now(("p", 5)) and manager.ready_now(("p", 0))
    assert manager.ready_now(("q", 9))        # never deferred: the jit path, no wait
    x = programs[5].call_args[0]
    done = {}
    waiter = threading.Thread(target=lambda: done.setdefault(
        "out", manager.call(("p", 5), (x,), None, None)))
    waiter.start()
    while ("p", 5) not in manager._urgent:
        threading.Event().wait(0.01)
    release.set()
    waiter.join(30)
    np.testing.assert_array_equal(np.asarray(done["out"]), np.zeros(9))
    assert ("p", 5) in order[:2]              # compiled first or second, not last
    for name in names:
        while name in manager.background:
            threading.Event().wait(0.01)
        assert name in manager.programs
