"""Flax NNX encoder for the BERT family: BertModel, XLMRobertaModel, RobertaModel.

Bidirectional attention over padded [B, T] rows, learned absolute positions
(RoBERTa's offset past padding_idx), token type 0, post-LayerNorm blocks, erf GELU.
The HF pooler head is not built: sentence-transformers pools the token states.

Letter legend: B rows, T tokens per row, N = B*T, E hidden, H heads, D head dim,
F MLP width, V vocab, P positions.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.models.bert_config import EncoderConfig


def _param(rngs, shape, dtype, scale=0.02):
    return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) * scale).astype(dtype))


def _const(shape, dtype, value):
    return nnx.Param(jnp.full(shape, value, dtype))


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = _const((dim,), dtype, 1.0)
        self.bias = _const((dim,), dtype, 0.0)
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.weight[...].astype(jnp.float32) +
                self.bias[...].astype(jnp.float32)).astype(x.dtype)


def _act(name: str, x):
    if name == "gelu":
        return jax.nn.gelu(x, approximate=False)
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return jax.nn.gelu(x, approximate=True)
    return jax.nn.relu(x)


class EncoderLayer(nnx.Module):
    def __init__(self, cfg: EncoderConfig, dtype, rngs):
        e, h, d, f = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.intermediate_size
        # q, k and v as one [E, 3, H, D] weight: one matmul.
        self.qkv = _param(rngs, (e, 3, h, d), dtype)
        self.qkv_bias = _const((3, h, d), dtype, 0.0)
        self.o = _param(rngs, (h, d, e), dtype)
        self.o_bias = _const((e,), dtype, 0.0)
        self.attn_norm = LayerNorm(e, cfg.layer_norm_eps, dtype)
        self.up = _param(rngs, (e, f), dtype)
        self.up_bias = _const((f,), dtype, 0.0)
        self.down = _param(rngs, (f, e), dtype)
        self.down_bias = _const((e,), dtype, 0.0)
        self.out_norm = LayerNorm(e, cfg.layer_norm_eps, dtype)
        self.cfg = cfg

    def __call__(self, x, bias):
        """x: [B, T, E]; bias: f32 [B, 1, 1, T] (0 or -inf-like per key)."""
        qkv = jnp.einsum("bte,eshd->btshd", x, self.qkv[...]) + self.qkv_bias[...]
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32)
        probs = jax.nn.softmax(scores * (self.cfg.head_dim ** -0.5) + bias, axis=-1)
        ctx = jnp.einsum("bhts,bshd->bthd", probs.astype(x.dtype), v)
        attn = jnp.einsum("bthd,hde->bte", ctx, self.o[...]) + self.o_bias[...]
        x = self.attn_norm(x + attn)
        h = _act(self.cfg.hidden_act,
                 jnp.einsum("bte,ef->btf", x, self.up[...]) + self.up_bias[...])
        return self.out_norm(x + jnp.einsum("btf,fe->bte", h, self.down[...]) + self.down_bias[...])


class BertModel(nnx.Module):
    def __init__(self, cfg: EncoderConfig, dtype=jnp.float32, *, rngs: nnx.Rngs):
        e = cfg.hidden_size
        self.word_embeddings = _param(rngs, (cfg.vocab_size, e), dtype)
        self.position_embeddings = _param(rngs, (cfg.max_position_embeddings, e), dtype)
        self.token_type_embeddings = _param(rngs, (cfg.type_vocab_size, e), dtype)
        self.embed_norm = LayerNorm(e, cfg.layer_norm_eps, dtype)
        self.layers = nnx.List([EncoderLayer(cfg, dtype, rngs) for _ in range(cfg.num_layers)])
        self.cfg = cfg

    def __call__(self, input_ids, lengths):
        """input_ids: i32 [B, T] (right-padded); lengths: i32 [B] -> hidden [B, T, E]."""
        t = input_ids.shape[1]
        positions = jnp.arange(t) + self.cfg.position_offset
        x = (jnp.take(self.word_embeddings[...], input_ids, axis=0)
             + self.position_embeddings[...][positions][None]
             + self.token_type_embeddings[...][0])
        x = self.embed_norm(x)
        valid = jnp.arange(t)[None, :] < lengths[:, None]
        # A large finite negative, not -inf: a padding row (length 0) masks every key
        # and must still give finite (ignored) values, not NaN.
        bias = jnp.where(valid, 0.0, -1e30).astype(jnp.float32)[:, None, None, :]
        for i, layer in enumerate(self.layers):
            with jax.named_scope(f"layer{i}"):
                x = layer(x, bias)
        return x


# Target parameter ({i} = layer) <- HF tensor names (after the prefix) and how they
# combine; each function gets numpy float32 arrays in the listed order.
def _qkv(cfg, *ws):
    return np.stack([w.reshape(cfg.num_heads, cfg.head_dim, cfg.hidden_size) for w in ws]
                    ).transpose(3, 0, 1, 2)


_SELF = "encoder.layer.{i}.attention.self."
WEIGHT_MAP = {
    "word_embeddings": (("embeddings.word_embeddings.weight",), lambda c, w: w),
    "position_embeddings": (("embeddings.position_embeddings.weight",), lambda c, w: w),
    "token_type_embeddings": (("embeddings.token_type_embeddings.weight",), lambda c, w: w),
    "embed_norm.weight": (("embeddings.LayerNorm.weight",), lambda c, w: w),
    "embed_norm.bias": (("embeddings.LayerNorm.bias",), lambda c, w: w),
    "layers.{i}.qkv": ((_SELF + "query.weight", _SELF + "key.weight", _SELF + "value.weight"),
                       _qkv),
    "layers.{i}.qkv_bias": ((_SELF + "query.bias", _SELF + "key.bias", _SELF + "value.bias"),
                            lambda c, *bs: np.stack(bs).reshape(3, c.num_heads, c.head_dim)),
    "layers.{i}.o": (("encoder.layer.{i}.attention.output.dense.weight",),
                     lambda c, w: w.T.reshape(c.num_heads, c.head_dim, c.hidden_size)),
    "layers.{i}.o_bias": (("encoder.layer.{i}.attention.output.dense.bias",), lambda c, w: w),
    "layers.{i}.attn_norm.weight": (("encoder.layer.{i}.attention.output.LayerNorm.weight",),
                                    lambda c, w: w),
    "layers.{i}.attn_norm.bias": (("encoder.layer.{i}.attention.output.LayerNorm.bias",),
                                  lambda c, w: w),
    "layers.{i}.up": (("encoder.layer.{i}.intermediate.dense.weight",), lambda c, w: w.T),
    "layers.{i}.up_bias": (("encoder.layer.{i}.intermediate.dense.bias",), lambda c, w: w),
    "layers.{i}.down": (("encoder.layer.{i}.output.dense.weight",), lambda c, w: w.T),
    "layers.{i}.down_bias": (("encoder.layer.{i}.output.dense.bias",), lambda c, w: w),
    "layers.{i}.out_norm.weight": (("encoder.layer.{i}.output.LayerNorm.weight",), lambda c, w: w),
    "layers.{i}.out_norm.bias": (("encoder.layer.{i}.output.LayerNorm.bias",), lambda c, w: w),
}
