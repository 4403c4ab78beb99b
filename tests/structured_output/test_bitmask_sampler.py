"""The sampler's grammar bitmask: apply_token_bitmask against llguidance's numpy
reference, and `sample` with use_bitmask never picking a masked token.

Legend: S rows, V vocab, W = ceil(V / 32) mask words; bit v of row s set: v allowed.
"""
from __future__ import annotations

import dataclasses

import jax
import llguidance.numpy
import numpy as np
import pytest

from jaxllm.runner import sampling_rows
from jaxllm.runner.sampler import SamplerFlags, apply_token_bitmask, sample
from jaxllm.sampling_params import MAX_LOGPROBS, SamplingParams

sample_jit = jax.jit(sample, static_argnums=2)


def random_bitmask(rng: np.random.Generator, s: int, v: int, density: float) -> np.ndarray:
    """i32[S, W]: each token allowed with probability `density`; bits past V random
    too (they must be ignored). Row 0 allows everything, row 1 nothing when S > 2."""
    w = -(-v // 32)
    bits = rng.random((s, w * 32)) < density
    if s > 2:
        bits[0], bits[1] = True, False
    return pack(bits)


def pack(bits: np.ndarray) -> np.ndarray:
    """bool[S, W*32] -> i32[S, W], little-endian bits in each word."""
    s, n = bits.shape
    words = (bits.reshape(s, n // 32, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64))
    return words.sum(-1).astype(np.uint32).view(np.int32)


def allowed_of(bitmask: np.ndarray, v: int) -> np.ndarray:
    """bool[S, V] from i32[S, W], bit by bit (no shifts shared with the code under test)."""
    u = bitmask.view(np.uint32)
    return np.array([[(int(u[s, t // 32]) >> (t % 32)) & 1 == 1 for t in range(v)]
                     for s in range(u.shape[0])])


@pytest.mark.parametrize("s,v", [(1, 32), (3, 33), (4, 311), (5, 64), (2, 1000), (8, 4097)])
@pytest.mark.parametrize("density", [0.02, 0.5, 0.97])
def test_apply_token_bitmask_matches_llguidance(s, v, density):
    rng = np.random.default_rng(s * 1000 + v)
    logits = rng.normal(0, 3, (s, v)).astype(np.float32)
    bitmask = random_bitmask(rng, s, v, density)
    want = logits.copy()
    llguidance.numpy.apply_token_bitmask_inplace(want, bitmask)
    got = np.asarray(jax.jit(apply_token_bitmask)(logits, bitmask))
    np.testing.assert_array_equal(got, want)
    allowed = allowed_of(bitmask, v)
    np.testing.assert_array_equal(np.isfinite(got), allowed)      # the reference agrees too
    np.testing.assert_array_equal(got[allowed], logits[allowed])   # kept logits untouched
    if s > 2:
        assert np.isfinite(got[0]).all() and np.isneginf(got[1]).all()


def test_pack_matches_llguidance_layout():
    """The test's own packing is llguidance's: a matcher allowing only token t sets
    exactly bit t (checked through llguidance's reference, not the code under test)."""
    v = 70
    for t in (0, 31, 32, 63, 69):
        bits = np.zeros((1, 96), bool)
        bits[0, t] = True
        logits = np.zeros((1, v), np.float32)
        llguidance.numpy.apply_token_bitmask_inplace(logits, pack(bits))
        assert np.flatnonzero(np.isfinite(logits[0])).tolist() == [t]


def build(params, v, rows, output_index=0):
    md, flags = sampling_rows.from_params(
        params, [output_index] * len(params), [[] for _ in params], [[] for _ in params],
        rows, v)
    return md, dataclasses.replace(flags, use_bitmask=True)


def adversarial_case(seed: int, s: int, v: int):
    """Logits whose masked tokens are the most likely by far, and a sparse mask with at
    least one allowed token per row: a sampler ignoring the mask picks a masked one."""
    rng = np.random.default_rng(seed)
    bits = rng.random((s, -(-v // 32) * 32)) < 0.1
    bits[np.arange(s), rng.integers(0, v, s)] = True
    allowed = bits[:, :v]
    logits = rng.normal(0, 1, (s, v)).astype(np.float32)
    logits[~allowed] += 8.0
    return logits, pack(bits), allowed


SAMPLERS = {
    "greedy": SamplingParams(temperature=0.0),
    "random": SamplingParams(temperature=1.0),
    "hot": SamplingParams(temperature=3.0),
    "filters": SamplingParams(temperature=1.0, top_k=5, top_p=0.9, min_p=0.01),
    "penalties": SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=1.0),
    "logprobs": SamplingParams(temperature=1.0, logprobs=5),
}


@pytest.mark.parametrize("kind", list(SAMPLERS))
@pytest.mark.parametrize("v", [311, 320])
def test_sample_never_picks_a_masked_token(kind, v):
    s = 8
    params = [dataclasses.replace(SAMPLERS[kind], seed=1000 + i) for i in range(s)]
    for trial in range(6):
        logits, bitmask, allowed = adversarial_case(trial * 7 + v, s, v)
        md, flags = build(params, v, s, output_index=trial)
        out = jax.tree.map(np.asarray, sample_jit(logits, md, flags, bitmask))
        assert allowed[np.arange(s), out.token_ids].all(), (trial, out.token_ids)
        if kind == "logprobs":    # (the others ask for none: the sampler makes none)
            assert np.isfinite(out.logprobs).all()
        if kind == "greedy":
            want = np.where(allowed, logits, -np.inf).argmax(-1)
            np.testing.assert_array_equal(out.token_ids, want)


def test_random_draws_cover_the_allowed_tokens_only():
    """Many draws of one row spread over its allowed tokens and nothing else."""
    v, s = 100, 16
    bits = np.zeros((s, 128), bool)
    bits[:, [3, 40, 77, 99]] = True
    logits = np.zeros((s, v), np.float32)
    logits[:, 50] = 20.0                           # masked, and overwhelmingly likely
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(s)]
    seen = set()
    for step in range(8):
        md, flags = build(params, v, s, output_index=step)
        seen |= set(np.asarray(sample_jit(logits, md, flags, pack(bits)).token_ids).tolist())
    assert seen == {3, 40, 77, 99}


def test_logprobs_are_the_masked_distributions():
    v, s = 311, 4
    logits, bitmask, allowed = adversarial_case(5, s, v)
    params = [SamplingParams(temperature=1.0, seed=i, logprobs=MAX_LOGPROBS) for i in range(s)]
    md, flags = build(params, v, s)
    out = jax.tree.map(np.asarray, sample_jit(logits, md, flags, bitmask))
    masked = np.where(allowed, logits, -np.inf)
    ref = masked - masked.max(-1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
    rows = np.arange(s)
    np.testing.assert_allclose(out.logprobs, ref[rows, out.token_ids], rtol=1e-5, atol=1e-5)
    for i in range(s):
        top = out.top_logprob_ids[i]
        finite = np.isfinite(out.top_logprobs[i])
        assert allowed[i, top[finite]].all()
        # Every allowed token is in the top list before any -inf entry.
        assert finite.sum() == min(allowed[i].sum(), MAX_LOGPROBS)
        np.testing.assert_allclose(out.top_logprobs[i][finite], ref[i, top[finite]], atol=1e-5)
        assert out.sampled_rank[i] <= allowed[i].sum()


def test_all_ones_bitmask_changes_nothing():
    """An unconstrained row in a constrained batch samples exactly as without a mask."""
    v, s = 311, 8
    logits = np.random.default_rng(0).normal(0, 2, (s, v)).astype(np.float32)
    params = [SamplingParams(temperature=t, seed=i, logprobs=3)
              for i, t in enumerate([0.0, 1.0, 0.7, 1.3] * 2)]
    md, flags = sampling_rows.from_params(params, [2] * s, [[]] * s, [[]] * s, s, v)
    plain = jax.tree.map(np.asarray, sample_jit(logits, md, flags))
    ones = np.full((s, -(-v // 32)), -1, np.int32)
    masked = jax.tree.map(np.asarray, sample_jit(
        logits, md, dataclasses.replace(flags, use_bitmask=True), ones))
    for a, b in zip(plain, masked):
        np.testing.assert_array_equal(a, b)
    assert isinstance(flags, SamplerFlags) and not flags.use_bitmask
