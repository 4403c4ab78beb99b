"""Small-M (decode) matmuls of weights XLA's GEMMs were not seen to widen in place on
the H200 (4-bit; fp8 with group scales): the weight streamed from HBM once, converted
tile by tile in registers, the products accumulated in f32 (int32 for int8 x int8).

Letter legend: M tokens (rows of x), Mp = M padded to a power of two >= 16, N output
channels, K contracted dim, BN output channels per program, BK columns of K per inner
step, S k-splits, G the group size (4-bit; fp8 with group scales).

Grid (cdiv(N, BN), S). A program owns BN output channels and 1/S of the K steps and
computes acc[BN, Mp] = W[BN, BK] @ x[Mp, BK]^T per step: the weight is the MMA's
left operand, so its many rows are the MMA's M and x's few rows its N (>= 16). On
Hopper wgmma takes A from registers, where the converted weight already is, and B
from shared memory, where x's tile lands. With S > 1 each split writes f32 partials
[S, M, N] (scales applied) and an XLA sum adds them; inside a model that sum fuses
into the consumer of the matmul.

Out-of-range rows of a tile read a clamped in-range row (no load masks on the weight
stream); their outputs are not stored. A K not a multiple of BK clamps the weight's
columns too and reads x's columns past K as 0, so the duplicates add nothing.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common

# Rows of x a program keeps: the accumulator is [BN, Mp] f32 in registers.
MAX_M = 128
# 2^23 as f32: ``bits(2^23) | q`` is the float 2^23 + q for an integer q < 2^23.
_MAGIC = 0x4B000000


# --- references ----------------------------------------------------------------------

def ref_quant_matmul(x, w, x_scale, w_scale, *, out_dtype=None):
    """x [M, K]: quantized per token (fp8 / int8, or those values held in f16) with
    x_scale f32[M] or a scalar, or a 16-bit activation with x_scale None (weight-only);
    w [N, K] fp8 e4m3 / int8 with per-channel w_scale f32[N] -> [M, N] ``out_dtype``
    (default: x's dtype when 16-bit, else bf16). Weight-only, w_scale may also be
    f32 [N, K / G], per row and group of G columns (block FP8 scales, repeated per row).

    Quantized x: the dot of the widened values, exact in f32 (jaxllm's
    ``quantized_matmul``); weight-only: w cast to x's dtype, the dot with f32 sums
    (the kernel's f16 dots: the same for |x| in [2^-14, 65504]). Scales multiply it;
    group scales the weight, in f32 (block_matmul rounds it to x's dtype)."""
    out_dtype = default_out_dtype(x.dtype, x_scale, out_dtype)
    dims = (((1,), (1,)), ((), ()))
    if w_scale.ndim == 2:
        group = _group(x.shape[1], w_scale, x_scale)
        wd = w.astype(jnp.float32) * jnp.repeat(w_scale.astype(jnp.float32), group, axis=1)
        return lax.dot_general(x.astype(jnp.float32), wd, dims, lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32).astype(out_dtype)
    if x_scale is None:
        y = lax.dot_general(x, w.astype(x.dtype), dims, preferred_element_type=jnp.float32)
    else:
        y = lax.dot_general(x.astype(jnp.float32), w.astype(jnp.float32), dims,
                            preferred_element_type=jnp.float32)
        y = y * jnp.broadcast_to(jnp.asarray(x_scale, jnp.float32), (x.shape[0],))[:, None]
    return (y * w_scale[None, :]).astype(out_dtype)


def ref_quant_matmul_int4(x, w, scale, zero, *, group, out_dtype=None):
    """x [M, K] (a float dtype), w uint8 [N, K/2] holding two uint4 a byte (column 2j in
    the low nibble, 2j + 1 in the high), scale and zero f32 [N, cdiv(K, G)] ->
    [M, N] ``out_dtype`` (default x's dtype). The weight dequantized as
    ((q - zero) * scale) in f32 and the dot of x's values with it in f32: what the
    kernel computes with scales="output", up to the order of its f32 sums (and
    TF32 dots for an f32 x on a GPU). (jaxllm's jnp layer path,
    ``grouped_dequant_matmul``, rounds the dequantized weight to x's dtype first.)"""
    out_dtype = default_out_dtype(x.dtype, None, out_dtype)
    n, k = w.shape[0], x.shape[1]
    q = jnp.stack([w & 15, w >> 4], axis=-1).reshape(n, k)
    g = jnp.arange(k) // group
    wd = (q.astype(jnp.float32) - zero[:, g]) * scale[:, g]
    y = jnp.einsum("mk,nk->mn", x.astype(jnp.float32), wd,
                   precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


def default_out_dtype(x_dtype, x_scale, out_dtype=None):
    if out_dtype is not None:
        return jnp.dtype(out_dtype)
    return jnp.dtype(x_dtype) if x_scale is None else jnp.dtype(jnp.bfloat16)


# --- settings ------------------------------------------------------------------------

def default_dot_dtype(x_dtype, w_dtype, x_scale):
    """int8 x int8: the int8 dot itself (int32 sums, exact, no conversion: widening int8
    to f16 is a cvt per value on the conversion pipe, 16 results per clock per SM).
    Weight-only int8 or an f32 x: x's dtype. Otherwise f16 (a weight-only x through
    common.to_f16): e4m3 -> f16 is one packed cvt per two values on sm90, e4m3 -> bf16
    a scalar cvt per value more; e4m3 and int8 values are exact in f16."""
    x_dtype, w_dtype = jnp.dtype(x_dtype), jnp.dtype(w_dtype)
    if x_scale is None:
        wide = w_dtype == jnp.int8 or x_dtype.itemsize > 2
        return x_dtype if wide else jnp.dtype(jnp.float16)
    return jnp.dtype(jnp.int8 if x_dtype == w_dtype == jnp.int8 else jnp.float16)


def smem_bytes(mp, bn, bk, w_bits, x_itemsize, num_stages, groups_per_step=0) -> int:
    """Shared memory of the pipelined loads: each stage holds a weight tile, an x tile
    and the step's scales and zeros (f32); plus one x tile converted for the dot."""
    stage = bn * bk * w_bits // 8 + mp * bk * x_itemsize + 2 * 4 * bn * groups_per_step
    return num_stages * stage + mp * bk * 2


def default_k_splits(m, n_blocks, k, bk, w_bits) -> int:
    """Splits of K so that small N still fills the card: about two programs per SM
    (common.num_sms) when the N blocks alone do not reach one per SM, keeping >= 4
    steps per split (a pipeline of 3-4 stages has to fill), and the partials (S x M x
    N f32, written then read back) under 1/8 of the weight's bytes. Powers of two.

    4-bit weights: a program's pace is set by converting its values, not by their
    bytes, so more programs pay: ``want`` rounds up, the partials are held to 1/8
    of the weight's values, and at most 4 splits (measured faster than 2 for the
    8B model's o and qkv at M = 16; more than 4 were not measured)."""
    if n_blocks >= common.num_sms():
        return 1
    want = common.cdiv(2 * common.num_sms(), n_blocks)
    steps = common.cdiv(k, bk) // 4
    if w_bits == 4:
        s = max(1, min(common.next_pow2(want), k // (64 * m), steps, 4))
    else:
        s = max(1, min(want, (k * w_bits // 8) // (64 * m), steps))
    return 1 << (s.bit_length() - 1)


def default_settings(m, n, k, w_bits, x_itemsize, group=None, block_n=None, block_k=None,
                     k_splits=None, num_warps=None, num_stages=None) -> dict:
    """Tile settings, each default only where the caller gave None.

    BK: 256 columns, 256 bytes of a 1-byte weight row (two 128-byte lines) or 128 of a
    4-bit one; the converted tile [BN, BK] 16-bit is 64 registers a thread at BN = 16
    x warps. BN: 128 (8 warps) when N / 128 programs reach one per SM (gate/up 28672:
    224), else 64 (4 warps; a wgmma covers 64 rows), so qkv's 6144 and o/down's 4096
    give 96 and 64 programs before the k-splits. 4 stages keep ~48-64 KB of weight in
    flight per SM, which 4 TB/s over 132 SMs at ~1.5 us of latency asks for; fewer
    where shared memory (common.SMEM_BYTES) does not hold them. For 4-bit weights
    an H200 sweep at M = 16 found BK 128-512, BN 64-128 and 3-6 stages within ~15%
    of these (docs/benchmarks.md); the 8-bit settings are unswept."""
    mp = max(16, common.next_pow2(m))
    bk = block_k or min(256, max(32, common.next_pow2(k)))
    bn = block_n or (128 if common.cdiv(n, 128) >= common.num_sms() else 64)
    bn = min(bn, max(16, common.next_pow2(n)))
    warps = num_warps or max(4, min(8, bn // 16))
    gps = 0 if group is None else max(1, bk // group)
    stages = num_stages or 4
    while num_stages is None and stages > 2 and smem_bytes(
            mp, bn, bk, w_bits, x_itemsize, stages, gps) > common.SMEM_BYTES:
        stages -= 1
    splits = k_splits or default_k_splits(m, common.cdiv(n, bn), k, bk, w_bits)
    return dict(mp=mp, bn=bn, bk=bk, k_splits=splits, num_warps=warps, num_stages=stages)


# --- kernels -------------------------------------------------------------------------

_SETTINGS = ("out_dtype", "block_n", "block_k", "k_splits", "num_warps", "num_stages",
             "dot_dtype", "interpret")


@functools.partial(jax.jit, static_argnames=_SETTINGS)
def quant_matmul(x, w, x_scale, w_scale, *, out_dtype=None, block_n=None, block_k=None,
                 k_splits=None, num_warps=None, num_stages=None, dot_dtype=None,
                 interpret=False):
    """Same contract as ``ref_quant_matmul``; the rest are kernel settings
    (default_settings, default_dot_dtype). A weight-only x is cast to f16 here for f16
    dots, once rather than per program."""
    m, k = x.shape
    n = w.shape[0]
    if jnp.dtype(w.dtype) not in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.int8)):
        raise ValueError(f"weight dtype {w.dtype}: fp8 e4m3 or int8 expected")
    _check(m, k, w.shape, (n, k))
    out_dtype = default_out_dtype(x.dtype, x_scale, out_dtype)
    dot_dtype = jnp.dtype(dot_dtype or default_dot_dtype(x.dtype, w.dtype, x_scale))
    if x_scale is None and dot_dtype == jnp.float16:
        x = common.to_f16(x)
    st = default_settings(m, n, k, 8, x.dtype.itemsize, block_n=block_n, block_k=block_k,
                          k_splits=k_splits, num_warps=num_warps, num_stages=num_stages)
    aux = [w_scale.astype(jnp.float32)]
    if x_scale is not None:
        aux.insert(0, jnp.broadcast_to(jnp.asarray(x_scale, jnp.float32), (m,)))
    bk, ragged = st["bk"], k % st["bk"] != 0
    # Group scales: each chunk of a step (one group's columns) scales its own product.
    group = _group(k, w_scale, x_scale) if w_scale.ndim == 2 else None
    chunk = bk if group is None else min(bk, group)

    def step(aux_refs, x_ref, w_ref, rows, xrows, i, acc):
        for c in range(bk // chunk):
            cols = i * bk + c * chunk + jnp.arange(chunk)
            wt = w_ref[rows[:, None], (jnp.minimum(cols, k - 1) if ragged else cols)[None, :]]
            xt = _load_x(x_ref, xrows, cols, k, ragged)
            d = plgpu.dot(wt.astype(dot_dtype), xt.astype(dot_dtype), trans_b=True)
            if group is not None:
                g = jnp.minimum(lax.div(i * bk + c * chunk, group), w_scale.shape[1] - 1)
                d = aux_refs[-1][rows, g][:, None] * d
            acc = acc + d
        return acc

    def epilogue(aux_refs, acc, rows, xrows):   # x's scale first, as quantized_matmul
        if x_scale is not None:
            acc = acc * aux_refs[0][xrows][None, :]
        return acc if group is not None else acc * aux_refs[-1][rows][:, None]

    return _launch(step, epilogue, x, w, aux, n=n, st=st, out_dtype=out_dtype,
                   dot_dtype=dot_dtype, name="quant_matmul", interpret=interpret)


@functools.partial(jax.jit, static_argnames=("group", "scales", "split_x") + _SETTINGS)
def quant_matmul_int4(x, w, scale, zero, *, group, out_dtype=None, block_n=None,
                      block_k=None, k_splits=None, num_warps=None, num_stages=None,
                      dot_dtype=None, scales=None, split_x=True, interpret=False):
    """Same contract as ``ref_quant_matmul_int4`` (G a power of two); the rest are kernel
    settings (default_settings). The dot runs in x's dtype unless ``dot_dtype``.

    A step's columns are taken a group at a time (``chunk`` = min(BK, G) columns,
    within one group). The two nibbles of a byte are columns 2j and 2j + 1, so instead
    of interleaving the weight's halves (a register shuffle per value) the kernel
    multiplies them with x's even and odd columns apart: two dots per chunk.
    ``split_x``: x's columns are reordered by XLA first (each chunk's even columns,
    then its odd ones), so the kernel's x loads are contiguous rather than strided
    (faster on every 8B projection at M = 16 on the H200).
    ``scales``: "output" runs the dots on the raw nibbles (exact in a 16-bit float)
    and applies scale and zero point to their [BN, Mp] product, as
    sum_k x_k (q_k - z) s = s (sum_k x_k q_k - z sum_k x_k); "weight" dequantizes
    the chunk in the dot's dtype ((q - z) * s, scale rounded to it) and accumulates
    in the dot itself (the scale and the product each rounded: ~1.4x the XLA
    path's error). Default: "output" up to Mp = 16, where it was the faster;
    "weight" above, where the product's epilogue grows with M (at M = 64 "output"
    was 3.6x slower on the down projection)."""
    m, k = x.shape
    n = w.shape[0]
    if jnp.dtype(w.dtype) != jnp.uint8 or k % 2:
        raise ValueError(f"weight {w.dtype} {w.shape}: uint8 [N, K/2] expected, K even")
    if group < 32 or group & (group - 1):
        raise ValueError(f"group {group}: a power of two >= 32 expected (a dot takes "
                         "at least 16 columns, half a group)")
    if scales not in (None, "output", "weight"):
        raise ValueError(f"scales {scales!r}: 'output' or 'weight'")
    _check(m, k, w.shape, (n, k // 2))
    groups = common.cdiv(k, group)
    if scale.shape != (n, groups) or zero.shape != (n, groups):
        raise ValueError(f"scale {scale.shape} / zero {zero.shape}: [{n}, {groups}] expected")
    out_dtype = default_out_dtype(x.dtype, None, out_dtype)
    dot_dtype = jnp.dtype(dot_dtype or x.dtype)
    st = default_settings(m, n, k, 4, x.dtype.itemsize, group=group, block_n=block_n,
                          block_k=block_k, k_splits=k_splits, num_warps=num_warps,
                          num_stages=num_stages)
    bk = st["bk"]
    scales = scales or ("output" if st["mp"] <= 16 else "weight")
    chunk = min(bk, group)
    half, last, ragged = chunk // 2, k // 2 - 1, k % bk != 0
    split_x = split_x and k % chunk == 0
    if split_x:
        x = x.reshape(m, k // chunk, half, 2).swapaxes(2, 3).reshape(m, k)

    def step(aux_refs, x_ref, w_ref, rows, xrows, i, acc):
        s_ref, z_ref = aux_refs
        for c in range(bk // chunk):
            first = i * bk + c * chunk
            pcols = lax.div(first, 2) + jnp.arange(half)
            pin = jnp.minimum(pcols, last) if ragged else pcols
            p = w_ref[rows[:, None], pin[None, :]]                    # u8 [BN, chunk/2]
            if split_x:
                xe = _load_x(x_ref, xrows, first + jnp.arange(half), k, ragged)
                xo = _load_x(x_ref, xrows, first + half + jnp.arange(half), k, ragged)
            else:
                xe = _load_x(x_ref, xrows, 2 * pcols, k, ragged)          # [Mp, chunk/2]
                xo = _load_x(x_ref, xrows, 2 * pcols + 1, k, ragged)
            xe, xo = xe.astype(dot_dtype), xo.astype(dot_dtype)
            lo, hi, offset = _nibbles(p, dot_dtype)
            g = jnp.minimum(lax.div(first, group), groups - 1)
            s, z = s_ref[rows, g], z_ref[rows, g] + offset
            if scales == "weight":
                sd, zd = s.astype(dot_dtype)[:, None], z.astype(dot_dtype)[:, None]
                acc = acc + plgpu.dot((lo - zd) * sd, xe, trans_b=True)
                acc = acc + plgpu.dot((hi - zd) * sd, xo, trans_b=True)
            else:
                d = plgpu.dot(lo, xe, trans_b=True) + plgpu.dot(hi, xo, trans_b=True)
                xsum = jnp.sum(xe.astype(jnp.float32) + xo.astype(jnp.float32), axis=1)
                acc = acc + s[:, None] * (d - z[:, None] * xsum[None, :])
        return acc

    def epilogue(aux_refs, acc, rows, xrows):
        return acc

    aux = [scale.astype(jnp.float32), zero.astype(jnp.float32)]
    return _launch(step, epilogue, x, w, aux, n=n, st=st, out_dtype=out_dtype,
                   dot_dtype=dot_dtype, name="quant_matmul_int4", interpret=interpret)


# 16.0 in bf16 and f16, whose last mantissa bits count in units of one: the value with
# a nibble q in them is 16 + q, exactly.
_SIXTEEN = {jnp.dtype(jnp.bfloat16): (0x4180, 3), jnp.dtype(jnp.float16): (0x4C00, 6)}


def _nibbles(p, dtype):
    """The low and high nibbles of u8 ``p`` as ``dtype`` values, and the offset they
    carry (added to the zero point). In bf16 / f16 they are 16 + q, built by bit
    operations: an int-to-float conversion runs at 16 per clock per SM on the
    conversion pipe, and a 4-bit stream at 4 TB/s asks ~30 values per clock per SM."""
    if jnp.dtype(dtype) in _SIXTEEN:
        base, shift = _SIXTEEN[jnp.dtype(dtype)]
        p16 = p.astype(jnp.uint16)
        lo = ((p16 & 15) << shift) | base
        hi = ((p16 >> 4) << shift) | base
        as_float = functools.partial(lax.bitcast_convert_type, new_dtype=dtype)
        return as_float(lo), as_float(hi), 16.0
    return _nibble_f32(p & 15).astype(dtype), _nibble_f32(p >> 4).astype(dtype), 0.0


def _nibble_f32(q):
    """uint values < 16 as f32 without an int-to-float conversion: the bits of 2^23
    with q in the low mantissa bits are 2^23 + q, exactly."""
    bits = q.astype(jnp.uint32) | jnp.uint32(_MAGIC)
    return lax.bitcast_convert_type(bits, jnp.float32) - jnp.float32(1 << 23)


def _load_x(x_ref, xrows, cols, k, ragged):
    """x's columns ``cols`` of rows ``xrows`` as [Mp, len(cols)]; with ``ragged``
    columns past K read as 0, so a clamped (repeated) weight column there adds nothing."""
    if not ragged:
        return x_ref[xrows[:, None], cols[None, :]]
    return plgpu.load(x_ref.at[xrows[:, None], jnp.minimum(cols, k - 1)[None, :]],
                      mask=(cols < k)[None, :], other=0)


def _group(k, w_scale, x_scale) -> int:
    """G of group scales [N, K / G]: weight-only, a power of two >= 32 dividing K."""
    g = k // w_scale.shape[1]
    if x_scale is not None or g * w_scale.shape[1] != k or g < 32 or g & (g - 1):
        raise ValueError(f"scales {w_scale.shape} for K {k}: weight-only, G a power of two >= 32")
    return g


def _check(m, k, w_shape, want):
    if m > MAX_M:
        raise ValueError(f"{m} rows: the small-M kernel takes at most {MAX_M}")
    if tuple(w_shape) != want:
        raise ValueError(f"weight {tuple(w_shape)} for x [{m}, {k}]: {want} expected")


def _launch(step, epilogue, x, w, aux, *, n, st, out_dtype, dot_dtype, name, interpret):
    """Grid (N blocks, k-splits). ``step(aux_refs, x_ref, w_ref, rows, xrows, i, acc)``
    adds step i's products to acc [BN, Mp]; ``epilogue(aux_refs, acc, rows, xrows)``
    scales the sum."""
    m, k = x.shape
    ns, bn, bk = st["k_splits"], st["bn"], st["bk"]
    if bn & (bn - 1) or bk & (bk - 1) or bn < 16 or bk < 32:
        raise ValueError(f"block_n {bn} / block_k {bk}: powers of two, >= 16 / 32")
    kernel = functools.partial(_kernel, step=step, epilogue=epilogue, m=m, n=n, k=k,
                               mp=st["mp"], bn=bn, bk=bk, num_splits=ns, dot_dtype=dot_dtype)
    shape = (ns, m, n) if ns > 1 else (m, n)
    full = lambda s: pl.BlockSpec(s, lambda j, sp: (0,) * len(s))  # noqa: E731
    out = common.pallas_call(
        kernel, grid=(common.cdiv(n, bn), ns),
        in_specs=[full(a.shape) for a in (x, w, *aux)],
        out_specs=full(shape),
        out_shape=jax.ShapeDtypeStruct(shape, jnp.float32 if ns > 1 else out_dtype),
        num_warps=st["num_warps"], num_stages=st["num_stages"], interpret=interpret,
        name=name,
    )(x, w, *aux)
    return out if ns == 1 else out.sum(axis=0).astype(out_dtype)


def _kernel(x_ref, w_ref, *refs, step, epilogue, m, n, k, mp, bn, bk, num_splits,
            dot_dtype):
    *aux, o_ref = refs
    j, split = pl.program_id(0), pl.program_id(1)
    rows = j * bn + jnp.arange(bn)
    rows_in = jnp.minimum(rows, n - 1) if n % bn else rows
    xrows = jnp.minimum(jnp.arange(mp), m - 1)
    steps = common.cdiv(k, bk)
    if num_splits == 1:
        start, end = 0, steps
    else:
        per = common.cdiv(steps, num_splits)
        start = jnp.minimum(split * per, steps)
        end = jnp.minimum(start + per, steps)

    acc_dtype = jnp.int32 if dot_dtype == jnp.int8 else jnp.float32
    acc = lax.fori_loop(start, end,
                        lambda i, acc: step(aux, x_ref, w_ref, rows_in, xrows, i, acc),
                        jnp.zeros((bn, mp), acc_dtype))
    y = epilogue(aux, acc.astype(jnp.float32), rows_in, xrows)

    # Masked lanes point out of bounds (common.store_rows).
    row_ok, col_ok = rows < n, jnp.arange(mp) < m
    out_rows = jnp.where(row_ok, rows, n)
    out_cols = jnp.where(col_ok, jnp.arange(mp), m)
    lead = (split,) if num_splits > 1 else ()
    plgpu.store(o_ref.at[(*lead, out_cols[None, :], out_rows[:, None])],
                y.astype(o_ref.dtype), mask=row_ok[:, None] & col_ok[None, :])
