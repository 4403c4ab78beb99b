"""Benchmark request lengths: vLLM's random rule and BENCHMARKS.md's sharegpt-like."""
import numpy as np

from jaxllm.benchmarks.datasets import sample_requests, sharegpt_like_lengths


def test_random_lengths_stay_in_the_range_ratio_and_vocab():
    reqs = sample_requests("random", 200, 100, 20, 0.25, vocab_size=50, seed=3)
    inp = [len(r.prompt_token_ids) for r in reqs]
    out = [r.output_len for r in reqs]
    assert min(inp) >= 75 and max(inp) <= 125 and len(set(inp)) > 10
    assert min(out) >= 15 and max(out) <= 25
    assert all(0 <= t < 50 for r in reqs for t in r.prompt_token_ids)
    fixed = sample_requests("random", 5, 16, 4, 0.0, vocab_size=50)
    assert {len(r.prompt_token_ids) for r in fixed} == {16} and {r.output_len for r in fixed} == {4}
    assert sample_requests("random", 5, 16, 4, 0.0, 50, seed=1) != \
        sample_requests("random", 5, 16, 4, 0.0, 50, seed=2)


def test_sharegpt_like_is_the_benchmarks_md_generator():
    inp, out = sharegpt_like_lengths(1000)
    rng = np.random.default_rng(0)
    assert (inp == np.clip(np.round(rng.lognormal(4.8, 1.0, 1000)), 4, 1024)).all()
    assert (out == np.clip(np.round(rng.lognormal(4.75, 0.95, 1000)), 4, 1024)).all()
    assert 150 < inp.mean() < 250 and 130 < out.mean() < 230
    reqs = sample_requests("sharegpt-like", 1000, 1, 1, 0.0, vocab_size=100)
    assert [len(r.prompt_token_ids) for r in reqs] == inp.tolist()
