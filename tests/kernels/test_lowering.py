"""Each kernel lowers for CUDA on this CPU machine (Triton IR is built and shape-checked
here; a Triton shape error fails CI without a GPU)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from cuda_lowering import lower_for_cuda

from pallas_kernels.paged_attention_decode import decode_and_write, paged_attention_decode
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.reshape_and_cache import reshape_and_cache

SD = jax.ShapeDtypeStruct
BF16, FP8, E5M2, I32 = jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int32


def _shapes(num_tokens, num_seqs, hq, hkv, d, bs, kv_dtype, q_dtype=BF16, nb=4000, width=64):
    pool = SD((hkv, nb, bs, d), kv_dtype)
    return (SD((num_tokens, hq, d), q_dtype), pool, pool, SD((num_seqs, width), I32),
            SD((num_seqs,), I32), SD((num_seqs + 1,), I32))


# (Hq, Hkv, D, BS, KV dtype, sliding window, settings)
CONFIGS = [
    (32, 8, 128, 16, BF16, None, {}),                      # the benchmark shape
    (32, 8, 128, 16, FP8, None, {}),
    (8, 8, 64, 32, BF16, None, dict(blocks_per_step=4)),
    (32, 4, 96, 16, BF16, 4096, {}),                       # G=8, padded head dim
    (9, 3, 64, 16, FP8, None, {}),                         # G=3 (SmolLM2)
    (32, 8, 128, 16, E5M2, None, {}),                      # --kv-cache-dtype fp8_e5m2
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_decode_lowers(cfg):
    hq, hkv, d, bs, kv_dtype, window, settings = cfg
    args = _shapes(64, 64, hq, hkv, d, bs, kv_dtype)[:5]
    fn = functools.partial(paged_attention_decode, sm_scale=0.1, sliding_window=window,
                           **settings)
    assert "triton" in lower_for_cuda(fn, *args)


def test_spread_decode_lowers():
    """Programs shared among the live rows of a bucket of 8 (the plan read in-kernel)."""
    args = _shapes(8, 8, 32, 8, 128, 16, BF16, width=128)[:5]
    fn = functools.partial(paged_attention_decode, sm_scale=0.1, sliding_window=4096,
                           spread=True)
    assert "triton" in lower_for_cuda(fn, *args)


@pytest.mark.parametrize("settings", [dict(blocks_per_step=8, per_block=True),
                                      dict(blocks_per_step=16, num_stages=3),
                                      dict(dot_dtype=BF16), dict(spread=True)], ids=str)
def test_fp8_decode_settings_lower(settings):
    """The fp8 KV settings the kernel sweep tries (f16 dots unless dot_dtype says)."""
    args = _shapes(64, 64, 32, 8, 128, 16, FP8)[:5]
    fn = functools.partial(paged_attention_decode, sm_scale=0.1, **settings)
    assert "triton" in lower_for_cuda(fn, *args)


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_ragged_lowers(cfg):
    hq, hkv, d, bs, kv_dtype, window, settings = cfg
    args = _shapes(512, 16, hq, hkv, d, bs, kv_dtype)
    fn = functools.partial(ragged_paged_attention, sm_scale=0.1, sliding_window=window,
                           **settings)
    assert "triton" in lower_for_cuda(fn, *args)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, BF16], ids=str)
def test_every_dtype_and_head_dim_lowers(dtype, d):
    """The nine dtype x head_dim combinations a model may run (tiles from
    default_settings; their shared memory is only checked on the device)."""
    decode = functools.partial(paged_attention_decode, sm_scale=0.1)
    args = _shapes(64, 64, 16, 4, d, 16, dtype, q_dtype=dtype)
    assert "triton" in lower_for_cuda(decode, *args[:5])
    ragged = functools.partial(ragged_paged_attention, sm_scale=0.1)
    assert "triton" in lower_for_cuda(ragged, *_shapes(512, 16, 16, 4, d, 16, dtype,
                                                       q_dtype=dtype))


@pytest.mark.parametrize("hkv,d,dtype", [(8, 128, BF16), (3, 80, FP8), (2, 64, BF16)])
def test_kv_write_lowers(hkv, d, dtype):
    pool = SD((hkv, 1000, 16, d), dtype)
    x = SD((256, hkv, d), BF16)
    fn = functools.partial(reshape_and_cache, k_scale=0.5, v_scale=0.5)
    assert "triton" in lower_for_cuda(fn, x, x, pool, pool, SD((256,), I32))


def test_fused_qkv_decode_path_lowers():
    """The decode step's path on a fused [T, Hq + 2 Hkv, D] array (KV write and decode
    kernel reading their rows in place)."""
    hq, hkv, d = 32, 8, 128
    qkv = SD((64, hq + 2 * hkv, d), BF16)
    pool = SD((hkv, 4000, 16, d), BF16)
    write = functools.partial(reshape_and_cache, head_offsets=(hq, hq + hkv))
    assert "triton" in lower_for_cuda(write, qkv, qkv, pool, pool, SD((64,), I32))
    decode = functools.partial(paged_attention_decode, sm_scale=0.1, num_q_heads=hq)
    assert "triton" in lower_for_cuda(decode, qkv, pool, pool, SD((64, 64), I32), SD((64,), I32))


@pytest.mark.parametrize("kv_dtype,settings", [(BF16, {}), (FP8, dict(spread=True)),
                                               (E5M2, {})],
                         ids=str)
def test_decode_and_write_lowers(kv_dtype, settings):
    """The decode kernel that writes the step's keys and values itself (pools aliased
    to its outputs), on the fused q/k/v array."""
    hq, hkv, d = 32, 8, 128
    qkv = SD((8, hq + 2 * hkv, d), BF16)
    pool = SD((hkv, 4000, 16, d), kv_dtype)
    fn = functools.partial(decode_and_write, sm_scale=0.1, num_q_heads=hq, k_scale=0.5,
                           v_scale=0.5, **settings)
    assert "triton" in lower_for_cuda(fn, qkv, pool, pool, SD((8, 128), I32), SD((8,), I32),
                                      SD((8,), I32))


def test_mixed_step_lowers():
    """A step that is not pure decode: the ragged kernel and the decode kernel (for the
    one-query sequences) in one program."""
    from pallas_kernels.dispatch import mixed_step_attention
    fn = functools.partial(mixed_step_attention, sm_scale=0.1)
    text = lower_for_cuda(fn, *_shapes(512, 16, 32, 8, 128, 16, BF16))
    assert "ragged_paged_attention" in text and "paged_attention_decode" in text
