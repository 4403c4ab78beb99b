"""The sort-free top-k / top-p (the radix search, and the block path for small top_k)
keeps exactly the tokens its sort-based twin keeps, so the sampled distribution is
unchanged (same kept set, same renormalisation, same Gumbel draw)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_lowering import lower_for_cuda

from jaxllm.runner import sampler, sampling_rows
from jaxllm.runner.top_k_top_p import (MAX_SMALL_TOP_K, apply_small_top_k_top_p,
                                       apply_top_k_top_p, ref_apply_top_k_top_p)
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
    md, flags = sampling_rows.from_params(params, [0] * rows, None, None, rows, vocab)
    assert flags.use_top_k_top_p_min_p
    md = dataclasses.replace(md, **{f.name: jnp.asarray(getattr(md, f.name))
                                    for f in dataclasses.fields(md)})
    fast = np.asarray(sampler.sample(logits, md, flags).token_ids)
    monkeypatch.setattr(sampler, "apply_top_k_top_p", ref_apply_top_k_top_p)
    slow = np.asarray(sampler.sample(logits, md, flags).token_ids)
    np.testing.assert_array_equal(fast, slow)


def _small_case(seed, rows, vocab, bf16):
    """Rows that fit the block path (top_k in [1, G], or top_k and top_p off), each of
    one kind, the kinds rotated by seed so that a one-row batch meets them too."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(rows, vocab)).astype(np.float32) * rng.uniform(0.5, 8, (rows, 1))
    top_k = rng.integers(1, MAX_SMALL_TOP_K + 1, rows).astype(np.int32)
    top_p = rng.uniform(0.02, 1.0, rows).astype(np.float32)
    for i in range(rows):
        kind = (i + seed) % 8
        if kind == 1:                  # a grammar bitmask: few tokens allowed
            logits[i, rng.random(vocab) < 0.9] = -np.inf
        elif kind == 2:                # fewer allowed tokens than top_k
            logits[i, rng.permutation(vocab)[5:]] = -np.inf
            top_k[i] = MAX_SMALL_TOP_K
        elif kind == 3:                # the k-th largest tied with many: the floor group
            logits[i] = rng.normal(size=vocab) * 0.1 - 5
            logits[i, rng.permutation(vocab)[:300]] = 2.0
            logits[i, rng.permutation(vocab)[:20]] = rng.uniform(2.5, 4, 20)
            top_k[i] = 50
        elif kind == 4:                # one value everywhere, -0.0 alike
            logits[i] = 0.0
            logits[i, ::2] = -0.0
        elif kind == 5:                # both filters off (min-p only, or padding)
            top_k[i], top_p[i] = 0, 1.0
            logits[i, :7] = -200.0     # probability 0 in f32: the twin drops them
        elif kind == 6:
            top_p[i] = rng.choice([1.0, 1e-7])
        elif kind == 7:                # the k-th largest tied with more than G, above
            logits[i, 64:264] = logits[i].max() + 1      # the floor, in a few blocks
            top_k[i] = 10
    if bf16:        # bf16 logits: many exact ties, also at the thresholds
        logits = np.array(jnp.asarray(logits).astype(jnp.bfloat16).astype(jnp.float32))
    return jnp.asarray(logits), jnp.asarray(top_k), jnp.asarray(top_p)


def _assert_same_kept_set(got, want):
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_array_equal(got[np.isfinite(got)], want[np.isfinite(want)])


@pytest.mark.parametrize("rows", [1, 8, 64])
@pytest.mark.parametrize("vocab", [20_000, 300])      # 300: fewer blocks than G + 1
@pytest.mark.parametrize("seed,bf16", [(0, False), (1, True), (2, False), (3, True)])
def test_small_top_k_same_kept_set_as_the_sort(rows, vocab, seed, bf16):
    logits, top_k, top_p = _small_case(seed, rows, vocab, bf16)
    got = jax.jit(apply_small_top_k_top_p)(logits, top_k, top_p)
    _assert_same_kept_set(got, ref_apply_top_k_top_p(logits, top_k, top_p))


