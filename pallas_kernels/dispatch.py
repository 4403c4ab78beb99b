"""The pallas attention backend: KV write, then the decode kernel for pure-decode steps;
in other steps the ragged kernel for the sequences with several query tokens and the
decode kernel for those with one (as vLLM's FlashInfer backend splits decodes from
prefills). Called by ``jaxllm.layers.attention._pallas``. Pure decode steps pass the
spec's ``decode_spread`` to the decode kernel (its ``spread``).

Letter legend: T flat tokens, S sequences, Hq/Hkv query/KV heads, D head dim.
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.paged_attention_decode import decode_and_write, paged_attention_decode
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.reshape_and_cache import reshape_and_cache


def paged_attention(q, k, v, k_cache, v_cache, md, spec):
    """q: [T, Hq, D]; k, v: [T, Hkv, D]; caches [Hkv, NB, BS, D]; md: AttentionMetadata;
    spec: AttentionSpec. Returns (out [T, Hq, D], k_cache, v_cache)."""
    k_cache, v_cache = reshape_and_cache(k, v, k_cache, v_cache, md.slot_mapping,
                                         spec.k_scale, spec.v_scale,
                                         interpret=spec.interpret)
    kw = _settings(spec)
    if md.decode_only:
        out = _decode(q, k_cache, v_cache, md, kw, spec)
    else:
        out = mixed_step_attention(q, k_cache, v_cache, md.block_tables, md.seq_lens,
                                   md.query_start_loc, **kw)
    return out, k_cache, v_cache


def mixed_step_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                         **kw):
    """The ragged kernel's contract, its one-query sequences through the decode kernel.

    The ragged kernel's programs hold 256 (token, head) rows, so a decode token there
    fills G of them and still pays the whole dot; the decode kernel packs a sequence's
    G heads alone and splits long contexts. Each kernel sees the other's sequences with
    ``seq_len`` 0, which it skips (the ragged kernel writes zeros there, which the
    decode rows then overwrite)."""
    one = query_start_loc[1:] - query_start_loc[:-1] == 1
    out = ragged_paged_attention(q, k_cache, v_cache, block_tables,
                                 jnp.where(one, 0, seq_lens), query_start_loc, **kw)
    return _with_decode_rows(out, q, k_cache, v_cache, block_tables, seq_lens,
                             query_start_loc, one, kw)


def _with_decode_rows(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                      one, kw):
    """``out`` with the query row of each sequence where ``one`` replaced by the decode
    kernel's output: gather those rows, attend, scatter back."""
    num_tokens = q.shape[0]
    first = query_start_loc[:-1]
    dec = paged_attention_decode(q[jnp.clip(first, 0, num_tokens - 1)], k_cache, v_cache,
                                 block_tables, jnp.where(one, seq_lens, 0), **kw)
    return out.at[jnp.where(one, first, num_tokens)].set(dec, mode="drop")


def decode_qkv(qkv, k_cache, v_cache, md, spec, num_q_heads):
    """A decode-only step in the runner's layout (token i = sequence i) on the fused
    [T, Hq + 2 Hkv, D] q/k/v array: the KV write and the decode kernel read their rows
    in place (with the spec's ``folds_kv_write``, one kernel does both). Returns
    (out [T, Hq, D], k_cache, v_cache)."""
    hkv = k_cache.shape[0]
    if spec.folds_kv_write:     # the predicate the runner keeps such steps safe by
        return decode_and_write(qkv, k_cache, v_cache, md.block_tables, md.seq_lens,
                                md.slot_mapping, num_q_heads=num_q_heads,
                                spread=spec.decode_spread, **_settings(spec))
    k_cache, v_cache = reshape_and_cache(qkv, qkv, k_cache, v_cache, md.slot_mapping,
                                         spec.k_scale, spec.v_scale,
                                         head_offsets=(num_q_heads, num_q_heads + hkv),
                                         interpret=spec.interpret)
    out = paged_attention_decode(qkv, k_cache, v_cache, md.block_tables, md.seq_lens,
                                 num_q_heads=num_q_heads, spread=spec.decode_spread,
                                 **_settings(spec))
    return out, k_cache, v_cache


def _settings(spec):
    """The attention kernels' keyword arguments from the AttentionSpec."""
    return dict(sm_scale=spec.sm_scale, sliding_window=spec.sliding_window,
                k_scale=spec.k_scale, v_scale=spec.v_scale, interpret=spec.interpret)


def _decode(q, k_cache, v_cache, md, kw, spec):
    num_tokens, num_seqs = q.shape[0], md.seq_lens.shape[0]
    if num_tokens == num_seqs:
        # The runner's decode layout: token i is sequence i's query; padding rows have
        # seq_len 0 and come out as zeros.
        return paged_attention_decode(q, k_cache, v_cache, md.block_tables, md.seq_lens,
                                      spread=spec.decode_spread, **kw)
    # Any other layout: gather each sequence's query token, attend, scatter back.
    qsl = md.query_start_loc
    return _with_decode_rows(jnp.zeros_like(q), q, k_cache, v_cache, md.block_tables,
                             md.seq_lens, qsl, qsl[1:] > qsl[:-1], kw)
