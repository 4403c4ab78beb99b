"""Sampler vs numpy references of vLLM's semantics, on fixed logits.

Legend: S rows, V vocab, K top logprobs, N draws.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.outputs import make_logprobs_entry
from jaxllm.runner import sampling_rows
from jaxllm.runner.sampler import (
    SamplerFlags,
    apply_min_p,
    apply_penalties,
    apply_small_top_k_top_p,
    apply_top_k_top_p,
    sample,
)
from jaxllm.sampling_params import MAX_LOGPROBS, SamplingParams

V = 32
sample_jit = jax.jit(sample, static_argnums=2)


def _logits(rows: int, seed: int = 0, vocab: int = V) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 2.0, (rows, vocab)).astype(np.float32)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _build(params, rows=None, output_indices=None, prompts=None, outputs=None, **kw):
    """from_params with defaults; small batches pad to 8 rows to share compiles."""
    n = len(params)
    return sampling_rows.from_params(
        params,
        output_indices if output_indices is not None else [0] * n,
        prompts if prompts is not None else [[] for _ in params],
        outputs if outputs is not None else [[] for _ in params],
        rows or max(n, 8), V, **kw)


def _sample(logits, md, flags):
    """sample() on logits f32[N, V] padded with zero rows to md's S rows; -> numpy [N]."""
    n, rows = logits.shape[0], md.temperature.shape[0]
    padded = jnp.concatenate([jnp.asarray(logits), jnp.zeros((rows - n, V), logits.dtype)])
    return jax.tree.map(lambda x: np.asarray(x)[:n], sample_jit(padded, md, flags))


# ---- numpy references (vLLM's algorithms written row by row) ----


def ref_top_k_top_p(logits, top_k, top_p):
    out = logits.copy()
    for i, row in enumerate(logits):
        order = np.argsort(row, kind="stable")
        srt = row[order]
        mask = np.zeros(V, bool)
        if top_k[i] > 0:
            mask = srt < srt[V - top_k[i]]
        cum = np.cumsum(_softmax(np.where(mask, -np.inf, srt)))
        pmask = cum <= 1 - top_p[i]
        pmask[-1] = False
        out[i, order[mask | pmask]] = -np.inf
    return out


def ref_min_p(logits, min_p):
    probs = _softmax(logits)
    keep = probs >= min_p[:, None] * probs.max(-1, keepdims=True)
    return np.where(keep, logits, -np.inf)


def ref_penalties(logits, prompts, outputs, rep, freq, pres):
    out = logits.copy()
    for i in range(len(logits)):
        counts = np.bincount(np.asarray(outputs[i], int), minlength=V)
        seen = (counts > 0) | (np.bincount(np.asarray(prompts[i], int), minlength=V) > 0)
        row = out[i]
        row[seen] = np.where(row[seen] > 0, row[seen] / rep[i], row[seen] * rep[i])
        out[i] = row - freq[i] * counts - pres[i] * (counts > 0)
    return out


def _assert_same_support(got, want):
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], rtol=1e-5)


# ---- filters and penalties against the references ----


# Both paths: the radix search, and the block path (top_k <= 64, or both filters off).
BOTH_PATHS = [apply_top_k_top_p, apply_small_top_k_top_p]


@pytest.mark.parametrize("top_k_top_p", BOTH_PATHS)
def test_top_k_matches_reference(top_k_top_p):
    logits = _logits(6)
    top_k = np.array([0, 1, 2, 5, V, V + 10], np.int32)
    got = np.asarray(top_k_top_p(jnp.asarray(logits), jnp.asarray(top_k), jnp.ones(6)))
    _assert_same_support(got, ref_top_k_top_p(logits, np.minimum(top_k, V), np.ones(6)))
    assert list(np.isfinite(got).sum(-1)) == [V, 1, 2, 5, V, V]


def test_top_p_matches_reference():
    logits = _logits(5, seed=1)
    top_p = np.array([1.0, 0.9, 0.5, 0.1, 1e-6], np.float32)
    got = np.asarray(apply_top_k_top_p(jnp.asarray(logits), jnp.zeros(5, jnp.int32),
                                       jnp.asarray(top_p)))
    _assert_same_support(got, ref_top_k_top_p(logits, np.zeros(5, int), top_p))
    assert np.isfinite(got[-1]).sum() == 1  # tiny p still keeps the argmax


@pytest.mark.parametrize("top_k_top_p", BOTH_PATHS)
def test_top_k_and_top_p_combined_renormalize_over_top_k(top_k_top_p):
    logits = _logits(4, seed=2)
    top_k, top_p = np.array([3, 8, 1, 16]), np.array([0.7, 0.6, 0.5, 0.95], np.float32)
    got = top_k_top_p(jnp.asarray(logits), jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p))
    _assert_same_support(np.asarray(got), ref_top_k_top_p(logits, top_k, top_p))


