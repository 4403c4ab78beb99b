"""Ragged paged attention: query chunks of many sequences packed flat, each attending
causally to its cached prefix plus itself through its block table.

Letter legend: T query tokens (flat, padded), S sequences (padded), Hq query heads,
Hkv KV heads, G = Hq // Hkv, D head dim, NB blocks in the pool, BS block size,
B blocks per block-table row.

Metadata (all int32): ``block_tables [S, B]``, ``seq_lens [S]`` = context length after
this step's tokens are written (0 for padding rows), ``query_start_loc [S + 1]`` =
cumulative query counts; tokens at or past ``query_start_loc[-1]`` are padding. The
query tokens of a sequence are its last ``q_len`` positions, so a query's position is
``seq_len - q_len + i``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG_INF = float("-inf")


def token_positions(query_start_loc, seq_lens, num_tokens):
    """Per flat token: (sequence index i32[T], position i32[T], valid bool[T])."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    num_seqs = seq_lens.shape[0]
    seq = jnp.searchsorted(query_start_loc, t, side="right").astype(jnp.int32) - 1
    seq = jnp.clip(seq, 0, num_seqs - 1)
    valid = t < query_start_loc[-1]
    q_len = query_start_loc[seq + 1] - query_start_loc[seq]
    pos = seq_lens[seq] - q_len + (t - query_start_loc[seq])
    return seq, pos, valid


def ref_ragged_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                               *, sm_scale, sliding_window=None, k_scale=1.0, v_scale=1.0):
    """q: [T, Hq, D]; k_cache, v_cache: [Hkv, NB, BS, D] -> out [T, Hq, D] (q's dtype).

    Plain jnp: a loop over block columns with an online softmax, so memory stays
    O(T * BS) whatever the context length. Padding tokens give zeros.
    """
    num_tokens, hq, d = q.shape
    hkv, _, bs, _ = k_cache.shape
    g = hq // hkv
    seq, pos, valid = token_positions(query_start_loc, seq_lens, num_tokens)
    qg = q.reshape(num_tokens, hkv, g, d).astype(jnp.float32) * sm_scale
    num_iters = (jnp.max(seq_lens) + bs - 1) // bs

    def body(j, carry):
        m, l, acc = carry
        blk = block_tables[seq, j]                                 # [T]
        kpos = j * bs + jnp.arange(bs)                             # [BS]
        mask = (kpos[None, :] <= pos[:, None]) & valid[:, None]    # [T, BS]
        if sliding_window is not None:
            mask &= kpos[None, :] > pos[:, None] - sliding_window
        kb = _load(k_cache, blk, mask, k_scale)                    # [Hkv, T, BS, D]
        vb = _load(v_cache, blk, mask, v_scale)
        s = jnp.einsum("thgd,htkd->thgk", qg, kb)
        s = jnp.where(mask[:, None, None, :], s, _NEG_INF)
        m_new = jnp.maximum(m, s.max(-1))
        m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)          # rows with no key yet
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(m - m_safe)
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + jnp.einsum("thgk,htkd->thgd", p, vb)
        return m_new, l, acc

    init = (jnp.full((num_tokens, hkv, g), _NEG_INF, jnp.float32),
            jnp.zeros((num_tokens, hkv, g), jnp.float32),
            jnp.zeros((num_tokens, hkv, g, d), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, num_iters, body, init)
    out = acc / jnp.where(l == 0.0, 1.0, l)[..., None]
    return out.reshape(num_tokens, hq, d).astype(q.dtype)


def _load(cache, blk, mask, scale):
    """Gather blocks [Hkv, T, BS, D] as float32; masked slots become 0 so that NaN or
    garbage in unused pool slots never reaches the output."""
    x = cache[:, blk].astype(jnp.float32)
    if cache.dtype.itemsize == 1:
        x = x * scale
    return jnp.where(mask[None, :, :, None], x, 0.0)
