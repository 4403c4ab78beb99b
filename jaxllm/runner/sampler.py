"""Jittable sampling: greedy, temperature, min-p / top-k / top-p, penalties, logprobs.

Runs inside the jitted model step, so every shape is static: S rows (a sequence
bucket), V vocab entries, K top logprobs (0 or MAX_LOGPROBS), Lp / Lo / Lb padded
prompt / output / blocked token lists. What varies per batch but changes the
program (penalties on, filters on, logprobs wanted, all greedy) is a hashable
``SamplerFlags`` passed as a static argument, so the common path (no penalties, no
filters) pays neither for the [S, V] scatter-adds nor for the filters' threshold
searches (top_k_top_p.py: no [S, V] sort).

Order of operations is vLLM's: penalties on the raw logits, then greedy argmax
(for temperature 0 rows), else temperature, min-p, top-k, top-p and a Gumbel-max
draw. Logprobs are vLLM's default "raw" ones: log_softmax of the unprocessed logits.
Structured outputs (``use_bitmask``) mask the logits first, so those rows' logprobs are
the constrained distribution's (disallowed tokens at -inf).

Randomness: a row's draw depends only on (seed, output_index), never on its row or
on the rest of the batch, so a seeded request is reproducible however it is batched.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.runner.top_k_top_p import apply_small_top_k_top_p, apply_top_k_top_p
from jaxllm.sampling_params import MAX_LOGPROBS, SAMPLING_EPS


@dataclasses.dataclass(frozen=True)
class SamplerFlags:
    """Static (compile-time) switches for ``sample``; hashable, a jit static arg.

    num_logprobs: K, the top logprobs computed per row: MAX_LOGPROBS when a row asks
    for logprobs (0 included: its sampled token's), else 0, and then none are
    computed at all (no log_softmax or rank pass over [S, V]).
    all_greedy: every row has temperature 0, so no random numbers are drawn.
    use_bitmask: a grammar bitmask i32[S, ceil(V/32)] comes with the logits (bit v of
    row s set: token v allowed); batches without a constrained row pass none.
    small_top_k: with the filters, every row's top_k is in [1, MAX_SMALL_TOP_K] or its
    top_k and top_p are off, so they take the block path (top_k_top_p.py).
    """

    use_penalties: bool = False
    use_top_k_top_p_min_p: bool = False
    num_logprobs: int = 0
    all_greedy: bool = False
    use_bitmask: bool = False
    small_top_k: bool = False


# The per-row scalars of SamplingMetadata.rows, by column: f32 ones by their bits,
# the seed's two u32 words by theirs.
_COLUMNS = {"temperature": (0, np.float32), "top_p": (1, np.float32),
            "min_p": (2, np.float32), "presence_penalty": (3, np.float32),
            "frequency_penalty": (4, np.float32), "repetition_penalty": (5, np.float32),
            "top_k": (6, np.int32), "output_index": (7, np.int32)}
_SEED_COLUMNS = slice(8, 10)
NUM_COLUMNS = 10


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingMetadata:
    """Per-row sampling inputs for S rows; a pytree of arrays (numpy or jax).

    rows: i32[S, NUM_COLUMNS], every per-row scalar in one array (read through the
    properties below), so a sampled step uploads one buffer. Six separate ones
    (temperature, top_p, top_k, min_p, seeds, output_index) each cost a host-to-device
    transfer per step, which greedy steps do not pay (their program reads none).
    prompt_tokens / output_tokens / blocked_tokens: i32[S, Lp|Lo|Lb], padded with
    -1; only read when ``SamplerFlags.use_penalties``. blocked_tokens are banned
    this step (stop tokens while a request is below its min_tokens).
    """

    rows: jax.Array  # i32[S, NUM_COLUMNS]
    prompt_tokens: jax.Array  # i32[S, Lp]
    output_tokens: jax.Array  # i32[S, Lo]
    blocked_tokens: jax.Array  # i32[S, Lb]

    def _column(self, name: str):
        i, dtype = _COLUMNS[name]
        return _bitcast(self.rows[:, i], dtype)

    temperature = property(lambda self: self._column("temperature"))  # f32[S], 0 = greedy
    top_p = property(lambda self: self._column("top_p"))  # f32[S], 1 = off
    top_k = property(lambda self: self._column("top_k"))  # i32[S], 0 = off
    min_p = property(lambda self: self._column("min_p"))  # f32[S], 0 = off
    presence_penalty = property(lambda self: self._column("presence_penalty"))  # f32[S]
    frequency_penalty = property(lambda self: self._column("frequency_penalty"))  # f32[S]
    repetition_penalty = property(lambda self: self._column("repetition_penalty"))  # f32[S]
    # i32[S], the tokens the request has generated so far
    output_index = property(lambda self: self._column("output_index"))

    @property
    def seeds(self):
        """u32[S, 2], the request seed's low and high 32-bit words."""
        return _bitcast(self.rows[:, _SEED_COLUMNS], np.uint32)


class SamplerOutput(NamedTuple):
    """token_ids i32[S]; logprobs f32[S] (raw logprob of the sampled token);
    top_logprob_ids i32[S, K] / top_logprobs f32[S, K], best first;
    sampled_rank i32[S], 1-based rank of the sampled token among all V. All but
    token_ids are None when no row asks for logprobs (SamplerFlags.num_logprobs 0)."""

    token_ids: jax.Array
    logprobs: jax.Array
    top_logprob_ids: jax.Array
    top_logprobs: jax.Array
    sampled_rank: jax.Array


def sample(logits: jax.Array, md: SamplingMetadata, flags: SamplerFlags,
           bitmask: jax.Array | None = None) -> SamplerOutput:
    """Sample one token per row. logits: [S, V] (any float dtype); bitmask: i32[S, W]
    with ``flags.use_bitmask``."""
    if flags.use_bitmask:
        # Masked once and kept (the barrier): left to XLA, the mask's bit unpacking
        # was fused into each of the passes below. H200, 256 rows, 128k vocabulary,
        # bf16 logits cast in the sampler: 0.75 ms masked against 0.27 unmasked, and
        # 0.32 with the masked f32 logits kept (the model's logits are f32 already).
        logits = jax.lax.optimization_barrier(apply_token_bitmask(logits, bitmask))
    logits = logits.astype(jnp.float32)
    raw_logits = logits
    if flags.use_penalties:
        logits = apply_penalties(logits, md)
    token_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not flags.all_greedy:
        random_ids = _sample_random(logits, md, flags)
        token_ids = jnp.where(md.temperature < SAMPLING_EPS, token_ids, random_ids)
    if not flags.num_logprobs:      # no row reads them: none made, none copied back
        return SamplerOutput(token_ids, None, None, None, None)
    lp, rank, top_ids, top_lps = compute_logprobs(raw_logits, token_ids, flags.num_logprobs)
    return SamplerOutput(token_ids, lp, top_ids, top_lps, rank)


def compute_logprobs(
    logits: jax.Array, token_ids: jax.Array, num_logprobs: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Raw logprobs of chosen tokens and the top-K; also usable for prompt logprobs.

    logits f32[T, V], token_ids i32[T] -> (logprob f32[T], rank i32[T],
    top_ids i32[T, K], top_logprobs f32[T, K]) with K = num_logprobs.
    """
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logprobs, token_ids[:, None], axis=-1)
    # vLLM's rank counts ties as better, so rank >= 1 and equals 1 for the argmax.
    rank = jnp.sum(logprobs >= chosen, axis=-1, dtype=jnp.int32)
    if num_logprobs:
        top_lps, top_ids = jax.lax.top_k(logprobs, num_logprobs)
    else:
        top_lps = jnp.zeros((logits.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
    return chosen[:, 0], rank, top_ids.astype(jnp.int32), top_lps


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """-inf where the row's bit for the token is clear. bitmask i32[S, W], W*32 >= V;
    an unconstrained row is all ones (-1)."""
    s, v = logits.shape
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    allowed = bits.reshape(s, -1)[:, :v].astype(bool)
    return jnp.where(allowed, logits, -jnp.inf)


def apply_penalties(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """vLLM's repetition / frequency / presence penalties, then blocked tokens.

    logits f32[S, V] -> f32[S, V]. Repetition applies to tokens seen in prompt or
    output; frequency and presence only to output tokens.
    """
    vocab = logits.shape[-1]
    out_counts = _token_counts(md.output_tokens, vocab)
    seen = (_token_counts(md.prompt_tokens, vocab) > 0) | (out_counts > 0)
    rep = md.repetition_penalty[:, None]
    # Dividing a positive logit / multiplying a negative one both lower the token.
    penalized = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(seen, penalized, logits)
    logits = logits - md.frequency_penalty[:, None] * out_counts
    logits = logits - md.presence_penalty[:, None] * (out_counts > 0)
    rows = jnp.arange(logits.shape[0])[:, None]
    blocked = jnp.where(md.blocked_tokens >= 0, md.blocked_tokens, vocab)
    return logits.at[rows, blocked].set(-jnp.inf, mode="drop")


def apply_min_p(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    """Drop tokens with prob < min_p * max prob. logits f32[S, V], min_p f32[S].

    Done in log space (logit < max + log(min_p)), which needs no softmax; min_p = 0
    gives log 0 = -inf and keeps everything.
    """
    threshold = jnp.max(logits, axis=-1, keepdims=True) + jnp.log(min_p)[:, None]
    return jnp.where(logits < threshold, -jnp.inf, logits)


def row_keys(seeds: jax.Array, output_index: jax.Array) -> jax.Array:
    """One PRNG key per row from (seed words u32[S, 2], output_index i32[S])."""

    def one(seed: jax.Array, index: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.key(seed[0]), seed[1])
        return jax.random.fold_in(key, index)

    return jax.vmap(one)(seeds, output_index)


def _sample_random(logits: jax.Array, md: SamplingMetadata, flags: SamplerFlags) -> jax.Array:
    """Temperature, filters, then Gumbel-max. logits f32[S, V] -> i32[S]."""
    vocab = logits.shape[-1]
    # Greedy rows are picked by argmax elsewhere; 1 only avoids dividing by 0.
    temperature = jnp.where(md.temperature < SAMPLING_EPS, 1.0, md.temperature)
    logits = logits / temperature[:, None]
    if flags.use_top_k_top_p_min_p:
        logits = apply_min_p(logits, md.min_p)
        top_k_top_p = apply_small_top_k_top_p if flags.small_top_k else apply_top_k_top_p
        logits = top_k_top_p(logits, md.top_k, md.top_p)
    keys = row_keys(md.seeds, md.output_index)
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (vocab,), jnp.float32))(keys)
    return jnp.argmax(logits + gumbel, axis=-1).astype(jnp.int32)


def _token_counts(tokens: jax.Array, vocab: int) -> jax.Array:
    """Per-row occurrence counts i32[S, V] of tokens i32[S, L] (-1 = padding)."""
    rows = jnp.arange(tokens.shape[0])[:, None]
    # Padding points one past the vocab, where mode="drop" discards it.
    index = jnp.where(tokens >= 0, tokens, vocab)
    counts = jnp.zeros((tokens.shape[0], vocab), jnp.int32)
    return counts.at[rows, index].add(1, mode="drop")


def _bitcast(x, dtype):
    """x's 32-bit words read as `dtype`: a numpy view on the host, a bitcast in a jit."""
    if isinstance(x, np.ndarray):
        return x.view(dtype)
    return jax.lax.bitcast_convert_type(x, dtype)


def warm_up_variants() -> list[SamplerFlags]:
    """The variants warmed up: greedy or random, with or without top-k/p/min-p (either
    path), with or without logprobs. Penalty variants depend on token-list widths and
    compile on first use."""
    out = []
    for lp in (0, MAX_LOGPROBS):
        out.append(SamplerFlags(False, False, lp, True))
        out.append(SamplerFlags(False, False, lp, False))
        out.append(SamplerFlags(False, True, lp, False))
        out.append(SamplerFlags(False, True, lp, False, small_top_k=True))
    # Constrained batches, greedy or plain random; the rest compile on first use.
    out.append(SamplerFlags(False, False, 0, True, use_bitmask=True))
    out.append(SamplerFlags(False, False, 0, False, use_bitmask=True))
    return out