def test_min_p_matches_reference():
    logits = _logits(4, seed=3)
    min_p = np.array([0.0, 0.05, 0.3, 1.0], np.float32)
    got = np.asarray(apply_min_p(jnp.asarray(logits), jnp.asarray(min_p)))
    _assert_same_support(got, ref_min_p(logits, min_p))
    assert np.isfinite(got[0]).all() and np.isfinite(got[3]).sum() == 1


@pytest.mark.parametrize("rep,freq,pres", [(1.3, 0.0, 0.0), (1.0, 0.7, 0.0), (1.0, 0.0, -1.5),
                                           (0.8, -0.4, 1.2)])
def test_penalties_match_reference(rep, freq, pres):
    prompts = [[1, 2, 2, 3], [5], [], [7, 8]]
    outputs = [[3, 3, 3, 9], [], [4, 4, 10], [8, 31, 0]]
    params = [SamplingParams(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)
              for _ in range(4)]
    md, flags = _build(params, rows=4, prompts=prompts, outputs=outputs)
    assert flags.use_penalties
    logits = _logits(4, seed=4)
    got = np.asarray(apply_penalties(jnp.asarray(logits), jax.device_put(md)))
    want = ref_penalties(logits, prompts, outputs, [rep] * 4, [freq] * 4, [pres] * 4)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_greedy_takes_argmax_of_penalized_logits():
    logits = np.zeros((1, V), np.float32)
    logits[0, 3], logits[0, 4] = 2.0, 1.5
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0)]
    md, flags = _build(params, outputs=[[3]])
    assert flags.all_greedy and flags.use_penalties
    assert int(_sample(logits, md, flags).token_ids[0]) == 4  # 2/2 < 1.5


# ---- sampling: allowed sets, distributions, greedy, seeds ----


def _draw(logits_row, params_kw, n_draws, flags_kw=None):
    """N draws of one logits row, one row per draw, seeds 0..N-1. -> i32[N]."""
    params = [SamplingParams(seed=i, **params_kw) for i in range(n_draws)]
    md, flags = _build(params)
    if flags_kw:
        flags = SamplerFlags(**{**flags.__dict__, **flags_kw})
    logits = jnp.broadcast_to(jnp.asarray(logits_row), (n_draws, V))
    return np.asarray(sample_jit(logits, md, flags).token_ids)


N_DRAWS = 16384


def _chi_square(counts, probs):
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token with probability 0"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()), int(keep.sum()) - 1


def _assert_distribution(tokens, probs):
    stat, dof = _chi_square(np.bincount(tokens, minlength=V), probs)
    # About the p = 1e-4 critical value; seeds are fixed, so the test is deterministic.
    assert stat < dof + 4 * np.sqrt(2 * dof), (stat, dof)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_distribution(temperature):
    row = _logits(1, seed=5)[0] / 2
    tokens = _draw(row, {"temperature": temperature}, N_DRAWS)
    _assert_distribution(tokens, _softmax(row / temperature))


@pytest.mark.parametrize("kw", [{"top_k": 4}, {"top_p": 0.6}, {"min_p": 0.2},
                                {"top_k": 10, "top_p": 0.8, "temperature": 0.7}])
def test_filtered_sampling_stays_in_allowed_set_with_right_distribution(kw):
    row = _logits(1, seed=6)[0]
    p = SamplingParams(**kw)
    want = row[None] / p.temperature
    want = ref_min_p(want, np.array([p.min_p]))
    want = ref_top_k_top_p(want, [p.top_k], [p.top_p])[0]
    tokens = _draw(row, kw, N_DRAWS)
    assert np.isfinite(want[tokens]).all()
    _assert_distribution(tokens, _softmax(want))


def test_greedy_rows_take_argmax_in_mixed_batch():
    logits = _logits(8, seed=7)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, top_k=3) for i in range(8)]
    md, flags = _build(params)
    assert not flags.all_greedy
    out = _sample(logits, md, flags).token_ids
    np.testing.assert_array_equal(out[1::2], logits.argmax(-1)[1::2])
    md, flags = _build([SamplingParams(temperature=0.0)] * 8)
    out = _sample(logits, md, flags).token_ids
    np.testing.assert_array_equal(out, logits.argmax(-1))


