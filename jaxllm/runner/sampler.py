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
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.runner.top_k_top_p import (apply_small_top_k_top_p, apply_top_k_top_p,
                                       fits_small_top_k)
from jaxllm.sampling_params import MAX_LOGPROBS, SAMPLING_EPS, SamplingParams


@dataclasses.dataclass(frozen=True)
class SamplerFlags:
    """Static (compile-time) switches for ``sample``; hashable, a jit static arg.

    num_logprobs: K, the top logprobs computed per row: 0 or MAX_LOGPROBS.
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

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        output_indices: Sequence[int],
        prompt_token_lists: Sequence[Sequence[int]] | None,
        output_token_lists: Sequence[Sequence[int]] | None,
        pad_to_rows: int,
        vocab_size: int,
        *,
        fallback_seeds: Sequence[int] | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> tuple[SamplingMetadata, SamplerFlags]:
        """Build host (numpy) metadata for N requests padded to S = pad_to_rows rows.

        Padded rows are greedy and neutral. ``fallback_seeds[i]`` seeds row i when
        ``params[i].seed`` is None (the engine draws one per request); without it a
        fresh random seed is drawn. Token lists are only read for rows that use
        penalties; their widths are padded to a power of two to bound recompiles.
        """
        n, s = len(params), pad_to_rows
        if n > s:
            raise ValueError(f"{n} requests do not fit in pad_to_rows={s}")
        greedy = np.array([p.is_greedy for p in params] + [True] * (s - n))
        temperature = _pad_f32([0.0 if p.is_greedy else p.temperature for p in params], s, 0.0)
        columns = dict(
            temperature=temperature,
            top_p=_pad_f32([p.top_p for p in params], s, 1.0),
            top_k=_pad_i32([min(p.top_k, vocab_size) for p in params], s, 0),
            min_p=_pad_f32([p.min_p for p in params], s, 0.0),
            presence_penalty=_pad_f32([p.presence_penalty for p in params], s, 0.0),
            frequency_penalty=_pad_f32([p.frequency_penalty for p in params], s, 0.0),
            repetition_penalty=_pad_f32([p.repetition_penalty for p in params], s, 1.0),
            output_index=_pad_i32(list(output_indices), s, 0))
        rows = np.empty((s, NUM_COLUMNS), np.int32)
        for name, (i, _) in _COLUMNS.items():
            rows[:, i] = columns[name].view(np.int32)
        rows[:, _SEED_COLUMNS] = _row_seeds(params, s, fallback_seeds).view(np.int32)
        md = cls(
            rows=rows,
            prompt_tokens=_pad_token_lists(_penalty_rows(params, prompt_token_lists), s),
            output_tokens=_pad_token_lists(_penalty_rows(params, output_token_lists), s),
            blocked_tokens=_pad_token_lists(
                _blocked_token_lists(params, output_indices, eos_token_ids), s),
        )
        filters = any(p.uses_filters for p in params)
        flags = SamplerFlags(
            use_penalties=any(p.uses_penalties for p in params)
            or bool((md.blocked_tokens >= 0).any()),
            use_top_k_top_p_min_p=filters,
            num_logprobs=MAX_LOGPROBS if any(p.logprobs for p in params) else 0,
            all_greedy=bool(greedy.all()),
            small_top_k=filters and fits_small_top_k(columns["top_k"], columns["top_p"]),
        )
        return md, flags


class SamplerOutput(NamedTuple):
    """token_ids i32[S]; logprobs f32[S] (raw logprob of the sampled token);
    top_logprob_ids i32[S, K] / top_logprobs f32[S, K], best first;
    sampled_rank i32[S], 1-based rank of the sampled token among all V."""

    token_ids: jax.Array
    logprobs: jax.Array
    top_logprob_ids: jax.Array
    top_logprobs: jax.Array
    sampled_rank: jax.Array


def sample(logits: jax.Array, md: SamplingMetadata, flags: SamplerFlags,
           bitmask: jax.Array | None = None) -> SamplerOutput:
    """Sample one token per row. logits: [S, V] (any float dtype); bitmask: i32[S, W]
    with ``flags.use_bitmask``."""
    logits = logits.astype(jnp.float32)
    if flags.use_bitmask:
        logits = apply_token_bitmask(logits, bitmask)
    raw_logits = logits
    if flags.use_penalties:
        logits = apply_penalties(logits, md)
    token_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not flags.all_greedy:
        random_ids = _sample_random(logits, md, flags)
        token_ids = jnp.where(md.temperature < SAMPLING_EPS, token_ids, random_ids)
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


# ---- host-side helpers for SamplingMetadata.from_params (numpy only) ----


def _pad_f32(values: list[float], rows: int, fill: float) -> np.ndarray:
    return np.array(values + [fill] * (rows - len(values)), np.float32)


def _pad_i32(values: list[int], rows: int, fill: int) -> np.ndarray:
    return np.array(values + [fill] * (rows - len(values)), np.int32)


def _row_seeds(
    params: Sequence[SamplingParams], rows: int, fallback: Sequence[int] | None
) -> np.ndarray:
    """u32[rows, 2] (low, high words) of each request's 64-bit seed."""
    seeds = np.zeros((rows, 2), np.uint32)
    rng = None
    for i, p in enumerate(params):
        seed = p.seed if p.seed is not None else (fallback[i] if fallback is not None else None)
        if seed is None and p.is_greedy:
            continue  # argmax rows never read their key
        if seed is None:
            rng = rng or np.random.default_rng()
            seed = int(rng.integers(0, 2**63))
        seed %= 2**64  # negative Python ints map onto the same 64-bit space
        seeds[i] = (seed & 0xFFFFFFFF, seed >> 32)
    return seeds


def _penalty_rows(
    params: Sequence[SamplingParams], token_lists: Sequence[Sequence[int]] | None
) -> list[Sequence[int]]:
    """Token lists of the rows that use penalties; empty for the others."""
    if token_lists is None:
        if any(p.uses_penalties for p in params):
            raise ValueError("token lists are required when a request uses penalties")
        return [[] for _ in params]
    return [toks if p.uses_penalties else [] for p, toks in zip(params, token_lists)]


def _blocked_token_lists(
    params: Sequence[SamplingParams], output_indices: Sequence[int], eos_token_ids: Sequence[int]
) -> list[list[int]]:
    """Stop tokens each request may not sample yet, being below its min_tokens."""
    blocked = []
    for p, index in zip(params, output_indices):
        ids: list[int] = []
        if index < p.min_tokens:
            ids = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
        blocked.append(ids)
    return blocked


def _pad_token_lists(lists: Sequence[Sequence[int]], rows: int) -> np.ndarray:
    """i32[rows, L] padded with -1; L is a power of two >= the longest list (>= 1)."""
    longest = max(map(len, lists), default=0)
    width = 1 << max(longest - 1, 0).bit_length()
    out = np.full((rows, width), -1, np.int32)
    if longest:
        for i, toks in enumerate(lists):
            if toks:
                out[i, : len(toks)] = toks
    return out


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


def dummy_metadata(rows: int) -> SamplingMetadata:
    """Metadata of `rows` padding rows (the warm-up's)."""
    md, _ = SamplingMetadata.from_params([], [], [], [], rows, 2, fallback_seeds=[])
    return md
