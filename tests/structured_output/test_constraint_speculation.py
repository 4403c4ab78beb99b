"""How a step's constrained rows reach the masks and the matchers. Constrained
requests in the same steps as requests that verify drafts: a
verifying request takes one sampler row per draft, so the rows after it move: the
constrained rows' masks must land on their new rows, or the constrained outputs break
their regex and the unconstrained ones change. And the parallel consume of a step's
tokens (accept_tokens) against one by one."""
from __future__ import annotations

import re

import numpy as np
from structured_helpers import TINY_ENGINE, constrained

from jaxllm import LLM, SamplingParams


class Oracle:
    """Drafts each request's known greedy continuation."""
    num_lookahead_tokens = 0

    def __init__(self, truth: dict):
        self.truth = truth

    def propose(self, requests, max_drafts, block_tables):
        return [list(self.truth[tuple(r.prompt_token_ids)][r.num_tokens:r.num_tokens + k])
                for r, k in zip(requests, max_drafts)]

    def finish(self, request_ids):
        pass


def test_masks_follow_rows_moved_by_drafts(tiny_folder, tiny_llm):
    vocab = tiny_llm.llm_engine.arch.vocab_size
    rng = np.random.default_rng(3)
    phrases = [rng.integers(0, vocab, 5).tolist() for _ in range(4)]
    repeated = [p * 5 for p in phrases]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in tiny_llm.generate(
        [{"prompt_token_ids": p} for p in repeated], greedy, use_tqdm=False)]

    llm = LLM(tiny_folder, **TINY_ENGINE,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    # Drafts that are always right, so the policy keeps drafting for the whole run.
    truth = {tuple(p): p + a for p, a in zip(repeated, alone)}
    llm.llm_engine.executor.proposer = Oracle(truth)
    core = llm.llm_engine.engine_core
    regex = r"[0-9]{12}"
    llm.generate("digits", constrained(max_tokens=2, regex=regex), use_tqdm=False)  # compiled
    moved = []
    start_masks = core._start_masks

    def recording(so, handle, rows):
        moved.append(len(handle.scheduled) != len(so.scheduled))
        return start_masks(so, handle, rows)
    core._start_masks = recording
    # Verifying requests first in the batch: every constrained row after them moves.
    prompts = [{"prompt_token_ids": p} for p in repeated] + ["digits"] * 4
    params = [greedy] * 4 + [constrained(seed=s, max_tokens=16, regex=regex)
                             for s in range(4)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert any(moved), "no step had drafts and constrained rows together"
    assert core.spec_stats.num_drafts > 0
    assert [o.outputs[0].token_ids for o in outs[:4]] == alone
    for o in outs[4:]:
        assert o.outputs[0].finish_reason == "stop"
        assert re.fullmatch(regex, o.outputs[0].text), o.outputs[0].text


def test_parallel_consume_gives_the_same_outputs(tiny_llm, monkeypatch):
    """The engine's accept_tokens (one llguidance call for a step's rows, from 128 rows
    by default; here from 2) leaves every constrained output as consuming one by one
    does: same tokens for the same seeds, each output complete."""
    from jaxllm.structured_output import manager as manager_module
    som = tiny_llm.llm_engine.engine_core.structured_output_manager
    regex = r"[0-9]{2}-[a-z]{3}"
    params = [constrained(seed=s, max_tokens=12, regex=regex) for s in range(6)]
    one_by_one = [o.outputs[0].token_ids for o in tiny_llm.generate(
        ["code"] * 6, params, use_tqdm=False)]
    calls = []
    consume = som._mask_filler().consume
    monkeypatch.setattr(manager_module, "PARALLEL_ACCEPT_ROWS", 2)
    monkeypatch.setattr(som._mask_filler(), "consume",
                        lambda pairs: calls.append(len(pairs)) or consume(pairs))
    outs = tiny_llm.generate(["code"] * 6, params, use_tqdm=False)
    assert calls and max(calls) == 6
    assert [o.outputs[0].token_ids for o in outs] == one_by_one
    for o in outs:
        assert o.outputs[0].finish_reason == "stop"
        assert re.fullmatch(regex, o.outputs[0].text), o.outputs[0].text
