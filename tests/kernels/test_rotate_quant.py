"""pallas_kernels/rotate_quant.py: the rotation and asymmetric int8 quantization of a
layer's input in one kernel, against its reference twin and against the layer's own
XLA path (rotation.rotate, then quantize_per_token_asym), in interpret mode; and its
lowering for CUDA at the Llama-3.1-8B shapes."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_lowering import lower_for_cuda

from jaxllm.layers.quantization.linear import quantize_per_token_asym
from jaxllm.layers.quantization.rotation import hadamard, rotate
from pallas_kernels.rotate_quant import ref_rotate_quantize, rint, rotate_quantize

SD = jax.ShapeDtypeStruct


def _x(t, k, dtype, seed=0):
    """Rows with one-signed outlier channels (as SmolLM2's q/k/v inputs), a zero row."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, k)).astype(np.float32)
    x[:, rng.choice(k, 3, replace=False)] += 20.0
    x[-1] = 0.0
    return jnp.asarray(x, dtype)


@pytest.mark.parametrize("t,k,b", [(8, 4096, 64), (3, 576, 64), (5, 1536, 16),
                                   (2, 12352, 64), (1, 64, 64), (4, 14336, 64)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_kernel_matches_reference_and_the_layer_path(t, k, b, dtype):
    """Tiles of 64 blocks (4096 values) with a partial last tile (576 = 9 blocks, 12352
    = 3 tiles and one block): the int8 values, scales and zero points of the reference,
    which are the layer's XLA path's exactly."""
    x, h = _x(t, k, dtype), jnp.asarray(hadamard(b))
    q, s, z = rotate_quantize(x, h, interpret=True)
    rq, rs, rz = ref_rotate_quantize(x, h)
    lq, ls, lz = quantize_per_token_asym(rotate(x, 1, b), 1)
    assert np.array_equal(rq, lq) and np.array_equal(rs, ls) and np.array_equal(rz, lz)
    assert q.dtype == jnp.int8 and q.shape == (t, k) and s.shape == z.shape == (t,)
    np.testing.assert_allclose(s, rs, rtol=1e-6)
    assert np.array_equal(z, rz)
    # The kernel's dot sums in its own order: a value at a rounding boundary may land
    # one level over (scripts/check_rotate_quant.py counts them on a GPU).
    d = np.abs(np.asarray(q, np.int32) - np.asarray(rq, np.int32))
    assert d.max() <= 1 and (d > 0).sum() <= max(1, d.size // 10_000)
    assert np.all(np.asarray(q[-1]) == np.asarray(z[-1]))      # zeros stay exactly zero


def test_rounds_half_to_even():
    y = jnp.float32([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 2.4999, 127.5, -128.5, 3.0])
    assert np.array_equal(jax.jit(rint)(y), jnp.round(y))


def test_refuses_what_it_does_not_take():
    h = jnp.asarray(hadamard(32))          # 1/sqrt(32) is not exact in 16 bits
    with pytest.raises(ValueError, match="a 16-bit x and a block of 16 or 64"):
        rotate_quantize(jnp.ones((2, 64), jnp.bfloat16), h, interpret=True)
    with pytest.raises(ValueError, match="a 16-bit x"):
        rotate_quantize(jnp.ones((2, 64), jnp.float32), jnp.asarray(hadamard(64)),
                        interpret=True)


@pytest.mark.parametrize("t,k,b", [(8, 4096, 64), (256, 4096, 64), (8, 14336, 64),
                                   (256, 14336, 64), (8, 64, 64), (8, 576, 64), (8, 64, 16)])
def test_lowers_for_cuda(t, k, b):
    """The 8B shapes, and K under 16 blocks (a tile's dot still has 16 rows)."""
    text = lower_for_cuda(rotate_quantize, SD((t, k), jnp.bfloat16), SD((b, b), jnp.bfloat16))
    assert "__gpu$xla.gpu.triton" in text and f"grid_x = {t}" in text
