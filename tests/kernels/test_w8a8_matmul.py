"""The one-kernel W8A8 matmul (x cast inside the kernel) in interpret mode against its
reference and jaxllm's W8A8 layer math, QuantLinear's use of it, and its CUDA
lowering at the Llama-3.1-8B shapes."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_lowering import lower_for_cuda
from kernel_cases import run

from jaxllm.layers.quantization import linear
from jaxllm.layers.quantization.linear import (activation_scales, quantize,
                                               quantize_per_token, quantize_per_token_asym,
                                               quantized_matmul)
from jaxllm.layers.quantization.schemes import ActScheme, LinearScheme
from pallas_kernels.quant_matmul import default_settings
from pallas_kernels.w8a8_matmul import ref_w8a8_matmul, w8a8_matmul

SD = jax.ShapeDtypeStruct
F32, BF16 = jnp.float32, jnp.bfloat16
SMALL = dict(block_n=32, block_k=64)
SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
             "down": (4096, 14336)}


def _w8(seed, n, k, kind):
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    scale = jnp.asarray(np.abs(w).max(axis=1) / (448.0 if kind == "fp8" else 127.0))
    return quantize(jnp.asarray(w), kind, scale[:, None]), scale


def _x(seed, m, k, dtype=BF16):
    x = np.random.default_rng(seed).standard_normal((m, k)) * 3
    x[:, ::7] += 2.0         # one-signed columns: an asymmetric range, a zero point != 0
    return jnp.asarray(x, dtype)


def _layer(x, wq, ws, kind, symmetric):
    """jaxllm's XLA layer math: x quantized outside, then quantized_matmul."""
    if symmetric:
        xq, xs = quantize_per_token(x, 1, ActScheme(kind))
        return quantized_matmul(xq, xs, wq, ws, 1, native=False)
    xq, xs, xz = quantize_per_token_asym(x, 1)
    return quantized_matmul(xq, xs, wq, ws, 1, False, xz, jnp.sum(wq.astype(F32), axis=1))


# (M, N, K, settings): ragged N (80 = 2.5 tiles), ragged K (200 = 3 steps + 8
# columns), 3 splits over 4 steps (the last split empty), 64 rows.
CASES = [(1, 96, 256, dict(k_splits=1)), (3, 80, 200, dict(k_splits=2)),
         (8, 64, 256, dict(k_splits=3)), (16, 80, 256, dict(k_splits=1)),
         (64, 48, 192, dict(k_splits=2))]


@pytest.mark.parametrize("kind,symmetric", [("fp8", True), ("int8", True), ("int8", False)],
                         ids=["fp8", "int8", "int8_asym"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"m{c[0]}_n{c[1]}_k{c[2]}_{c[3]}")
def test_matches_layer_math(kind, symmetric, case):
    """The kernel casts x to the same values as the layer's quantize_per_token(_asym):
    int8 without splits equals the layer to the bit (exact integer sums, the scales
    and the zero point's term applied in the same order); the rest to f32 sum order.
    The asymmetric ragged-K case checks the zero point stays off the padded columns
    and goes in once over the splits."""
    m, n, k, settings = case
    wq, ws = _w8(m + n, n, k, kind)
    x = _x(k + m, m, k)
    xs, xz = activation_scales(x, 1, ActScheme(kind, symmetric=symmetric))
    azp = None if symmetric else jnp.sum(wq.astype(F32), axis=1)
    got = run(functools.partial(w8a8_matmul, out_dtype=F32, interpret=True, **SMALL,
                                **settings), x, wq, xs, ws, xz, azp)
    layer = _layer(x, wq, ws, kind, symmetric)
    want = ref_w8a8_matmul(x, wq, xs, ws, xz, azp, out_dtype=F32)
    np.testing.assert_array_equal(np.asarray(want), np.asarray(layer))
    if kind == "int8" and settings["k_splits"] == 1:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(layer))
    else:
        np.testing.assert_allclose(np.asarray(got), np.asarray(layer), rtol=0,
                                   atol=1e-6 * np.abs(np.asarray(layer)).max())


def test_static_scale_and_default_dtype():
    """A stored per-tensor input scale (a scalar); the output in x's dtype."""
    wq, ws = _w8(2, 64, 128, "fp8")
    x = _x(3, 4, 128)
    got = run(functools.partial(w8a8_matmul, interpret=True, **SMALL), x, wq,
              jnp.float32(0.02), ws)
    assert got.dtype == BF16
    want = quantized_matmul(quantize(x, "fp8", 0.02), 0.02, wq, ws, 1, False)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=0,
                               atol=4e-3 * np.abs(np.asarray(want)).max())


def test_rejects_what_it_does_not_support():
    wq, ws = _w8(0, 64, 128, "fp8")
    x = jnp.zeros((4, 128), BF16)
    with pytest.raises(ValueError, match="go together"):
        w8a8_matmul(x, wq, jnp.ones(4), ws, jnp.zeros(4), jnp.zeros(64), interpret=True)
    with pytest.raises(ValueError, match="weight dtype"):
        w8a8_matmul(x, wq.astype(BF16), jnp.ones(4), ws, interpret=True)
    with pytest.raises(ValueError, match="rows"):
        w8a8_matmul(jnp.zeros((129, 128), BF16), wq, jnp.ones(129), ws, interpret=True)


# --- QuantLinear ---------------------------------------------------------------------

