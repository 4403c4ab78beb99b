"""vLLM's top-k then top-p without sorting the vocabulary.

Both filters keep the tokens at or above a threshold value per row: the k-th largest
logit for top-k, and for top-p the smallest value whose tokens below it carry at most
1 - p of the (top-k renormalised) probability mass. Each threshold is found exactly by
a radix search over the logits' 32-bit order-preserving keys, BITS bits per pass:
every pass is one fused read of the [S, V] row, so a step costs 2 * 32 / BITS small
reductions instead of a full [S, V] sort. The sort-based ``ref_apply_top_k_top_p``
is the reference twin (same signature, same kept set up to the rounding of the mass
sums).

The search pays C compares per token and pass, the sort a fixed cost per token: on
the H200 at vocab 128,256 (bf16 logits) the search at 4 bits took 163 / 880 / 8,635 us
at S = 8 / 64 / 256 rows against the sort's 310 / 1,109 / 2,637 us, so rows past
RADIX_MAX_ROWS are sorted.

Rows whose top_k is at most MAX_SMALL_TOP_K (or with both filters off), the sampler's
``SamplerFlags.small_top_k``, take ``apply_small_top_k_top_p`` instead: it reads the
row once for block maxima and works on the few blocks that can hold the top-k, with
no search over the whole row (see its docstring).

Letter legend: S rows, V vocabulary, C = 2**BITS - 1 candidates per pass, G =
MAX_SMALL_TOP_K blocks of BLOCK tokens kept per row.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

RADIX_MAX_ROWS = 64
MAX_SMALL_TOP_K = 64
BLOCK = 64


def apply_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array,
                      bits: int | None = None) -> jax.Array:
    """logits f32[S, V]; top_k i32[S] (0 = off); top_p f32[S] (1 = off). Tokens below
    the row's threshold become -inf; ties with a threshold are kept."""
    s, vocab = logits.shape
    if bits is None and s > RADIX_MAX_ROWS:
        return ref_apply_top_k_top_p(logits, top_k, top_p)
    bits = bits or 4
    keys = _order_keys(logits)
    k = jnp.where(top_k > 0, jnp.clip(top_k, 1, vocab), vocab)
    # Top-k: the largest key with at least k keys at or above it (the k-th largest).
    kth = _radix_search(lambda c: jnp.sum(keys[:, None, :] >= c[:, :, None], axis=-1)
                        >= k[:, None], s, bits)
    kept = keys >= kth[:, None]
    x = jnp.where(kept, logits, -jnp.inf)
    probs = jax.nn.softmax(x, axis=-1)
    budget = (1.0 - top_p)[:, None]
    # Top-p: the largest key with at most 1 - p of the mass strictly below it. It is a
    # kept token's (the mass below the next key up exceeds 1 - p), and no lower than kth.
    pth = _radix_search(lambda c: jnp.sum(
        jnp.where(keys[:, None, :] < c[:, :, None], probs[:, None, :], 0.0), axis=-1)
        <= budget, s, bits)
    # The largest logit always survives, even where the rounded total mass is <= 1 - p.
    pth = jnp.minimum(pth, jnp.max(keys, axis=-1))
    return jnp.where(keys >= pth[:, None], logits, -jnp.inf)


def fits_small_top_k(top_k: int, top_p: float) -> bool:
    """Host side: whether a row (its top_k, and its top_p as the float32 the sampler
    reads) may take ``apply_small_top_k_top_p``: top_k in [1, MAX_SMALL_TOP_K], or
    top_k and top_p off. A batch takes it when every row does."""
    return 1 <= top_k <= MAX_SMALL_TOP_K or (top_k == 0 and top_p >= 1.0)


def apply_small_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array,
                            block: int = BLOCK) -> jax.Array:
    """``apply_top_k_top_p`` for rows that ``fits_small_top_k`` (others come out wrong).

    Of the row's blocks of `block` tokens, take the G with the largest maxima and call
    the next block maximum the floor: every token above the floor lies in those G
    blocks, and G + 1 blocks hold a token at or above it, so for k <= G + 1 the k-th
    largest logit is a token of the G blocks or the floor itself. Top-p after top-k
    then only needs those tokens and how many tokens equal the floor. Rows with both
    filters off keep the tokens of nonzero probability, as the sort-based twin does.
    """
    s, vocab = logits.shape
    cand, floor, row_max = _top_blocks(logits, block)
    k = jnp.where(top_k > 0, jnp.clip(top_k, 1, vocab), vocab)
    n_floor = jnp.sum(logits == floor[:, None], axis=-1)
    thr = _small_thresholds(cand, floor, n_floor, row_max, k, top_p)
    # Rows without filters: the twin's p = 1 cut drops the tokens whose probability
    # rounds to 0 (the lowest of the cumulative sum that stays at 0).
    e = jnp.exp(logits - row_max[:, None])
    alive = e / jnp.sum(e, axis=-1, keepdims=True) > 0
    keep = jnp.where((k <= MAX_SMALL_TOP_K)[:, None], logits >= thr[:, None], alive)
    return jnp.where(keep, logits, -jnp.inf)


