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

from jaxllm.layers.quantization import linear
from jaxllm.layers.quantization.linear import (grouped_dequant_matmul, int4_kernel_matmul,
                                               quantize_per_token, quantize_per_token_asym,
                                               quantized_matmul)
from jaxllm.layers.quantization.schemes import ActScheme, LinearScheme


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


def test_asymmetric_int8_equals_numpy_and_beats_symmetric():
    """A zero point per token (vLLM's azp): x ~= scale * (xq - zero), the dot on the
    int8 values minus zero * (the weight's sums over K). On inputs with a one-signed
    outlier channel it halves the error of the symmetric scale."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(6, 64)).astype(np.float32)
    x[:, 3] = 25.0                              # one-signed outlier channel
    x[4] = 0.0
    wq = np.clip(np.round(rng.normal(size=(5, 64)) * 40), -127, 127).astype(np.int8)
    ws = rng.uniform(0.001, 0.01, 5).astype(np.float32)
    xq, xs, xz = quantize_per_token_asym(jnp.asarray(x), 1)
    adj = wq.astype(np.float32).sum(axis=1)
    y = np.asarray(quantized_matmul(xq, xs, jnp.asarray(wq), jnp.asarray(ws), 1, False, xz,
                                    jnp.asarray(adj)))
    lo, hi = np.minimum(x.min(1), 0), np.maximum(x.max(1), 0)
    s = np.maximum((hi - lo) / 255, 1e-12)
    z = np.round(-128 - lo / s)
    q = np.clip(np.round(x / s[:, None]) + z[:, None], -128, 127)
    np.testing.assert_array_equal(np.asarray(xq), q)
    deq = (q - z[:, None]) * s[:, None]
    np.testing.assert_allclose(y, (deq @ wq.T.astype(np.float32)) * ws, rtol=1e-6, atol=1e-6)
    assert np.all(y[4] == 0) and np.all(np.asarray(xz)[4] == -128)
    sym_q, sym_s = _np_quant(x, "int8")
    err = lambda d: np.linalg.norm(d - x) / np.linalg.norm(x)      # noqa: E731
    assert err(deq) < 0.6 * err(sym_q * sym_s)


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


@pytest.mark.parametrize("kind,x_dtype,product", [("fp8", jnp.bfloat16, "bf16"),
                                                  ("fp8", jnp.float16, "f32"),
                                                  ("fp8", jnp.float32, "f32"),
                                                  ("int8", jnp.bfloat16, "i32")])
def test_fp8_layer_gemm_writes_the_layer_dtype(monkeypatch, kind, x_dtype, product):
    """QuantLinear's fp8 dot emits a bf16 layer's product in bf16 (half the bytes the
    GEMM writes at prompt sizes), the scales after it in f32; an f32 layer keeps f32
    and int8's dot stays int32. An f16 layer keeps f32 too: the unscaled product
    passes f16's range (test_native_fp8_product_numbers)."""
    from flax import nnx
    nnx.use_eager_sharding(False)
    monkeypatch.setattr(linear, "native_dot", lambda: True)
    act = ActScheme(kind, symmetric=True)
    layer = linear.QuantLinear(LinearScheme(kind, None, act), (512,), (256,), (None,),
                               (None,))
    graph, state = nnx.split(layer)

    def call(state, x):
        return nnx.merge(graph, state)(x, tp=1)
    text = lower_for_cuda(call, state, jax.ShapeDtypeStruct((300, 256), x_dtype))
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert len(dots) == 1 and f"-> tensor<300x512x{product}>" in dots[0], dots


@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float16], ids=str)
def test_native_fp8_product_numbers(monkeypatch, x_dtype):
    """The native fp8 dot as the GPU runs it (forced on the CPU, which can run it):
    the layer's output equals the f32-widened path's within the product's extra
    rounding, and stays finite in an f16 layer, whose unscaled product (~1e6 here)
    f16 could not hold."""
    from flax import nnx
    nnx.use_eager_sharding(False)
    rng = np.random.default_rng(11)
    k, n = 4096, 256
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.02
    ws = np.abs(w).max(axis=1) / 448.0
    layer = linear.QuantLinear(LinearScheme("fp8", None, ActScheme("fp8")), (n,), (k,),
                               (None,), (None,))
    layer.weight[...] = jnp.asarray(w / ws[:, None], jnp.float8_e4m3fn)
    layer.weight_scale[...] = jnp.asarray(ws, jnp.float32)
    x = jnp.asarray(rng.standard_normal((8, k)), x_dtype)
    want = np.asarray(layer(x, tp=1), np.float32)          # CPU: widened to f32
    monkeypatch.setattr(linear, "native_dot", lambda: True)
    got = np.asarray(layer(x, tp=1), np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=2 ** -7 * np.abs(want).max())


