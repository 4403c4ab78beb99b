"""Decode paged attention kernel (interpret mode) against its reference."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import E5M2, FP8, assert_close, make_case, run, same_bits
from pallas_kernels.paged_attention_decode import (combine_splits, decode_and_write,
                                                   default_dot_dtype,
                                                   paged_attention_decode,
                                                   ref_decode_and_write,
                                                   ref_paged_attention_decode, spread_plan)

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
    "g4_d64_e5m2": (dict(hq=8, hkv=2, d=64, bs=16, kv_dtype=E5M2),
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


# Live rows anywhere in the bucket; the row of length 0 and the rows past the live ones
# are padding.
SPREAD_LENS = {
    "one_live": [0, 0, 150, 0, 0, 0, 0, 0],
    "two_live": [70, 0, 0, 0, 0, 0, 0, 200],
    "all_live": [1, 16, 37, 100, 130, 64, 65, 5],
    "none_live": [0] * 8,
}


@pytest.mark.parametrize("name", list(SPREAD_LENS))
def test_spread_matches_reference(name):
    lens = SPREAD_LENS[name]
    c = make_case(7, q_lens=[1] * len(lens), kv_lens=lens, hq=8, hkv=2, d=64, bs=16)
    kw = dict(sm_scale=0.3)
    want = ref_paged_attention_decode(*_args(c), **kw)
    for settings in (dict(), dict(k_splits=8, blocks_per_step=1)):
        out = run(functools.partial(paged_attention_decode, interpret=True, spread=True,
                                    **kw, **settings), *_args(c))
        assert_close(out, want)
        assert all((out[i] == 0).all() for i, n in enumerate(lens) if n == 0)


def test_spread_with_window_fp8_and_fused_queries():
    lens = [0, 90, 0, 0]
    c = make_case(8, q_lens=[1] * 4, kv_lens=lens, hq=8, hkv=2, d=64, bs=16,
                  dtype=jnp.bfloat16, kv_dtype=FP8, scale=0.5)
    q, *rest = _args(c)
    fused = jnp.concatenate([q, jnp.full((4, 4, 64), jnp.nan, q.dtype)], axis=1)
    kw = dict(sm_scale=0.3, k_scale=0.5, v_scale=0.5, sliding_window=40)
    want = ref_paged_attention_decode(q, *rest, **kw)
    out = run(functools.partial(paged_attention_decode, interpret=True, spread=True,
                                num_q_heads=8, blocks_per_step=1, **kw), fused, *rest)
    assert_close(out, want, rtol=2e-2)


def test_spread_plan_shares_the_programs_among_live_rows():
    lens = jnp.array([0, 5, 0, 9], jnp.int32)
    row, split, length, ks = (x.tolist() for x in spread_plan(lens, work=16, slots=8))
    assert ks == [8] * 32                        # 16 programs of work over 2 live rows
    assert row[:16] == [1] * 8 + [3] * 8 and split[:16] == list(range(8)) * 2
    assert length == [5] * 8 + [9] * 8 + [0] * 16
    assert row[16:] == [0] * 8 + [2] * 8 and split[16:] == list(range(8)) * 2   # dead rows
    row, split, length, ks = (x.tolist() for x in spread_plan(lens, work=16, slots=4))
    assert ks == [4] * 16 and length == [5] * 4 + [9] * 4 + [0] * 8     # capped at 4
    row, split, length, ks = (x.tolist() for x in spread_plan(jnp.array([3, 4]), 4, 8))
    assert ks == [2] * 16                        # all live: the fixed split's 2 each
    assert row[4:] == [0] * 6 + [1] * 6 and split[4:] == list(range(2, 8)) * 2


@pytest.mark.parametrize("seed", range(4))
def test_spread_plan_writes_every_slot_once(seed):
    rng = np.random.default_rng(seed)
    lens = jnp.asarray(rng.integers(0, 3, 8) * rng.integers(1, 100, 8), jnp.int32)
    for work, slots in ((32, 8), (8, 8), (16, 4)):
        row, split, length, k = np.asarray(spread_plan(lens, work, slots))
        assert sorted(zip(row.tolist(), split.tolist())) == [
            (r, j) for r in range(8) for j in range(slots)]
        # A live row's first k splits work on it; every other slot is written empty.
        live = np.asarray(lens)[row] > 0
        assert (length == np.where(live & (split < k), np.asarray(lens)[row], 0)).all()


def test_k_splits_is_the_fixed_count_where_spread_is_off():
    """spread=True in a bucket that fills the card keeps the fixed launch, with the
    k_splits asked for (in spread it is the most splits a row gets)."""
    c = make_case(13, q_lens=[1] * 128, kv_lens=[100] + [0] * 127, hq=8, hkv=2, d=64,
                  bs=16, extra_cols=40)
    fn = functools.partial(paged_attention_decode, sm_scale=0.3, k_splits=4)
    text = str(jax.make_jaxpr(functools.partial(fn, spread=True))(*_args(c)))
    assert text == str(jax.make_jaxpr(fn)(*_args(c)))
    assert "f32[4,1024,64]" in text                      # 4 slots of partial outputs


def test_spread_is_off_where_each_row_has_one_program():
    """spread builds its plan where the fixed split gives a row several programs, and
    keeps the fixed launch (no plan, no gathering combine) where it gives one."""
    fn = functools.partial(paged_attention_decode, sm_scale=0.3, spread=True)
    for rows, want in ((8, True), (128, False)):     # 2 KV heads: 5 / 1 splits a row
        c = make_case(9, q_lens=[1] * rows, kv_lens=[30] + [0] * (rows - 1), hq=8, hkv=2,
                      d=64, bs=16, extra_cols=40)
        assert ("cumsum" in str(jax.make_jaxpr(fn)(*_args(c)))) == want


def _write_case(seed, lens, *, dtype=jnp.float32, kv_dtype=None, scale=1.0, bs=16, hq=8,
                hkv=2, d=64):
    """A decode step on a fused qkv [S, Hq + 2 Hkv, D] whose newest key and value are not
    in the pool yet: their slots hold NaN, so reading them from the pool shows."""
    c = make_case(seed, q_lens=[1] * len(lens), kv_lens=lens, hq=hq, hkv=hkv, d=d, bs=bs,
                  dtype=dtype, kv_dtype=kv_dtype, scale=scale)
    rng = np.random.default_rng(seed + 100)
    kv = jnp.asarray(rng.standard_normal((len(lens), 2 * hkv, d)), dtype)
    qkv = jnp.concatenate([c.q, kv], axis=1)
    tables = np.asarray(c.block_tables)
    slots = np.array([tables[i, (n - 1) // bs] * bs + (n - 1) % bs if n else -1
                      for i, n in enumerate(lens)], np.int32)
    nan = jnp.asarray(np.nan, c.k_cache.dtype)
    flat = [x.reshape(hkv, -1, d).at[:, slots[slots >= 0]].set(nan).reshape(x.shape)
            for x in (c.k_cache, c.v_cache)]
    return qkv, flat[0], flat[1], c.block_tables, c.seq_lens, jnp.asarray(slots)


WRITE_CASES = {
    # name: (case kwargs, kernel settings)
    "splits": (dict(lens=[1, 16, 37, 100, 0, 130]), dict(k_splits=3, blocks_per_step=1)),
    "whole_tiles": (dict(lens=[64, 128, 0, 32]), dict()),      # newest key ends a tile
    "fp8": (dict(lens=[5, 80, 0, 33], dtype=jnp.bfloat16, kv_dtype=FP8, scale=0.5),
            dict(k_splits=2, blocks_per_step=2)),
    "e5m2": (dict(lens=[5, 80, 0, 33], dtype=jnp.bfloat16, kv_dtype=E5M2),
             dict(k_splits=2, blocks_per_step=2)),
    "spread": (dict(lens=[0, 150, 0, 0, 0, 0, 0, 0]), dict(spread=True, blocks_per_step=1)),
}


@pytest.mark.parametrize("name", list(WRITE_CASES))
def test_decode_and_write_matches_write_then_decode(name):
    case_kw, settings = WRITE_CASES[name]
    args = _write_case(10, **case_kw)
    scale = case_kw.get("scale", 1.0)
    kw = dict(num_q_heads=8, sm_scale=0.3, k_scale=scale, v_scale=scale)
    want = ref_decode_and_write(*args, **kw)
    got = run(functools.partial(decode_and_write, interpret=True, **kw, **settings), *args)
    assert_close(got[0], want[0], rtol=2e-2 if case_kw.get("kv_dtype") else 1e-5)
    assert same_bits(got[1], want[1]) and same_bits(got[2], want[2])


def test_decode_and_write_without_a_slot_writes_nothing_and_reads_the_pool():
    """A live row whose slot is -1 (EAGLE's padding rows): the pool is left alone and
    the newest key is the pool's, as in the reference."""
    qkv, kc, vc, tables, lens, slots = _write_case(12, [30, 45, 0, 9])
    fill = jnp.asarray(np.random.default_rng(3).standard_normal(kc.shape), kc.dtype)
    kc = jnp.where(jnp.isnan(kc), fill, kc)        # the unwritten slots read as numbers
    vc = jnp.where(jnp.isnan(vc), fill, vc)
    slots = slots.at[1].set(-1)
    kw = dict(num_q_heads=8, sm_scale=0.3)
    args = (qkv, kc, vc, tables, lens, slots)
    want = ref_decode_and_write(*args, **kw)
    got = run(functools.partial(decode_and_write, interpret=True, k_splits=2,
                                blocks_per_step=1, **kw), *args)
    assert_close(got[0], want[0])
    assert same_bits(got[1], want[1]) and same_bits(got[2], want[2])


def test_decode_and_write_with_a_sliding_window():
    args = _write_case(11, [90, 7, 0, 40])
    kw = dict(num_q_heads=8, sm_scale=0.3, sliding_window=21)
    want = ref_decode_and_write(*args, **kw)
    got = run(functools.partial(decode_and_write, interpret=True, k_splits=2,
                                blocks_per_step=1, **kw), *args)
    assert_close(got[0], want[0])
    assert same_bits(got[1], want[1]) and same_bits(got[2], want[2])
