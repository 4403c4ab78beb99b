"""RMSNorm and the fused residual-add + RMSNorm of a decoder layer (vLLM's
``rms_norm`` / ``fused_add_rms_norm``): one kernel where XLA launches two (the add,
then the normalization), since the add's result is also the next residual.

Letter legend: T tokens (rows), E hidden size, Ep E padded to a power of two.

Numerics (both twins): the residual sum is rounded to the input dtype (as the
unfused ``x + h`` is), then normalized in float32, multiplied by the weight in
float32 and cast back.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import common


def ref_rms_norm(x, weight, eps):
    """x: [T, E]; weight: [E] -> [T, E] in x's dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * weight.astype(jnp.float32)).astype(x.dtype)


def ref_fused_add_rms_norm(x, residual, weight, eps):
    """x, residual: [T, E]; weight: [E]. Returns (rms_norm(x + residual), x + residual)."""
    total = (x + residual).astype(x.dtype)
    return ref_rms_norm(total, weight, eps), total


# --- Pallas kernels -----------------------------------------------------------------
# Grid (cdiv(T, rows_per_program),): a program normalizes whole rows (E is small enough
# to sit in registers: 4096 bf16 per row at the 8B shapes).

@functools.partial(jax.jit, static_argnames=("eps", "rows_per_program", "num_warps",
                                             "interpret"))
def rms_norm(x, weight, eps, *, rows_per_program=1, num_warps=4, interpret=False):
    """Same contract as ``ref_rms_norm``."""
    return _call(x, None, weight, eps, rows_per_program, num_warps, interpret)[0]


@functools.partial(jax.jit, static_argnames=("eps", "rows_per_program", "num_warps",
                                             "interpret"))
def fused_add_rms_norm(x, residual, weight, eps, *, rows_per_program=1, num_warps=4,
                       interpret=False):
    """Same contract as ``ref_fused_add_rms_norm``."""
    return _call(x, residual, weight, eps, rows_per_program, num_warps, interpret)


def _call(x, residual, weight, eps, rpp, num_warps, interpret):
    num_rows, e = x.shape
    ep = common.next_pow2(e)
    fused = residual is not None
    kernel = functools.partial(_norm_kernel, e=e, ep=ep, rpp=rpp, eps=float(eps),
                               fused=fused)
    full = lambda a: pl.BlockSpec(a.shape, lambda i: (0,) * a.ndim)  # noqa: E731
    w2 = weight.reshape(1, e)
    ins = (x, residual, w2) if fused else (x, w2)
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return common.pallas_call(
        kernel,
        grid=(-(-num_rows // rpp),),
        in_specs=[full(a) for a in ins],
        out_specs=[full(x)] * (2 if fused else 1),
        out_shape=[out] * (2 if fused else 1),
        num_warps=num_warps, num_stages=1, interpret=interpret,
        name="fused_add_rms_norm" if fused else "rms_norm",
    )(*ins)


def _norm_kernel(*refs, e, ep, rpp, eps, fused):
    if fused:
        x_ref, res_ref, w_ref, out_ref, res_out_ref = refs
    else:
        x_ref, w_ref, out_ref = refs
    rows = pl.program_id(0) * rpp + jnp.arange(rpp)
    ok = rows < x_ref.shape[0]
    rows = jnp.where(ok, rows, 0)
    x = common.load_rows(x_ref, rows, e, ep, ok)
    if fused:
        x = (x + common.load_rows(res_ref, rows, e, ep, ok)).astype(x_ref.dtype)
        common.store_rows(res_out_ref, rows, x, e, ok)
    xf = x.astype(jnp.float32)
    # Padding columns read as 0: they add nothing to the sum of squares.
    inv = jax.lax.rsqrt(jnp.sum(xf * xf, axis=1) / e + eps)
    w = common.load_rows(w_ref, jnp.zeros((1,), jnp.int32), e, ep).astype(jnp.float32)
    common.store_rows(out_ref, rows, xf * inv[:, None] * w, e, ok)
