"""Weight-only FP8 matmul for decode-sized steps on Hopper, in Pallas' Mosaic GPU
backend: the e4m3 weight [N, K] streamed by TMA through a pipeline of shared-memory
stages, widened to f16 in registers (one packed conversion a pair of values) and
multiplied there by wgmma (A from registers, B = x's f16 tile from shared memory, read
transposed). The per-channel scale is applied by XLA to the partials' sum, in the
same fusion.

Why a kernel: at 16 rows XLA's Triton GEMMs stream an fp8 weight widened in place at
2.9-3.5 TB/s on the big projections and 1.6-2.2 TB/s on q/k/v and o (H200,
docs/benchmarks.md), against a ~4.3 TB/s copy ceiling. Here each program copies its
tiles with TMA, many stages deep, and the widening is one instruction per two values
(the 4-bit kernel, w4a16_mgpu.py, needs ~4 a byte), so the stream should approach the
copy rate; k-splits give the small projections enough programs to fill the SMs.

Letter legend: M tokens (rows of x), Mp = M rounded up to a power of two in [16, 64],
N output channels, K contracted dim, B = 128 columns (a sub-step: one 128-byte
swizzled row of the weight), C columns a pipeline step (a multiple of B), TN output
channels per program, S k-splits.

Grid (N / TN, S). A program owns TN channels and 1/S of K, and computes
acc[TN, Mp] += W[TN, C] @ x^T[C, Mp] per step. The weight is the MMA's M dimension (x's
few rows would not fill it). Each split writes f32 partials, [S, M, N] (`out_rows`,
jax >= 0.11: only x's M rows, their sum and the scale fused into the consumer) or
[S, N, Mp], which XLA sums. x stays [M, K]: its tiles are [Mp, C] TMA copies, which
fill the rows past M with zeros.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common
from pallas_kernels.w4a16_mgpu import ROWS, interpret_params, smem_transforms

B = 128              # columns a sub-step (one wgmma chain over a 128-byte weight row)
MAX_M = 64
FP8 = jnp.dtype(jnp.float8_e4m3fn)


def ref_w8a16_matmul(x, wq, w_scale, *, out_dtype=None, **settings):
    """x [M, K] (16- or 32-bit float), wq e4m3 [N, K], w_scale f32 [N] or a scalar ->
    [M, N] ``out_dtype`` (default x's dtype): (f16(x) @ wq^T) * w_scale, x as the
    kernel takes it (common.to_f16), the dot in f32 (fp8 values are exact in f16)."""
    del settings
    xf = common.to_f16(x).astype(jnp.float32)
    y = jnp.einsum("mk,nk->mn", xf, wq.astype(jnp.float32),
                   precision=lax.Precision.HIGHEST)
    return (y * jnp.asarray(w_scale, jnp.float32)).astype(out_dtype or x.dtype)


def smem_bytes(tile_n: int, mp: int, stages: int, cols: int = B) -> int:
    """A program's shared memory: the pipeline's stages (a weight tile and an x tile
    each) or the output tile in their place after it, and an 8-byte barrier a stage."""
    stage = tile_n * cols + mp * cols * 2
    return max(stages * stage, tile_n * mp * 4) + 8 * stages


def default_stages(mp: int) -> int:
    """4 stages up to 32 rows, 3 at 64 (x's tiles grow with the rows)."""
    return 4 if mp <= 32 else 3


def default_k_splits(n: int, k: int, tile_n: int) -> int:
    """The fewest splits of K whose programs cover the SMs twice, each split keeping at
    least 4 sub-steps (its pipeline fills); the most that keep 4 if none does; 0 if K
    has no such split."""
    blocks, tiles = k // B, n // tile_n
    fits = [s for s in range(1, blocks // 4 + 1) if blocks % s == 0]
    if not fits:
        return 0
    enough = [s for s in fits if tiles * s >= 2 * common.num_sms()]
    return enough[0] if enough else fits[-1]


def supported(n: int, k: int, tile_n: int = 128) -> bool:
    """Shapes the kernel takes at every M up to MAX_M with its defaults."""
    return (n % tile_n == 0 and k % B == 0 and default_k_splits(n, k, tile_n) > 0
            and smem_bytes(tile_n, MAX_M, default_stages(MAX_M)) <= common.SMEM_BYTES)


# One jit for every call site (as w4a16_mgpu.w4a16_matmul: identical calls compile once).
@functools.partial(jax.jit, static_argnames=("out_dtype", "tile_n", "k_splits", "stages",
                                             "cols", "out_rows", "warpgroups", "interpret"))
def w8a16_matmul(x, wq, w_scale, *, out_dtype=None, tile_n=128, k_splits=None, stages=None,
                 cols=None, out_rows=None, warpgroups=1, interpret=False):
    """Same contract as ``ref_w8a16_matmul``; the rest are kernel settings (`cols`:
    columns a pipeline step copies, a multiple of 128; `out_rows`: the partials' layout;
    `warpgroups` 2: a warp-specialized program, one warp group issuing the copies and two
    widening and multiplying half the tile's channels each, jax >= 0.11, no interpret
    mode). M <= 64."""
    m, k = x.shape
    n = wq.shape[0]
    if jnp.dtype(wq.dtype) != FP8 or wq.shape != (n, k):
        raise ValueError(f"weight {wq.dtype} {wq.shape}: float8_e4m3fn [N, {k}] expected")
    if m > MAX_M or n % tile_n or k % B:
        raise ValueError(f"M {m} > {MAX_M}, N {n} not a multiple of {tile_n} or K {k} not "
                         f"a multiple of {B}")
    mp = max(16, common.next_pow2(m))
    stages = stages or default_stages(mp)
    cols = cols or B
    if cols % B:
        raise ValueError(f"cols {cols}: a multiple of {B}")
    if smem_bytes(tile_n, mp, stages, cols) > common.SMEM_BYTES:
        raise ValueError(f"tile_n {tile_n}, {stages} stages of {cols} columns at {mp} rows: "
                         "over the shared memory of a program")
    splits = k_splits or default_k_splits(n, k, tile_n)
    if not splits or k % (splits * cols):
        raise ValueError(f"k_splits {splits}: K {k} must split into a whole number of "
                         f"steps of {cols} columns")
    if warpgroups not in (1, 2):
        raise ValueError(f"warpgroups {warpgroups}: 1 or 2")
    if warpgroups == 2 and (interpret or not ROWS or tile_n % 128):
        raise ValueError("warpgroups 2: jax >= 0.11 on a GPU, tile_n a multiple of 128")
    # the warp-specialized program writes its partials [S, M, N] only
    out_rows = warpgroups == 2 or (ROWS if out_rows is None else out_rows)
    shape = dict(m=m, mp=mp, n=n, tile_n=tile_n, splits=splits, steps=k // splits // cols,
                 stages=stages, cols=cols)
    x16 = common.to_f16(x)
    out = (_call_ws(x16, wq, **shape) if warpgroups == 2 else
           _call(x16, wq, **shape, out_rows=out_rows, interpret=interpret))
    y = out.sum(0) if out_rows else out.sum(0)[:, :m].T
    return (y * jnp.asarray(w_scale, jnp.float32)).astype(out_dtype or x.dtype)


def _call(x, wq, *, m, mp, n, tile_n, splits, steps, stages, cols, out_rows, interpret):
    w_tr = smem_transforms(cols * 8, 8, "weight")
    x_tr = smem_transforms(cols * 16, 16, "x")
    # Interpret mode's wgmma reads A from shared memory only and takes no transposed
    # refs: there the widened tile and x^T are stored first (as in w4a16_mgpu).
    a_tr = smem_transforms(B * 16, 16, "widened weight")

    def kernel(w_gmem, x_gmem, out_gmem, *a_smem):
        ni, si = lax.axis_index("n"), lax.axis_index("s")
        first = si * steps

        def step(idx, w_smem, x_smem, acc):
            for h in range(cols // B):
                sub = pl.ds(h * B, B)
                w, xt = _widen(w_smem.at[:, sub], x_smem.at[:, sub], a_smem,
                               interpret=interpret)
                plgpu.wgmma(acc, w, xt)
                # waited for here, as in w4a16_mgpu (the next widening reuses registers)
                plgpu.wgmma_wait(0)
            return acc

        specs = [
            plgpu.BlockSpec((tile_n, cols), lambda t, j: (ni, first + j), transforms=w_tr),
            plgpu.BlockSpec((mp, cols), lambda t, j: (0, first + j), transforms=x_tr),
        ]
        tile_shape = (mp, tile_n) if out_rows else (tile_n, mp)

        def scope(acc):
            plgpu.emit_pipeline(step, grid=(1, steps), max_concurrent_steps=stages,
                                init_carry=acc, in_specs=specs)(w_gmem, x_gmem)

            def epilogue(tile):
                if not out_rows:
                    tile[...] = acc[...]
                elif interpret:
                    tile[...] = acc[...].T
                else:
                    v = plgpu.layout_cast(acc[...], plgpu.Layout.WGMMA_TRANSPOSED)
                    plgpu.transpose_ref(tile.at[:, :], (1, 0))[...] = v
                plgpu.commit_smem()
                chans = pl.ds(ni * tile_n, tile_n)
                plgpu.copy_smem_to_gmem(tile.at[pl.ds(0, m)] if out_rows else tile,
                                        out_gmem.at[si, :, chans] if out_rows
                                        else out_gmem.at[si, chans])
                plgpu.wait_smem_to_gmem(0)
            # allocated after the pipeline's buffers are freed, so in their place
            pl.run_scoped(epilogue, plgpu.SMEM(tile_shape, jnp.float32))

        pl.run_scoped(scope, plgpu.ACC((tile_n, mp), jnp.float32))

    scratch = [plgpu.SMEM((tile_n, B), jnp.float16, transforms=a_tr),
               plgpu.SMEM((B, mp), jnp.float16)] if interpret else []
    f = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((splits, m, n) if out_rows else (splits, n, mp),
                                              jnp.float32),
        grid=(n // tile_n, splits), grid_names=("n", "s"), scratch_types=scratch,
        interpret=interpret_params() if interpret else None)
    return f(wq, x)


def _call_ws(x, wq, *, m, mp, n, tile_n, splits, steps, stages, cols):
    """The program warp-specialized: a memory warp group runs the TMA pipeline, two
    compute warp groups each own half of the TN channels (an m64 wgmma chain each) and
    read the same x tile, so each SM has two widen-and-multiply chains a program where
    _call has one waiting on its wgmma every sub-step. Partials [S, M, N]."""
    w_tr = smem_transforms(cols * 8, 8, "weight")
    x_tr = smem_transforms(cols * 16, 16, "x")
    half = tile_n // 2

    def kernel(w_gmem, x_gmem, out_gmem, out_smem):
        ni, si, wg = lax.axis_index("n"), lax.axis_index("s"), lax.axis_index("wg")
        first = si * steps
        rows = pl.ds(wg * half, half)

        def context(run):
            zero = plgpu.layout_cast(jnp.zeros((half, mp), jnp.float32), plgpu.Layout.WGMMA)
            acc = run(zero)
            v = plgpu.layout_cast(acc, plgpu.Layout.WGMMA_TRANSPOSED)
            plgpu.transpose_ref(out_smem.at[wg], (1, 0))[...] = v
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[wg, pl.ds(0, m)],
                                    out_gmem.at[si, :, pl.ds(ni * tile_n + wg * half, half)])
            plgpu.wait_smem_to_gmem(0)

        def step(idx, w_smem, x_smem, acc):
            for h in range(cols // B):
                sub = pl.ds(h * B, B)
                w, xt = _widen(w_smem.at[rows, sub], x_smem.at[:, sub], (), interpret=False)
                acc = pl.run_state(lambda r: plgpu.wgmma(r, w, xt))(plgpu.ACC.init(acc))
            return acc

        pipeline = plgpu.emit_pipeline_warp_specialized(
            step, grid=(steps,), memory_registers=40, max_concurrent_steps=stages,
            wg_axis="wg", num_compute_wgs=2, compute_context=context,
            in_specs=[plgpu.BlockSpec((tile_n, cols), lambda j: (ni, first + j),
                                      transforms=w_tr),
                      plgpu.BlockSpec((mp, cols), lambda j: (0, first + j), transforms=x_tr)])
        pipeline(w_gmem, x_gmem)

    f = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((splits, m, n), jnp.float32),
        grid=(n // tile_n, splits), grid_names=("n", "s"), num_threads=3, thread_name="wg",
        scratch_types=[plgpu.SMEM((2, mp, half), jnp.float32)])
    return f(wq, x)


def _widen(w_smem, x_smem, a_smem, *, interpret):
    """A sub-step's weight widened to f16 [TN, B] (registers; in interpret mode a
    shared-memory copy) and x^T [B, Mp]."""
    if interpret:
        a_smem[0][...] = w_smem[...].astype(jnp.float16)
        a_smem[1][...] = x_smem[...].T
        plgpu.commit_smem()
        return a_smem
    # 32-bit shared-memory loads of 4 values, one shuffle to wgmma's layout while still
    # 8-bit (half the bytes of relaying out f16), then the packed e4m3x2 -> f16x2 cvt.
    w = plgpu.load(w_smem, (), layout=plgpu.Layout.WGMMA_UPCAST_2X)
    w = plgpu.layout_cast(w, plgpu.Layout.WGMMA).astype(jnp.float16)
    return w, plgpu.transpose_ref(x_smem, (1, 0))