def _kernel_in_interpret_mode(monkeypatch):
    """QuantLinear on 'a GPU' whose kernel runs in interpret mode."""
    monkeypatch.setattr(linear, "on_gpu", lambda: True)
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    real = linear.w8a8_kernel_matmul
    calls = []

    def interpret(*args, **kw):
        calls.append(args[0].shape)
        return real(*args, **kw, interpret=True)
    monkeypatch.setattr(linear, "w8a8_kernel_matmul", interpret)
    return calls


@pytest.mark.parametrize("act", [ActScheme("fp8"), ActScheme("int8", symmetric=False),
                                 ActScheme("fp8", dynamic=False)],
                         ids=["fp8", "int8_asym", "fp8_static"])
@pytest.mark.parametrize("in_shape,out_shape", [((256,), (2, 2, 16)), ((4, 64), (48,))],
                         ids=["kv_proj", "o_proj"])
def test_quant_linear_kernel_path_equals_xla_path(monkeypatch, act, in_shape, out_shape):
    """The same layer at decode size through the kernel and through XLA's path (on CPU,
    the quantized values widened): equal up to f32 sum order; the projection's dims
    flattened and restored as the XLA path reads them."""
    from flax import nnx
    nnx.use_eager_sharding(False)
    scheme = LinearScheme(act.dtype, None, act)
    layer = linear.QuantLinear(scheme, out_shape, in_shape, (None,) * len(out_shape),
                               (None,) * len(in_shape))
    rng = np.random.default_rng(5)
    k = int(np.prod(in_shape))
    wq, ws = _w8(6, int(np.prod(out_shape)), k, act.dtype)
    layer.weight[...] = wq.reshape(out_shape + in_shape)
    layer.weight_scale[...] = ws.reshape(out_shape)
    if not act.symmetric:
        layer.azp_adj[...] = jnp.sum(wq.astype(F32), axis=1).reshape(out_shape)
    if not act.dynamic:
        layer.input_scale[...] = jnp.float32(0.03)
    x = jnp.asarray(rng.standard_normal((5,) + in_shape) * 2, BF16)
    want = layer(x, tp=1)
    calls = _kernel_in_interpret_mode(monkeypatch)
    got = layer(x, tp=1)
    assert calls == [(5,) + in_shape]
    assert got.shape == want.shape == (5,) + out_shape and got.dtype == BF16
    np.testing.assert_allclose(np.asarray(got, F32), np.asarray(want, F32), rtol=0,
                               atol=8e-3 * np.abs(np.asarray(want, F32)).max())


def test_kernel_only_where_it_applies(monkeypatch):
    monkeypatch.setattr(linear, "on_gpu", lambda: True)
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    rows = linear.W8A8_KERNEL_ROWS
    fp8 = LinearScheme("fp8", None, ActScheme("fp8"))
    assert linear.use_w8a8_kernel(fp8, rows)
    assert linear.use_w8a8_kernel(LinearScheme("int8", None, ActScheme("int8", symmetric=False)), 1)
    assert not linear.use_w8a8_kernel(fp8, rows + 1)
    assert not linear.use_w8a8_kernel(LinearScheme("fp8"), 1)                  # weight only
    assert not linear.use_w8a8_kernel(LinearScheme("fp8", (128, 128), ActScheme(
        "fp8", group_size=128)), 1)                                           # block scales
    assert not linear.use_w8a8_kernel(fp8, 1, tp=2)
    monkeypatch.setattr(linear, "on_gpu", lambda: False)
    assert not linear.use_w8a8_kernel(fp8, 1)


# --- CUDA lowering at the 8B shapes --------------------------------------------------

@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("proj", list(SHAPES_8B))
@pytest.mark.parametrize("kind", ["fp8", "int8_asym"])
def test_lowers_at_8b_shapes(kind, proj, m):
    n, k = SHAPES_8B[proj]
    w = SD((n, k), jnp.float8_e4m3fn if kind == "fp8" else jnp.int8)
    args = [SD((m, k), BF16), w, SD((m,), F32), SD((n,), F32)]
    if kind == "int8_asym":
        args += [SD((m,), F32), SD((n,), F32)]
    text = lower_for_cuda(w8a8_matmul, *args)
    st = default_settings(m, n, k, 8, 2)
    assert "__gpu$xla.gpu.triton" in text
    assert f"grid_x = {n // st['bn']}" in text and f"grid_y = {st['k_splits']}" in text


def test_quant_linear_lowers_to_the_kernel_at_decode_sizes(monkeypatch):
    """fp8 QuantLinear lowered for CUDA: the kernel up to W8A8_KERNEL_ROWS tokens, the
    fp8 dot (cuBLASLt) above."""
    from flax import nnx
    nnx.use_eager_sharding(False)
    monkeypatch.setattr(linear, "on_gpu", lambda: True)
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    layer = linear.QuantLinear(LinearScheme("fp8", None, ActScheme("fp8")), (4096,),
                               (32, 128), (None,), (None, None))
    graph, state = nnx.split(layer)

    def call(state, x):
        return nnx.merge(graph, state)(x, tp=1)
    for tokens in (1, linear.W8A8_KERNEL_ROWS, linear.W8A8_KERNEL_ROWS + 1):
        text = lower_for_cuda(call, state, SD((tokens, 32, 128), BF16))
        assert ("w8a8_matmul" in text) == (tokens <= linear.W8A8_KERNEL_ROWS)