@pytest.mark.parametrize("output_index", [0, 1, 17])
def test_seeded_sampling_is_independent_of_batch_and_row(output_index):
    row = _logits(1, seed=8)[0] / 4  # flat-ish, so different keys give different tokens
    target = SamplingParams(seed=1234, temperature=1.0)
    md1, flags1 = _build([target], rows=1, output_indices=[output_index])
    alone = int(_sample(row[None], md1, flags1).token_ids[0])

    others = [SamplingParams(seed=s, top_k=5, repetition_penalty=1.2) for s in range(7)]
    params = others[:5] + [target] + others[5:]
    logits = _logits(8, seed=9)
    logits[5] = row
    md8, flags8 = _build(params, output_indices=[3] * 5 + [output_index] + [9, 9],
                         prompts=[[1, 2]] * 8, outputs=[[3]] * 8)
    assert flags8 != flags1
    assert int(sample_jit(jnp.asarray(logits), md8, flags8).token_ids[5]) == alone


def test_seed_and_output_index_both_change_the_draw():
    row = np.zeros(V, np.float32)  # uniform: any key difference shows up quickly
    draws = {}
    for seed, index in [(1, 0), (2, 0), (1, 1), (2**40 + 1, 0)]:
        md, flags = _build([SamplingParams(seed=seed)] * 4, output_indices=[index] * 4)
        draws[(seed, index)] = int(_sample(np.tile(row, (4, 1)), md, flags).token_ids[0])
    assert len(set(draws.values())) > 1
    # Seeds differing only in the high 32 bits are different seeds.
    md_a, f = _build([SamplingParams(seed=1)] * 8, output_indices=list(range(8)))
    md_b, _ = _build([SamplingParams(seed=2**40 + 1)] * 8, output_indices=list(range(8)))
    lg = np.zeros((8, V), np.float32)
    assert not np.array_equal(_sample(lg, md_a, f).token_ids, _sample(lg, md_b, f).token_ids)


# ---- logprobs ----


def test_logprobs_are_raw_log_softmax_and_top_k_sorted():
    logits = _logits(4, seed=10)
    params = [SamplingParams(temperature=0.5, seed=1, logprobs=5, repetition_penalty=1.5),
              SamplingParams(temperature=0.0, logprobs=0),
              SamplingParams(top_k=2, seed=3, logprobs=20),
              SamplingParams(seed=4)]
    md, flags = _build(params, prompts=[[0, 1, 2]] * 4, outputs=[[5]] * 4)
    assert flags.num_logprobs == MAX_LOGPROBS
    out = _sample(logits, md, flags)
    ref = _log_softmax(logits)
    rows = np.arange(4)
    np.testing.assert_allclose(out.logprobs, ref[rows, out.token_ids], rtol=1e-5, atol=1e-6)
    want_rank = (ref >= ref[rows, out.token_ids][:, None]).sum(-1)
    np.testing.assert_array_equal(out.sampled_rank, want_rank)
    assert out.top_logprob_ids.shape == (4, MAX_LOGPROBS) == out.top_logprobs.shape
    np.testing.assert_array_equal(out.top_logprob_ids, np.argsort(-ref, -1)[:, :MAX_LOGPROBS])
    np.testing.assert_allclose(out.top_logprobs, -np.sort(-ref, -1)[:, :MAX_LOGPROBS], rtol=1e-5)
    assert (np.diff(out.top_logprobs, axis=-1) <= 0).all()
    entry = make_logprobs_entry(out.token_ids[0], out.logprobs[0], out.sampled_rank[0],
                                out.top_logprob_ids[0], out.top_logprobs[0], 5)
    assert int(out.token_ids[0]) in entry and len(entry) in (5, 6)


def test_logprobs_0_still_computes_the_sampled_tokens():
    """logprobs=0 asks for the sampled token's logprob and rank only: the batch takes
    the logprobs variant (its top-K unused)."""
    logits = _logits(2, seed=3)
    md, flags = _build([SamplingParams(seed=1, logprobs=0), SamplingParams(seed=2)])
    assert flags.num_logprobs == MAX_LOGPROBS
    out = _sample(logits, md, flags)
    ref = _log_softmax(logits)
    np.testing.assert_allclose(out.logprobs, ref[np.arange(2), out.token_ids], rtol=1e-5,
                               atol=1e-6)
    assert (np.asarray(out.sampled_rank) >= 1).all()


def test_no_logprobs_computes_none():
    """No row asks for logprobs: the variant computes none (no outputs but the tokens)
    and its program has no log-softmax: the same tokens as the logprobs variant."""
    logits = _logits(3, seed=5)
    params = [SamplingParams(seed=s, temperature=0.7) for s in range(3)]
    md, flags = _build(params)
    assert flags.num_logprobs == 0
    out = _sample(logits, md, flags)
    assert out.logprobs is out.sampled_rank is out.top_logprobs is out.top_logprob_ids is None
    with_lp = _sample(logits, md, dataclasses.replace(flags, num_logprobs=MAX_LOGPROBS))
    np.testing.assert_array_equal(out.token_ids, with_lp.token_ids)
    greedy_md, greedy = _build([SamplingParams(temperature=0)] * 3)
    for f, has in ((greedy, False), (dataclasses.replace(greedy, num_logprobs=MAX_LOGPROBS),
                                     True)):
        text = jax.jit(lambda lg, f=f: sample(lg, greedy_md, f)).lower(
            jnp.asarray(logits)).as_text()
        assert ("stablehlo.exponential" in text) == has      # the log-softmax's exp


