"""Speculative decoding on the default model (SmolLM2-135M-Instruct, real weights):
n-gram drafts on code-editing prompts, where they land, give greedy output identical
to speculation off."""
from __future__ import annotations

from jaxllm import LLM, SamplingParams

ENGINE = dict(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=256, enforce_eager=True)
CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    return subtotal * (1 + tax_rate)
'''
MESSAGES = [
    [{"role": "user", "content": f"Rename `subtotal` to `net` in this function:\n{CODE}"}],
    [{"role": "user", "content": f"Add type hints to this function:\n{CODE}"}],
]


def test_ngram_greedy_identical_on_the_default_model():
    params = SamplingParams(temperature=0, max_tokens=48)
    plain = LLM(**ENGINE)
    want = [o.outputs[0].token_ids for o in plain.chat(MESSAGES, params, use_tqdm=False)]
    del plain
    llm = LLM(**ENGINE, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                            "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    got = [o.outputs[0].token_ids for o in llm.chat(MESSAGES, params, use_tqdm=False)]
    assert got == want
    stats = llm.llm_engine.engine_core.spec_stats
    assert stats.num_accepted_tokens > 0       # the code in the prompt is drafted from
