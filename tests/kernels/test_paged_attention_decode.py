"""Decode paged attention kernel (interpret mode) against its reference."""
from __future__ import annotations

import functools

import jax.numpy as jnp
import pytest

from kernel_cases import FP8, assert_close, make_case, run
from pallas_kernels.paged_attention_decode import (combine_splits, default_dot_dtype,
                                                   paged_attention_decode,
                                                   ref_paged_attention_decode)

# Context lengths from 1 token to several blocks, partial last blocks, a padding row.
KV_LENS = [1, 16, 37, 100, 0, 130]
CASES = {
    # name: (case kwargs, kernel settings)
    "g1_d64_bs16_1split": (dict(hq=2, hkv=2, d=64, bs=16), dict(k_splits=1, blocks_per_step=2)),
    # More splits than some sequences have steps: empty splits must combine to nothing.
    "g4_d128_bs32_4split": (dict(hq=8, hkv=2, d=128, bs=32),
                            dict(k_splits=4, blocks_per_step=1)),
    "g8_d64_fp8": (dict(hq=8, hkv=1, d=64, bs=16, kv_dtype=FP8, scale=0.5),
                   dict(k_splits=2, blocks_per_step=2)),
    "g3_d96_pad": (dict(hq=6, hkv=2, d=96, bs=16), dict(k_splits=3, blocks_per_step=1)),
    "defaults": (dict(hq=8, hkv=2, d=64, bs=16), dict()),
}


def _decode_case(seed, **kw):
    return make_case(seed, q_lens=[1] * len(KV_LENS), kv_lens=KV_LENS, **kw)


def _args(c):
    return c.q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name):
    case_kw, settings = CASES[name]
    scale = case_kw.get("scale", 1.0)
    c = _decode_case(0, **case_kw)
    kw = dict(sm_scale=0.3, k_scale=scale, v_scale=scale)
    out = run(functools.partial(paged_attention_decode, interpret=True, **kw, **settings),
              *_args(c))
    assert_close(out, ref_paged_attention_decode(*_args(c), **kw))
    assert (out[KV_LENS.index(0)] == 0).all()   # padding row


def test_sliding_window():
    c = _decode_case(1, hq=4, hkv=2, d=64, bs=16)
    kw = dict(sm_scale=0.3, sliding_window=21)
    out = run(functools.partial(paged_attention_decode, interpret=True, k_splits=2,
                                blocks_per_step=1, **kw), *_args(c))
    assert_close(out, ref_paged_attention_decode(*_args(c), **kw))


def test_bfloat16():
    c = _decode_case(2, hq=8, hkv=2, d=64, bs=16, dtype=jnp.bfloat16)
    out = run(functools.partial(paged_attention_decode, sm_scale=0.3, interpret=True,
                                k_splits=2), *_args(c))
    assert_close(out, ref_paged_attention_decode(*_args(c), sm_scale=0.3), rtol=2e-2)


def test_combine_splits_ignores_empty_splits():
    o = jnp.array([[[1.0, 2.0]], [[5.0, 6.0]], [[0.0, 0.0]]])         # [NS=3, R=1, D=2]
    lse = jnp.array([[0.0], [1.0], [-jnp.inf]])
    out = combine_splits(o, lse)
    # weights 2^0 : 2^1
    assert jnp.allclose(out, jnp.array([[(1 + 2 * 5) / 3, (2 + 2 * 6) / 3]]))
    assert (combine_splits(o[2:], lse[2:]) == 0).all()


def test_num_q_heads_reads_the_queries_in_place_from_a_fused_array():
    c = _decode_case(4, hq=8, hkv=2, d=64, bs=16)
    q, *rest = _args(c)
    extra = jnp.full((q.shape[0], 4, q.shape[2]), jnp.nan, q.dtype)   # k/v heads: unused
    fused = jnp.concatenate([q, extra], axis=1)
    want = ref_paged_attention_decode(q, *rest, sm_scale=0.3)
    got = run(functools.partial(paged_attention_decode, sm_scale=0.3, num_q_heads=8,
                                k_splits=2, interpret=True), fused, *rest)
    assert_close(got, want)
    assert_close(ref_paged_attention_decode(fused, *rest, sm_scale=0.3, num_q_heads=8), want)


def test_fp8_kv_under_bf16_queries_runs_the_dots_in_f16():
    assert default_dot_dtype(jnp.bfloat16, FP8) == jnp.float16
    assert default_dot_dtype(jnp.float32, FP8) == jnp.float32     # f32 stays exact
    assert default_dot_dtype(jnp.bfloat16, jnp.bfloat16) == jnp.bfloat16
    c = _decode_case(5, hq=8, hkv=2, d=64, bs=16, dtype=jnp.bfloat16, kv_dtype=FP8,
                     scale=0.5)
    kw = dict(sm_scale=0.3, k_scale=0.5, v_scale=0.5)
    want = ref_paged_attention_decode(*_args(c), **kw)
    for settings in (dict(k_splits=2), dict(blocks_per_step=1, per_block=True)):
        out = run(functools.partial(paged_attention_decode, interpret=True, **kw, **settings),
                  *_args(c))
        assert out.dtype == jnp.bfloat16
        assert_close(out, want, rtol=2e-2)


def test_f16_dots_keep_queries_past_the_f16_range():
    """Queries of 1e5 (beyond f16's 65504) reach the f16 dot scaled by sm_scale * log2(e)
    and give the reference's (sharply peaked) attention, not inf or NaN."""
    c = _decode_case(6, hq=4, hkv=2, d=64, bs=16, dtype=jnp.bfloat16, kv_dtype=FP8)
    q = (c.q.astype(jnp.float32) * 1e5).astype(jnp.bfloat16)
    args = (q, *_args(c)[1:])
    kw = dict(sm_scale=0.1)
    out = run(functools.partial(paged_attention_decode, interpret=True, k_splits=2, **kw),
              *args)
    assert_close(out, ref_paged_attention_decode(*args, **kw), rtol=2e-2)
