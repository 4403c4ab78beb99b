"""EAGLE draft heads for Llama targets (vLLM's llama_eagle.py and llama_eagle3.py), and
their loader from an HF folder.

Letter legend: T flat tokens, E the head's hidden size, G the target's hidden size,
V the target's vocab, W the head's (EAGLE-3: reduced) output vocab.

Checkpoint formats (config.json + safetensors; names without a "model." prefix,
which is stripped where a conversion added one):

EAGLE-1 (SafeAILab/EAGLE; config architectures ["LlamaForCausalLM"], vLLM's
EagleLlamaForCausalLM): `fc.weight` [E, 2E] (`fc.bias` [E] when config "bias" is
true) over concat(embed(token), feature); one Llama decoder layer `layers.0.*`
without its input_layernorm (EAGLE skips it; a stored one is ignored); no final
norm. The embedding and lm_head are the target's. The feature is the target's last
hidden state (after its final norm: the vector its lm_head reads), later the
head's own output.

EAGLE-3 (architectures ["LlamaForCausalLMEagle3"], vLLM's Eagle3LlamaForCausalLM):
`fc.weight` [E, 3G] over the target's residual streams entering three of its
layers, concatenated (config `eagle_config.eagle_aux_hidden_state_layer_ids`, else
vLLM's default (2, L // 2, L - 3)); applied to the target's states only. One layer
`midlayer.*` whose q/k/v projections take 2E: concat(input_layernorm(embed(token)),
hidden_norm(h)); its residual is h before hidden_norm (config
"norm_before_residual": after). `norm.weight` on the layer's output gives the
vector `lm_head.weight` [W, E] reads; the output before that norm is the next
step's h. `d2t` i64[W]: head id i is target id i + d2t[i] (absent: W == V, the
identity). `t2d` is not needed. `embed_tokens.weight` when stored (else the
target's).

A step feeds token p + 1 with the feature of position p, at position p (KV slot p).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.models.errors import CheckpointError
from jaxllm.models.llama import MLP, Attention, RMSNorm, _param
from jaxllm.models.registry import ArchConfig, arch_from_hf_config

METHODS = ("eagle", "eagle3")


@dataclass(frozen=True)
class EagleConfig:
    """Static shape of a head (a jit static value). arch: its decoder layer's shape,
    with the target's vocab."""
    method: str
    arch: ArchConfig
    fc_in: int                  # 2E (eagle) or 3G (eagle3)
    fc_bias: bool
    draft_vocab_size: int       # W
    aux_layer_ids: tuple[int, ...]   # eagle3: the target layers fc reads
    norm_before_residual: bool = False
    tied_target_head: bool = False   # eagle: the target's lm_head is its embedding


class EagleLayer(nnx.Module):
    """The head's decoder layer (EAGLE-3: attention over 2E inputs)."""

    def __init__(self, cfg: EagleConfig, dtype, rngs: nnx.Rngs):
        a = cfg.arch
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        self.self_attn = Attention(a, dtype, rngs, in_size=a.hidden_size * (
            2 if cfg.method == "eagle3" else 1))
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        self.mlp = MLP(a, dtype, rngs)


