"""The pallas backend through the attention seam, against the reference backend."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.layers.attention import AttentionMetadata, AttentionSpec, paged_attention
from kernel_cases import assert_close, make_case, run, same_bits


def _step(case, decode_only, num_tokens=None):
    """Metadata + new K/V for a step whose last q_len tokens per sequence are new."""
    rng = np.random.default_rng(7)
    q = case.q if num_tokens is None else jnp.zeros((num_tokens,) + case.q.shape[1:])
    if num_tokens is not None:
        q = q.at[:case.q.shape[0]].set(case.q)
    hkv, _, bs, d = case.k_cache.shape
    qsl, lens = np.asarray(case.query_start_loc), np.asarray(case.seq_lens)
    tables = np.asarray(case.block_tables)
    slots = np.full(q.shape[0], -1, np.int32)
    for i in range(len(lens)):
        for j, t in enumerate(range(qsl[i], qsl[i + 1])):
            pos = lens[i] - (qsl[i + 1] - qsl[i]) + j
            slots[t] = tables[i, pos // bs] * bs + pos % bs
    md = AttentionMetadata(jnp.asarray(slots), case.block_tables, case.seq_lens,
                           case.query_start_loc, decode_only=decode_only)
    k = jnp.asarray(rng.standard_normal((q.shape[0], hkv, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((q.shape[0], hkv, d)), jnp.float32)
    return q, k, v, md


@pytest.mark.parametrize("layout", ["mixed", "decode", "decode_padded_tokens"])
def test_pallas_backend_matches_reference(layout):
    if layout == "mixed":
        c = make_case(0, q_lens=[7, 1, 0, 12], kv_lens=[30, 18, 0, 12], hq=4, hkv=2, d=64,
                      bs=16, pad_tokens=3)
        q, k, v, md = _step(c, decode_only=False)
    else:
        c = make_case(0, q_lens=[1, 1, 1, 0], kv_lens=[30, 1, 47, 0], hq=4, hkv=2, d=64,
                      bs=16)
        q, k, v, md = _step(c, True, num_tokens=4 if layout == "decode" else 6)
    ref_spec = AttentionSpec(sm_scale=0.3, sliding_window=40)
    pallas_spec = AttentionSpec(sm_scale=0.3, sliding_window=40, backend="pallas",
                                interpret=True)
    caches = (c.k_cache, c.v_cache)
    want = paged_attention(q, k, v, *caches, md, ref_spec)
    got = run(lambda *a: paged_attention(*a, md, pallas_spec), q, k, v, *caches)
    assert_close(got[0], want[0])
    assert same_bits(got[1], want[1]) and same_bits(got[2], want[2])


@pytest.mark.parametrize("backend", ["reference", "pallas"])
@pytest.mark.parametrize("num_tokens", [4, 6])
def test_fused_qkv_matches_separate_q_k_v(backend, num_tokens):
    """paged_attention_qkv on [T, Hq + 2 Hkv, D] gives what paged_attention gives on its
    three slices: the pallas decode path reads q, k and v in place from the fused array
    (4 tokens: the runner's decode layout; 6: padded tokens take the sliced path)."""
    from jaxllm.layers.attention import paged_attention_qkv
    c = make_case(1, q_lens=[1, 1, 1, 0], kv_lens=[30, 1, 47, 0], hq=8, hkv=2, d=64, bs=16)
    q, k, v, md = _step(c, True, num_tokens=num_tokens)
    spec = AttentionSpec(sm_scale=0.3, backend=backend, interpret=backend == "pallas")
    caches = (c.k_cache, c.v_cache)
    want = paged_attention(q, k, v, *caches, md, AttentionSpec(sm_scale=0.3))
    qkv = jnp.concatenate([q, k, v], axis=1)
    got = run(lambda x, kc, vc: paged_attention_qkv(x, kc, vc, md, spec, 8), qkv, *caches)
    assert_close(got[0], want[0])
    assert same_bits(got[1], want[1]) and same_bits(got[2], want[2])


def _decode_step_fn(spec, md, fused):
    """(fn, args builder): the pure-decode attention path, q/k/v apart or fused."""
    from jaxllm.layers.attention import paged_attention_qkv
    if fused:
        return (lambda qkv, kc, vc: paged_attention_qkv(qkv, kc, vc, md, spec, 8),
                lambda q, k, v, kc, vc: (jnp.concatenate([q, k, v], axis=1), kc, vc))
    return lambda *a: paged_attention(*a, md, spec), lambda *a: a


@pytest.mark.parametrize("options", [
    dict(decode_kv_write=False), dict(decode_spread=True, decode_kv_write=False),
    dict(decode_kv_write=True), dict(decode_spread=True, decode_kv_write=True)], ids=str)
@pytest.mark.parametrize("fused", [False, True])
def test_decode_step_options_match_reference(fused, options):
    """The spec's decode options on both pure-decode paths (q/k/v apart and fused): the
    reference's output and pool. The spread plan (spread_plan's cumsum) is traced only
    when asked for; the KV write goes into the decode kernel on the fused path only."""
    # Tables 39 blocks wide: the fixed split gives each row 5 programs, so spread is on.
    c = make_case(2, q_lens=[1, 1] + [0] * 6, kv_lens=[75, 140] + [0] * 6, hq=8, hkv=2, d=64,
                  bs=16, extra_cols=30)
    q, k, v, md = _step(c, True, num_tokens=8)
    caches = (c.k_cache, c.v_cache)
    want = paged_attention(q, k, v, *caches, md, AttentionSpec(sm_scale=0.3))
    spec = AttentionSpec(sm_scale=0.3, backend="pallas", interpret=True, **options)
    fn, make_args = _decode_step_fn(spec, md, fused)
    args = make_args(q, k, v, *caches)
    jaxpr = str(jax.make_jaxpr(fn)(*args))
    assert ("cumsum" in jaxpr) == spec.decode_spread
    assert jaxpr.count("pallas_call") == (1 if fused and spec.decode_kv_write else 2)
    got = run(fn, *args)
    assert_close(got[0], want[0])
    assert same_bits(got[1], want[1]) and same_bits(got[2], want[2])


@pytest.mark.parametrize("name,field,default", [
    ("JAXLLM_DECODE_SPREAD", "decode_spread", False),
    ("JAXLLM_DECODE_KV_WRITE", "decode_kv_write", True)])
def test_decode_option_switches(monkeypatch, name, field, default):
    monkeypatch.delenv(name, raising=False)
    assert getattr(AttentionSpec(sm_scale=1.0), field) is default
    monkeypatch.setenv(name, "1")
    assert getattr(AttentionSpec(sm_scale=1.0), field) is True
    monkeypatch.setenv(name, "0")
    assert getattr(AttentionSpec(sm_scale=1.0), field) is False
    monkeypatch.setenv(name, "yes")
    with pytest.raises(ValueError, match=f"{name}='yes': 0 or 1 expected"):
        AttentionSpec(sm_scale=1.0)


def test_the_runner_guards_decode_steps_only_where_the_write_is_folded():
    """folds_kv_write: the KV write option on the Pallas backend on one device; the
    reference backend (and tensor parallelism) write apart whatever the option says."""
    assert AttentionSpec(sm_scale=1.0, backend="pallas", decode_kv_write=True).folds_kv_write
    assert not AttentionSpec(sm_scale=1.0, backend="pallas",
                             decode_kv_write=False).folds_kv_write
    assert not AttentionSpec(sm_scale=1.0, decode_kv_write=True).folds_kv_write
