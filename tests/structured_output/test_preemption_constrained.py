"""Constrained requests preempted (a KV pool of a few blocks: recompute and swap, and
recompute under chunked prefill with prefix caching) keep their grammar state: every
output's tokens replay through a fresh matcher, every finished one meets its
constraint, and each is the very output of an engine that never preempts."""
from __future__ import annotations

import numpy as np
import pytest
from constraint_cases import grammar_regex, mixed_constrained
from structured_helpers import TINY_ENGINE, meets, replay, token_prompts

from jaxllm import LLM

SHARED_PREFIX = np.random.default_rng(0).integers(2, 303, 40).tolist()
# Every request fits in 160 tokens (80 of prompt, 60 generated): 10 blocks of 16.
ENGINE = {**TINY_ENGINE, "max_model_len": 160}
VARIANTS = {
    "recompute": dict(num_gpu_blocks_override=12, preemption_mode="recompute"),
    "swap": dict(num_gpu_blocks_override=12, preemption_mode="swap", swap_space=0.01),
    "chunked-prefix-cache": dict(num_gpu_blocks_override=14, preemption_mode="recompute",
                                 max_num_batched_tokens=32, enable_prefix_caching=True),
}


@pytest.fixture(scope="module")
def workload():
    params = mixed_constrained(24, seed=90, max_tokens=60)
    prompts = token_prompts(12, seed=5, max_len=80) + token_prompts(
        12, seed=6, max_len=40, prefix=SHARED_PREFIX)
    return prompts, params


@pytest.fixture(scope="module")
def unpreempted(tiny_folder, workload):
    prompts, params = workload
    llm = LLM(tiny_folder, **ENGINE)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.get_stats().num_preemptions_total == 0
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_preempted_constrained_outputs(tiny_folder, workload, unpreempted, variant):
    prompts, params = workload
    llm = LLM(tiny_folder, **{**ENGINE, **VARIANTS[variant]})
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions_total > 0
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0
    finished = 0
    for p, o in zip(params, outs):
        out = o.outputs[0]
        accepted, complete = replay(llm, p.structured_outputs, out.token_ids)
        assert accepted, (p.structured_outputs, out.text)
        if out.finish_reason == "stop":
            assert complete
            meets(p.structured_outputs, out.text, grammar_regex(p))
            finished += 1
    assert finished >= 0.8 * len(outs)
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs] == unpreempted
