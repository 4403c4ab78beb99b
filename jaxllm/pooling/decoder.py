"""The Llama-family decoder (models/llama.py's modules and weights) run as an
embedding model: causal attention over padded [B, T] rows, no KV pool.

Rows are right-padded, so under the causal mask a real token never sees a padding
key; the padding positions compute garbage that the pooler never reads.

Attention is cuDNN's fused kernel where the runner found it working (a GPU, bf16 or
fp16: see `pick_attention`), else plain jnp. At T <= 72 the jnp form's flops are ~1%
of the step's, but it runs as small batched matmuls around an f32 [B, Q, T, T] score
tensor, which XLA does at a small fraction of the card's matrix rate.

Letter legend: B rows, T tokens, N = B*T, E hidden, Q query heads, K KV heads,
G = Q / K, D head dim.
"""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.layers.rotary import apply_rotary, inv_frequencies

logger = logging.getLogger(__name__)


def attention_core(q, k, v, window: int | None, impl: str):
    """q: [B, T, Q, D]; k, v: [B, T, K, D] -> [B, T, Q, D], causal (and within
    `window` keys when set). impl: "cudnn" or "xla"."""
    b, t, nq, d = q.shape
    if impl == "cudnn" and (window is None or window >= t):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    nk = k.shape[2]
    pos = jnp.arange(t)
    mask = pos[None, :] <= pos[:, None]                     # [T(query), T(key)]
    if window is not None and window < t:
        mask = mask & (pos[:, None] - pos[None, :] < window)
    q = q.reshape(b, t, nk, nq // nk, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = jnp.where(mask, scores * (d ** -0.5), -1e30)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, nq, d)


def pick_attention(cfg, dtype) -> str:
    """"cudnn" when a small causal GQA call of this model's heads compiles, runs and
    agrees with the jnp form on this device; "xla" otherwise (CPU, float32, no cuDNN)."""
    if jax.devices()[0].platform != "gpu" or jnp.dtype(dtype) not in (jnp.bfloat16,
                                                                        jnp.float16):
        return "xla"
    rng = np.random.default_rng(0)
    shape = (2, 12, cfg.num_heads, cfg.head_dim)
    kv_shape = (2, 12, cfg.num_kv_heads, cfg.head_dim)
    q, k, v = (jnp.asarray(rng.standard_normal(s), dtype) for s in (shape, kv_shape, kv_shape))
    try:
        got = jax.jit(lambda *a: attention_core(*a, None, "cudnn"))(q, k, v)
        want = attention_core(q, k, v, None, "xla")
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
    except Exception as e:       # noqa: BLE001 - any failure means: not on this device
        logger.info("pooling attention: jnp (cuDNN's fused attention failed: %s)", e)
        return "xla"
    if not err < 0.05:
        logger.warning("pooling attention: jnp (cuDNN's differs by %.3g)", err)
        return "xla"
    return "cudnn"


def _attention(attn, x, positions, b: int, t: int, impl: str):
    """x: [N, E]; positions: i32 [N] -> [N, E]."""
    cfg = attn.cfg
    q, k, v = attn.project_qkv(x)
    inv_freq = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    q = apply_rotary(q, positions, inv_freq)
    k = apply_rotary(k, positions, inv_freq)
    rows = lambda a: a.reshape(b, t, a.shape[1], cfg.head_dim)  # noqa: E731
    out = attention_core(rows(q), rows(k), rows(v), cfg.sliding_window, impl)
    return jnp.einsum("nqd,qde->ne", out.reshape(b * t, cfg.num_heads, cfg.head_dim),
                      attn.o_proj[...])


def decoder_hidden(model, input_ids, lengths, attention: str = "xla"):
    """model: a LlamaForCausalLM; input_ids: i32 [B, T]; lengths: i32 [B] (unused:
    right padding needs no key mask under the causal one); attention: "cudnn" or
    "xla" (see pick_attention). Returns [B, T, E]."""
    del lengths
    b, t = input_ids.shape
    positions = jnp.tile(jnp.arange(t), b)
    x = jnp.take(model.embed_tokens[...], input_ids.reshape(-1), axis=0)
    for i, layer in enumerate(model.layers):
        with jax.named_scope(f"layer{i}"):
            x = x + _attention(layer.self_attn, layer.input_layernorm(x), positions, b, t,
                               attention)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.norm(x).reshape(b, t, -1)
