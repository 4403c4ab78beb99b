"""Online int8's input path in one kernel: each token's row rotated in Hadamard blocks,
then quantized to int8 with a scale and zero point per token (vLLM's dynamic azp).

XLA runs the same math as four kernels a projection at decode sizes (the f32 copy,
the rotation's dot, the token's min / max, the quantizing cast; jaxllm's
rotation.rotate and quantize_per_token_asym); on the H200 the rotation cost the int8
8B decode step 14%. Here one program owns one token's row and reads it twice: a
first pass rotates it tile by tile and keeps its min and max, a second rotates it
again (from L2) and writes the int8 values. The row's rotated values never leave
registers.

Letter legend: T tokens, K the row's length, B the Hadamard block (16 or 64 here, so
its entries, +-1/sqrt(B), are exact in bf16 and f16), C blocks per tile.

The rotation is a dot of a [C, B] tile of x with the [B, B] matrix, both in x's
16-bit dtype (exact products), summed in f32: the reference's f32 einsum up to the
order of its sums. That order can put a value at a rounding boundary one level apart
from the XLA path's: a few values in a million (scripts/check_rotate_quant.py). The
divisions are not a source: compiled for the H200, Triton here and XLA's fusions there
both emit the same approximate f32 division (div.full.f32).

Rounding half to even is built from floor (Pallas' Triton lowering has no round op):
floor(y + 0.5), less one where that was a tie rounded up to an odd value; exact for
|y| < 2^22.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common

INT8_MAX = 127.0
MIN_SCALE = 1e-12             # as jaxllm's quantization: an all-zero row stays finite
# Blocks whose 1/sqrt(B) is exact in a 16-bit float (a power of four).
BLOCKS = (16, 64)
# Elements of a tile: C = TILE // B rows of the dot, [C, B] f32 in registers.
TILE = 4096


def asym_params(lo, hi):
    """A token's [min, max] (each widened to take in 0) -> (scale, zero point)."""
    scale = jnp.maximum((hi - lo) / (2 * INT8_MAX + 1), MIN_SCALE)
    return scale, rint(-INT8_MAX - 1 - lo / scale)


def rint(y):
    """f32 y rounded half to even (jnp.round's rule), from floor."""
    t = jnp.floor(y + 0.5)
    odd_tie = (t - y == 0.5) & (t - 2 * jnp.floor(t * 0.5) == 1)
    return jnp.where(odd_tie, t - 1, t)


def ref_rotate_quantize(x, h, *, interpret=False):
    """x [T, K] (bf16 / f16 / f32), h [B, B] a normalized Hadamard block, B dividing K ->
    (int8 [T, K], f32 scale [T], f32 zero point [T]) with x ~= scale * (q - zero) after
    rotation: each row's blocks of B times h in f32, then the row's [min, max]
    (widened to take in 0) onto [-128, 127], rounding half to even."""
    del interpret
    t, k = x.shape
    b = h.shape[0]
    xr = jnp.einsum("tgb,bc->tgc", x.astype(jnp.float32).reshape(t, k // b, b),
                    h.astype(jnp.float32), precision=lax.Precision.HIGHEST).reshape(t, k)
    lo = jnp.minimum(jnp.min(xr, axis=1), 0.0)
    hi = jnp.maximum(jnp.max(xr, axis=1), 0.0)
    scale, zero = asym_params(lo, hi)
    q = jnp.clip(jnp.round(xr / scale[:, None]) + zero[:, None], -INT8_MAX - 1, INT8_MAX)
    return q.astype(jnp.int8), scale, zero


def supported(x_dtype, k: int, b: int) -> bool:
    """Whether the kernel takes this input: a 16-bit x (its dot is exact in its dtype)
    and a block of 16 or 64 dividing K."""
    return (jnp.dtype(x_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and b in BLOCKS and k % b == 0)


@functools.partial(jax.jit, static_argnames=("num_warps", "interpret"))
def rotate_quantize(x, h, *, num_warps=4, interpret=False):
    """Same contract as ``ref_rotate_quantize`` for a 16-bit x and B in BLOCKS."""
    t, k = x.shape
    b = h.shape[0]
    if not supported(x.dtype, k, b) or h.shape != (b, b):
        raise ValueError(f"x {x.dtype} [{t}, {k}] with a {h.shape} block: a 16-bit x "
                         f"and a block of {' or '.join(map(str, BLOCKS))} dividing K")
    # Blocks a tile: a power of two, at least 16 (a Triton dot's rows).
    c = min(TILE // b, max(16, common.next_pow2(k // b)))
    tiles = common.cdiv(k // b, c)
    kernel = functools.partial(_kernel, k=k, b=b, c=c, tiles=tiles)
    full = lambda s: pl.BlockSpec(s, lambda i: (0,) * len(s))  # noqa: E731
    q, scale, zero = common.pallas_call(
        kernel, grid=(t,),
        in_specs=[full((t, k)), full((b, b))],
        out_specs=[full((t, k)), full((t, 1)), full((t, 1))],
        out_shape=[jax.ShapeDtypeStruct((t, k), jnp.int8),
                   jax.ShapeDtypeStruct((t, 1), jnp.float32),
                   jax.ShapeDtypeStruct((t, 1), jnp.float32)],
        num_warps=num_warps, num_stages=2, interpret=interpret, name="rotate_quantize",
    )(x, h.astype(x.dtype))
    return q, scale[:, 0], zero[:, 0]


def _kernel(x_ref, h_ref, q_ref, s_ref, z_ref, *, k, b, c, tiles):
    row = pl.program_id(0)
    h = h_ref[...]
    groups, cols = jnp.arange(c), jnp.arange(b)

    def tile(i):
        """Tile i's [C, B] rotated values (f32), its blocks' indices and its mask. The
        block index is clamped before the columns are added, so each block's B offsets
        stay contiguous (vectorized loads and stores)."""
        g = i * c + groups
        ok = (g < k // b)[:, None] & (cols < b)[None, :]
        offs = jnp.minimum(g, k // b - 1)[:, None] * b + cols[None, :]
        xt = plgpu.load(x_ref.at[row, offs], mask=ok, other=0)
        return plgpu.dot(xt, h), g, ok

    def bounds(i, lohi):
        y, _, _ = tile(i)      # masked lanes are 0, inside the widened range already
        return jnp.minimum(lohi[0], jnp.min(y)), jnp.maximum(lohi[1], jnp.max(y))

    lo, hi = lax.fori_loop(0, tiles, bounds, (jnp.float32(0.0), jnp.float32(0.0)))
    scale, zero = asym_params(lo, hi)

    def write(i, carry):
        y, g, ok = tile(i)
        q = jnp.clip(rint(y / scale) + zero, -INT8_MAX - 1, INT8_MAX)
        # Masked blocks point past K (as common.store_rows), never at a real value.
        offs = jnp.minimum(g, k // b)[:, None] * b + cols[None, :]
        plgpu.store(q_ref.at[row, offs], q.astype(jnp.int8), mask=ok)
        return carry

    lax.fori_loop(0, tiles, write, 0)
    s_ref[row, 0] = scale
    z_ref[row, 0] = zero