# ---- metadata building and padding ----


def test_from_params_pads_rows_and_sets_flags():
    params = [SamplingParams(seed=5, top_p=0.9), SamplingParams(temperature=0.0)]
    md, flags = _build(params, rows=8, prompts=[[1] * 100, [2]], outputs=[[3] * 3, []])
    assert md.temperature.shape == (8,) and md.seeds.shape == (8, 2)
    np.testing.assert_array_equal(md.temperature[1:], 0.0)  # greedy and padding rows
    assert flags == SamplerFlags(use_top_k_top_p_min_p=True)
    assert md.prompt_tokens.shape == (8, 1)  # no penalties: token lists not shipped
    md2, _ = _build(params, rows=8, prompts=[[1] * 100, [2]], outputs=[[3] * 3, []])
    np.testing.assert_array_equal(md.seeds[0], md2.seeds[0])
    pen = [SamplingParams(frequency_penalty=0.5)] + params
    md3, flags3 = _build(pen, rows=8, prompts=[[1] * 100, [2], []], outputs=[[3] * 3, [], []])
    assert flags3.use_penalties and md3.prompt_tokens.shape == (8, 128)
    assert md3.output_tokens.shape == (8, 4) and (md3.prompt_tokens[1:] == -1).all()


@pytest.mark.parametrize("params", [
    [SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=1)] * 8,
    [SamplingParams(temperature=0.7, min_p=0.1), SamplingParams(temperature=0.0)],
    [SamplingParams(temperature=1.0, seed=3)]])
def test_sampled_batch_reads_one_metadata_array(params):
    """Without penalties the program reads the logits and one metadata array (the
    jit drops the arguments it does not read): each more would be one more
    host-to-device transfer in every sampled step, which greedy steps do not pay."""
    assert _num_program_args(*_build(params)) == 2
    assert _num_program_args(*_build([SamplingParams(temperature=0.0)])) == 1


def _num_program_args(md, flags) -> int:
    text = sample_jit.lower(jnp.asarray(_logits(8)), md, flags).as_text()
    return re.search(r"func\.func public @main\((.*?)\) ->", text, re.S).group(1).count("%arg")


def test_unseeded_rows_use_fallback_seeds():
    params = [SamplingParams(), SamplingParams(seed=-1)]
    md, _ = _build(params, fallback_seeds=[2**33 + 7, 99])
    np.testing.assert_array_equal(md.seeds[:2], [[7, 2], [2**32 - 1, 2**32 - 1]])
    with pytest.raises(ValueError, match="pad_to_rows"):
        _build(params, rows=1)


def test_min_tokens_blocks_stop_and_eos_tokens():
    logits = np.zeros((2, V), np.float32)
    logits[:, [2, 6]] = 50.0  # EOS 2 and stop token 6 dominate
    params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[6])] * 2
    md, flags = _build(params, output_indices=[2, 3], eos_token_ids=[2])
    assert flags.use_penalties
    out = _sample(logits, md, flags).token_ids
    assert out[0] not in (2, 6) and out[1] in (2, 6)
    ignore = [SamplingParams(min_tokens=3, ignore_eos=True, seed=0, temperature=0.1)]
    md, _ = _build(ignore, eos_token_ids=[2])
    assert list(md.blocked_tokens[0]) == [-1]


def test_padded_rows_do_not_change_real_rows():
    logits = _logits(3, seed=11)
    params = [SamplingParams(seed=s, top_p=0.8, presence_penalty=0.5, logprobs=0)
              for s in range(3)]
    kw = dict(prompts=[[1, 2]] * 3, outputs=[[4]] * 3, output_indices=[1] * 3)
    md3, f3 = _build(params, rows=3, **kw)
    md8, f8 = _build(params, rows=8, **kw)
    # Padded rows see whatever logits the padded tokens produced.
    padded = np.concatenate([logits, _logits(5, seed=12) * 100])
    out3 = sample_jit(jnp.asarray(logits), md3, f3)
    out8 = sample_jit(jnp.asarray(padded), md8, f8)
    np.testing.assert_array_equal(out3.token_ids, out8.token_ids[:3])
    np.testing.assert_allclose(out3.logprobs, out8.logprobs[:3], rtol=1e-6)
    assert ((0 <= out8.token_ids) & (out8.token_ids < V)).all()
