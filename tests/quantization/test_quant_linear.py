"""The quantized matmul: on CPU it equals a numpy computation on the same quantized
values; the GPU path (the fp8 / int8 dot itself) lowers for CUDA here, its dot taking
the quantized operands contracting K on both sides."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from cuda_lowering import lower_for_cuda

from jaxllm.layers.quantization.linear import quantize_per_token, quantized_matmul
from jaxllm.layers.quantization.schemes import ActScheme


def _np_quant(x, kind):
    qmax = 448.0 if kind == "fp8" else 127.0
    s = np.maximum(np.abs(x).max(axis=-1, keepdims=True) / qmax, 1e-12)
    if kind == "fp8":
        q = np.clip(x / s, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    else:
        q = np.clip(np.round(x / s), -128, 127)
    return q, s


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_cpu_path_equals_numpy(kind):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 48)).astype(np.float32)
    x[2] = 0.0                                  # an all-zero row stays zero, not NaN
    wq = np.clip(np.round(rng.normal(size=(7, 48)) * 40), -127, 127)
    ws = rng.uniform(0.001, 0.01, 7).astype(np.float32)
    storage = jnp.float8_e4m3fn if kind == "fp8" else jnp.int8
    xq, xs = quantize_per_token(jnp.asarray(x), 1, ActScheme(kind))
    y = quantized_matmul(xq, xs, jnp.asarray(wq, storage), jnp.asarray(ws), 1, native=False)
    q, s = _np_quant(x, kind)
    w = np.asarray(jnp.asarray(wq, storage).astype(jnp.float32))
    ref = (q @ w.T) * s * ws
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-6, atol=1e-7)
    assert np.all(np.asarray(y)[2] == 0)


@pytest.mark.parametrize("kind, operand, acc", [("fp8", "f8E4M3FN", "f32"),
                                                ("int8", "i8", "i32")])
def test_gpu_path_lowers_to_a_quantized_dot(kind, operand, acc):
    storage = jnp.float8_e4m3fn if kind == "fp8" else jnp.int8

    def layer(x, w, ws):
        xq, xs = quantize_per_token(x, 1, ActScheme(kind))
        return quantized_matmul(xq, xs, w, ws, 1, native=True).astype(x.dtype)

    text = lower_for_cuda(layer, jax.ShapeDtypeStruct((64, 4096), jnp.bfloat16),
                          jax.ShapeDtypeStruct((8192, 4096), storage),
                          jax.ShapeDtypeStruct((8192,), jnp.float32))
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert len(dots) == 1
    # [T, K] x [N, K] contracting dimension 1 of both, into f32 / i32
    assert "contracting_dims = [1] x [1]" in dots[0]
    assert f"tensor<64x4096x{operand}>, tensor<8192x4096x{operand}>) -> tensor<64x8192x{acc}>" \
        in dots[0], dots[0]
