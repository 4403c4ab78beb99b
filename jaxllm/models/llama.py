"""Flax NNX decoder for the Llama family: Llama 2/3/3.1, SmolLM2, Mistral, Qwen2, Qwen3.

Letter legend: T flat tokens, E hidden (embed), Q query heads, K KV heads, D head dim,
F MLP width, V vocab, S sampled rows.

Parameters carry logical axis names (``out_sharding`` metadata); parallel/mesh.py maps
them to mesh axes. K and V projections are one [E, 2, K, D] weight and gate/up one
[E, 2, F] weight: one matmul each, and still shardable by head / by MLP column. A
quantized layer's q and k/v of one scheme are one qkv_proj ([K, G + 2, D] output rows,
G = Q / K) where tensor parallelism divides the KV heads (quant_config.resolve_for_tp).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.layers.attention import (AttentionMetadata, AttentionSpec, paged_attention,
                                    paged_attention_qkv)
from jaxllm.layers.quantization.linear import QuantLinear
from jaxllm.layers.quantization.schemes import QuantConfig
from jaxllm.layers.rotary import apply_rotary, inv_frequencies
from jaxllm.models.registry import ArchConfig
from jaxllm.parallel.mesh import tp_size

nnx.use_eager_sharding(False)


def _param(rngs: nnx.Rngs, shape, dtype, axes, scale=0.02):
    value = (jax.random.normal(rngs.params(), shape, jnp.float32) * scale).astype(dtype)
    return nnx.Param(value, out_sharding=axes)


def _linear(rngs, dtype, quant: QuantConfig | None, path: str, in_shape, out_shape,
            in_axes, out_axes):
    """A projection's weight: a float [K..., N...] parameter, or a QuantLinear
    ([N..., K...]) when `quant` names `path`."""
    scheme = quant.scheme(path) if quant is not None else None
    if scheme is not None:
        return QuantLinear(scheme, out_shape, in_shape, out_axes, in_axes)
    return _param(rngs, in_shape + out_shape, dtype, in_axes + out_axes)


def _proj(w, x, eq: str, tp: int | None = None):
    """x times a projection's weight: the einsum `eq`, or the QuantLinear's matmul
    (tp: the tensor-parallel size, where known)."""
    if isinstance(w, QuantLinear):
        return w(x, tp)
    return jnp.einsum(eq, x, w[...])


def _ones(shape, dtype, axes):
    return nnx.Param(jnp.ones(shape, dtype), out_sharding=axes)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = _ones((dim,), dtype, ("norm",))
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * self.weight[...].astype(jnp.float32)).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ArchConfig, dtype, rngs: nnx.Rngs, quant=None, prefix="",
                 in_size: int | None = None):
        """in_size: the q/k/v projections' input width (default the hidden size; an
        EAGLE-3 head's layer takes 2E)."""
        q, k, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        e = cfg.hidden_size if in_size is None else in_size
        hd = ("q_heads", "head_dim")
        qkv = quant.scheme(prefix + "qkv_proj") if quant is not None else None
        if qkv is not None:     # schemes.fuse_qkv: rows grouped by KV head, TP-shardable
            self.qkv_proj = QuantLinear(qkv, (k, q // k + 2, d), (e,),
                                        ("kv_heads", None, "head_dim"), ("embed",))
        else:
            self.q_proj = _linear(rngs, dtype, quant, prefix + "q_proj", (e,), (q, d),
                                  ("embed",), hd)
            self.kv_proj = _linear(rngs, dtype, quant, prefix + "kv_proj", (e,), (2, k, d),
                                   ("embed",), (None, "kv_heads", "head_dim"))
        self.o_proj = _linear(rngs, dtype, quant, prefix + "o_proj", (q, d),
                              (cfg.hidden_size,), hd, ("embed",))
        if cfg.attention_bias:
            self.q_bias = _param(rngs, (q, d), dtype, ("q_heads", "head_dim"))
            self.kv_bias = _param(rngs, (2, k, d), dtype, (None, "kv_heads", "head_dim"))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.cfg = cfg

    def project_qkv(self, x, tp: int | None = None):
        """x [T, E] -> q [T, Q, D], k and v [T, K, D], biases added and q/k normed."""
        cfg = self.cfg
        if hasattr(self, "qkv_proj"):
            y = self.qkv_proj(x, tp)                              # [T, K, G + 2, D]
            g = cfg.num_heads // cfg.num_kv_heads
            q = y[:, :, :g].reshape(x.shape[0], cfg.num_heads, cfg.head_dim)
            k, v = y[:, :, g], y[:, :, g + 1]
        else:
            q = _proj(self.q_proj, x, "te,eqd->tqd", tp)
            kv = _proj(self.kv_proj, x, "te,eskd->tskd", tp)
            k, v = kv[:, 0], kv[:, 1]
        if cfg.attention_bias:
            kv_bias = self.kv_bias[...]
            q, k, v = q + self.q_bias[...], k + kv_bias[0], v + kv_bias[1]
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def __call__(self, x, positions, k_cache, v_cache, md, spec):
        cfg, tp = self.cfg, tp_size(spec.mesh)
        q, k, v = self.project_qkv(x, tp)
        inv_freq = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        if tp <= 1:
            # One [T, Hq + 2 Hkv, D] array, RoPE on its q and k heads: XLA writes it in
            # one fusion and the decode kernels read it in place; separate q, k and v
            # arrays take three fusions per layer.
            qkv = jnp.concatenate([q, k, v], axis=1)
            qkv = apply_rotary(qkv, positions, inv_freq, num_rotated=q.shape[1] + k.shape[1])
            out, k_cache, v_cache = paged_attention_qkv(qkv, k_cache, v_cache, md, spec,
                                                        q.shape[1])
        else:   # head-sharded q and k/v: a concatenation would reshard them
            q = apply_rotary(q, positions, inv_freq)
            k = apply_rotary(k, positions, inv_freq)
            out, k_cache, v_cache = paged_attention(q, k, v, k_cache, v_cache, md, spec)
        return _proj(self.o_proj, out, "tqd,qde->te", tp), k_cache, v_cache


class MLP(nnx.Module):
    def __init__(self, cfg: ArchConfig, dtype, rngs: nnx.Rngs, quant=None, prefix=""):
        e, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = _linear(rngs, dtype, quant, prefix + "gate_up_proj", (e,),
                                    (2, f), ("embed",), (None, "mlp"))
        self.down_proj = _linear(rngs, dtype, quant, prefix + "down_proj", (f,), (e,),
                                 ("mlp",), ("embed",))

    def __call__(self, x, tp: int | None = None):
        gu = _proj(self.gate_up_proj, x, "te,esf->tsf", tp)
        h = jax.nn.silu(gu[:, 0]) * gu[:, 1]
        return _proj(self.down_proj, h, "tf,fe->te", tp)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ArchConfig, dtype, rngs: nnx.Rngs, quant=None, prefix=""):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, rngs, quant, prefix + "self_attn.")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype, rngs, quant, prefix + "mlp.")

    def __call__(self, x, positions, k_cache, v_cache, md, spec):
        with jax.named_scope("attn"):
            h, k_cache, v_cache = self.self_attn(
                self.input_layernorm(x), positions, k_cache, v_cache, md, spec)
        x = x + h
        with jax.named_scope("mlp"):
            x = x + self.mlp(self.post_attention_layernorm(x), tp_size(spec.mesh))
        return x, k_cache, v_cache