class EagleHead(nnx.Module):
    def __init__(self, cfg: EagleConfig, dtype=jnp.float32, *, rngs: nnx.Rngs):
        a, e = cfg.arch, cfg.arch.hidden_size
        self.cfg = cfg
        self.embed_tokens = _param(rngs, (a.vocab_size, e), dtype, ("vocab", "embed"))
        self.fc = _param(rngs, (cfg.fc_in, e), dtype, (None, "embed"))
        if cfg.fc_bias:
            self.fc_bias = _param(rngs, (e,), dtype, ("embed",))
        self.layer = EagleLayer(cfg, dtype, rngs)
        if cfg.method == "eagle3":
            self.hidden_norm = RMSNorm(e, a.rms_norm_eps, dtype)
            self.norm = RMSNorm(e, a.rms_norm_eps, dtype)
            self.lm_head = _param(rngs, (e, cfg.draft_vocab_size), dtype, ("embed", "vocab"))
            self.d2t = nnx.Param(jnp.zeros((cfg.draft_vocab_size,), jnp.int32),
                                 out_sharding=(None,))
        elif not cfg.tied_target_head:
            self.lm_head = _param(rngs, (e, a.vocab_size), dtype, ("embed", "vocab"))

    def combine_hidden_states(self, target_hidden):
        """The target's states as the head's first feature: EAGLE-3 [T, 3G] -> [T, E]
        through fc; EAGLE-1 [T, E] as they are (its fc runs every step)."""
        if self.cfg.method != "eagle3":
            return target_hidden
        return jnp.einsum("tg,ge->te", target_hidden, self.fc[...])

    def __call__(self, input_ids, hidden, positions, kv_caches, md, spec):
        """input_ids, positions: i32[T]; hidden [T, E] (combine_hidden_states' or the
        previous step's); kv_caches: [(k, v)] of the one layer. Returns (the vector
        for compute_logits [T, E], the next step's feature [T, E], kv_caches)."""
        emb = jnp.take(self.embed_tokens[...], input_ids, axis=0)
        layer = self.layer
        if self.cfg.method == "eagle3":
            normed = self.hidden_norm(hidden)
            residual = normed if self.cfg.norm_before_residual else hidden
            x = jnp.concatenate([layer.input_layernorm(emb), normed], axis=-1)
        else:
            x = jnp.einsum("tg,ge->te", jnp.concatenate([emb, hidden], axis=-1), self.fc[...])
            if self.cfg.fc_bias:
                x = x + self.fc_bias[...]
            residual = x
        k_cache, v_cache = kv_caches[0]
        h, k_cache, v_cache = layer.self_attn(x, positions, k_cache, v_cache, md, spec)
        x = residual + h
        out = x + layer.mlp(layer.post_attention_layernorm(x))
        final = self.norm(out) if self.cfg.method == "eagle3" else out
        return final, out, [(k_cache, v_cache)]

    def compute_logits(self, final):
        """final [S, E] -> float32 logits over the TARGET's vocab [S, V] (EAGLE-3: the
        W head ids scattered to their target ids, -inf elsewhere)."""
        if self.cfg.method == "eagle3":
            w = jnp.einsum("se,ew->sw", final, self.lm_head[...]).astype(jnp.float32)
            targets = jnp.arange(self.cfg.draft_vocab_size) + self.d2t[...]
            full = jnp.full((final.shape[0], self.cfg.arch.vocab_size), -jnp.inf, jnp.float32)
            return full.at[:, targets].set(w)
        if self.cfg.tied_target_head:
            return jnp.einsum("se,ve->sv", final, self.embed_tokens[...]).astype(jnp.float32)
        return jnp.einsum("se,ev->sv", final, self.lm_head[...]).astype(jnp.float32)


# ---------------------------------------------------------------- loading

