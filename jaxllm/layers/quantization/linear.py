"""The quantized linear layer: fp8 / int8 weights stored [N..., K...], the input
quantized in the layer, the matmul in fp8 / int8 with f32 accumulation and the
scales applied to its output. On a GPU, fp8 layers in decode-sized steps leave the
input unquantized instead (WEIGHT_ONLY_ROWS).

On a GPU the matmul is one dot of the quantized operands (XLA hands an fp8 or int8
dot contracting K on both sides to cuBLASLt). On the CPU backend, which has no fp8
GEMMs, the same quantized values are widened to f32 first: exact with respect to
the quantized values, so CPU tests check the numbers the GPU path computes, up to
the GPU's rounding of a bf16 layer's fp8 product to bf16 before the scales
(quantized_matmul's product_dtype; tested by forcing the native dot on the CPU).

Letter legend: T tokens, N... output dims, K... contracted dims, G K-groups.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.env_switch import env_switch
from jaxllm.layers.quantization import int4_kernels
from jaxllm.layers.quantization.fp8_kernels import fp8_kernel_matmul, use_mosaic_fp8
from jaxllm.layers.quantization.int4_kernels import int4_kernel_matmul
from jaxllm.layers.quantization.rotation import block_size, hadamard, rotate
from jaxllm.layers.quantization.schemes import FP8_MAX, INT8_MAX, ActScheme, LinearScheme
from pallas_kernels.common import target_platform, to_f16

STORAGE = {"fp8": jnp.float8_e4m3fn, "int8": jnp.int8, "uint4": jnp.uint8, "uint8": jnp.uint8}
# A floor under dynamic scales: an all-zero token row quantizes to zeros, not NaN.
_MIN_SCALE = 1e-12


def native_dot() -> bool:
    """The quantized dot itself (GPU) or its f32 widening (CPU, no fp8 dots)."""
    return target_platform() != "cpu"


def quantize(x, dtype: str, scale):
    """x / scale rounded into `dtype` (fp8: saturating cast; int8: round half to even,
    clamped to [-128, 127])."""
    y = x.astype(jnp.float32) / scale
    if dtype == "fp8":
        return jnp.clip(y, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return jnp.clip(jnp.round(y), -INT8_MAX - 1, INT8_MAX).astype(jnp.int8)


def _qmax(dtype: str) -> float:
    return FP8_MAX if dtype == "fp8" else INT8_MAX


# Tokens from which a layer's dynamic token scales are written out before use
# (activation_scales). H200, fp8 8B: at 8192 tokens the mixed steps took 129.9 against
# 133.3 ms with it; at 256 rows the decode steps were level (15.23 / 15.30 ms); at 16
# rows the step took 0.19 ms longer (more kernels). Between 256 and 8192 not measured.
SCALES_APART_TOKENS = 512


def activation_scales(x, nk: int, act: ActScheme, input_scale=None):
    """x [T, K...] -> (f32 scale [T] or the stored scalar, f32 zero point [T] or None):
    what quantize_per_token / quantize_per_token_asym quantize x with.

    From SCALES_APART_TOKENS tokens the scales pass an optimization barrier, so they
    are written out: otherwise XLA recomputes the token's reduction, and x's
    producer (residual add, RMSNorm) with it, inside the epilogue that applies the
    scale to the GEMM's product (fp8 prefill of the 8B model: the gate/up epilogue
    took 294 us a layer against bf16's 168)."""
    if not act.dynamic:
        return input_scale, None
    axes = tuple(range(x.ndim - nk, x.ndim))
    xf = x.astype(jnp.float32)
    apart = jax.lax.optimization_barrier if x.shape[0] >= SCALES_APART_TOKENS else (
        lambda v: v)
    if act.symmetric:
        amax = jnp.max(jnp.abs(xf), axis=axes)
        return apart(jnp.maximum(amax / _qmax(act.dtype), _MIN_SCALE)), None
    # The token's [min, max] onto [-128, 127], widened to take in 0 so the zero point
    # fits int8 and zeros (padding rows) stay exactly zero.
    lo = jnp.minimum(jnp.min(xf, axis=axes), 0.0)
    hi = jnp.maximum(jnp.max(xf, axis=axes), 0.0)
    scale = jnp.maximum((hi - lo) / (2 * INT8_MAX + 1), _MIN_SCALE)
    return apart((scale, jnp.round(-INT8_MAX - 1 - lo / scale)))


