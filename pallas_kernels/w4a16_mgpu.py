"""W4A16 matmul for decode-sized steps on Hopper, in Pallas' Mosaic GPU backend: the
4-bit weight streamed by TMA through a pipeline of shared-memory stages, widened to
bf16 in registers with its group's zero point and scale, and multiplied there by
wgmma (A from registers, B = x's tile from shared memory, read transposed).

Letter legend: M tokens (rows of x), Mp = M rounded up to a power of two in [16, 64],
N output channels, K contracted dim, G the group size (= columns per step), TN
output channels per program, S k-splits, P = K / G / S groups per split.

The weight is the checkpoint's layout as jaxllm stores it (no copy at load): uint4
two a byte, the even column in the low nibble, reread as int4 [N, K] by a bitcast
(``as_int4``), so a value q reads as q - 16 where q >= 8 and the kernel flips each
nibble's top bit. The group scales and zero points come packed (``pack_scales``: one
bf16 [2 K/G, N]); each pipeline step copies its group's [2, TN] rows beside its
weight tile.

Grid (N / TN / T, S). A program owns T consecutive tiles of TN channels (``tiles``)
and 1/S of K, and computes acc[TN, Mp] += W[TN, G] @ x^T[G, Mp] per step, with W =
(q - z) * s, the scale in bf16 (as vLLM's Marlin kernels take a bf16 model's) and the
product one fma a pair of values, (q - 8) * s + c with c = -(z - 8) * s in bf16. The
tile is loaded in the layout meant for 4-bit values bound for wgmma
(WGMMA_UPCAST_4X: 128-bit shared-memory loads) and relaid out while still 4-bit,
before it is widened (the main loop's SASS and its H100 times: docs/benchmarks.md).
The weight is the MMA's M dimension (x's few rows would not fill it). Each split
writes f32 partials, [S, N, Mp] or with `out_rows` [S, M, N] (only x's M rows; their
sum fused into the consumer), which XLA sums. x stays [M, K]: its tiles are [Mp, G]
TMA copies, which fill the rows past M with zeros.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common

GROUP = 128          # the only group size the kernel takes (one group per step)
MAX_M = 64
# jax >= 0.11 stores registers into transposed shared-memory views (0.10 flattens the
# view): there the partials can leave as rows (OUT_ROWS).
ROWS = jax.__version_info__ >= (0, 11)
# The partials written [S, M, N] (`out_rows`; jax >= 0.11): XLA then fuses their sum
# into the consumer, 3 kernels a layer fewer and ~0.25 ms off an 8B decode step on an
# H100 (docs/benchmarks.md); False writes them [S, N, Mp], summed and transposed by XLA.
OUT_ROWS = True


def as_int4(w_u8):
    """uint8 [..., K/2] (two uint4 a byte) -> int4 [..., K], the same bytes."""
    *lead, half = w_u8.shape
    return lax.bitcast_convert_type(w_u8, jnp.int4).reshape(*lead, 2 * half)


def ref_w4a16_matmul(x, q, scales, *, out_dtype=None, **settings):
    """x [M, K], q int4 [N, K] (uint4 values reread, see as_int4), scales bf16 [2 K/G, N]
    (``pack_scales``) -> [M, N] ``out_dtype`` (default x's dtype). The weight as the kernel
    widens it, (q - z) * s as one fma: (q - 8) * s + c with c = -(z - 8) * s rounded to
    bf16, the sum rounded to bf16 once (exact in f32 before that rounding: a 4-bit
    integer times a bf16, plus a bf16 of at most 2^4 times its size); the dot in f32."""
    del settings
    scale, zero = unpack_scales(scales)
    k = q.shape[1]
    g = jnp.arange(k) // GROUP
    v = q.astype(jnp.float32)
    v = jnp.where(v < 0, v + 16, v)
    c = (-(zero - 8) * scale).astype(jnp.bfloat16).astype(jnp.float32)
    w = ((v - 8) * scale[:, g] + c[:, g]).astype(jnp.bfloat16)
    y = jnp.einsum("mk,nk->mn", x.astype(jnp.bfloat16).astype(jnp.float32),
                   w.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return y.astype(out_dtype or x.dtype)


def pack_scales(scale, zero):
    """f32 scale and zero point [N, K/G] -> bf16 [2 K/G, N], group j's scales in row
    2j and its zero points in row 2j + 1 (the packed operand: a step's TMA copy reads
    both as one [2, TN] box of whole rows, and no program copies or transposes a slab
    first). The scale rounded to bf16 as the kernel rounds it; zero points (integers
    below 256) exact."""
    n, groups = scale.shape
    return jnp.stack([scale.T, zero.T], 1).astype(jnp.bfloat16).reshape(2 * groups, n)


def unpack_scales(packed):
    """``pack_scales``' inverse: bf16 [2 K/G, N] -> f32 scale and zero [N, K/G]."""
    p = packed.astype(jnp.float32)
    return p[0::2].T, p[1::2].T


def default_k_splits(n: int, k: int, tile_n: int, mp: int = MAX_M, stages: int = 4) -> int:
    """Splits of K, among those leaving each at least 4 groups; up to 16 rows the most
    of them up to 8, above the fewest whose programs cover the SMs twice (more write
    f32 partials that approach the weight's own bytes), else the most (the H100 sweeps
    in docs/benchmarks.md). 0 if none or a program at ``mp`` rows is over shared
    memory."""
    groups, tiles = k // GROUP, n // tile_n
    if smem_bytes(tile_n, mp, stages) > common.SMEM_BYTES:
        return 0
    fits = [s for s in range(1, groups // 4 + 1) if groups % s == 0]
    if not fits:
        return 0
    if mp <= 16:
        return [s for s in fits if s <= 8][-1]
    enough = [s for s in fits if tiles * s >= 2 * common.num_sms()]
    return enough[0] if enough else fits[-1]


def default_settings(n: int, k: int, tile_n: int, mp: int) -> tuple[int, int, int]:
    """(k_splits, stages, groups_per_step) where a call names none. Up to 16 rows,
    where the programs are many (tiles x splits >= 6 waves of the SMs), fewer and
    longer splits; and where a split holds at least 8 groups, 2 of them a pipeline
    stage with 2 stages (the same shared memory as 4 stages of one). On an H100 at
    1 / 16 rows: gate/up 31.0 / 32.7 us with 4 splits so against 31.4 / 35.7 with 8
    of one group a stage; down 18.2 / 18.3 against 18.7 / 19.3; the 8B AWQ engine's
    `latency` 0.963x (docs/benchmarks.md). Above 16 rows default_k_splits and
    default_stages, one group a stage."""
    stages = default_stages(mp)
    splits = default_k_splits(n, k, tile_n, mp, stages)
    if mp > 16 or not splits:
        return splits, stages, 1
    groups, tiles = k // GROUP, n // tile_n
    # d <= default_k_splits' choice leaves each split its 4 groups or more already
    many = [d for d in range(1, splits + 1)
            if groups % d == 0 and tiles * d >= 6 * common.num_sms()]
    splits = many[0] if many else splits
    if groups // splits >= 8 and groups // splits % 2 == 0:
        return splits, 2, 2
    return splits, stages, 1


def smem_bytes(tile_n: int, mp: int, stages: int, gps: int = 1, tiles: int = 1) -> int:
    """A program's shared memory: the pipeline's tiles (weight, x and the group's
    scale and zero-point rows a stage) and the output tile, in their place once the
    pipeline is done (beside them with ``tiles`` > 1, written within it), and an
    8-byte barrier a stage: the kernel's dynamic shared memory as Mosaic sizes it (its
    dumps, jax 0.11.2: 51,232 bytes at 16 rows with 4 stages, 50,192 at 64 rows with
    2). ``gps``: groups a stage."""
    stage = gps * (tile_n * GROUP // 2 + mp * GROUP * 2 + 2 * tile_n * 2)
    out = tile_n * mp * 4
    pipe = stages * stage + out if tiles > 1 else max(stages * stage, out)
    return pipe + 8 * stages


def default_stages(mp: int) -> int:
    """Pipeline depth: 4 up to 16 rows; 2 above, where x's tiles grow (on an H100 a
    layer's four matmuls took 0.81x the time at 64 rows with 2, 0.90x at 32, when
    4 left room for one gate/up program an SM)."""
    return 4 if mp <= 16 else 2


def supported(n: int, k: int, tile_n: int = 128) -> bool:
    """Shapes the kernel takes at every M up to MAX_M with the default splits and
    stages (a program's shared memory at any M is at most MAX_M's with 2 stages: at
    16 rows 4 stages of tiles take no more)."""
    if n % tile_n or k % GROUP:
        return False
    return default_k_splits(n, k, tile_n, MAX_M, default_stages(MAX_M)) > 0


# One jit for every call site: without it each call site's kernel is lowered and
# compiled on its own (~0.9 s each on the GPU machine, 128 a decode step of an 8B
# model, so minutes of warm-up), while identical calls through one jit compile once.
@functools.partial(jax.jit, static_argnames=("out_dtype", "tile_n", "k_splits", "stages",
                                             "out_rows", "groups_per_step", "tiles",
                                             "interpret"))
def w4a16_matmul(x, q, scales, *, out_dtype=None, tile_n=128, k_splits=None, stages=None,
                 out_rows=None, groups_per_step=None, tiles=None, interpret=False):
    """Same contract as ``ref_w4a16_matmul``; the rest are kernel settings (`out_rows`:
    the partials' layout, OUT_ROWS's by default; `groups_per_step`: groups a pipeline
    stage copies, one wgmma each; `tiles`: consecutive tiles of N a program streams
    through one pipeline; those left None: default_settings' where none is named).
    M <= 64."""
    m, k = x.shape
    n = q.shape[0]
    groups = k // GROUP
    if jnp.dtype(q.dtype) != jnp.int4 or q.shape != (n, k):
        raise ValueError(f"weight {q.dtype} {q.shape}: int4 [N, {k}] expected")
    if k % GROUP or scales.shape != (2 * groups, n):
        raise ValueError(f"scales {scales.shape}: packed [{2 * groups}, {n}] expected "
                         f"(pack_scales; K a multiple of {GROUP})")
    if m > MAX_M or n % tile_n:
        raise ValueError(f"M {m} > {MAX_M} or N {n} not a multiple of {tile_n}")
    mp = max(16, common.next_pow2(m))
    if k_splits is None and stages is None and groups_per_step is None and tiles is None:
        (k_splits, stages, groups_per_step), tiles = default_settings(n, k, tile_n, mp), 1
    tiles = 1 if tiles is None else tiles
    if tiles < 1 or n // tile_n % tiles:
        raise ValueError(f"tiles {tiles}: must divide N's {n // tile_n} tiles of {tile_n}")
    out_rows = OUT_ROWS and ROWS if out_rows is None else out_rows
    stages = stages or default_stages(mp)
    # shared memory first: default_k_splits gives 0 for a program over it as well
    gps = 1 if groups_per_step is None else groups_per_step
    if gps not in (1, 2, 4):
        raise ValueError(f"groups_per_step {gps}: 1, 2 or 4")
    if smem_bytes(tile_n, mp, stages, gps, tiles) > common.SMEM_BYTES:
        raise ValueError(f"tile_n {tile_n}, {stages} stages at {mp} rows: over the shared "
                         "memory of a program")
    splits = k_splits or default_k_splits(n, k, tile_n, mp, stages)
    if not splits:
        raise ValueError(f"K's {groups} groups: no default split of at least 4 groups "
                         "(pass k_splits)")
    if groups % splits or groups // splits % gps:
        raise ValueError(f"k_splits {splits}: must divide K's {groups} groups (into "
                         f"splits of a multiple of {gps} groups)")
    # x goes in unpadded, its tiles [Mp, G] read past its M rows: TMA fills those rows
    # with zeros (a pad would be a kernel of its own at every call below 16 rows), the
    # interpreter with NaNs, so its runs also show that no row leaks into another.
    out = _call(x.astype(jnp.bfloat16), q, scales.astype(jnp.bfloat16), n=n, m=m, mp=mp,
                tile_n=tile_n, splits=splits, per=groups // splits, stages=stages,
                out_rows=out_rows, gps=gps, tiles=tiles, interpret=interpret)
    y = out.sum(0) if out_rows else out.sum(0)[:, :m].T
    return y.astype(out_dtype or x.dtype)


def smem_transforms(minor_bits: int, elem_bits: int, what: str):
    """A shared-memory tile's tiling and swizzle for rows of `minor_bits` bits."""
    swizzle = plgpu.find_swizzle(minor_bits, what)
    return (plgpu.TilingTransform((8, swizzle * 8 // elem_bits)),
            plgpu.SwizzleTransform(swizzle))


def _call(x, q, scales, *, n, m, mp, tile_n, splits, per, stages, out_rows, gps, tiles,
          interpret):
    q_tr = smem_transforms(GROUP * 4, 4, "weight")
    x_tr = smem_transforms(GROUP * 16, 16, "x")
    # Interpret mode's wgmma reads A from shared memory only and takes no transposed
    # refs, and its loads take no layouts: there the widened tile and x^T are stored
    # first (the GPU keeps the tile in registers and reads x's tile transposed).
    a_tr = smem_transforms(GROUP * 16, 16, "widened weight")
    steps = per // gps                                  # pipeline steps a tile

    def kernel(q_gmem, x_gmem, sz_gmem, out_gmem, *a_smem):
        ni, si = lax.axis_index("n"), lax.axis_index("s")
        first = si * steps                              # in stages of gps groups

        def groups(q_smem, x_smem, sz_smem, mma):
            for h in range(gps):
                # a group's [2, TN] rows: its scales, then its zero points
                cols = pl.ds(h * GROUP, GROUP)
                w, xt = _widen(q_smem.at[:, cols], x_smem.at[:, cols], sz_smem.at[2 * h],
                               sz_smem.at[2 * h + 1], a_smem, interpret=interpret)
                mma(w, xt)

        def write(acc, tile, t):
            """acc (a value) -> the shared-memory tile -> the partials of tile t."""
            if not out_rows:
                tile[...] = acc
            elif interpret:
                tile[...] = acc.T
            else:
                v = plgpu.layout_cast(acc, plgpu.Layout.WGMMA_TRANSPOSED)
                plgpu.transpose_ref(tile.at[:, :], (1, 0))[...] = v
            plgpu.commit_smem()
            chans = pl.ds((ni * tiles + t) * tile_n, tile_n)
            # [S, M, N]: of the tile's Mp rows only x's M leave (TMA copies any box)
            plgpu.copy_smem_to_gmem(tile.at[pl.ds(0, m)] if out_rows else tile,
                                    out_gmem.at[si, :, chans] if out_rows
                                    else out_gmem.at[si, chans])

        # pipeline step (t, j): the program's tile t, stage j of its split
        specs = [
            plgpu.BlockSpec((tile_n, gps * GROUP), lambda t, j: (ni * tiles + t, first + j),
                            transforms=q_tr),
            plgpu.BlockSpec((mp, gps * GROUP), lambda t, j: (0, first + j), transforms=x_tr),
            plgpu.BlockSpec((2 * gps, tile_n), lambda t, j: (first + j, ni * tiles + t)),
        ]
        tile_shape = (mp, tile_n) if out_rows else (tile_n, mp)

        def one_tile(acc):
            def step(idx, q_smem, x_smem, sz_smem, acc):
                def mma(w, xt):
                    # Waited for here: leaving it running while the next step widens
                    # its tile (wait(1), x's stage released a step later) gave wrong
                    # sums on an H100 (errors up to 1e7).
                    plgpu.wgmma(acc, w, xt)
                    plgpu.wgmma_wait(0)
                groups(q_smem, x_smem, sz_smem, mma)
                return acc

            plgpu.emit_pipeline(step, grid=(1, steps), max_concurrent_steps=stages,
                                init_carry=acc, in_specs=specs)(q_gmem, x_gmem, sz_gmem)

            # The partials leave through a shared-memory tile allocated after the
            # pipeline's buffers are freed (so in their place); with out_rows stored
            # transposed, from registers relaid out as WGMMA_TRANSPOSED.
            def epilogue(tile):
                write(acc[...], tile, 0)
                plgpu.wait_smem_to_gmem(0)
            pl.run_scoped(epilogue, plgpu.SMEM(tile_shape, jnp.float32))

        def many_tiles(tile):
            # One pipeline through a program's tiles, so the next tile's copies are in
            # flight while this one's last groups multiply (a program a tile fills its
            # pipeline anew and, one round of programs after another, pays for it:
            # ~3.3 us a round on an H100, docs/benchmarks.md). The accumulator is a
            # value, written out and zeroed at a tile's last step.
            def step(idx, q_smem, x_smem, sz_smem, acc):
                t, j = idx
                box = [acc]

                def mma(w, xt):
                    if interpret:      # its interpreter runs no run_state
                        box[0] = box[0] + jnp.dot(w[...], xt[...],
                                                  preferred_element_type=jnp.float32)
                        return
                    box[0] = pl.run_state(lambda r: plgpu.wgmma(r, w, xt))(
                        plgpu.ACC.init(box[0]))
                groups(q_smem, x_smem, sz_smem, mma)
                acc = box[0]
                last = j == steps - 1

                @pl.when(last)
                def _():
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    write(acc, tile, t)
                return acc * jnp.where(last, 0.0, 1.0).astype(jnp.float32)

            zero = jnp.zeros((tile_n, mp), jnp.float32)
            if not interpret:
                zero = plgpu.layout_cast(zero, plgpu.Layout.WGMMA)
            plgpu.emit_pipeline(step, grid=(tiles, steps), max_concurrent_steps=stages,
                                init_carry=zero, in_specs=specs)(q_gmem, x_gmem, sz_gmem)
            plgpu.wait_smem_to_gmem(0)

        if tiles == 1:
            pl.run_scoped(one_tile, plgpu.ACC((tile_n, mp), jnp.float32))
        else:
            pl.run_scoped(many_tiles, plgpu.SMEM(tile_shape, jnp.float32))

    scratch = [plgpu.SMEM((tile_n, GROUP), jnp.bfloat16, transforms=a_tr),
               plgpu.SMEM((GROUP, mp), jnp.bfloat16)] if interpret else []
    f = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((splits, m, n) if out_rows else (splits, n, mp),
                                              jnp.float32),
        grid=(n // tile_n // tiles, splits), grid_names=("n", "s"), scratch_types=scratch,
        interpret=interpret_params() if interpret else None)
    return f(q, x, scales)


def _widen(q_smem, x_smem, s_ref, z_ref, a_smem, *, interpret):
    """One group's ((q - z) * s)[TN, G] (registers; in interpret mode a shared-memory
    copy) and x^T [G, Mp]: s and z the group's [TN] bf16 scales and zero points in
    shared memory."""
    row = plgpu.Layout.WGMMA.reduce(1)
    if interpret:
        w, z, s = q_smem[...], z_ref[...], s_ref[...]
    else:
        w = plgpu.load(q_smem, (), layout=plgpu.Layout.WGMMA_UPCAST_4X)
        z = plgpu.load(z_ref, (), layout=row, optimized=False)
        s = plgpu.load(s_ref, (), layout=row, optimized=False)
    # Flipping each nibble's top bit turns the reread q - 16 [q >= 8] into q - 8 (one
    # xor a register); the zero point takes the 8: q - z = (q - 8) - (z - 8).
    w = w ^ jnp.int4(-8)
    if not interpret:
        # Relaid out while 4-bit (4X -> 2X -> wgmma's: a shuffle and a permute a
        # register of 8 values), where the widened tile took a shuffle and three
        # selects a 4 values.
        w = plgpu.layout_cast(w, plgpu.Layout.WGMMA)
    w = w.astype(jnp.bfloat16)                                  # q - 8, exact
    # (q - z) * s as one fma a pair: (q - 8) * s + c, c = -(z - 8) * s rounded to bf16
    # (the group's [TN] bf16 rows, once a step); ref_w4a16_matmul rounds the same way.
    c = -(z - 8) * s
    sb = lax.broadcast_in_dim(s, w.shape, (0,))
    cb = lax.broadcast_in_dim(c, w.shape, (0,))
    if interpret:
        # one rounding, as the GPU's fma (the interpreter rounds each bf16 op)
        w = (w.astype(jnp.float32) * sb.astype(jnp.float32)
             + cb.astype(jnp.float32)).astype(jnp.bfloat16)
    else:
        # a mul and an add with no rounding mode in the PTX, which ptxas fuses into one
        # HFMA2 a pair (the SASS has 64 a step and no HMUL2 on the tile)
        w = w * sb + cb
    xt = plgpu.transpose_ref(x_smem, (1, 0))                             # x^T [G, Mp]
    if a_smem:
        a_smem[0][...] = w
        a_smem[1][...] = x_smem[...].T
        plgpu.commit_smem()
        return a_smem
    return w, xt


def interpret_params():
    # jax 0.10 exports no public name for the GPU interpreter's parameters
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams(out_of_bounds_reads="uninitialized")
