"""The Hadamard rotation online int8 applies to each layer's K (rotation.py)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from scipy.linalg import hadamard as scipy_hadamard

from jaxllm.layers.quantization.linear import quantize_per_token_asym
from jaxllm.layers.quantization.rotation import block_size, hadamard, rotate
from jaxllm.layers.quantization.schemes import online_scheme


@pytest.mark.parametrize("k, cap, want", [(4096, 64, 64), (576, 64, 64), (14336, 64, 64),
                                          (96, 64, 32), (24, 64, 8), (7, 64, 1),
                                          (1536, 512, 512)])
def test_block_size_is_the_largest_power_of_two_dividing_k(k, cap, want):
    assert block_size(k, cap) == want


def test_hadamard_is_scipys_normalized_and_its_own_inverse():
    h = hadamard(64)
    np.testing.assert_allclose(h, scipy_hadamard(64) / 8, atol=0)
    np.testing.assert_allclose(h @ h, np.eye(64), atol=1e-6)


def test_rotation_keeps_products_and_numpy_and_jax_agree():
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(5, 4, 24)).astype(np.float32), rng.normal(
        size=(7, 4, 24)).astype(np.float32)                     # K = (4, 24): nk = 2
    xr, wr = rotate(x, 2, 64), rotate(w, 2, 64)
    np.testing.assert_allclose(np.einsum("tab,nab->tn", xr, wr),
                               np.einsum("tab,nab->tn", x, w), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(rotate(jnp.asarray(x), 2, 64)), xr, atol=1e-5)
    assert not np.allclose(xr, x)


def test_rotation_cuts_int8_error_on_outlier_channels():
    """A token whose range one channel sets (~20x the rms, as in SmolLM2's q/k/v and
    gate/up inputs) loses far less to per-token int8 once rotated."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 256)).astype(np.float32)
    x[:, 3] += 20.0

    def error(v):
        q, s, z = quantize_per_token_asym(jnp.asarray(v), 1)
        back = (np.asarray(q, np.float32) - np.asarray(z)[:, None]) * np.asarray(s)[:, None]
        return np.linalg.norm(back - v) / np.linalg.norm(v)
    assert error(rotate(x, 1, 64)) < 0.5 * error(x)


def test_online_int8_rotates_and_fp8_does_not(monkeypatch):
    assert online_scheme("int8").rotate == 64 and online_scheme("fp8").rotate == 0
    assert "Hadamard" in online_scheme("int8").describe()
    monkeypatch.setenv("JAXLLM_INT8_ROTATION", "0")
    assert online_scheme("int8").rotate == 0
    monkeypatch.setenv("JAXLLM_INT8_ROTATION", "yes")
    with pytest.raises(ValueError, match="JAXLLM_INT8_ROTATION='yes': 0 or 1 expected"):
        online_scheme("int8")


@pytest.mark.parametrize("in_shape", [(256,), (4, 64)], ids=["k", "heads"])
def test_layer_takes_the_rotate_quantize_kernel_on_one_gpu(monkeypatch, in_shape):
    """A rotated int8 layer on one GPU (forced here; the kernel interpreted) quantizes its
    input through pallas_kernels/rotate_quant.py and computes what the XLA path does;
    under tensor parallelism, or for an f32 input, it keeps the XLA path."""
    from flax import nnx

    from jaxllm.layers.quantization import linear
    from pallas_kernels import rotate_quant
    nnx.use_eager_sharding(False)       # as the models set it (jaxllm/models/llama.py)
    scheme = online_scheme("int8")
    layer = linear.QuantLinear(scheme, (96,), in_shape, (None,), (None,) * len(in_shape))
    rng = np.random.default_rng(0)
    layer.weight[...] = jnp.asarray(rng.integers(-127, 128, (96,) + in_shape), jnp.int8)
    layer.weight_scale[...] = jnp.asarray(rng.uniform(0.01, 0.02, 96), jnp.float32)
    layer.azp_adj[...] = jnp.sum(layer.weight[...].astype(jnp.float32).reshape(96, -1), 1)
    x = jnp.asarray(rng.standard_normal((8,) + in_shape) * 3, jnp.bfloat16)
    want = np.asarray(layer(x, tp=1), np.float32)
    calls = []
    real = rotate_quant.rotate_quantize
    monkeypatch.setattr(rotate_quant, "rotate_quantize",
                        lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    monkeypatch.setattr(linear, "on_gpu", lambda: True)
    nk = len(in_shape)
    assert not linear.use_rotate_kernel(scheme, x, nk, tp=2)
    assert not linear.use_rotate_kernel(scheme, x.astype(jnp.float32), nk, tp=1)
    monkeypatch.setitem(linear.WEIGHT_ONLY_ROWS, "int8", 16)
    assert not linear.use_rotate_kernel(scheme, x, nk, tp=1)      # weight-only steps
    monkeypatch.setitem(linear.WEIGHT_ONLY_ROWS, "int8", 0)
    monkeypatch.setenv("JAXLLM_INT8_ROTATE_KERNEL", "0")
    assert not linear.use_rotate_kernel(scheme, x, nk, tp=1)
    monkeypatch.delenv("JAXLLM_INT8_ROTATE_KERNEL")
    got = np.asarray(layer(x, tp=1), np.float32)
    assert calls == [{"interpret": True}]
    np.testing.assert_array_equal(got, want)


def test_rotate_kernel_switch_refuses_a_bad_value(monkeypatch):
    """Read when a rotated layer traces, on a CPU too (no GPU needed to be told)."""
    from jaxllm.layers.quantization import linear
    monkeypatch.setenv("JAXLLM_INT8_ROTATE_KERNEL", "yes")
    x = jnp.ones((8, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="JAXLLM_INT8_ROTATE_KERNEL='yes': 0 or 1 expected"):
        linear.use_rotate_kernel(online_scheme("int8"), x, 1)
    assert not linear.use_rotate_kernel(online_scheme("fp8"), x, 1)     # not rotated