def _top_blocks(logits: jax.Array, block: int):
    """-> (cand f32[S, G*block]: the tokens of the G blocks with the largest maxima,
    those at or below the floor set to -inf; floor f32[S]: the (G+1)-th largest block
    maximum; row_max f32[S]). Short rows are padded with -inf blocks."""
    s, vocab = logits.shape
    g = MAX_SMALL_TOP_K
    n = max(-(-vocab // block), g + 1)
    x = jnp.pad(logits, ((0, 0), (0, n * block - vocab)), constant_values=-jnp.inf)
    blocks = x.reshape(s, n, block)
    top_max, top_ids = jax.lax.top_k(jnp.max(blocks, axis=-1), g + 1)
    floor = top_max[:, g]
    cand = jnp.take_along_axis(blocks, top_ids[:, :g, None], axis=1).reshape(s, g * block)
    return jnp.where(cand > floor[:, None], cand, -jnp.inf), floor, top_max[:, 0]


def _small_thresholds(cand, floor, n_floor, row_max, k, top_p) -> jax.Array:
    """The kept set's lowest value per row, for rows with k <= G (see
    apply_small_top_k_top_p). The top-k is the G largest candidates above its k-th
    largest value, fewer than k, and every token tied with that value: candidates, or
    the n_floor tokens of the floor when it is the floor."""
    g = MAX_SMALL_TOP_K
    top = jax.lax.top_k(cand, g)[0]                # descending; -inf past the tokens
    kth = jnp.take_along_axis(top, jnp.minimum(k, g)[:, None] - 1, axis=-1)[:, 0]
    kth = jnp.maximum(kth, floor)                  # fewer than k above the floor
    ties = jnp.sum(cand == kth[:, None], axis=-1) + jnp.where(floor == kth, n_floor, 0)
    e_top = jnp.where(top > kth[:, None], jnp.exp(top - row_max[:, None]), 0.0)
    e_kth = ties * jnp.exp(kth - row_max)
    z = jnp.sum(e_top, axis=-1) + e_kth
    # A value's mass below is what the twin's ascending cumulative sum holds just
    # before it: the k-th largest's ties, then the smaller values above them.
    below = (e_kth / z)[:, None] + jnp.sum(jnp.where(
        top[:, None, :] < top[:, :, None], (e_top / z[:, None])[:, None, :], 0.0), axis=-1)
    ok = (top > kth[:, None]) & (below <= (1.0 - top_p)[:, None])
    # With no value above it passing, the cut falls on the k-th largest's ties.
    return jnp.maximum(kth, jnp.max(jnp.where(ok, top, -jnp.inf), axis=-1))


def ref_apply_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array,
                          bits: int | None = None) -> jax.Array:
    """The same filters by one ascending sort (``bits`` unused). The cumsum runs in
    ascending order, as vLLM's, so p = 1 never cuts the tail by rounding."""
    vocab = logits.shape[-1]
    srt = jnp.sort(logits, axis=-1)
    k = jnp.where(top_k > 0, jnp.clip(top_k, 1, vocab), vocab)
    kth = jnp.take_along_axis(srt, (vocab - k)[:, None], axis=-1)
    srt = jnp.where(srt < kth, -jnp.inf, srt)
    cum = jnp.cumsum(jax.nn.softmax(srt, axis=-1), axis=-1)
    n_drop = jnp.sum(cum <= 1.0 - top_p[:, None], axis=-1)
    # The largest logit always survives, even if rounding says otherwise.
    pth = jnp.take_along_axis(srt, jnp.minimum(n_drop, vocab - 1)[:, None], axis=-1)
    return jnp.where(logits < jnp.maximum(kth, pth), -jnp.inf, logits)


def _order_keys(x: jax.Array) -> jax.Array:
    """u32 keys in the order of the f32 values (-0 and +0 alike; -inf lowest)."""
    b = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.uint32)
    return jnp.where(b >> 31 == 1, ~b, b | jnp.uint32(0x80000000))


def _radix_search(ok, rows: int, bits: int) -> jax.Array:
    """Per row, the largest u32 t with ok(t), for ok true at 0 and monotone (true up to
    some t, false above). ok: u32[S, C] candidates -> bool[S, C]. Each pass tries the
    C values of the next `bits` bits at once; ok's monotonicity makes the count of
    passing candidates the digit."""
    t = jnp.zeros((rows,), jnp.uint32)
    for shift in range(32 - bits, -1, -bits):
        digits = jnp.arange(1, 2 ** bits, dtype=jnp.uint32) << shift
        passed = jnp.sum(ok(t[:, None] | digits[None, :]), axis=-1, dtype=jnp.uint32)
        t = t | (passed << shift)
    return t