@pytest.mark.parametrize("act", [ActScheme("fp8"), ActScheme("int8", symmetric=False)],
                         ids=["fp8", "int8_asym"])
def test_token_scales_written_out_at_prompt_sizes(act):
    """From SCALES_APART_TOKENS tokens the dynamic scales (and an asymmetric zero
    point) pass an optimization barrier (XLA would otherwise recompute them inside
    the GEMM's epilogue); decode sizes keep the fusions free; the values are the
    layer's formula either way."""
    outputs = 1 if act.symmetric else 2
    for t in (linear.SCALES_APART_TOKENS - 1, linear.SCALES_APART_TOKENS):
        text = lower_for_cuda(lambda x: linear.activation_scales(x, 1, act),
                              jax.ShapeDtypeStruct((t, 64), jnp.bfloat16))
        barriers = [line for line in text.splitlines() if "optimization_barrier" in line]
        if t < linear.SCALES_APART_TOKENS:
            assert barriers == []
        else:
            assert len(barriers) == 1 and barriers[0].count("tensor<512xf32>") == outputs
        x = np.random.default_rng(t).standard_normal((t, 64)).astype(np.float32)
        scale, zero = jax.jit(lambda x: linear.activation_scales(x, 1, act))(x)
        if act.symmetric:
            np.testing.assert_allclose(scale, np.abs(x).max(1) / 448.0, rtol=1e-6)
            assert zero is None
        else:
            lo, hi = np.minimum(x.min(1), 0), np.maximum(x.max(1), 0)
            np.testing.assert_allclose(scale, (hi - lo) / 255.0, rtol=1e-6)
            np.testing.assert_array_equal(zero, np.round(-128 - lo / np.asarray(scale)))


@pytest.mark.parametrize("in_shape,out_shape", [((256,), (4, 32)), ((256,), (2, 2, 16)),
                                                ((4, 64), (48,))],
                         ids=["q_proj", "kv_proj", "o_proj"])
