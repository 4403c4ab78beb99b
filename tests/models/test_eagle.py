"""EAGLE-1 and EAGLE-3 heads (random weights written here as HF folders) against a
numpy reference of vLLM's llama_eagle.py / llama_eagle3.py forward: a prompt in one
step, then one token attending to the paged KV the first step wrote."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxllm.layers.attention import AttentionMetadata, AttentionSpec
from jaxllm.models.eagle import EagleHead, load_eagle_head
from jaxllm.models.loader import load_model
from jaxllm.runner import kv_cache
from jaxllm.config import ConfigError

H, HEADS, KV, D, F, W = 64, 4, 2, 16, 112, 50
EPS = 1e-5


def head_config(vocab: int, method: str) -> dict:
    cfg = dict(architectures=["LlamaForCausalLMEagle3" if method == "eagle3" else
                              "LlamaForCausalLM"], model_type="llama", hidden_size=H,
               intermediate_size=F, num_attention_heads=HEADS, num_key_value_heads=KV,
               num_hidden_layers=1, vocab_size=vocab, rms_norm_eps=EPS, rope_theta=10000.0,
               max_position_embeddings=512, torch_dtype="float32")
    if method == "eagle3":
        cfg.update(draft_vocab_size=W, target_hidden_size=H,
                   eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 1]})
    else:
        cfg["bias"] = True
    return cfg


def write_head(folder, vocab: int, method: str, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    w = lambda *shape: rng.normal(0, 0.15, shape).astype(np.float32)  # noqa: E731
    pre = "midlayer." if method == "eagle3" else "layers.0."
    q_in = 2 * H if method == "eagle3" else H
    t = {pre + "self_attn.q_proj.weight": w(HEADS * D, q_in),
         pre + "self_attn.k_proj.weight": w(KV * D, q_in),
         pre + "self_attn.v_proj.weight": w(KV * D, q_in),
         pre + "self_attn.o_proj.weight": w(H, HEADS * D),
         pre + "mlp.gate_proj.weight": w(F, H), pre + "mlp.up_proj.weight": w(F, H),
         pre + "mlp.down_proj.weight": w(H, F),
         pre + "post_attention_layernorm.weight": 1 + w(H)}
    if method == "eagle3":
        t.update({"fc.weight": w(H, 3 * H), pre + "input_layernorm.weight": 1 + w(H),
                  pre + "hidden_norm.weight": 1 + w(H), "norm.weight": 1 + w(H),
                  "lm_head.weight": w(W, H),
                  # head id i -> target id i + d2t[i]: every 3rd target id, shifted
                  "d2t": (np.arange(W) * 2 + 5).astype(np.int64)})
    else:
        t.update({"fc.weight": w(H, 2 * H), "fc.bias": w(H)})
    save_file(t, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(head_config(vocab, method)))
    return t


# ---------------------------------------------------------------- numpy reference

def rms(x, w):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + EPS) * w


def rope(x, pos):          # x [T, h, D], HF's rotate-half layout
    inv = 1.0 / 10000.0 ** (np.arange(0, D, 2) / D)
    ang = pos[:, None] * inv[None]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = x[..., :D // 2], x[..., D // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def attention(t, pre, x, pos):
    """Causal attention of all tokens x [T, in] at positions pos (one sequence)."""
    q = rope((x @ t[pre + "self_attn.q_proj.weight"].T).reshape(-1, HEADS, D), pos)
    k = rope((x @ t[pre + "self_attn.k_proj.weight"].T).reshape(-1, KV, D), pos)
    v = (x @ t[pre + "self_attn.v_proj.weight"].T).reshape(-1, KV, D)
    k, v = np.repeat(k, HEADS // KV, 1), np.repeat(v, HEADS // KV, 1)
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(D)
    s = np.where(np.tril(np.ones((len(x), len(x)), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return (np.einsum("hqk,khd->qhd", p, v).reshape(len(x), -1)
            @ t[pre + "self_attn.o_proj.weight"].T)


def mlp(t, pre, x):
    g, u = x @ t[pre + "mlp.gate_proj.weight"].T, x @ t[pre + "mlp.up_proj.weight"].T
    return (g / (1 + np.exp(-g)) * u) @ t[pre + "mlp.down_proj.weight"].T


def reference(t, method, embed, lm_head, ids, hidden):
    """Target-vocab logits [T, V] and next features [T, E] of every token."""
    pos, e = np.arange(len(ids)), embed[ids]
    if method == "eagle3":
        pre = "midlayer."
        h = hidden @ t["fc.weight"].T
        x = np.concatenate([rms(e, t[pre + "input_layernorm.weight"]),
                            rms(h, t[pre + "hidden_norm.weight"])], -1)
        x = h + attention(t, pre, x, pos)
        out = x + mlp(t, pre, rms(x, t[pre + "post_attention_layernorm.weight"]))
        w = rms(out, t["norm.weight"]) @ t["lm_head.weight"].T
        logits = np.full((len(ids), embed.shape[0]), -np.inf)
        logits[:, np.arange(W) + t["d2t"]] = w
        return logits, out
    pre = "layers.0."
    x = np.concatenate([e, hidden], -1) @ t["fc.weight"].T + t["fc.bias"]
    x = x + attention(t, pre, x, pos)     # no input_layernorm in EAGLE-1
    out = x + mlp(t, pre, rms(x, t[pre + "post_attention_layernorm.weight"]))
    return out @ lm_head, out


# ---------------------------------------------------------------- the head under test

def run_head(cfg, graphdef, state, ids, hidden):
    """The prompt but its last token in one step, then the last token alone (reading
    the first step's paged KV). Returns logits [T, V] and features [T, E]."""
    bs, blocks = 8, [3, 1]
    kv = kv_cache.allocate(cfg.arch, 5, bs, jnp.float32)
    spec = AttentionSpec(sm_scale=D ** -0.5)
    model = nnx_merge(graphdef, state)
    combined = model.combine_hidden_states(jnp.asarray(hidden))
    outs = []
    for lo, hi in ((0, len(ids) - 1), (len(ids) - 1, len(ids))):
        pos = np.arange(lo, hi, dtype=np.int32)
        md = AttentionMetadata(
            slot_mapping=jnp.asarray(np.take(blocks, pos // bs) * bs + pos % bs, jnp.int32),
            block_tables=jnp.asarray([blocks], jnp.int32),
            seq_lens=jnp.asarray([hi], jnp.int32),
            query_start_loc=jnp.asarray([0, hi - lo], jnp.int32), decode_only=hi - lo == 1)
        final, out, kv = model(jnp.asarray(ids[lo:hi], jnp.int32), combined[lo:hi],
                               jnp.asarray(pos), kv, md, spec)
        outs.append((model.compute_logits(final), out))
    return (np.concatenate([np.asarray(o[0]) for o in outs]),
            np.concatenate([np.asarray(o[1]) for o in outs]))


def one_device(path, axes, shape=None):
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def nnx_merge(graphdef, state):
    from flax import nnx
    return nnx.merge(graphdef, state)


@pytest.fixture(scope="module")
def target(tiny_model):
    folder, hf = tiny_model("llama")
    return load_model(folder, "float32"), hf


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_head_forward_matches_reference(target, tmp_path, method):
    loaded, hf = target
    vocab = hf.config.vocab_size
    t = write_head(tmp_path, vocab, method)
    cfg, graphdef, state = load_eagle_head(str(tmp_path), method, loaded, jnp.float32, one_device)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, vocab, 9)
    hidden = rng.normal(0, 1, (9, 3 * H if method == "eagle3" else H)).astype(np.float32)
    embed = hf.model.embed_tokens.weight.detach().numpy()
    lm_head = hf.lm_head.weight.detach().numpy().T
    want_logits, want_out = reference(t, method, embed, lm_head, ids, hidden)
    logits, out = run_head(cfg, graphdef, state, ids, hidden)
    np.testing.assert_allclose(out, want_out, rtol=2e-4, atol=2e-4)
    finite = np.isfinite(want_logits)
    assert (np.isfinite(logits) == finite).all()
    np.testing.assert_allclose(logits[finite], want_logits[finite], rtol=2e-4, atol=2e-4)
    if method == "eagle3":
        assert cfg.aux_layer_ids == (0, 1, 1) and finite.sum(1).tolist() == [W] * 9
    else:   # the target's embedding and head are shared, not copied
        assert state["embed_tokens"].get_value() is loaded.state["embed_tokens"].get_value()


def test_head_vocab_mismatch_is_one_line(target, tmp_path):
    loaded, _ = target
    write_head(tmp_path, 300, "eagle")
    with pytest.raises(ConfigError) as err:
        load_eagle_head(str(tmp_path), "eagle", loaded, jnp.float32, one_device)
    assert "\n" not in str(err.value) and "300" in str(err.value)


def test_eagle_head_class_builds_for_both_methods(target, tmp_path):
    """The head's parameters are those its checkpoint format names (nothing extra
    for EAGLE-3 but the d2t table)."""
    from flax import nnx
    from jaxllm.models.eagle import eagle_config
    loaded, hf = target
    names = {}
    for method in ("eagle", "eagle3"):
        cfg = eagle_config(head_config(hf.config.vocab_size, method), method, loaded.arch, "x")
        head = nnx.eval_shape(lambda: EagleHead(cfg, rngs=nnx.Rngs(0)))
        names[method] = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(head))}
    assert names["eagle3"] - names["eagle"] == {"hidden_norm.weight", "norm.weight", "d2t"}
    assert "fc_bias" in names["eagle"]


