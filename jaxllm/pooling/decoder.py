"""The Llama-family decoder (models/llama.py's modules and weights) run as an
embedding model: causal attention over padded [B, T] rows in plain jnp, no KV pool.

Rows are right-padded, so under the causal mask a real token never sees a padding
key; the padding positions compute garbage that the pooler never reads.

Letter legend: B rows, T tokens, N = B*T, E hidden, Q query heads, K KV heads,
G = Q / K, D head dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.layers.rotary import apply_rotary, inv_frequencies


def _attention(attn, x, positions, b: int, t: int, mask):
    """x: [N, E]; positions: i32 [N]; mask: bool [T, T] -> [N, E]."""
    cfg = attn.cfg
    q = jnp.einsum("ne,eqd->nqd", x, attn.q_proj[...])
    kv = jnp.einsum("ne,eskd->nskd", x, attn.kv_proj[...])
    if cfg.attention_bias:
        q = q + attn.q_bias[...]
        kv = kv + attn.kv_bias[...]
    k, v = kv[:, 0], kv[:, 1]
    if cfg.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    inv_freq = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    q = apply_rotary(q, positions, inv_freq)
    k = apply_rotary(k, positions, inv_freq)
    kh, g = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    q = q.reshape(b, t, kh, g, cfg.head_dim)
    k = k.reshape(b, t, kh, cfg.head_dim)
    v = v.reshape(b, t, kh, cfg.head_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = jnp.where(mask, scores * (cfg.head_dim ** -0.5), -1e30)
    probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b * t, cfg.num_heads, cfg.head_dim)
    return jnp.einsum("nqd,qde->ne", out, attn.o_proj[...])


def decoder_hidden(model, input_ids, lengths):
    """model: a LlamaForCausalLM; input_ids: i32 [B, T]; lengths: i32 [B] (unused:
    right padding needs no key mask under the causal one). Returns [B, T, E]."""
    del lengths
    b, t = input_ids.shape
    cfg = model.cfg
    pos = jnp.arange(t)
    mask = pos[None, :] <= pos[:, None]                     # [T(query), T(key)]
    if cfg.sliding_window is not None and cfg.sliding_window < t:
        mask = mask & (pos[:, None] - pos[None, :] < cfg.sliding_window)
    positions = jnp.tile(pos, b)
    x = jnp.take(model.embed_tokens[...], input_ids.reshape(-1), axis=0)
    for i, layer in enumerate(model.layers):
        with jax.named_scope(f"layer{i}"):
            x = x + _attention(layer.self_attn, layer.input_layernorm(x), positions, b, t, mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.norm(x).reshape(b, t, -1)