def quantize_per_token(x, nk: int, act: ActScheme, input_scale=None):
    """x [T, K...] -> (quantized x, f32 scale [T] or a scalar)."""
    scale, _ = activation_scales(x, nk, act, input_scale)
    if not act.dynamic:
        return quantize(x, act.dtype, scale), scale
    return quantize(x, act.dtype, scale.reshape(scale.shape + (1,) * nk)), scale


def quantize_per_token_asym(x, nk: int):
    """x [T, K...] -> (int8 x, f32 scale [T], f32 zero point [T]), x ~= scale * (xq -
    zero): vLLM's dynamic azp quantization (activation_scales)."""
    scale, zero = activation_scales(x, nk, ActScheme("int8", symmetric=False))
    shape = scale.shape + (1,) * nk
    xq = jnp.clip(jnp.round(x.astype(jnp.float32) / scale.reshape(shape)) + zero.reshape(shape),
                  -INT8_MAX - 1, INT8_MAX)
    return xq.astype(jnp.int8), scale, zero


def quantized_matmul(xq, x_scale, wq, w_scale, nk: int, native: bool, x_zero=None,
                     azp_adj=None, product_dtype=jnp.float32):
    """xq [T, K...] times wq [N..., K...] contracting the K dims, then times
    x_scale ([T] or scalar) and w_scale [N...]. f32 [T, N...]. Asymmetric inputs:
    x_zero [T] and azp_adj [N...] (the weight's sums over K) subtract
    x_zero * sum_k wq, so the dot itself stays one on the quantized operands.

    product_dtype: what the native fp8 dot writes before the scales (f32 sums either
    way). A bf16 product halves the bytes the GEMM writes and its consumer reads:
    with per-token and per-channel scales cuBLASLt cannot apply them itself, and at
    prompt sizes the f32 product of gate/up alone is 0.94 GB a layer for 8192 tokens.
    It rounds the product once more (at most 2^-8 relative) before the scales, and
    a row-parallel layer's cross-shard sum runs on it in bf16, as a bf16 model's
    does. Never f16: the unscaled product (operands up to 448, summed over K)
    passes f16's 65504."""
    dims = ((tuple(range(xq.ndim - nk, xq.ndim)), tuple(range(wq.ndim - nk, wq.ndim))),
            ((), ()))
    if native:
        acc = jnp.int32 if xq.dtype == jnp.int8 else product_dtype
        y = jax.lax.dot_general(xq, wq, dims, preferred_element_type=acc).astype(jnp.float32)
    else:
        y = jax.lax.dot_general(xq.astype(jnp.float32), wq.astype(jnp.float32), dims,
                                preferred_element_type=jnp.float32)
    if x_zero is not None:
        y = y - x_zero.reshape(x_zero.shape + (1,) * (y.ndim - 1)) * azp_adj
    x_scale = jnp.asarray(x_scale, jnp.float32)
    if x_scale.ndim:
        x_scale = x_scale.reshape(x_scale.shape + (1,) * (y.ndim - 1))
    return y * x_scale * w_scale