def test_target_aux_hidden_states_are_layer_inputs(target):
    """LlamaForCausalLM(aux_layers=...): the residual stream entering each named
    layer (HF's hidden_states[i]), concatenated in the order given; off: unchanged."""
    import torch
    from flax import nnx
    loaded, hf = target
    ids = np.random.default_rng(2).integers(0, hf.config.vocab_size, 6)
    kv = kv_cache.allocate(loaded.arch, 3, 8, jnp.float32)
    pos = np.arange(6, dtype=np.int32)
    md = AttentionMetadata(slot_mapping=jnp.asarray(8 + pos), block_tables=jnp.asarray([[1]]),
                           seq_lens=jnp.asarray([6]), query_start_loc=jnp.asarray([0, 6]))
    model = nnx.merge(loaded.graphdef, loaded.state)
    spec = AttentionSpec(sm_scale=loaded.arch.head_dim ** -0.5)
    hidden, _, aux = model(jnp.asarray(ids), jnp.asarray(pos), kv, md, spec, aux_layers=(1, 0))
    plain, _ = model(jnp.asarray(ids), jnp.asarray(pos), kv, md, spec)
    with torch.no_grad():
        states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    want = np.concatenate([states[1][0].numpy(), states[0][0].numpy()], -1)
    np.testing.assert_allclose(np.asarray(aux), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(hidden), np.asarray(plain))
