"""SiLU(gate) * up, quantized per token, in one pass: the step between a W8A8 MLP's
gate/up GEMM and its down GEMM.

The gate/up GEMM writes its product unscaled (cuBLASLt takes scalar scales only). In
XLA the rest took two passes over that product at prompt sizes: a reduction fusion
(scales, SiLU * up, the token's amax) and a second fusion that recomputed SiLU * up
to cast it. On the H200 at 8,192 tokens of the Llama-3.1-8B shape that was 195 + 143
us a layer, reading the 470 MB product twice. Here a program owns whole rows: it reads
the product once, keeps SiLU * up in registers for the row's amax (or min / max),
and writes the quantized row and its scale.

Letter legend: T tokens, F the MLP width (gate and up each), Fp F padded to a power
of two, BR rows per program.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common

FP8_MAX = 448.0
INT8_MIN, INT8_MAX = -128.0, 127.0
# A floor under the scales, as jaxllm's layer: an all-zero row quantizes to zeros.
MIN_SCALE = 1e-12
# f32 values of SiLU * up a program keeps in registers (BR x Fp): 64 a thread at 8 warps.
ROW_ELEMS = 16384

_STORE = {"fp8": jnp.float8_e4m3fn, "int8": jnp.int8}


def _gate_up(p, x_scale, w_scale, x_zero, azp_adj):
    """The scaled gate / up values in f32, as quantized_matmul applies the scales."""
    y = p.astype(jnp.float32)
    if x_zero is not None:
        y = y - x_zero[:, None] * azp_adj
    return y * x_scale[:, None] * w_scale


def _silu_mul(g, u):
    return g / (1.0 + jnp.exp(-g)) * u


def _row_quant(h, dtype, symmetric, rint):
    """h f32 [R, C] (padding columns 0) -> (quantized [R, C], scale [R], zero [R] or None)."""
    if symmetric:
        qmax = FP8_MAX if dtype == "fp8" else INT8_MAX
        scale = jnp.maximum(jnp.max(jnp.abs(h), axis=1) / qmax, MIN_SCALE)
        y = h / scale[:, None]
        if dtype == "fp8":
            return jnp.clip(y, -FP8_MAX, FP8_MAX).astype(_STORE[dtype]), scale, None
        return jnp.clip(rint(y), INT8_MIN, INT8_MAX).astype(jnp.int8), scale, None
    # int8 with a zero point: the row's [min, max], widened to take in 0, onto 256 levels.
    lo = jnp.minimum(jnp.min(h, axis=1), 0.0)
    hi = jnp.maximum(jnp.max(h, axis=1), 0.0)
    scale = jnp.maximum((hi - lo) / (INT8_MAX - INT8_MIN), MIN_SCALE)
    zero = rint(INT8_MIN - lo / scale)
    y = rint(h / scale[:, None]) + zero[:, None]
    return jnp.clip(y, INT8_MIN, INT8_MAX).astype(jnp.int8), scale, zero


def _check(p, x_scale, w_scale, x_zero, azp_adj, dtype, symmetric):
    if p.ndim != 3 or p.shape[1] != 2:
        raise ValueError(f"product {p.shape}: [T, 2, F] (gate, up) expected")
    if w_scale.shape != p.shape[1:]:
        raise ValueError(f"w_scale {w_scale.shape}: {p.shape[1:]} expected")
    if (x_zero is None) != (azp_adj is None):
        raise ValueError("x_zero and azp_adj go together")
    if dtype not in _STORE or (dtype == "fp8" and not symmetric):
        raise ValueError(f"{dtype} {'symmetric' if symmetric else 'asymmetric'}: fp8 "
                         "symmetric or int8 expected")


def ref_silu_and_mul_quant(p, x_scale, w_scale, x_zero=None, azp_adj=None, *, dtype,
                           symmetric=True):
    """p [T, 2, F]: the gate/up GEMM's unscaled product (bf16 / f32; int32 for int8);
    x_scale f32[T] and, for an asymmetric int8 input, x_zero f32[T] with azp_adj
    f32[2, F] (the weight's sums over K); w_scale f32[2, F].

    h = SiLU(gate) * up in f32 from the scaled product, then quantized per token into
    ``dtype`` (fp8: saturating cast of h / (amax / 448); int8: rounded half to even,
    symmetric over [-amax, amax] / 127 or with a zero point over [min, max]).
    Returns (hq [T, F], scale f32[T], zero f32[T] or None)."""
    _check(p, x_scale, w_scale, x_zero, azp_adj, dtype, symmetric)
    f = p.shape[2]
    az = None if azp_adj is None else azp_adj.reshape(-1)
    gu = _gate_up(p.reshape(p.shape[0], 2 * f), x_scale, w_scale.reshape(-1), x_zero, az)
    return _row_quant(_silu_mul(gu[:, :f], gu[:, f:]), dtype, symmetric, jnp.round)


def _rint_ptx(y):
    """Round half to even on the GPU (``cvt.rni``): Pallas' Triton lowering has no
    lax.round."""
    return plgpu.elementwise_inline_asm(
        "cvt.rni.f32.f32 $0, $1;", args=[y], constraints="=r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(y.shape, jnp.float32)])[0]


def default_rows(f: int) -> int:
    """Rows a program owns: as many as keep BR x Fp at ROW_ELEMS, at least one."""
    return max(1, ROW_ELEMS // common.next_pow2(f))


@functools.partial(jax.jit, static_argnames=("dtype", "symmetric", "block_rows",
                                             "num_warps", "interpret"))
def silu_and_mul_quant(p, x_scale, w_scale, x_zero=None, azp_adj=None, *, dtype,
                       symmetric=True, block_rows=None, num_warps=8, interpret=False):
    """ref_silu_and_mul_quant's contract in one kernel; grid cdiv(T, BR)."""
    _check(p, x_scale, w_scale, x_zero, azp_adj, dtype, symmetric)
    t, _, f = p.shape
    fp = common.next_pow2(f)
    br = block_rows or default_rows(f)
    asym = x_zero is not None
    aux = [x_scale.astype(jnp.float32), w_scale.reshape(2 * f).astype(jnp.float32)]
    if asym:
        aux += [x_zero.astype(jnp.float32), azp_adj.reshape(2 * f).astype(jnp.float32)]
    rint = jnp.round if interpret else _rint_ptx
    out_shape = [jax.ShapeDtypeStruct((t, f), _STORE[dtype]),
                 jax.ShapeDtypeStruct((t,), jnp.float32)]
    if not symmetric:
        out_shape.append(jax.ShapeDtypeStruct((t,), jnp.float32))
    kernel = functools.partial(_kernel, t=t, f=f, fp=fp, br=br, asym=asym, dtype=dtype,
                               symmetric=symmetric, rint=rint)
    out = common.pallas_call(
        kernel, out_shape=tuple(out_shape), grid=(common.cdiv(t, br),),
        num_warps=num_warps, num_stages=1, interpret=interpret,
        name=f"silu_and_mul_quant_{dtype}")(p.reshape(t, 2 * f), *aux)
    return out[0], out[1], (out[2] if not symmetric else None)


def _kernel(p_ref, xs_ref, ws_ref, *refs, t, f, fp, br, asym, dtype, symmetric, rint):
    if asym:
        xz_ref, az_ref, *outs = refs
    else:
        xz_ref = az_ref = None
        outs = refs
    rows = pl.program_id(0) * br + jnp.arange(br)
    row_ok = rows < t
    rows = jnp.where(row_ok, rows, 0)        # padding rows read row 0, never stored
    cols = jnp.arange(fp)
    col_ok = cols < f if fp != f else None
    mask = row_ok[:, None] if col_ok is None else row_ok[:, None] & col_ok[None, :]

    def load(ref, c):      # [BR, Fp] of a [T, 2F] array at columns c; padding reads 0
        zero = 0 if jnp.issubdtype(ref.dtype, jnp.integer) else 0.0
        return plgpu.load(ref.at[rows[:, None], c[None, :]], mask=mask, other=zero)

    def vec(ref, c):       # [1, Fp] of a [2F] array
        return plgpu.load(ref.at[c], mask=col_ok, other=0.0)[None, :]

    xs = plgpu.load(xs_ref.at[rows])[:, None]
    halves = []
    for c in (cols, cols + f):
        y = load(p_ref, c).astype(jnp.float32)
        if asym:
            y = y - plgpu.load(xz_ref.at[rows])[:, None] * vec(az_ref, c)
        halves.append(y * xs * vec(ws_ref, c))
    # Padding columns: gate 0 and up 0, so h is 0 there and leaves the row's range alone.
    hq, scale, zero = _row_quant(_silu_mul(*halves), dtype, symmetric, rint)
    common.store_rows(outs[0], rows, hq, f, row_ok)
    common.store_vec(outs[1], rows, scale, row_ok)
    if not symmetric:
        common.store_vec(outs[2], rows, zero, row_ok)
