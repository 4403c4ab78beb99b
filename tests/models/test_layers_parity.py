"""Per-op parity with HF transformers (torch, float32, CPU); max abs errors bounded."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flax import nnx
from transformers.models.llama import modeling_llama as hf_llama

from conftest import make_hf_config
from jaxllm.layers.rotary import apply_rotary, inv_frequencies
from jaxllm.models.llama import MLP, RMSNorm
from jaxllm.models.registry import arch_from_hf_config
from pallas_kernels.ragged_paged_attention import ref_ragged_paged_attention

RNG = np.random.default_rng(0)


def test_rmsnorm():
    x = RNG.standard_normal((7, 64)).astype(np.float32)
    w = RNG.uniform(0.5, 1.5, 64).astype(np.float32)
    hf = hf_llama.LlamaRMSNorm(64, eps=1e-5)
    hf.weight.data = torch.tensor(w)
    ours = RMSNorm(64, 1e-5, jnp.float32)
    ours.weight[...] = jnp.asarray(w)
    err = np.abs(np.asarray(ours(jnp.asarray(x))) - hf(torch.tensor(x)).detach().numpy()).max()
    assert err < 1e-5


@pytest.mark.parametrize("arch", ["llama", "llama_tied"])   # llama3 scaling / default
def test_rotary(arch):
    cfg = make_hf_config(arch)
    a = arch_from_hf_config(cfg.to_dict())
    pos = np.array([0, 1, 5, 63, 64, 200, 511])
    q = RNG.standard_normal((len(pos), 4, a.head_dim)).astype(np.float32)
    k = RNG.standard_normal((len(pos), 2, a.head_dim)).astype(np.float32)
    rope = hf_llama.LlamaRotaryEmbedding(cfg)
    cos, sin = rope(torch.tensor(q), torch.tensor(pos)[None])
    hq, hk = hf_llama.apply_rotary_pos_emb(torch.tensor(q).transpose(0, 1)[None],
                                           torch.tensor(k).transpose(0, 1)[None], cos, sin)
    inv = inv_frequencies(a.head_dim, a.rope_theta, a.rope_scaling)
    oq = np.asarray(apply_rotary(jnp.asarray(q), jnp.asarray(pos), inv))
    ok = np.asarray(apply_rotary(jnp.asarray(k), jnp.asarray(pos), inv))
    assert np.abs(oq - hq[0].transpose(0, 1).numpy()).max() < 1e-4
    assert np.abs(ok - hk[0].transpose(0, 1).numpy()).max() < 1e-4


def test_mlp():
    cfg = make_hf_config("llama")
    a = arch_from_hf_config(cfg.to_dict())
    hf = hf_llama.LlamaMLP(cfg)
    ours = MLP(a, jnp.float32, nnx.Rngs(0))
    ours.gate_up_proj[...] = jnp.asarray(np.stack([hf.gate_proj.weight.detach().numpy().T,
                                                   hf.up_proj.weight.detach().numpy().T], 1))
    ours.down_proj[...] = jnp.asarray(hf.down_proj.weight.detach().numpy().T)
    x = RNG.standard_normal((9, a.hidden_size)).astype(np.float32)
    err = np.abs(np.asarray(ours(jnp.asarray(x))) - hf(torch.tensor(x)).detach().numpy()).max()
    assert err < 1e-5


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (8, 1)])
def test_paged_attention_vs_torch_sdpa(hq, hkv):
    """Ragged chunks over a block pool with random tables vs dense causal SDPA per
    sequence (the query chunk is the tail of the sequence)."""
    d, bs, nb = 32, 16, 40
    seq_lens, q_lens = [5, 40, 17, 33], [5, 1, 9, 16]
    k_cache = np.full((hkv, nb, bs, d), np.nan, np.float32)
    v_cache = np.full((hkv, nb, bs, d), np.nan, np.float32)
    free = list(RNG.permutation(np.arange(1, nb)))
    width = max(-(-n // bs) for n in seq_lens)
    tables = np.zeros((len(seq_lens), width), np.int32)
    qs, refs = [], []
    for i, (n, ql) in enumerate(zip(seq_lens, q_lens)):
        blocks = [free.pop() for _ in range(-(-n // bs))]
        tables[i, :len(blocks)] = blocks
        k = RNG.standard_normal((n, hkv, d)).astype(np.float32)
        v = RNG.standard_normal((n, hkv, d)).astype(np.float32)
        for p in range(n):
            k_cache[:, blocks[p // bs], p % bs] = k[p]
            v_cache[:, blocks[p // bs], p % bs] = v[p]
        q = RNG.standard_normal((ql, hq, d)).astype(np.float32)
        qs.append(q)
        mask = torch.tensor(np.arange(n)[None, :] <= np.arange(n - ql, n)[:, None])
        rep = hq // hkv
        kt = torch.tensor(k).transpose(0, 1).repeat_interleave(rep, 0)
        vt = torch.tensor(v).transpose(0, 1).repeat_interleave(rep, 0)
        out = F.scaled_dot_product_attention(torch.tensor(q).transpose(0, 1), kt, vt,
                                             attn_mask=mask, scale=d ** -0.5)
        refs.append(out.transpose(0, 1).numpy())
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    out = ref_ragged_paged_attention(
        jnp.asarray(np.concatenate(qs)), jnp.asarray(k_cache), jnp.asarray(v_cache),
        jnp.asarray(tables), jnp.asarray(seq_lens, dtype=jnp.int32), jnp.asarray(qsl),
        sm_scale=d ** -0.5)
    err = np.abs(np.asarray(out) - np.concatenate(refs)).max()
    assert err < 1e-5, err