@pytest.mark.parametrize("top_p", [1.0, 0.5, 0.1, 0.01])
def test_small_top_k_cut_at_and_above_the_floor_group(top_p):
    """Top 20 distinct, then 300 tokens tied at 2.0 spread over all blocks: with
    top_k 50 the k-th largest is the floor; p decides whether the group stays."""
    logits, _, _ = _small_case(3, 1, 20_000, False)
    got = np.asarray(apply_small_top_k_top_p(logits, jnp.array([50]), jnp.array([top_p])))
    want = np.asarray(ref_apply_top_k_top_p(logits, jnp.array([50]), jnp.array([top_p])))
    _assert_same_kept_set(got, want)
    assert (np.isfinite(got).sum() == 320) == (top_p >= 0.5)   # the group holds ~80%


def test_flags_take_the_block_path_only_where_it_is_exact():
    def small(*params):
        _, flags = sampling_rows.from_params(
            list(params), [0] * len(params), None, None, 8, 1000)
        return flags.small_top_k
    p = SamplingParams
    assert small(p(temperature=0.8, top_k=50, top_p=0.95), p(temperature=0))
    assert small(p(top_k=MAX_SMALL_TOP_K), p(min_p=0.1))
    assert not small(p(top_k=MAX_SMALL_TOP_K + 1))
    assert not small(p(top_k=50), p(top_p=0.9))         # top-p alone: the whole row
    assert not small(p(temperature=0.8))                 # no filters: no filter variant


@pytest.mark.parametrize("top_k", [50, MAX_SMALL_TOP_K + 6])
def test_sampled_tokens_equal_on_either_path(monkeypatch, top_k):
    """Seeded draws at vocab 128,256 through `sample`, bf16 values: the same tokens as
    with the twin, on the block path and (top_k past it) the radix search."""
    rng = np.random.default_rng(4)
    rows, vocab = 8, 128_256
    logits = jnp.asarray(rng.normal(size=(rows, vocab)) * 4, jnp.bfloat16).astype(jnp.float32)
    params = [SamplingParams(temperature=0.8, top_p=0.95, top_k=top_k, seed=i) for i in range(6)]
    params += [SamplingParams(temperature=0.0), SamplingParams(temperature=1.2, min_p=0.05, seed=7)]
    md, flags = sampling_rows.from_params(params, [0] * rows, None, None, rows, vocab)
    assert flags.small_top_k == (top_k <= MAX_SMALL_TOP_K)
    md = jax.device_put(md)
    fast = np.asarray(sampler.sample(logits, md, flags).token_ids)
    monkeypatch.setattr(sampler, "apply_top_k_top_p", ref_apply_top_k_top_p)
    monkeypatch.setattr(sampler, "apply_small_top_k_top_p", ref_apply_top_k_top_p)
    np.testing.assert_array_equal(fast, np.asarray(sampler.sample(logits, md, flags).token_ids))


@pytest.mark.parametrize("rows", [8, 64])
def test_block_path_lowers_for_cuda_without_a_vocabulary_sort(rows):
    """The sampler program of the block path lowers for an H200; its selections run
    on the block maxima (V / BLOCK per row) and the G kept blocks, never on all V."""
    vocab = 128_256
    params = [SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=1)] * rows
    md, flags = sampling_rows.from_params(params, [0] * rows, None, None, rows, vocab)
    assert flags.small_top_k
    text = lower_for_cuda(lambda x, m: sampler.sample(x, m, flags).token_ids,
                          jax.ShapeDtypeStruct((rows, vocab), jnp.float32),
                          jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), md))
    selections = [line for line in text.splitlines()
                  if "chlo.top_k" in line or "stablehlo.sort" in line]
    assert len(selections) == 2, selections
    assert not any(f"{rows}x{vocab}x" in line for line in selections), selections
