"""SiLU(gate) * up, quantized per token, in one pass: the step between a W8A8 MLP's
gate/up GEMM and its down GEMM.

The gate/up GEMM writes its product unscaled (cuBLASLt takes scalar scales only). In
XLA the rest took two passes over that product at prompt sizes: a reduction fusion
(scales, SiLU * up, the token's amax) and a second fusion that recomputed SiLU * up
to cast it. On the H200 at 8,192 tokens of the Llama-3.1-8B shape that was 195 + 143
us a layer, reading the 470 MB product twice from HBM. Here a program owns BR whole
rows and walks them in chunks of BC columns twice: the first pass takes each row's
amax (or min / max), the second recomputes SiLU * up, quantizes and stores it. The
second pass reads what the first just read (57 KB a row at F = 14336), from L2.

Letter legend: T tokens, F the MLP width (gate and up each), BR rows per program, BC
columns per chunk.
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


def _stats(h, symmetric):
    """A chunk's per-row statistics: amax, or (min, max) for a zero point."""
    if symmetric:
        return (jnp.max(jnp.abs(h), axis=1),)
    return jnp.min(h, axis=1), jnp.max(h, axis=1)


def _merge(a, b, symmetric):
    if symmetric:
        return (jnp.maximum(a[0], b[0]),)
    return jnp.minimum(a[0], b[0]), jnp.maximum(a[1], b[1])


def _scale_zero(stats, dtype, symmetric, rint):
    """(scale [R], zero point [R] or None) from a row's statistics, as jaxllm's layer."""
    if symmetric:
        qmax = FP8_MAX if dtype == "fp8" else INT8_MAX
        return jnp.maximum(stats[0] / qmax, MIN_SCALE), None
    # int8 with a zero point: the row's [min, max], widened to take in 0, onto 256 levels.
    lo, hi = jnp.minimum(stats[0], 0.0), jnp.maximum(stats[1], 0.0)
    scale = jnp.maximum((hi - lo) / (INT8_MAX - INT8_MIN), MIN_SCALE)
    return scale, rint(INT8_MIN - lo / scale)


def _quantize(h, scale, zero, dtype, rint):
    """h f32 [R, C] into ``dtype`` with per-row scale [R] (and zero point [R])."""
    y = h / scale[:, None]
    if dtype == "fp8":
        return jnp.clip(y, -FP8_MAX, FP8_MAX).astype(_STORE[dtype])
    y = rint(y)
    if zero is not None:
        y = y + zero[:, None]
    return jnp.clip(y, INT8_MIN, INT8_MAX).astype(jnp.int8)


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
    h = _silu_mul(gu[:, :f], gu[:, f:])
    scale, zero = _scale_zero(_stats(h, symmetric), dtype, symmetric, jnp.round)
    return _quantize(h, scale, zero, dtype, jnp.round), scale, zero


