"""LLM(scheduling_policy="priority") and LLM.generate(..., priority=[...]) as vLLM's:
with one sequence at a time, prompts run in priority order (lower first)."""
from __future__ import annotations

import pytest

from jaxllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model):
    folder, _ = tiny_model("llama")
    return LLM(folder, enforce_eager=True, dtype="float32", max_model_len=128, max_num_seqs=1,
               max_num_batched_tokens=64, cpu_kv_cache_bytes=4 << 20,
               scheduling_policy="priority")


def test_prompts_run_in_priority_order(llm):
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12], [13], [14, 15]]
    priority = [3, 0, 2, -1, 0]     # the two 0s: in input (arrival) order
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                        priority=priority)
    assert [o.prompt_token_ids for o in outs] == prompts      # results in input order
    started = sorted(range(len(outs)), key=lambda i: outs[i].metrics.first_scheduled_time)
    assert started == [3, 1, 4, 2, 0]
    assert all(len(o.outputs[0].token_ids) == 3 for o in outs)


def test_one_priority_per_prompt(llm):
    with pytest.raises(ValueError, match="2 prompts but 1 priorities"):
        llm.generate(["a", "b"], GREEDY, use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="priority must be an int"):
        llm.generate(["a"], GREEDY, use_tqdm=False, priority=["high"])
    assert not llm.llm_engine.has_unfinished_requests()
