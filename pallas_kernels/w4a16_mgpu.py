"""W4A16 matmul for decode-sized steps on Hopper, in Pallas' Mosaic GPU backend: the
4-bit weight streamed by TMA through a pipeline of shared-memory stages, widened to
bf16 in registers with its group's scale and offset, and multiplied there by wgmma
(A from registers, B = x's tile from shared memory).

Letter legend: M tokens (rows of x), Mp = M padded to a power of two in [16, 64],
N output channels, K contracted dim, G the group size (= TK, columns per step),
TN output channels per program, S k-splits.

Layout (written once at load by ``kernel_weight`` / ``kernel_scales``): the weight
as signed int4 [N, K] holding q - 8 for the checkpoint's uint4 q, and per group the
bf16 pair (s, b) with b = (8 - z) * s, stored [K / G, N] so a step's TN scales are
one contiguous row: w = (q - z) * s = (q - 8) * s + b.

Grid (N / TN, S). A program owns TN channels and 1/S of the K steps and computes
acc[TN, Mp] += W[TN, G] @ x^T[G, Mp] per step, the weight as the MMA's M dimension
(x's few rows would not fill it). With S > 1 each split writes f32 partials
[S, N, Mp] and XLA sums them (inside a model the sum fuses into the consumer).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common

GROUP = 128          # the only group size the kernel takes (one group per step)
MAX_M = 64


# --- layout --------------------------------------------------------------------------

def kernel_weight(w_u8):
    """uint8 [N, K/2] holding two uint4 a byte (column 2j in the low nibble) -> int4
    [N, K] of q - 8 (each nibble's top bit flipped)."""
    n, half = w_u8.shape
    flipped = w_u8 ^ jnp.uint8(0x88)
    nib = jnp.stack([flipped & 15, flipped >> 4], axis=-1).reshape(n, 2 * half)
    return (nib.astype(jnp.int8) - jnp.where(nib >= 8, 16, 0).astype(jnp.int8)
            ).astype(jnp.int4)


def checkpoint_operands(w_u8, scale, zero):
    """The checkpoint's layout as the kernel's operands with ``unsigned=True``, per call:
    the bytes reread as int4 (a bitcast: int4's first element is a byte's low nibble,
    as the checkpoint packs them; each uint4 q then reads as q - 16 where q >= 8) and
    bf16 (s, b) [K/G, N] with b = -z * s (one small fusion over the scales)."""
    n, half = w_u8.shape
    q = lax.bitcast_convert_type(w_u8, jnp.int4).reshape(n, 2 * half)
    s = scale.astype(jnp.float32)
    return q, s.T.astype(jnp.bfloat16), (-zero.astype(jnp.float32) * s).T.astype(jnp.bfloat16)


def kernel_scales(scale, zero):
    """f32 scale and zero point [N, K/G] -> bf16 (s, b) [K/G, N], b = (8 - z) * s."""
    s = scale.astype(jnp.float32)
    return s.T.astype(jnp.bfloat16), ((8.0 - zero.astype(jnp.float32)) * s).T.astype(
        jnp.bfloat16)


# --- reference -----------------------------------------------------------------------

def ref_w4a16_matmul(x, q, s, b, *, out_dtype=None, unsigned=False, **settings):
    """x [M, K] bf16, q int4 [N, K], s / b bf16 [K/G, N] -> [M, N] ``out_dtype``
    (default x's dtype); ``unsigned``: q holds uint4 values bit for bit (each read as
    q - 16 where q >= 8, see checkpoint_operands). The weight as the kernel widens it: q * s + b in f32 rounded
    once to bf16 (the kernel's bf16 arithmetic rounds the product and the sum apart:
    within a unit in the last place of it), then the dot in f32."""
    del settings
    n, k = q.shape
    g = jnp.arange(k) // GROUP
    v = q.astype(jnp.float32)
    if unsigned:
        v = jnp.where(v < 0, v + 16, v)
    w = (v * s.T[:, g].astype(jnp.float32)
         + b.T[:, g].astype(jnp.float32)).astype(jnp.bfloat16)
    y = jnp.einsum("mk,nk->mn", x.astype(jnp.float32), w.astype(jnp.float32),
                   precision=lax.Precision.HIGHEST)
    return y.astype(out_dtype or x.dtype)


# --- kernel --------------------------------------------------------------------------

def default_k_splits(n: int, k: int, tile_n: int) -> int:
    """Splits of K so the programs cover the SMs about twice (several programs an SM
    keep more weight bytes in flight), each split at least 4 steps."""
    steps, tiles = k // GROUP, n // tile_n
    s = 1
    while tiles * s < 2 * common.num_sms() and steps % (2 * s) == 0 and steps // (2 * s) >= 4:
        s *= 2
    return s


def w4a16_matmul(x, q, s, b, *, out_dtype=None, unsigned=False, tile_n=128, k_splits=None,
                 stages=4, interpret=False):
    """Same contract as ``ref_w4a16_matmul``; the rest are kernel settings. M <= 64."""
    m, k = x.shape
    n = q.shape[0]
    if q.shape != (n, k) or jnp.dtype(q.dtype) != jnp.int4:
        raise ValueError(f"weight {q.dtype} {q.shape}: int4 [N, {k}] expected")
    if s.shape != (k // GROUP, n) or b.shape != s.shape or k % GROUP:
        raise ValueError(f"scales {s.shape} / {b.shape}: [{k // GROUP}, {n}] expected "
                         f"(K a multiple of {GROUP})")
    if m > MAX_M or n % tile_n:
        raise ValueError(f"M {m} > {MAX_M} or N {n} not a multiple of {tile_n}")
    mp = max(16, 1 << (m - 1).bit_length())
    splits = k_splits or default_k_splits(n, k, tile_n)
    steps = k // GROUP
    if steps % splits:
        raise ValueError(f"k_splits {splits} does not divide K's {steps} steps")
    per = steps // splits
    xt = jnp.pad(x.astype(jnp.bfloat16), ((0, mp - m), (0, 0))).T          # [K, Mp]
    out = _call(xt, q, s.astype(jnp.bfloat16), b.astype(jnp.bfloat16), n=n, mp=mp,
                tile_n=tile_n, splits=splits, per=per, stages=stages, unsigned=unsigned,
                interpret=interpret)
    return out.sum(0)[:, :m].T.astype(out_dtype or x.dtype)


def _transforms(minor_bits: int, elem_bits: int, what: str):
    swizzle = plgpu.find_swizzle(minor_bits, what)
    return (plgpu.TilingTransform((8, swizzle * 8 // elem_bits)),
            plgpu.SwizzleTransform(swizzle))


def _call(xt, q, s, b, *, n, mp, tile_n, splits, per, stages, unsigned, interpret):
    q_tr = _transforms(GROUP * 4, 4, "weight")
    x_tr = _transforms(mp * 16, 16, "x")
    # Interpret mode's wgmma reads A from shared memory only: there the widened tile is
    # stored first (the GPU keeps it in registers), and loads take no layouts.
    a_tr = _transforms(GROUP * 16, 16, "widened weight")
    row = plgpu.Layout.WGMMA.reduce(1)

    def load(ref, layout):
        return ref[...] if interpret else plgpu.load(ref, (), layout=layout)

    def kernel(q_gmem, xt_gmem, s_gmem, b_gmem, out_gmem, out_smem, *a_smem):
        ni, si = lax.axis_index("n"), lax.axis_index("s")

        def step(_, q_smem, x_smem, s_smem, b_smem, acc):
            w = load(q_smem, plgpu.Layout.WGMMA).astype(jnp.bfloat16)
            if unsigned:      # back to the uint4 value: one compare and select a value
                w = jnp.where(w < 0, w + 16, w)
            sc, bi = load(s_smem, row), load(b_smem, row)
            w = w * lax.broadcast_in_dim(sc, w.shape, (0,)) + lax.broadcast_in_dim(
                bi, w.shape, (0,))
            if a_smem:
                a_smem[0][...] = w
                plgpu.commit_smem()
                w = a_smem[0]
            plgpu.wgmma(acc, w, x_smem)
            plgpu.wgmma_wait(0)
            return acc

        def run(acc):
            first = si * per
            plgpu.emit_pipeline(
                step, grid=(per,), max_concurrent_steps=stages, init_carry=acc,
                in_specs=[
                    plgpu.BlockSpec((tile_n, GROUP), lambda j: (ni, first + j),
                                    transforms=q_tr),
                    plgpu.BlockSpec((GROUP, mp), lambda j: (first + j, 0), transforms=x_tr),
                    plgpu.BlockSpec((None, tile_n), lambda j: (first + j, ni)),
                    plgpu.BlockSpec((None, tile_n), lambda j: (first + j, ni)),
                ])(q_gmem, xt_gmem, s_gmem, b_gmem)
            out_smem[...] = acc[...]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[si, pl.ds(ni * tile_n, tile_n)])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(run, plgpu.ACC((tile_n, mp), jnp.float32))

    scratch = [plgpu.SMEM((tile_n, mp), jnp.float32)]
    if interpret:
        scratch.append(plgpu.SMEM((tile_n, GROUP), jnp.bfloat16, transforms=a_tr))
    f = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((splits, n, mp), jnp.float32),
        grid=(n // tile_n, splits), grid_names=("n", "s"), scratch_types=scratch,
        interpret=_interpret_params() if interpret else None)
    return f(q, xt, s, b)


def _interpret_params():
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams()