def _rint_ptx(y):
    """Round half to even on the GPU (``cvt.rni``): Pallas' Triton lowering has no
    lax.round."""
    return plgpu.elementwise_inline_asm(
        "cvt.rni.f32.f32 $0, $1;", args=[y], constraints="=r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(y.shape, jnp.float32)])[0]


# Columns per chunk and rows per program at F = 14336: not yet swept on the H200.
BLOCK_COLS = 2048
BLOCK_ROWS = 1


@functools.partial(jax.jit, static_argnames=("dtype", "symmetric", "block_rows",
                                             "block_cols", "programs", "num_warps",
                                             "num_stages", "interpret"))
def silu_and_mul_quant(p, x_scale, w_scale, x_zero=None, azp_adj=None, *, dtype,
                       symmetric=True, block_rows=BLOCK_ROWS, block_cols=BLOCK_COLS,
                       programs=None, num_warps=4, num_stages=1, interpret=False):
    """ref_silu_and_mul_quant's contract in one kernel. Grid: `programs` programs, each
    taking every programs-th block of BR rows (None: one program per block). Fewer
    programs than blocks keep the rows in flight, read twice, within L2."""
    _check(p, x_scale, w_scale, x_zero, azp_adj, dtype, symmetric)
    t, _, f = p.shape
    bc = min(block_cols, common.next_pow2(f))
    asym = x_zero is not None
    aux = [x_scale.astype(jnp.float32), w_scale.reshape(2 * f).astype(jnp.float32)]
    if asym:
        aux += [x_zero.astype(jnp.float32), azp_adj.reshape(2 * f).astype(jnp.float32)]
    rint = jnp.round if interpret else _rint_ptx
    out_shape = [jax.ShapeDtypeStruct((t, f), _STORE[dtype]),
                 jax.ShapeDtypeStruct((t,), jnp.float32)]
    if not symmetric:
        out_shape.append(jax.ShapeDtypeStruct((t,), jnp.float32))
    blocks = common.cdiv(t, block_rows)
    grid = min(programs or blocks, blocks)
    kernel = functools.partial(_kernel, t=t, f=f, bc=bc, br=block_rows, asym=asym,
                               dtype=dtype, symmetric=symmetric, rint=rint, grid=grid,
                               blocks=blocks)
    out = common.pallas_call(
        kernel, out_shape=tuple(out_shape), grid=(grid,),
        num_warps=num_warps, num_stages=num_stages, interpret=interpret,
        name=f"silu_and_mul_quant_{dtype}")(p.reshape(t, 2 * f), *aux)
    return out[0], out[1], (out[2] if not symmetric else None)


def _kernel(p_ref, xs_ref, ws_ref, *refs, grid, blocks, **kw):
    """Row blocks pid, pid + grid, ... (the last round's blocks past the end skip)."""
    pid = pl.program_id(0)
    rounds = common.cdiv(blocks, grid)
    if rounds == 1:
        _rows(pid, p_ref, xs_ref, ws_ref, *refs, **kw)
        return

    def body(j, carry):
        blk = pid + j * grid

        @pl.when(blk < blocks)
        def _():
            _rows(blk, p_ref, xs_ref, ws_ref, *refs, **kw)
        return carry

    jax.lax.fori_loop(0, rounds, body, 0)


def _rows(blk, p_ref, xs_ref, ws_ref, *refs, t, f, bc, br, asym, dtype, symmetric, rint):
    """Rows blk*BR .. (blk+1)*BR."""
    # Loads and stores through pl.ds windows (start + arange), which Triton sees as
    # contiguous and vectorizes; gathered index arrays load element by element.
    if asym:
        xz_ref, az_ref, *outs = refs
    else:
        xz_ref = az_ref = None
        outs = refs
    r0 = blk * br
    row_ok = (r0 + jnp.arange(br)) < t if t % br else None
    rws = pl.ds(r0, br)

    def load(ref, idx, mask):
        if mask is None:
            return plgpu.load(ref.at[idx])
        zero = 0 if jnp.issubdtype(ref.dtype, jnp.integer) else 0.0
        return plgpu.load(ref.at[idx], mask=mask, other=zero)

    xs = load(xs_ref, rws, row_ok)[:, None]
    xz = load(xz_ref, rws, row_ok)[:, None] if asym else None

    def chunk(i):
        """SiLU * up of columns i*BC .. (i+1)*BC: (h [BR, BC], its mask or None)."""
        c0 = i * bc
        col_ok = (c0 + jnp.arange(bc)) < f if f % bc else None
        if row_ok is None:
            mask = None if col_ok is None else jnp.broadcast_to(col_ok[None, :], (br, bc))
        else:
            mask = row_ok[:, None] if col_ok is None else row_ok[:, None] & col_ok[None, :]
            mask = jnp.broadcast_to(mask, (br, bc))
        halves = []
        for start in (c0, c0 + f):     # gate, then up; padding columns read 0
            cols = pl.ds(start, bc)
            y = load(p_ref, (rws, cols), mask).astype(jnp.float32)
            if asym:
                y = y - xz * load(az_ref, cols, col_ok)[None, :]
            halves.append(y * xs * load(ws_ref, cols, col_ok)[None, :])
        return _silu_mul(*halves), mask

    n = common.cdiv(f, bc)
    # Zeros to start from: amax >= 0, and a zero point's range takes in 0 anyway.
    first = tuple(jnp.zeros((br,), jnp.float32) for _ in range(1 if symmetric else 2))
    stats = jax.lax.fori_loop(0, n, lambda i, s: _merge(s, _stats(chunk(i)[0], symmetric),
                                                        symmetric), first)
    scale, zero = _scale_zero(stats, dtype, symmetric, rint)

    def write(i, carry):
        h, mask = chunk(i)
        plgpu.store(outs[0].at[rws, pl.ds(i * bc, bc)], _quantize(h, scale, zero, dtype, rint),
                    mask=mask)
        return carry

    jax.lax.fori_loop(0, n, write, 0)
    plgpu.store(outs[1].at[rws], scale, mask=row_ok)
    if not symmetric:
        plgpu.store(outs[2].at[rws], zero, mask=row_ok)
