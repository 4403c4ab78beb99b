"""The Mosaic GPU W4A16 kernel (pallas_kernels/w4a16_mgpu.py): its load-time layout
against the checkpoint's, the kernel in GPU interpret mode against its plain-jnp twin,
and its lowering for CUDA (Mosaic's layout inference runs there, on this CPU)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_lowering import lower_for_cuda

from pallas_kernels import quant_matmul as qmm
from pallas_kernels import w4a16_mgpu as w4

G = w4.GROUP


def _checkpoint(n, k, seed=0):
    """Random uint4 weights two a byte, f32 scales and integer zero points."""
    ks = jax.random.split(jax.random.key(seed), 3)
    wu8 = jax.random.randint(ks[0], (n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    s = jax.random.uniform(ks[1], (n, k // G), jnp.float32, 0.01, 0.02)
    z = jnp.round(jax.random.uniform(ks[2], (n, k // G), jnp.float32, 0.0, 15.0))
    return wu8, s, z


def _x(m, k, seed=1):
    return jax.random.normal(jax.random.key(seed), (m, k), jnp.float32).astype(jnp.bfloat16)


def test_kernel_weight_holds_q_minus_8():
    wu8, _, _ = _checkpoint(8, 256)
    q = np.asarray(w4.kernel_weight(wu8)).astype(np.int32)
    b = np.asarray(wu8).astype(np.int32)
    nibbles = np.stack([b & 15, b >> 4], axis=-1).reshape(8, 256)
    np.testing.assert_array_equal(q, nibbles - 8)


def test_layout_reference_matches_the_checkpoint_reference():
    """The twin on the kernel's layout computes what the checkpoint's weights mean, to
    the bf16 rounding of the scales (one relative unit of 2^-9 a group)."""
    wu8, s, z = _checkpoint(64, 512)
    x = _x(4, 512)
    want = qmm.ref_quant_matmul_int4(x, wu8, s, z, group=G, out_dtype=jnp.float32)
    got = w4.ref_w4a16_matmul(x, w4.kernel_weight(wu8), *w4.kernel_scales(s, z),
                              out_dtype=jnp.float32)
    scale = float(jnp.max(jnp.abs(want)))
    assert float(jnp.max(jnp.abs(got - want))) < 6e-3 * scale
    # and not by accident: zero points ignored would be far off
    bad = w4.ref_w4a16_matmul(x, w4.kernel_weight(wu8), *w4.kernel_scales(s, z * 0),
                              out_dtype=jnp.float32)
    assert float(jnp.max(jnp.abs(bad - want))) > 0.1 * scale


@pytest.mark.parametrize("m,n,k,settings", [
    (1, 128, 256, {}),
    (5, 256, 512, dict(k_splits=2)),
    (16, 128, 512, dict(k_splits=4, tile_n=64)),
    (33, 64, 256, dict(tile_n=64, stages=2)),
    (64, 128, 384, dict(k_splits=3)),
], ids=str)
def test_kernel_matches_reference_interpret(m, n, k, settings):
    wu8, s, z = _checkpoint(n, k, seed=m)
    args = (_x(m, k, seed=m + 1), w4.kernel_weight(wu8), *w4.kernel_scales(s, z))
    got = w4.w4a16_matmul(*args, out_dtype=jnp.float32, interpret=True, **settings)
    want = w4.ref_w4a16_matmul(*args, out_dtype=jnp.float32)
    assert got.shape == (m, n)
    # the kernel rounds the widened weight's product and sum apart (bf16), the twin once
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                               atol=4e-3 * float(jnp.max(jnp.abs(want))))


def test_bad_shapes_are_refused():
    wu8, s, z = _checkpoint(128, 256)
    q, (sk, bk) = w4.kernel_weight(wu8), w4.kernel_scales(s, z)
    with pytest.raises(ValueError, match="int4"):
        w4.w4a16_matmul(_x(4, 256), wu8, sk, bk)
    with pytest.raises(ValueError, match="scales"):
        w4.w4a16_matmul(_x(4, 256), q, sk[:1], bk[:1])
    with pytest.raises(ValueError, match="M 65"):
        w4.w4a16_matmul(_x(65, 256), q, sk, bk)
    with pytest.raises(ValueError, match="k_splits"):
        w4.w4a16_matmul(_x(4, 256), q, sk, bk, k_splits=4)


SD = jax.ShapeDtypeStruct


@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
                         ids=["qkv", "o", "gate_up", "down"])
def test_lowers_for_cuda(m, n, k):
    """Every Llama-3.1-8B projection at decode sizes: Mosaic's layout inference and
    lowering run here, so a kernel the GPU cannot lower fails CI."""
    args = (SD((m, k), jnp.bfloat16), SD((n, k), jnp.int4), SD((k // G, n), jnp.bfloat16),
            SD((k // G, n), jnp.bfloat16))
    assert "mosaic_gpu" in lower_for_cuda(functools.partial(w4.w4a16_matmul), *args)


def test_checkpoint_operands_unsigned_match_the_checkpoint_reference():
    """The checkpoint's bytes reread as int4 (a bitcast) with ``unsigned``: the kernel
    (interpret mode) and its twin compute what the checkpoint's weights mean."""
    wu8, s, z = _checkpoint(128, 512, seed=7)
    x = _x(6, 512, seed=8)
    want = qmm.ref_quant_matmul_int4(x, wu8, s, z, group=G, out_dtype=jnp.float32)
    ops = w4.checkpoint_operands(wu8, s, z)
    twin = w4.ref_w4a16_matmul(x, *ops, unsigned=True, out_dtype=jnp.float32)
    got = w4.w4a16_matmul(x, *ops, unsigned=True, k_splits=2, out_dtype=jnp.float32,
                          interpret=True)
    scale = float(jnp.max(jnp.abs(want)))
    assert float(jnp.max(jnp.abs(twin - want))) < 6e-3 * scale
    np.testing.assert_allclose(np.asarray(got), np.asarray(twin), rtol=0, atol=4e-3 * scale)
    signed = w4.ref_w4a16_matmul(x, *ops, out_dtype=jnp.float32)    # unsigned forgotten
    assert float(jnp.max(jnp.abs(signed - want))) > 0.1 * scale
