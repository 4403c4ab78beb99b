"""KV write kernel (interpret mode): every written slot exact, every other slot untouched."""
from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import E5M2, FP8, run, same_bits
from pallas_kernels.reshape_and_cache import ref_reshape_and_cache, reshape_and_cache

CASES = {
    # name: (Hkv, D, BS, x dtype, cache dtype, scale, tokens_per_program)
    "f32_h2_d64": (2, 64, 16, jnp.float32, jnp.float32, 1.0, None),
    "bf16_h8_d128": (8, 128, 32, jnp.bfloat16, jnp.bfloat16, 1.0, 4),
    "fp8_h3_d80": (3, 80, 16, jnp.float32, FP8, 0.5, 8),
    "e5m2_h2_d64": (2, 64, 16, jnp.bfloat16, E5M2, 1.0, 4),
}


@pytest.mark.parametrize("name", list(CASES))
def test_writes_exactly_the_mapped_slots(name):
    hkv, d, bs, x_dtype, c_dtype, scale, tpp = CASES[name]
    rng = np.random.default_rng(0)
    nb, num_tokens = 9, 37
    k_cache = jnp.full((hkv, nb, bs, d), jnp.nan, c_dtype)
    v_cache = jnp.asarray(rng.standard_normal((hkv, nb, bs, d)), c_dtype)
    k = jnp.asarray(rng.standard_normal((num_tokens, hkv, d)), x_dtype)
    v = jnp.asarray(rng.standard_normal((num_tokens, hkv, d)), x_dtype)
    slots = rng.choice(np.arange(bs, nb * bs), num_tokens, replace=False).astype(np.int32)
    slots[[0, 5, 6, num_tokens - 1]] = -1                      # padding tokens
    write = functools.partial(reshape_and_cache, k_scale=scale, v_scale=scale,
                              tokens_per_program=tpp, interpret=True)
    new_k, new_v = run(write, k, v, k_cache, v_cache, jnp.asarray(slots))

    ref_k, ref_v = ref_reshape_and_cache(k, v, k_cache, v_cache, jnp.asarray(slots),
                                         scale, scale)
    assert same_bits(new_k, ref_k) and same_bits(new_v, ref_v)
    # Independently of the reference: written slots hold the cast values, the rest
    # (including block 0 and the NaNs) is bit-identical to before.
    live = slots >= 0
    flat = lambda c: np.asarray(c).reshape(hkv, nb * bs, d)  # noqa: E731
    expect = (np.asarray(k, np.float32) / (scale if c_dtype in (FP8, E5M2) else 1.0))[live]
    got = flat(new_k)[:, slots[live]].astype(np.float32).swapaxes(0, 1)
    assert np.array_equal(got, np.asarray(jnp.asarray(expect).astype(c_dtype), np.float32))
    untouched = np.ones(nb * bs, bool)
    untouched[slots[live]] = False
    # e5m2 has several NaN encodings, and interpret mode writes the untouched NaNs
    # back in the canonical one: compare those by value there.
    same = same_bits if c_dtype != E5M2 else lambda a, b: np.array_equal(
        a.astype(np.float32), b.astype(np.float32), equal_nan=True)
    for new, old in ((new_k, k_cache), (new_v, v_cache)):
        assert same(flat(new)[:, untouched], flat(old)[:, untouched])


@pytest.mark.parametrize("tpp", [None, 3])
def test_head_offsets_read_k_and_v_in_place_from_a_fused_array(tpp):
    """k and v given as one [T, Hq + 2 Hkv, D] array with head offsets write exactly
    what the separate k and v arrays write."""
    hq, hkv, d, bs, nb, num_tokens = 6, 2, 64, 16, 5, 11
    rng = np.random.default_rng(3)
    qkv = jnp.asarray(rng.standard_normal((num_tokens, hq + 2 * hkv, d)), jnp.float32)
    cache = jnp.full((hkv, nb, bs, d), jnp.nan, jnp.float32)
    slots = rng.choice(np.arange(bs, nb * bs), num_tokens, replace=False).astype(np.int32)
    slots[2] = -1
    slots = jnp.asarray(slots)
    k, v = qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    want = ref_reshape_and_cache(k, v, cache, cache, slots)
    offsets = (hq, hq + hkv)
    got = run(functools.partial(reshape_and_cache, head_offsets=offsets, tokens_per_program=tpp,
                                interpret=True), qkv, qkv, cache, cache, slots)
    ref = ref_reshape_and_cache(qkv, qkv, cache, cache, slots, head_offsets=offsets)
    for g, w, r in zip(got, want, ref):
        assert same_bits(g, w) and same_bits(r, w)


@pytest.mark.parametrize("c_dtype", [FP8, E5M2], ids=str)
def test_fp8_write_saturates(c_dtype):
    """A value past the format's range divided by its scale is stored as the largest
    finite value, as vLLM's conversion and the GPU's saturate (a plain XLA cast would
    store NaN), by the kernel and its reference alike."""
    top = float(jnp.finfo(c_dtype).max)
    k = jnp.asarray([[[3 * top, -3 * top, 1.0, -2.0]]], jnp.float32)      # [T=1, 1, 4]
    cache = jnp.zeros((1, 2, 8, 4), c_dtype)
    slots = jnp.asarray([9], jnp.int32)
    write = functools.partial(reshape_and_cache, k_scale=2.0, v_scale=0.5, interpret=True)
    for new_k, new_v in (run(write, k, k, cache, cache, slots),
                         ref_reshape_and_cache(k, k, cache, cache, slots, 2.0, 0.5)):
        np.testing.assert_array_equal(np.asarray(new_k[0, 1, 1], np.float32),
                                      [top, -top, 0.5, -1.0])
        np.testing.assert_array_equal(np.asarray(new_v[0, 1, 1], np.float32),
                                      [top, -top, 2.0, -4.0])