class LlamaForCausalLM(nnx.Module):
    def __init__(self, cfg: ArchConfig, dtype=jnp.float32, *, rngs: nnx.Rngs,
                 quant: QuantConfig | None = None):
        """quant: which projections are quantized, and how (None: all float)."""
        self.cfg = cfg
        self.embed_tokens = _param(rngs, (cfg.vocab_size, cfg.hidden_size), dtype,
                                   ("vocab", "embed"))
        self.layers = nnx.List([DecoderLayer(cfg, dtype, rngs, quant, f"layers.{i}.")
                                for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), dtype,
                                  ("embed", "vocab"))

    def __call__(self, input_ids, positions, kv_caches, md: AttentionMetadata,
                 spec: AttentionSpec, aux_layers: tuple[int, ...] = ()):
        """input_ids, positions: i32[T]; kv_caches: list of (k, v) [K, NB, BS, D] per
        layer. Returns (hidden [T, E], new kv_caches); with `aux_layers` (EAGLE-3's
        target layers) also [T, len(aux_layers) * E]: the residual stream entering
        each of those layers, concatenated in their order (vLLM's aux hidden states)."""
        x = jnp.take(self.embed_tokens[...], input_ids, axis=0)
        new_caches, aux = [], {}
        # Layers unrolled in Python: each has its own weight arrays, so XLA never
        # slices a stacked weight per step (measured faster than lax.scan on GPU).
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                aux[i] = x
            with jax.named_scope(f"layer{i}"):
                x, k_cache, v_cache = layer(x, positions, *kv_caches[i], md, spec)
            new_caches.append((k_cache, v_cache))
        if not aux_layers:
            return self.norm(x), new_caches
        return self.norm(x), new_caches, jnp.concatenate([aux[i] for i in aux_layers], -1)

    def compute_logits(self, hidden):
        """hidden: [S, E] -> float32 logits [S, V]."""
        if self.cfg.tie_word_embeddings:
            logits = jnp.einsum("se,ve->sv", hidden, self.embed_tokens[...])
        else:
            logits = jnp.einsum("se,ev->sv", hidden, self.lm_head[...])
        return logits.astype(jnp.float32)
