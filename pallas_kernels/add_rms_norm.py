"""A projection's split-K partial products summed, added to the residual stream and
RMS-normalized, in one kernel: vLLM's fused_add_rms_norm, taking the projection's
partials in place of its output.

At decode sizes XLA runs a projection whose K is long as a batched GEMM writing f32
partials [S, T, N], then sums them into the residual add (a loop fusion) and runs the
RMSNorm after it as a second kernel: the residual add of a split-K sum and the norm's
row reduction do not fuse. The layer's o and down projections each end so, so a decode
step of an L-layer model runs 2L such pairs; here each pair is one kernel, a program a
token row, the row in registers from its first load to its last store.

Letter legend: S splits of K, T token rows, E the hidden size (the row's length).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common

MAX_SPLITS = 16          # the partials' loads are unrolled, all in flight at once
MAX_E = 8192             # a row in registers: E / (32 x warps) f32 a thread, twice


def ref_fused_add_rms_norm(partials, residual, weight, *, eps: float, interpret=False):
    """partials f32 [S, T, E], residual [T, E], weight [E] (residual's dtype) ->
    (y, normed), both [T, E] in residual's dtype: h = sum_s partials cast to that
    dtype (the projection's output), y = residual + h, normed = RMSNorm(y) * weight
    computed in f32 (jaxllm's RMSNorm)."""
    del interpret
    dt = residual.dtype
    h = partials.astype(jnp.float32).sum(0).astype(dt)
    y = residual + h
    yf = y.astype(jnp.float32)
    yf = yf * lax.rsqrt(jnp.mean(yf * yf, axis=-1, keepdims=True) + eps)
    return y, (yf * weight.astype(jnp.float32)).astype(dt)


def supported(num_splits: int, e: int) -> bool:
    return 1 <= num_splits <= MAX_SPLITS and e <= MAX_E


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def fused_add_rms_norm(partials, residual, weight, *, eps: float, interpret=False):
    """Same contract as ``ref_fused_add_rms_norm``."""
    s, t, e = partials.shape
    if residual.shape != (t, e) or weight.shape != (e,) or not supported(s, e):
        raise ValueError(f"partials {partials.shape}, residual {residual.shape}, weight "
                         f"{weight.shape}: [S <= {MAX_SPLITS}, T, E <= {MAX_E}], [T, E], [E]")
    ep = common.next_pow2(e)
    kernel = functools.partial(_kernel, s=s, e=e, ep=ep, eps=eps)
    full = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))  # noqa: E731
    out = jax.ShapeDtypeStruct((t, e), residual.dtype)
    return common.pallas_call(
        kernel, grid=(t,),
        in_specs=[full((s, t, e)), full((t, e)), full((e,))],
        out_specs=[full((t, e)), full((t, e))], out_shape=[out, out],
        num_warps=8 if ep >= 4096 else 4, num_stages=1, interpret=interpret,
        name="fused_add_rms_norm",
    )(partials.astype(jnp.float32), residual, weight.astype(residual.dtype))


def _kernel(p_ref, r_ref, w_ref, y_ref, n_ref, *, s, e, ep, eps):
    row = pl.program_id(0)
    cols = jnp.arange(ep)
    ok = cols < e
    # Masked lanes point past the row (never at a real value, as common.store_rows).
    safe = jnp.where(ok, cols, e)

    def load(ref, idx):
        return plgpu.load(ref.at[idx], mask=ok, other=0).astype(jnp.float32)

    h = load(p_ref, (0, row, safe))
    for i in range(1, s):         # unrolled: every split's row requested at once
        h = h + load(p_ref, (i, row, safe))
    dt = y_ref.dtype
    y = (load(r_ref, (row, safe)) + h.astype(dt).astype(jnp.float32)).astype(dt)
    yf = y.astype(jnp.float32)    # masked lanes are 0: the sum of squares is the row's
    inv = lax.rsqrt(jnp.sum(yf * yf) / e + eps)
    normed = (yf * inv * load(w_ref, (safe,))).astype(dt)
    plgpu.store(y_ref.at[row, safe], y, mask=ok)
    plgpu.store(n_ref.at[row, safe], normed, mask=ok)
