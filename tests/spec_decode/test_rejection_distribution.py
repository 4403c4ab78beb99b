"""The sampled distribution with speculation equals the target's (chi-square).

A tiny random Llama samples three tokens at temperature 0.9 with top_k=4, so every
sequence (t1, t2, t3) is one of at most 64 cells, whose exact probabilities come from
HF transformers' logits (the oracle). The prefill samples t1; a proposer then drafts
(d2, d3), each uniform over the target's top 4 at its position, so the verify step
accepts, rejects at the first or at the second draft in comparable shares, and t2,
t3 come from verify rows. 4,000 requests with their own seeds; cells expected below
5 are pooled. Threshold p < 1e-3: a correct sampler raises a false alarm with
probability 0.1% per seed, and this seed is fixed, so the outcome is reproducible.
The same test on a broken acceptance rule (drafts always accepted) must fail it,
which shows the test can see a wrong distribution.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chi2

from jaxllm import LLM, SamplingParams
from jaxllm.runner import step_output
from jaxllm.spec_decode.policy import SpecPolicy

PROMPT = [17, 42, 99, 5, 61]
TEMPERATURE, TOP_K, NUM = 0.9, 4, 4000
ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=32, max_num_batched_tokens=128,
              cpu_kv_cache_bytes=4 << 20, enforce_eager=True)


def target_probs(hf, prefix: list[int]) -> dict[int, float]:
    """The target's next-token distribution after temperature and top-k (vLLM's order)."""
    with torch.no_grad():
        logits = hf(torch.tensor([prefix])).logits[0, -1].double() / TEMPERATURE
    top = torch.topk(logits, TOP_K)
    p = torch.softmax(top.values, 0)
    return dict(zip(top.indices.tolist(), p.tolist()))


def exact_joint(hf) -> dict[tuple, float]:
    joint = {}
    for a, pa in target_probs(hf, PROMPT).items():
        for b, pb in target_probs(hf, PROMPT + [a]).items():
            for c, pc in target_probs(hf, PROMPT + [a, b]).items():
                joint[(a, b, c)] = pa * pb * pc
    return joint


class UniformTopK:
    """Drafts d2, d3 uniform over the target's top-k at their positions (from the
    oracle's tables), never looking at what the target will sample."""
    num_lookahead_tokens = 0

    def __init__(self, hf):
        self.hf, self.tables, self.rng = hf, {}, np.random.default_rng(0)

    def _top(self, prefix):
        key = tuple(prefix)
        if key not in self.tables:
            self.tables[key] = sorted(target_probs(self.hf, list(prefix)))
        return self.tables[key]

    def propose(self, requests, max_drafts, block_tables):
        out = []
        for r in requests:
            tokens = list(r.all_token_ids)
            if len(tokens) != len(PROMPT) + 1:
                out.append([])
                continue
            d2 = int(self.rng.choice(self._top(tokens)))
            d3 = int(self.rng.choice(self._top(tokens + [d2])))
            out.append([d2, d3])
        return out

    def finish(self, request_ids):
        pass


def sample_counts(llm) -> dict[tuple, int]:
    # max_tokens=4: both drafts fit (t1 and the step's own token besides them); t4 is
    # not counted.
    params = [SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, max_tokens=4,
                             ignore_eos=True, seed=i) for i in range(NUM)]
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * NUM, params, use_tqdm=False)
    counts: dict[tuple, int] = {}
    for o in outs:
        key = tuple(o.outputs[0].token_ids[:3])
        counts[key] = counts.get(key, 0) + 1
    return counts


def chi_square_p(counts: dict, joint: dict) -> float:
    """p-value of the counts against the exact joint, cells expected < 5 pooled (a
    sequence outside the support lands in the pool, with its expectation of 0)."""
    n = sum(counts.values())
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for cell, p in joint.items():
        if n * p >= 5:
            obs.append(counts.get(cell, 0))
            exp.append(n * p)
        else:
            pool_o += counts.get(cell, 0)
            pool_e += n * p
    pool_o += sum(v for k, v in counts.items() if k not in joint)
    obs.append(pool_o)
    exp.append(max(pool_e, 1e-9))
    obs, exp = np.array(obs, float), np.array(exp)
    stat = float(((obs - exp) ** 2 / exp).sum())
    return float(chi2.sf(stat, len(obs) - 1))


@pytest.fixture(scope="module")
def setup(tiny_model):
    folder, hf = tiny_model("llama")
    llm = LLM(folder, **ENGINE, speculative_config={
        "method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 32})
    llm.llm_engine.executor.proposer = UniformTopK(hf)
    # Every request drafts (the test is about the sampler, not when drafting pays).
    llm.llm_engine.engine_core.spec_policy = SpecPolicy(2, 1 << 30, cost=lambda batch: 1.0)
    return llm, exact_joint(hf)


def test_speculative_sampling_matches_target_distribution(setup):
    llm, joint = setup
    counts = sample_counts(llm)
    stats = llm.llm_engine.engine_core.spec_stats
    per_pos = stats.num_accepted_tokens_per_pos
    # Drafts were verified, and both accepted and rejected at each position.
    assert stats.num_draft_tokens > NUM and 0 < per_pos[1] < per_pos[0] < stats.num_drafts
    assert chi_square_p(counts, joint) > 1e-3


def test_the_check_sees_a_wrong_acceptance_rule(setup, monkeypatch):
    llm, joint = setup
    correct = step_output.accept_drafts

    def accept_all(row_results, rows, spec):
        """Broken on purpose: every draft taken, then the last row's sample."""
        results = correct(row_results, rows, spec)
        for rid, (first, drafts) in spec.items():
            results[rid] = ([step_output.SampleResult(d, 0.0, 1) for d in drafts]
                            + [row_results[first + len(drafts)]])
        return results

    monkeypatch.setattr(step_output, "accept_drafts", accept_all)
    assert chi_square_p(sample_counts(llm), joint) < 1e-6
