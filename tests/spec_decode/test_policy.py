"""spec_decode/policy.py: when a step drafts, and for which requests."""
from __future__ import annotations

from types import SimpleNamespace

from jaxllm.spec_decode.policy import SpecPolicy, cost_ratio


def reqs(n: int):
    return [SimpleNamespace(request_id=f"r{i}") for i in range(n)]


def run(policy, running, steps: int, accepted) -> int:
    """Steps in which some request drafted; `accepted(step)` per verify."""
    drafted = 0
    for step in range(steps):
        chosen = policy.drafting(running, lambda r: True)
        drafted += bool(chosen)
        for r in chosen:
            policy.observe(r.request_id, accepted(step))
    return drafted


def test_cost_ratio_interpolates_the_measured_points():
    assert cost_ratio(1) == 1.70 and cost_ratio(64) == 3.43 and cost_ratio(512) == 3.43
    assert 1.70 < cost_ratio(4) < 2.13 < cost_ratio(16) < 3.43


def test_no_drafts_above_disable_by_batch_size():
    policy = SpecPolicy(4, disable_by_batch_size=8)
    assert policy.drafting(reqs(9), lambda r: True) == []
    assert len(policy.drafting(reqs(8), lambda r: True)) == 8


def test_drafts_that_always_land_draft_every_step():
    policy = SpecPolicy(4, 32)
    assert run(policy, reqs(1), 200, lambda s: 4) == 200


def test_drafts_that_never_land_cost_a_few_steps():
    """Three misses bring a batch-1 request under the bar (0.7 accepted drafts:
    verify 1.70x a plain step); then probes at doubling intervals."""
    policy = SpecPolicy(4, 32)
    drafted = run(policy, reqs(1), 2000, lambda s: 0)
    assert 3 <= drafted <= 3 + 6      # 64, 128, 256, 512 and 512-step waits in 2000 steps


def test_a_probe_that_lands_brings_drafting_back():
    policy = SpecPolicy(4, 32)
    assert run(policy, reqs(1), 300, lambda s: 0) < 10
    assert run(policy, reqs(1), 600, lambda s: 3) > 500


def test_large_batches_need_more_accepted_drafts():
    """At batch 64 the bar is 2.43 accepted drafts per request a step: one accepted
    draft each does not pay, three do."""
    low, high = SpecPolicy(4, 64), SpecPolicy(4, 64)
    assert run(low, reqs(64), 300, lambda s: 1) < 30
    assert run(high, reqs(64), 300, lambda s: 3) == 300
