"""W8A8 matmul for decode-sized batches in one kernel: the 16-bit input is quantized
per token inside the kernel (its scale, and for asymmetric int8 its zero point,
computed outside), the dot runs on the quantized operands (fp8 x fp8 -> f32, int8 x
int8 -> int32) and the scales are applied to the product.

Why: the layer's XLA path at decode sizes is three kernels per projection (the
token's amax, the cast to fp8 / int8 padded to cuBLASLt's 16 rows, the GEMM, plus
cuBLASLt's split-K reduction for the down projection): in the Llama-3.1-8B fp8 step
22 kernels a layer against bf16's 13, and cuBLASLt's fp8 GEMM at M = 8-16 no faster
than bf16 on the q/k/v and o projections. Here the cast happens on each x tile in
registers (x is [M, K] with M <= 128: a small tile beside the weight's), so a
projection is the amax (a reduction XLA may fuse into x's producer) and this kernel.

Grid, tiles, k-splits and the weight's clamped rows are quant_matmul's (_launch).
Letter legend: M tokens, N output channels, K contracted dim.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.quant_matmul import _check, _launch, _load_x, default_settings

FP8_MAX = 448.0
INT8_MIN, INT8_MAX = -128.0, 127.0
_FP8 = jnp.dtype(jnp.float8_e4m3fn)
_INT8 = jnp.dtype(jnp.int8)


def _x_scale_rows(x_scale, m):
    return jnp.broadcast_to(jnp.asarray(x_scale, jnp.float32), (m,))


def _quantize_rows(xf, scale, zero, dtype, rint):
    """xf f32 [M, C] / scale [M, 1] into ``dtype`` as jaxllm's layer does (fp8: a
    saturating cast; int8: rounded half to even, plus the zero point, clamped)."""
    y = xf / scale
    if dtype == _FP8:
        return jnp.clip(y, -FP8_MAX, FP8_MAX).astype(dtype)
    y = rint(y)
    if zero is not None:
        y = y + zero
    return jnp.clip(y, INT8_MIN, INT8_MAX).astype(dtype)


def ref_w8a8_matmul(x, w, x_scale, w_scale, x_zero=None, azp_adj=None, *, out_dtype=None):
    """x [M, K] 16-bit or f32; w [N, K] fp8 e4m3 / int8 with per-channel w_scale
    f32[N]; x_scale f32[M] (per token) or a scalar (static); int8 only: x_zero f32[M]
    (asymmetric tokens) with azp_adj f32[N] (the weight's sums over K) -> [M, N]
    ``out_dtype`` (default x's dtype).

    x quantized to w's dtype with x_scale (and x_zero), the dot of the quantized
    values exact in f32, then ``(dot - x_zero * azp_adj) * x_scale * w_scale``: what
    jaxllm's quantize_per_token / quantize_per_token_asym and quantized_matmul give
    for the same scales."""
    m = x.shape[0]
    dtype = jnp.dtype(w.dtype)
    xs = _x_scale_rows(x_scale, m)
    zero = None if x_zero is None else x_zero.astype(jnp.float32)[:, None]
    xq = _quantize_rows(x.astype(jnp.float32), xs[:, None], zero, dtype, jnp.round)
    y = lax.dot_general(xq.astype(jnp.float32), w.astype(jnp.float32),
                        (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    if x_zero is not None:
        y = y - zero * azp_adj.astype(jnp.float32)[None, :]
    y = y * xs[:, None] * w_scale.astype(jnp.float32)[None, :]
    return y.astype(out_dtype or x.dtype)


def _rint_ptx(y):
    """Round half to even on the GPU (``cvt.rni``): Pallas' Triton lowering has no
    lax.round."""
    return plgpu.elementwise_inline_asm("cvt.rni.f32.f32 $0, $1;", args=[y],
                                        constraints="=r,r", pack=1,
                                        result_shape_dtypes=[jax.ShapeDtypeStruct(
                                            y.shape, jnp.float32)])[0]


_SETTINGS = ("out_dtype", "block_n", "block_k", "k_splits", "num_warps", "num_stages",
             "interpret")


@functools.partial(jax.jit, static_argnames=_SETTINGS)
def w8a8_matmul(x, w, x_scale, w_scale, x_zero=None, azp_adj=None, *, out_dtype=None,
                block_n=None, block_k=None, k_splits=None, num_warps=None,
                num_stages=None, interpret=False):
    """Same contract as ``ref_w8a8_matmul``; the rest are kernel settings
    (quant_matmul.default_settings)."""
    m, k = x.shape
    n = w.shape[0]
    dtype = jnp.dtype(w.dtype)
    if dtype not in (_FP8, _INT8):
        raise ValueError(f"weight dtype {w.dtype}: fp8 e4m3 or int8 expected")
    if (x_zero is None) != (azp_adj is None) or (x_zero is not None and dtype != _INT8):
        raise ValueError("x_zero and azp_adj go together, with an int8 weight")
    _check(m, k, w.shape, (n, k))
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    st = default_settings(m, n, k, 8, x.dtype.itemsize, block_n=block_n, block_k=block_k,
                          k_splits=k_splits, num_warps=num_warps, num_stages=num_stages)
    bk, ragged, asym = st["bk"], k % st["bk"] != 0, x_zero is not None
    aux = [_x_scale_rows(x_scale, m), w_scale.astype(jnp.float32)]
    if asym:
        aux += [x_zero.astype(jnp.float32), azp_adj.astype(jnp.float32)]
    rint = jnp.round if interpret else _rint_ptx

    def step(aux_refs, x_ref, w_ref, rows, xrows, i, acc):
        cols = i * bk + jnp.arange(bk)
        wt = w_ref[rows[:, None], (jnp.minimum(cols, k - 1) if ragged else cols)[None, :]]
        xt = _load_x(x_ref, xrows, cols, k, ragged).astype(jnp.float32)
        zero = aux_refs[2][xrows][:, None] if asym else None
        xq = _quantize_rows(xt, aux_refs[0][xrows][:, None], zero, dtype, rint)
        if ragged and asym:      # x's zero point must not reach the clamped columns
            xq = jnp.where((cols < k)[None, :], xq, jnp.zeros_like(xq))
        return acc + plgpu.dot(wt, xq, trans_b=True)

    def epilogue(aux_refs, acc, rows, xrows):     # quantized_matmul's order
        if asym:
            azp = aux_refs[2][xrows][None, :] * aux_refs[3][rows][:, None]
            # Every split's partial is summed: the zero point's term goes in once.
            acc = acc - jnp.where(pl.program_id(1) == 0, azp, jnp.zeros_like(azp))
        return acc * aux_refs[0][xrows][None, :] * aux_refs[1][rows][:, None]

    return _launch(step, epilogue, x, w, aux, n=n, st=st, out_dtype=out_dtype,
                   dot_dtype=dtype, name="w8a8_matmul", interpret=interpret)
