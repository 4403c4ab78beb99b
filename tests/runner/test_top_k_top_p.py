"""The sort-free top-k / top-p keeps exactly the tokens its sort-based twin keeps, so
the sampled distribution is unchanged (same kept set, same renormalisation, same
Gumbel draw)."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.runner import sampler
from jaxllm.runner.top_k_top_p import apply_top_k_top_p, ref_apply_top_k_top_p
from jaxllm.sampling_params import SamplingParams


def _case(seed, rows=64, vocab=3000, bf16=False):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(rows, vocab)).astype(np.float32) * rng.uniform(0.5, 8)
    if bf16:        # bf16 logits: many exact ties, also at the thresholds
        logits = np.array(jnp.asarray(logits).astype(jnp.bfloat16).astype(jnp.float32))
    logits[0, :5] = -np.inf           # tokens masked before (min-p, a grammar)
    logits[1, :] = 0.0                # one value everywhere (and -0.0 alike)
    logits[1, ::2] = -0.0
    top_k = rng.integers(0, 100, rows).astype(np.int32)
    top_k[::3] = 0
    top_k[2] = vocab + 7
    top_p = rng.uniform(0.02, 1.0, rows).astype(np.float32)
    top_p[::4] = 1.0
    top_p[3] = 1e-7
    return jnp.asarray(logits), jnp.asarray(top_k), jnp.asarray(top_p)


@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("seed,bf16", [(0, False), (1, True), (2, True)])
def test_same_kept_set_as_the_sort(seed, bf16, bits):
    logits, top_k, top_p = _case(seed, bf16=bf16)
    got = np.asarray(apply_top_k_top_p(logits, top_k, top_p, bits))
    want = np.asarray(ref_apply_top_k_top_p(logits, top_k, top_p))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_array_equal(got[np.isfinite(got)], want[np.isfinite(want)])
    assert np.isfinite(got[3]).sum() >= 1          # a tiny p keeps the argmax
    assert np.isfinite(got[1]).all() or top_k[1] or top_p[1] < 1


def test_sampled_tokens_equal_at_a_large_vocabulary(monkeypatch):
    """Seeded draws at vocab 128,256 through `sample`: the same tokens either way."""
    rng = np.random.default_rng(3)
    rows, vocab = 8, 128_256
    logits = jnp.asarray(rng.normal(size=(rows, vocab)).astype(np.float32) * 4)
    params = [SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=i) for i in range(4)]
    params += [SamplingParams(temperature=1.0, top_p=0.5, seed=9),
               SamplingParams(temperature=0.7, top_k=3, seed=10),
               SamplingParams(temperature=0.0), SamplingParams(temperature=1.2, seed=11)]
    md, flags = sampler.SamplingMetadata.from_params(params, [0] * rows, None, None, rows, vocab)
    assert flags.use_top_k_top_p_min_p
    md = dataclasses.replace(md, **{f.name: jnp.asarray(getattr(md, f.name))
                                    for f in dataclasses.fields(md)})
    fast = np.asarray(sampler.sample(logits, md, flags).token_ids)
    monkeypatch.setattr(sampler, "apply_top_k_top_p", ref_apply_top_k_top_p)
    slow = np.asarray(sampler.sample(logits, md, flags).token_ids)
    np.testing.assert_array_equal(fast, slow)