def block_matmul(x, wq, w_scale, scheme: LinearScheme, nk: int):
    """Block-scaled weights ([N..., K] with scales [N..., K/bk]): XLA has no
    block-scaled fp8 GEMM on Hopper, so the weight is dequantized in the layer (it is
    still stored in fp8) and the input quantized per token and K-group of bk, as the
    checkpoint's producer computes it; the matmul runs in x's dtype."""
    t = x.shape[0]
    xf = x.reshape(t, -1)
    k = xf.shape[1]
    bk = scheme.block[1]
    if scheme.act is not None:
        g = xf.astype(jnp.float32).reshape(t, k // bk, bk)
        s = jnp.maximum(jnp.max(jnp.abs(g), axis=-1, keepdims=True) / _qmax(scheme.act.dtype),
                        _MIN_SCALE)
        xf = (quantize(g, scheme.act.dtype, s).astype(jnp.float32) * s).reshape(t, k)
    out = wq.shape[:wq.ndim - nk]
    w = wq.reshape(*out, k // bk, bk).astype(jnp.float32) * w_scale[..., None]
    w = w.reshape(*out, k).astype(x.dtype)
    return jnp.einsum("tk,...k->t...", xf.astype(x.dtype), w,
                      preferred_element_type=jnp.float32)


def grouped_dequant_matmul(x, wq, scale, zero, g_idx, scheme: LinearScheme, nk: int):
    """Weight-only uint4 / uint8 through XLA (int4_kernel_matmul at decode sizes on one
    GPU): (q - zero) * scale per group, the matmul in x's dtype, f32 sums."""
    t = x.shape[0]
    xf = x.reshape(t, -1)
    k = xf.shape[1]
    out = wq.shape[:wq.ndim - nk]
    q = wq.reshape(*out, -1)
    if scheme.weight == "uint4":     # two to a byte, the even column in the low nibble
        q = jnp.stack([q & 15, q >> 4], axis=-1).reshape(*out, k)
    if g_idx is None:      # column k in group k // group (a constant)
        g_idx = np.arange(k, dtype=np.int32) // min(scheme.group, k)
    s, z = jnp.take(scale, g_idx, axis=-1), jnp.take(zero, g_idx, axis=-1)
    w = ((q.astype(jnp.float32) - z) * s).astype(x.dtype)
    return jnp.einsum("tk,...k->t...", xf, w, preferred_element_type=jnp.float32)


# Tokens up to which a uint4 layer runs a fused kernel on a GPU; larger batches
# dequantize through XLA. On the H200 the Triton kernel (quant_matmul.py) beat XLA's
# path on every 8B projection at M = 1-64 (gate/up at 64: 142 against 349 us).
INT4_KERNEL_ROWS = 64


def on_gpu() -> bool:
    return target_platform() == "gpu"


def use_int4_kernel(scheme: LinearScheme, tokens: int, tp: int | None = None) -> bool:
    """The fused kernel takes 4-bit weights in column order (no act-order map) with a
    power-of-two group of at least 32 (its dots need 16 columns), on a GPU, unsharded:
    ``tp`` the model's tensor-parallel size (None: unknown, so only when one device
    is visible); under tensor parallelism the weight is sharded and XLA's path runs."""
    g = scheme.group or 0
    return (scheme.weight == "uint4" and not scheme.g_idx and g >= 32 and g & (g - 1) == 0
            and tokens <= INT4_KERNEL_ROWS and on_gpu() and _unsharded(tp))


def _unsharded(tp: int | None) -> bool:
    return tp == 1 if tp is not None else jax.device_count() == 1


# Tokens up to which a block-scaled fp8 layer runs the Pallas kernel with group scales
# (quant_matmul) on one GPU. 0 (off) until measured (bench_quant_matmul.py --kinds
# block_fp8,pallas_block_fp8): block_matmul's path writes the dequantized bf16 weight
# out every step (Qwen3-8B block FP8 decodes at 0.35x bf16's speed on the H200).
BLOCK_FP8_KERNEL_ROWS = 0


def use_block_fp8_kernel(scheme: LinearScheme, tokens: int, tp: int | None = None) -> bool:
    bk = scheme.block[1] if scheme.block else 0
    return (scheme.weight == "fp8" and bk >= 32 and bk & (bk - 1) == 0 and on_gpu()
            and tokens <= BLOCK_FP8_KERNEL_ROWS and _unsharded(tp))


def block_kernel_matmul(x, wq, w_scale, nk: int, interpret: bool = False):
    """block_matmul's weight-only contract through the kernel: [T, K] x [N, K] with
    scales [N, K/bk], reshaped back to [T, N...] in x's dtype."""
    from pallas_kernels.quant_matmul import quant_matmul   # Triton lowering, lazily
    t = x.shape[0]
    out = wq.shape[:wq.ndim - nk]
    n = math.prod(out)
    y = quant_matmul(x.reshape(t, -1), wq.reshape(n, -1), None, w_scale.reshape(n, -1),
                     out_dtype=x.dtype, interpret=interpret)
    return y.reshape(t, *out)


# Tokens up to which an fp8 / int8 W8A8 layer with per-channel or per-tensor weight
# scales runs weight-only on a GPU (weight_only_matmul; XLA's Triton GEMMs widen the
# weight in registers, step_compiler_options), by weight dtype: at decode sizes a
# GEMM's time is its weight's bytes and W8A8 adds a range and a cast kernel before
# each GEMM. H200, an 8B layer's four projections (us): fp8 at 16 rows 77.5
# weight-only against 90.7, level at 64, behind at 128 (155.1 / 109.8); int8 level at
# 16 rows and its engine's bare decode step 4.09 ms against 3.91 W8A8: int8 keeps W8A8.
WEIGHT_ONLY_ROWS = {"fp8": 64, "int8": 0}


def use_weight_only(scheme: LinearScheme, tokens: int) -> bool:
    """Whether the layer leaves its input unquantized in a step of `tokens` (block-
    scaled weights: block_matmul without the input's per-group quantization)."""
    return (on_gpu() and tokens <= WEIGHT_ONLY_ROWS.get(scheme.weight, 0)
            and scheme.group is None)


def weight_only_dot_dtype(x_dtype, w_dtype):
    """The dtype a weight-only dot runs in: on a GPU, f16 for an fp8 weight under a
    16-bit input; else x's. On sm90 Triton widens e4m3 to f16 with one packed
    conversion per two values, and to bf16 with that and a scalar f16 -> bf16
    conversion per value (Triton's conversion table; scripts/triton_sass.py counts
    them in compiled GEMMs). That conversion pipe, ~16 results per clock per SM, caps
    an fp8 weight stream at ~3.7 TB/s in bf16, where XLA's fp8 x bf16 GEMMs measured
    2.9-3.3 TB/s; the fp8 KV decode kernel gained 1.45x from the same switch
    (paged_attention_decode.default_dot_dtype). The f16 dot's operands are the bf16
    one's (pallas_kernels.common.to_f16) for |x| in [2^-14, 65504]."""
    fp8_w = jnp.dtype(w_dtype) == jnp.dtype(jnp.float8_e4m3fn)
    if fp8_w and jnp.dtype(x_dtype).itemsize == 2 and on_gpu():
        return jnp.dtype(jnp.float16)
    return jnp.dtype(x_dtype)


def weight_only_matmul(x, wq, w_scale, nk: int):
    """x [T, K...] times the weight [N..., K...] widened to weight_only_dot_dtype (exact
    for fp8 and int8 values), f32 accumulation, then times w_scale [N...] (or a
    scalar). f32 [T, N...]."""
    dims = ((tuple(range(x.ndim - nk, x.ndim)), tuple(range(wq.ndim - nk, wq.ndim))),
            ((), ()))
    dt = weight_only_dot_dtype(x.dtype, wq.dtype)
    if dt == jnp.float16:
        x = to_f16(x)
    return jax.lax.dot_general(x, wq.astype(dt), dims,
                               preferred_element_type=jnp.float32) * w_scale


def use_rotate_kernel(scheme: LinearScheme, x, nk: int, tp: int | None = None) -> bool:
    """Whether a rotated layer with per-token asymmetric int8 inputs (online int8)
    rotates and quantizes its input in one Pallas kernel (pallas_kernels/rotate_quant.py)
    instead of XLA's four kernels: on one GPU (a row-parallel layer's input is sharded
    along K, and the token's range spans the shards), for a 16-bit input whose block
    the kernel takes (16 or 64), unless JAXLLM_INT8_ROTATE_KERNEL=0."""
    from pallas_kernels import rotate_quant
    a = scheme.act
    # Read first, so a bad value is refused on any machine when a rotated layer traces.
    wanted = scheme.rotate and env_switch("JAXLLM_INT8_ROTATE_KERNEL", True)
    if not (wanted and a is not None and a.dynamic and not a.symmetric
            and scheme.group is None and scheme.block is None and on_gpu() and _unsharded(tp)
            and not use_weight_only(scheme, x.shape[0])):
        return False
    k = math.prod(x.shape[x.ndim - nk:])
    return x.ndim == nk + 1 and rotate_quant.supported(x.dtype, k, block_size(k, scheme.rotate))


def rotate_quantize_asym(x, scheme: LinearScheme):
    """x [T, K...] -> quantize_per_token_asym(rotate(x)) through the kernel: (int8
    [T, K...], f32 scale [T], f32 zero point [T])."""
    from pallas_kernels.rotate_quant import rotate_quantize   # Triton lowering, lazily
    t = x.shape[0]
    k = math.prod(x.shape[1:])
    h = jnp.asarray(hadamard(block_size(k, scheme.rotate)))
    xq, scale, zero = rotate_quantize(x.reshape(t, k), h,
                                      interpret=target_platform() == "cpu")
    return xq.reshape(x.shape), scale, zero


def fp8_product_dtype(x_dtype):
    """An fp8 layer's GEMM output (quantized_matmul): bf16 in a bf16 layer, else f32
    (f16 has not the range of the unscaled product)."""
    return jnp.bfloat16 if jnp.dtype(x_dtype) == jnp.bfloat16 else jnp.float32


class QuantLinear(nnx.Module):
    """y[T, N...] = x[T, K...] @ W, W stored quantized as weight [N..., K...]."""

    def __init__(self, scheme: LinearScheme, out_shape: tuple, in_shape: tuple,
                 out_axes: tuple, in_axes: tuple):
        self.scheme = scheme
        self.nk = len(in_shape)
        stored = in_shape[:-1] + (in_shape[-1] // 2,) if scheme.weight == "uint4" else in_shape
        self.weight = nnx.Param(jnp.zeros(out_shape + stored, STORAGE[scheme.weight]),
                                out_sharding=out_axes + in_axes)
        if scheme.group is not None:
            k = math.prod(in_shape)
            groups, n = -(-k // scheme.group), math.prod(out_shape)
            if int4_kernels.is_packed(scheme, n, k):       # one bf16 [2 K/G, N], one device
                self.weight_scale = nnx.Param(jnp.ones((2 * groups, n), jnp.bfloat16),
                                              out_sharding=(None, None))
            else:
                for name in ("weight_scale", "weight_zero_point"):
                    setattr(self, name, nnx.Param(jnp.ones(out_shape + (groups,), jnp.float32),
                                                  out_sharding=out_axes + in_axes[:1]))
            if scheme.g_idx:
                self.g_idx = nnx.Param(jnp.zeros((k,), jnp.int32), out_sharding=in_axes[:1])
        elif scheme.block is None:
            self.weight_scale = nnx.Param(jnp.ones(out_shape, jnp.float32),
                                          out_sharding=out_axes)
        else:
            groups = math.prod(in_shape) // scheme.block[1]
            self.weight_scale = nnx.Param(jnp.ones(out_shape + (groups,), jnp.float32),
                                          out_sharding=out_axes + in_axes[:1])
        if scheme.act is not None and not scheme.act.dynamic:
            self.input_scale = nnx.Param(jnp.ones((), jnp.float32), out_sharding=())
        if scheme.act is not None and not scheme.act.symmetric:
            self.azp_adj = nnx.Param(jnp.zeros(out_shape, jnp.float32), out_sharding=out_axes)

    def __call__(self, x, tp: int | None = None):
        """tp: the model's tensor-parallel size, where the caller knows it (the 4-bit
        kernel runs on unsharded weights only)."""
        s = self.scheme
        w, ws = self.weight[...], self.weight_scale[...]
        dtype = x.dtype
        # The kernel rotates and quantizes in one pass (the asymmetric branch below).
        kernel = use_rotate_kernel(s, x, self.nk, tp)
        if s.rotate and not kernel:     # as the weight was at load; f32 into the quantization
            x = rotate(x, self.nk, s.rotate)
        # zero None: packed with the scales (int4_kernels.py)
        zero = self.weight_zero_point[...] if hasattr(self, "weight_zero_point") else None
        if s.group is not None and use_int4_kernel(s, x.shape[0], tp):
            y = int4_kernel_matmul(x, w, ws, zero, s, self.nk)
        elif s.group is not None:
            if zero is None:
                ws, zero = int4_kernels.unpack(ws, w.shape[:w.ndim - self.nk])
            y = grouped_dequant_matmul(x, w, ws, zero, self.g_idx[...] if s.g_idx else None, s,
                                       self.nk)
        elif s.block is not None and use_block_fp8_kernel(s, x.shape[0], tp):
            y = block_kernel_matmul(x, w, ws, self.nk)
        elif s.block is not None:
            weight_only = use_weight_only(s, x.shape[0])
            y = block_matmul(x, w, ws, dataclasses.replace(s, act=None) if weight_only else s,
                             self.nk)
        elif s.act is None or use_weight_only(s, x.shape[0]):
            y = (fp8_kernel_matmul(x, w, ws, self.nk)
                 if use_mosaic_fp8(x, w, ws, self.nk, _unsharded(tp)) else
                 weight_only_matmul(x, w, ws, self.nk))
        elif not s.act.symmetric:
            xq, xs, xz = (rotate_quantize_asym(x, s) if kernel else
                          quantize_per_token_asym(x, self.nk))
            y = quantized_matmul(xq, xs, w, ws, self.nk, native_dot(), xz, self.azp_adj[...])
        else:
            xq, xs = quantize_per_token(x, self.nk, s.act,
                                        self.input_scale[...] if not s.act.dynamic else None)
            y = quantized_matmul(xq, xs, w, ws, self.nk, native_dot(),
                                 product_dtype=fp8_product_dtype(dtype))
        return y.astype(dtype)