def eagle_config(hf: dict, method: str, target_arch: ArchConfig, source: str) -> EagleConfig:
    """The head's EagleConfig from its config.json dict."""
    if method not in METHODS:
        raise CheckpointError(f"{source}: EAGLE method {method!r}: choose eagle or eagle3")
    arch = arch_from_hf_config(dict(hf, architectures=["LlamaForCausalLM"]), source)
    arch = dataclasses.replace(arch, num_layers=1)
    e = arch.hidden_size
    aux = ()
    if method == "eagle3":
        aux = tuple((hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
                    or default_aux_layers(target_arch.num_layers))
        fc_in = len(aux) * hf.get("target_hidden_size", target_arch.hidden_size)
    else:
        fc_in = 2 * e
    return EagleConfig(
        method=method, arch=arch, fc_in=fc_in, fc_bias=bool(hf.get("bias", False)),
        draft_vocab_size=int(hf.get("draft_vocab_size") or arch.vocab_size),
        aux_layer_ids=aux, norm_before_residual=bool(hf.get("norm_before_residual", False)),
        tied_target_head=method == "eagle" and target_arch.tie_word_embeddings)


def default_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    """vLLM's EAGLE-3 default: an early, the middle and a late target layer."""
    n = num_target_layers
    return (2, n // 2, n - 3)


def _heads_in(a, w):       # [H*D, in] -> [in, H, D]
    return w.reshape(a.num_heads, a.head_dim, -1).transpose(2, 0, 1)


def _kv_in(a, k, v):       # [K*D, in] x2 -> [in, 2, K, D]
    return np.stack([x.reshape(a.num_kv_heads, a.head_dim, -1) for x in (k, v)]
                    ).transpose(3, 0, 1, 2)


# Head parameter <- checkpoint tensors (names after the prefix rewrite) and how.
_LAYER = {
    "layer.input_layernorm.weight": (("layers.0.input_layernorm.weight",), lambda a, w: w),
    "layer.post_attention_layernorm.weight":
        (("layers.0.post_attention_layernorm.weight",), lambda a, w: w),
    "layer.self_attn.q_proj": (("layers.0.self_attn.q_proj.weight",), _heads_in),
    "layer.self_attn.kv_proj": (("layers.0.self_attn.k_proj.weight",
                                 "layers.0.self_attn.v_proj.weight"), _kv_in),
    "layer.self_attn.o_proj": (("layers.0.self_attn.o_proj.weight",),
                               lambda a, w: w.T.reshape(a.num_heads, a.head_dim, -1)),
    "layer.mlp.gate_up_proj": (("layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight"),
                               lambda a, g, u: np.stack([g.T, u.T], axis=1)),
    "layer.mlp.down_proj": (("layers.0.mlp.down_proj.weight",), lambda a, w: w.T),
    "fc": (("fc.weight",), lambda a, w: w.T),
    "fc_bias": (("fc.bias",), lambda a, w: w),
    "hidden_norm.weight": (("layers.0.hidden_norm.weight",), lambda a, w: w),
    "norm.weight": (("norm.weight",), lambda a, w: w),
    "lm_head": (("lm_head.weight",), lambda a, w: w.T),
}


def _canonical(name: str) -> str:
    if name.startswith("model."):
        name = name[len("model."):]
    return name.replace("midlayer.", "layers.0.")


class _HeadTensors:
    """The head's safetensors under canonical names."""

    def __init__(self, folder: str):
        from jaxllm.models.loader import SafetensorsReader
        self.reader = SafetensorsReader(folder)
        self.names = {_canonical(n): n for n in self.reader.names()}
        self.folder = folder

    def has(self, name: str) -> bool:
        return name in self.names

    def get(self, name: str) -> np.ndarray:
        if name not in self.names:
            raise CheckpointError(f"{self.folder}: missing tensor {name}")
        return self.reader.get(self.names[name])

    def raw(self, name: str) -> np.ndarray:
        return np.asarray(self.reader.raw(self.names[name]))


def load_eagle_head(folder: str, method: str, target, dtype, shardings):
    """(EagleConfig, graphdef, state) of the head in `folder`, sharing the target's
    embedding (unless the head stores one) and, for EAGLE-1, its lm_head. `target`:
    the target's LoadedModel; `shardings(path, logical_axes, shape)` as the loader's."""
    from jaxllm.models.loader import param_path, read_hf_config
    from jaxllm.spec_decode.config import check_draft_vocab
    hf = read_hf_config(folder)
    source = os.path.join(folder, "config.json")
    cfg = eagle_config(hf, method, target.arch, source)
    check_draft_vocab(target.arch.vocab_size, cfg.arch.vocab_size, folder)
    tensors = _HeadTensors(folder)
    graphdef, abstract = nnx.split(nnx.eval_shape(
        lambda: EagleHead(cfg, dtype, rngs=nnx.Rngs(0))))
    leaves = []
    for path, var in nnx.to_flat_state(abstract):
        name, want = param_path(path), var.get_value().shape
        value = _shared(name, tensors, target)
        if value is None:
            array = _head_array(cfg, tensors, name)
            if tuple(array.shape) != tuple(want):
                raise CheckpointError(f"{folder}: {name} has shape {tuple(array.shape)}, "
                                      f"the config needs {tuple(want)}")
            sharding = shardings(path, var.get_metadata().get("out_sharding"), want)
            value = jax.device_put(array.astype(var.get_value().dtype), sharding)
        leaves.append((path, var.replace(value=value)))
    return cfg, graphdef, nnx.from_flat_state(leaves)


def _shared(name: str, tensors: _HeadTensors, target):
    """The target's array for a parameter the head takes from it, else None."""
    if name == "embed_tokens" and not tensors.has("embed_tokens.weight"):
        return target.state["embed_tokens"].get_value()
    if name == "lm_head" and not tensors.has("lm_head.weight"):
        return target.state["lm_head"].get_value()
    return None


def _head_array(cfg: EagleConfig, tensors: _HeadTensors, name: str) -> np.ndarray:
    if name == "embed_tokens":
        return tensors.get("embed_tokens.weight")
    if name == "d2t":
        if not tensors.has("d2t"):
            return np.zeros(cfg.draft_vocab_size, np.int32)
        return tensors.raw("d2t").astype(np.int32)
    if name == "layer.input_layernorm.weight" and cfg.method == "eagle":
        # EAGLE-1 skips this norm; the parameter exists only to keep one layer class.
        return np.ones(cfg.arch.hidden_size, np.float32)
    hf_names, combine = _LAYER[name]
    return np.asarray(combine(cfg.arch, *[tensors.get(n) for n in hf_names]))