def test_int4_kernel_path_matches_xla_dequant(in_shape, out_shape):
    """QuantLinear's fused-kernel path (interpret mode) flattens a projection's dims
    the way the XLA path reads them: same numbers within the XLA path's bf16 rounding
    of each dequantized weight."""
    rng = np.random.default_rng(3)
    k, group = int(np.prod(in_shape)), 64
    packed = jnp.asarray(rng.integers(0, 256, out_shape + in_shape[:-1] + (in_shape[-1] // 2,)),
                         jnp.uint8)
    scale = jnp.asarray(rng.uniform(0.005, 0.02, out_shape + (k // group,)), jnp.float32)
    zero = jnp.asarray(rng.integers(0, 16, out_shape + (k // group,)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((6,) + in_shape), jnp.bfloat16)
    scheme = LinearScheme("uint4", group=group)
    nk = len(in_shape)
    got = int4_kernel_matmul(x, packed, scale, zero, scheme, nk, interpret=True)
    want = grouped_dequant_matmul(x, packed, scale, zero, None, scheme, nk)
    assert got.shape == want.shape == (6,) + out_shape
    err = np.abs(np.asarray(got) - np.asarray(want)).max() / np.abs(np.asarray(want)).max()
    assert err < 4e-3


def test_int4_kernel_only_where_it_applies(monkeypatch):
    """The kernel runs for uint4 in column order with a power-of-two group, at decode
    sizes, on one GPU; the XLA path everywhere else."""
    monkeypatch.setattr(linear, "on_gpu", lambda: True)
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    rows, g128 = linear.INT4_KERNEL_ROWS, LinearScheme("uint4", group=128)
    assert linear.use_int4_kernel(g128, rows)
    assert linear.use_int4_kernel(LinearScheme("uint4", group=1 << 30), 1)   # per channel
    assert not linear.use_int4_kernel(g128, rows + 1)
    assert not linear.use_int4_kernel(LinearScheme("uint4", group=128, g_idx=True), 1)
    assert not linear.use_int4_kernel(LinearScheme("uint4", group=96), 1)
    assert not linear.use_int4_kernel(LinearScheme("uint4", group=16), 1)
    assert not linear.use_int4_kernel(LinearScheme("uint8", group=128), 1)
    # Tensor parallelism: the model's size decides where it is known (one GPU of
    # several visible), the visible devices where it is not.
    monkeypatch.setattr(jax, "device_count", lambda: 2)
    assert linear.use_int4_kernel(g128, 1, tp=1)
    assert not linear.use_int4_kernel(g128, 1, tp=2)
    assert not linear.use_int4_kernel(g128, 1)
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    monkeypatch.setattr(linear, "on_gpu", lambda: False)
    assert not linear.use_int4_kernel(g128, 1)


@pytest.mark.parametrize("out_shape,in_shape", [((2, 8, 128), (4096,)), ((4096,), (32, 128))],
                         ids=["kv_proj", "o_proj"])
def test_int4_layer_lowers_to_the_kernel_at_decode_sizes(monkeypatch, out_shape, in_shape):
    """QuantLinear lowered for CUDA: the Triton kernel up to INT4_KERNEL_ROWS tokens,
    XLA's dequantize-then-dot above (the lowering's H200 would take the Mosaic kernel
    by default: test_int4_mosaic.py)."""
    from flax import nnx
    nnx.use_eager_sharding(False)       # as the models set it (jaxllm/models/llama.py)
    monkeypatch.setattr(linear, "on_gpu", lambda: True)
    monkeypatch.setenv("JAXLLM_INT4_MOSAIC", "0")
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    layer = linear.QuantLinear(LinearScheme("uint4", group=128), out_shape, in_shape,
                               (None,) * len(out_shape), (None,) * len(in_shape))
    graph, state = nnx.split(layer)

    def call(state, x):
        return nnx.merge(graph, state)(x, tp=1)
    for tokens in (1, linear.INT4_KERNEL_ROWS, linear.INT4_KERNEL_ROWS + 1):
        text = lower_for_cuda(call, state, jax.ShapeDtypeStruct((tokens,) + in_shape,
                                                                jnp.bfloat16))
        assert ("quant_matmul_int4" in text) == (tokens <= linear.INT4_KERNEL_ROWS)


@pytest.mark.parametrize("act", [ActScheme("fp8"), ActScheme("fp8", dynamic=False),
                                 ActScheme("int8", symmetric=False)],
                         ids=["fp8", "fp8_static", "int8_asym"])
def test_weight_only_at_decode_sizes(monkeypatch, act):
    """On a GPU, up to WEIGHT_ONLY_ROWS tokens a W8A8 layer with per-channel scales
    runs weight-only: lowered for CUDA, one dot on the widened weight (f16 for fp8,
    x's dtype for int8; no quantized operand) up to the bound, the quantized dot
    above it; its numbers are x times the dequantized weight (forced on the CPU)."""
    if act.dtype == "int8":     # the path as it stands, were int8 given rows
        monkeypatch.setitem(linear.WEIGHT_ONLY_ROWS, "int8", 16)
    from flax import nnx
    nnx.use_eager_sharding(False)
    monkeypatch.setattr(linear, "on_gpu", lambda: True)
    monkeypatch.setattr(linear, "native_dot", lambda: True)
    kind = act.dtype
    storage, operand = ((jnp.float8_e4m3fn, "f8E4M3FN") if kind == "fp8" else
                        (jnp.int8, "i8"))
    layer = linear.QuantLinear(LinearScheme(kind, None, act), (2, 96), (128,),
                               (None, None), (None,))
    rng = np.random.default_rng(5)
    wq = jnp.asarray(np.clip(np.round(rng.normal(size=(2, 96, 128)) * 40), -127, 127), storage)
    ws = rng.uniform(0.001, 0.01, (2, 96)).astype(np.float32)
    layer.weight[...], layer.weight_scale[...] = wq, jnp.asarray(ws)
    graph, state = nnx.split(layer)

    def call(state, x):
        return nnx.merge(graph, state)(x, tp=1)
    rows = linear.WEIGHT_ONLY_ROWS[kind]
    for tokens in (16, rows, rows + 1):
        text = lower_for_cuda(call, state, jax.ShapeDtypeStruct((tokens, 128), jnp.bfloat16))
        dots = [line for line in text.splitlines() if "dot_general" in line]
        assert len(dots) == 1, dots
        quantized = f"tensor<{tokens}x128x{operand}>" in dots[0]
        assert quantized == (tokens > rows), dots[0]
        wide = "f16" if kind == "fp8" else "bf16"    # weight_only_dot_dtype
        assert (f"tensor<{tokens}x128x{wide}>, tensor<2x96x128x{wide}>" in dots[0]) != quantized
    x = rng.standard_normal((16, 128)).astype(np.float32)
    w = np.asarray(wq.astype(jnp.float32)) * ws[..., None]
    got = np.asarray(layer(jnp.asarray(x), tp=1))
    np.testing.assert_allclose(got, np.einsum("tk,abk->tab", x, w), rtol=1e-5, atol=1e-5)


def test_weight_only_dot_dtype(monkeypatch):
    """On a GPU fp8 weights under a 16-bit input widen to f16 (one packed conversion per
    two values on sm90, where bf16 costs one more per value); int8 weights, f32 inputs
    and the CPU (no such conversion cost) keep x's dtype."""
    f8, i8 = jnp.float8_e4m3fn, jnp.int8
    monkeypatch.setattr(linear, "on_gpu", lambda: True)
    assert linear.weight_only_dot_dtype(jnp.bfloat16, f8) == jnp.float16
    assert linear.weight_only_dot_dtype(jnp.float16, f8) == jnp.float16
    assert linear.weight_only_dot_dtype(jnp.float32, f8) == jnp.float32
    assert linear.weight_only_dot_dtype(jnp.bfloat16, i8) == jnp.bfloat16
    monkeypatch.setattr(linear, "on_gpu", lambda: False)
    assert linear.weight_only_dot_dtype(jnp.bfloat16, f8) == jnp.bfloat16


def test_weight_only_f16_dot_equals_the_bf16_one(monkeypatch):
    """The f16 dot of a bf16 x and an fp8 weight is the bf16 dot's math: both widen
    their operands exactly and sum in f32 (equal up to the order of the f32 sums); x
    past f16's range is clamped to +-65504, not turned into inf, and inf stays inf."""
    monkeypatch.setattr(linear, "on_gpu", lambda: True)
    rng = np.random.default_rng(21)
    wq = jnp.asarray(rng.normal(size=(96, 256)) * 60, jnp.float8_e4m3fn)
    ws = jnp.asarray(rng.uniform(0.001, 0.01, (96,)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(16, 256)) * 4, jnp.bfloat16)
    dims = (((1,), (1,)), ((), ()))
    bf16 = jax.lax.dot_general(x, wq.astype(jnp.bfloat16), dims,
                               preferred_element_type=jnp.float32) * ws
    got = linear.weight_only_matmul(x, wq, ws, 1)
    assert "f16" in str(jax.make_jaxpr(linear.weight_only_matmul, static_argnums=3)(
        x, wq, ws, 1)).replace("bf16", "")
    np.testing.assert_allclose(np.asarray(got), np.asarray(bf16), rtol=1e-5, atol=1e-4)
    big = x.at[3, 7].set(3e5).at[5, 9].set(-1e38)       # bf16 values past f16's max
    got = np.asarray(linear.weight_only_matmul(big, wq, ws, 1))
    clamped = np.clip(np.asarray(big, np.float32), -65504, 65504)
    want = clamped @ (np.asarray(wq.astype(jnp.float32)) * np.asarray(ws)[:, None]).T
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-3)
    inf = np.asarray(linear.weight_only_matmul(x.at[2, 0].set(jnp.inf), wq, ws, 1))
    assert not np.isfinite(inf[2]).any() and np.isfinite(np.delete(inf, 2, 0)).all()


def test_weight_only_only_where_it_applies(monkeypatch):
    """fp8 (per channel, per tensor or block-scaled) on a GPU at decode sizes; never
    grouped weights (their own kernels), never on the CPU."""
    monkeypatch.setattr(linear, "on_gpu", lambda: True)
    rows = linear.WEIGHT_ONLY_ROWS
    fp8, int8 = LinearScheme("fp8", None, ActScheme("fp8")), LinearScheme("int8", None,
                                                                         ActScheme("int8"))
    assert linear.use_weight_only(fp8, rows["fp8"]) and linear.use_weight_only(fp8, 1)
    assert not linear.use_weight_only(fp8, rows["fp8"] + 1)
    assert not linear.use_weight_only(int8, rows["int8"] + 1)
    assert rows["int8"] == 0       # int8 keeps W8A8 (its engine measured slower)
    assert linear.use_weight_only(LinearScheme("fp8", (128, 128), ActScheme("fp8")), 1)
    assert not linear.use_weight_only(LinearScheme("uint4", group=128), 1)
    monkeypatch.setattr(linear, "on_gpu", lambda: False)
    assert not linear.use_weight_only(fp8, 1)


def test_block_fp8_leaves_its_input_unquantized_at_decode_sizes(monkeypatch):
    """A block-scaled fp8 layer (native FP8 checkpoints) quantizes its input per
    token and 128-group above WEIGHT_ONLY_ROWS tokens, and not up to it on a GPU:
    then its output is x times the dequantized weight."""
    from flax import nnx
    nnx.use_eager_sharding(False)
    rng = np.random.default_rng(8)
    n, k = 256, 256
    layer = linear.QuantLinear(LinearScheme("fp8", (128, 128), ActScheme("fp8")), (n,), (k,),
                               (None,), (None,))
    wq = jnp.asarray(rng.normal(size=(n, k)) * 100, jnp.float8_e4m3fn)
    ws = rng.uniform(0.001, 0.01, (n, k // 128)).astype(np.float32)
    layer.weight[...], layer.weight_scale[...] = wq, jnp.asarray(ws)
    x = rng.standard_normal((16, k)).astype(np.float32)
    w = np.asarray(wq.astype(jnp.float32)) * np.repeat(ws, 128, axis=1)
    exact = x @ w.T
    quantized = np.asarray(layer(jnp.asarray(x), tp=1))        # CPU: W8A8's numbers
    monkeypatch.setattr(linear, "on_gpu", lambda: True)
    np.testing.assert_allclose(np.asarray(layer(jnp.asarray(x), tp=1)), exact, rtol=1e-5,
                               atol=1e-4)
    assert np.abs(quantized - exact).max() > 100 * 1e-4      # (the input's fp8 rounding)


def test_block_fp8_kernel_where_enabled(monkeypatch):
    """With BLOCK_FP8_KERNEL_ROWS raised (it is off until measured on a GPU), a block-
    scaled fp8 layer lowers to the Pallas kernel up to the bound on one GPU, and the
    kernel's numbers (interpret mode) are block_matmul's weight-only ones."""
    from flax import nnx
    nnx.use_eager_sharding(False)
    monkeypatch.setattr(linear, "BLOCK_FP8_KERNEL_ROWS", 64)
    monkeypatch.setattr(linear, "on_gpu", lambda: True)
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    scheme = LinearScheme("fp8", (128, 128), ActScheme("fp8"))
    assert linear.use_block_fp8_kernel(scheme, 64, tp=1)
    assert not linear.use_block_fp8_kernel(scheme, 65, tp=1)
    assert not linear.use_block_fp8_kernel(scheme, 1, tp=2)
    layer = linear.QuantLinear(scheme, (256,), (4, 64), (None,), (None, None))
    graph, state = nnx.split(layer)

    def call(state, x):
        return nnx.merge(graph, state)(x, tp=1)
    for tokens in (8, 64, 65):
        text = lower_for_cuda(call, state, jax.ShapeDtypeStruct((tokens, 4, 64), jnp.bfloat16))
        assert ("quant_matmul" in text) == (tokens <= 64)
    rng = np.random.default_rng(12)
    wq = jnp.asarray(rng.normal(size=(256, 4, 64)) * 100, jnp.float8_e4m3fn)
    ws = jnp.asarray(rng.uniform(0.001, 0.01, (256, 2)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((8, 4, 64)), jnp.bfloat16)
    got = linear.block_kernel_matmul(x, wq, ws, 2, interpret=True)
    want = linear.block_matmul(x, wq, ws, LinearScheme("fp8", (128, 128), None), 2)
    assert got.shape == (8, 256) and got.dtype == jnp.bfloat16
    err = np.abs(np.asarray(got, np.float32) - np.asarray(want)).max()
    assert err <= 8e-3 * np.abs(np.asarray(want)).max()
