"""Pieces shared by the paged-attention kernels (Pallas, Triton backend).

Letter legend: M query rows of a program (tokens x query heads of one KV head),
K keys per inner step (``blocks_per_step * BS``), Dp head dim padded to a power of two.

The seam to jax-triton / Mosaic GPU is this module plus the kernels' ``pallas_call``
sites: everything Triton-specific is (1) ``plgpu.load``/``plgpu.store`` with masks over
pointer tensors built from integer index arrays (the block-table gather), (2)
``plgpu.dot``, and (3) ``plgpu.CompilerParams``. A Mosaic GPU port would replace the
gather by one TMA/async copy per pool block into shared memory (the pool block is
contiguous ``[BS, D]``), and the dots by wgmma; the online-softmax arithmetic below
stays as it is.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

LOG2E = math.log2(math.e)
# Finite, so a fully masked row gives exp2(MASK - MASK) = 1 instead of NaN; the first
# real key then wipes that (exp2(MASK - s) == 0 exactly).
MASK = -1e30


# Streaming multiprocessors assumed where the device cannot say: CPU / interpret mode,
# or a device without the attribute. 132 is the H100 / H200 SXM count.
FALLBACK_NUM_SMS = 132


def target_device():
    """The abstract mesh's device whenever one is in context: lowering for a device this
    machine lacks (a CUDA lowering on a CPU, or XLA's deviceless compilation for a GPU:
    jaxllm.runner.aot), or a real mesh's own device (inside shard_map or set_mesh).
    None when no abstract mesh names a device."""
    try:
        return jax.sharding.get_abstract_mesh().abstract_device
    except AttributeError:       # no abstract mesh (older jax) or none in context
        return None


def target_platform() -> str:
    """The platform a trace is lowered for ("gpu", "cpu", ...): target_device()'s when
    there is one, else jax's default backend. Code that picks a GPU-only path while
    tracing asks this, not the default backend, so a lowering for a GPU picks it too."""
    dev = target_device()
    platform = dev.platform if dev is not None else jax.default_backend()
    return "gpu" if platform in ("cuda", "rocm") else platform


def num_sms() -> int:
    """Streaming multiprocessors of the GPU the kernels are lowered for: target_device()
    when it is one, else the default device's ``core_count``; ``FALLBACK_NUM_SMS`` when
    neither is a GPU. Only steers launch heuristics, never results."""
    dev = target_device()
    if dev is not None and target_platform() == "gpu" and dev.num_cores:
        return int(dev.num_cores)
    dev = jax.devices()[0]
    count = getattr(dev, "core_count", None) if dev.platform == "gpu" else None
    return int(count) if count else FALLBACK_NUM_SMS


def is_hopper() -> bool:
    """Whether the GPU the kernels are lowered for is a Hopper (sm90: H100 / H200 /
    H800 / H20 / GH200), where Mosaic GPU's wgmma kernels run: target_device()'s kind,
    else the default device's."""
    dev = target_device()
    if dev is None or target_platform() != "gpu":
        dev = jax.devices()[0]
        if dev.platform != "gpu":
            return False
    kind = (getattr(dev, "device_kind", "") or "").upper()
    return any(h in kind for h in ("H100", "H200", "H800", "H20", "GH200"))


# Shared memory one thread block may use on Hopper (H100 / H200: 227 KiB, opt-in).
SMEM_BYTES = 232_448
# Bytes of f32 accumulator [M, Dp] a program keeps in registers: 256 x 128 (the tuned
# bf16 setting). Twice that (head_dim 256) would not fit 8 warps' registers.
ACC_BYTES = 256 * 128 * 4


def kv_smem_bytes(tile: int, dp: int, kv_itemsize: int, num_stages: int) -> int:
    """Shared memory Triton's pipeliner takes for the KV loads of a kernel: three
    ``[tile, Dp]`` buffers per stage. It reproduces the H200's refusal of the ragged
    kernel at f32 x head_dim 128 (3 stages, 64 keys): 294,912 bytes requested."""
    return 3 * num_stages * tile * dp * kv_itemsize


def fit_kv_pipeline(block_size: int, blocks_per_step: int, dp: int, kv_itemsize: int,
                    num_stages: int, budget: int = SMEM_BYTES) -> tuple[int, int]:
    """(blocks_per_step, num_stages) within the shared-memory budget: fewer stages
    first (down to 2, which still overlaps a load with the dot), then fewer keys per
    step (down to one pool block). The tuned 2-byte settings at head_dim <= 128 fit
    as they are."""
    def need():
        return kv_smem_bytes(blocks_per_step * block_size, dp, kv_itemsize, num_stages)
    while need() > budget and num_stages > 2:
        num_stages -= 1
    while need() > budget and blocks_per_step > 1:
        blocks_per_step //= 2
    return blocks_per_step, num_stages


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def cdiv(a, b):
    """Ceil division of non-negative ints (traced or not)."""
    return lax.div(a + b - 1, b) if isinstance(a, jax.Array) else -(-a // b)


def compiler_params(num_warps: int, num_stages: int):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def pallas_call(kernel, **kw):
    """pl.pallas_call with the Triton compiler params (kept in one place for the seam)."""
    num_warps, num_stages = kw.pop("num_warps"), kw.pop("num_stages")
    return pl.pallas_call(kernel, compiler_params=compiler_params(num_warps, num_stages), **kw)


def load_rows(ref, rows, d, dp, mask=None, lead=()):
    """Rows ``ref[*lead, rows, :d]`` as ``[len(rows), dp]``; masked rows and the padding
    columns ``d..dp`` read as 0 (and touch no memory). ``lead``: scalar indices."""
    cols = jnp.arange(dp)
    mask = _row_col_mask(mask, cols, d)
    idx = ref.at[(*lead, rows[:, None], cols[None, :])]
    if mask is None:
        return idx[...]
    zero = 0.0 if jnp.issubdtype(ref.dtype, jnp.floating) else 0
    return plgpu.load(idx, mask=mask, other=zero)


def load_row(ref, row, d, dp):
    """``ref[row, :d]`` as ``[dp]``, the padding columns 0 (and touching no memory)."""
    cols = jnp.arange(dp)
    idx = ref.at[(row, cols)]
    return idx[...] if dp == d else plgpu.load(idx, mask=cols < d, other=0)


def store_rows(ref, rows, x, d, mask, lead=()):
    """``ref[*lead, rows, :d] = x[:, :d]`` where ``mask`` (rows); x is ``[len(rows), dp]``.

    Masked lanes point out of bounds: on the GPU they are never accessed, and the
    interpreter drops them (an in-bounds duplicate would write back a stale value).
    """
    cols = jnp.arange(x.shape[-1])
    rows = jnp.where(mask, rows, ref.shape[-2])
    plgpu.store(ref.at[(*lead, rows[:, None], cols[None, :])], x.astype(ref.dtype),
                mask=_row_col_mask(mask, cols, d))


def store_vec(ref, idx, x, mask, lead=()):
    """``ref[*lead, idx] = x`` where ``mask``, same out-of-bounds trick as store_rows."""
    idx = jnp.where(mask, idx, ref.shape[-1])
    plgpu.store(ref.at[(*lead, idx)], x.astype(ref.dtype), mask=mask)


def _row_col_mask(mask, cols, d):
    """[rows, cols] mask from a row mask (or None) and the head-dim padding."""
    if cols.shape[0] == d:
        return None if mask is None else mask[:, None]
    col_ok = (cols < d)[None, :]
    return col_ok if mask is None else mask[:, None] & col_ok


def tile_slots(bt_ref, seq, first, *, tile, block_size, per_block=False):
    """Pool slots i32[K] of tokens ``first .. first + K`` of block-table row ``seq`` (the
    column is clamped, so a tile past the row's end still reads in bounds).

    ``per_block``: read the table once per pool block and broadcast over its slots
    (``first`` and K multiples of ``block_size``) instead of once per key. On the H200
    the ragged kernel at 256 rows per program takes 0.754 ms per block against
    1.137-1.156 ms per key at 8 x 2048 causal; the decode kernel is slower per block
    with fp8 KV (0.152 against 0.134 ms at B=64 ctx 2048; with f16 dots and 128 keys x
    3 stages 0.336 against 0.320 ms at ctx 8192) and at B=8 ctx 512 (0.066 against
    0.051 ms), so it reads per key.
    """
    if not per_block:
        kpos = first + jnp.arange(tile)
        col = jnp.minimum(lax.div(kpos, block_size), bt_ref.shape[1] - 1)
        return bt_ref[seq, col] * block_size + lax.rem(kpos, block_size)
    nblk = tile // block_size
    col = jnp.minimum(lax.div(first, block_size) + jnp.arange(nblk), bt_ref.shape[1] - 1)
    base = bt_ref[seq, col] * block_size                               # [K / BS]
    return (base[:, None] + jnp.arange(block_size)[None, :]).reshape(tile)


def load_kv(k_ref, v_ref, slots, kvalid, *, d, dp, dtype):
    """k, v [K, Dp] at ``slots``, cast to ``dtype`` (the query's: fp8 feeds the ragged
    kernel's dots as bf16, the decode kernel's as f16); keys where ``kvalid`` is False
    (None: all valid) read as 0."""
    if kvalid is not None:
        slots = jnp.where(kvalid, slots, 0)   # stale block ids past the end: never read
    k = load_rows(k_ref, slots, d, dp, kvalid).astype(dtype)
    v = load_rows(v_ref, slots, d, dp, kvalid).astype(dtype)
    return k, v


def kv_tile(bt_ref, k_ref, v_ref, seq, first, *, tile, block_size, d, dp, kv_mask_fn, dtype,
            per_block=False):
    """Keys/values of tokens ``first .. first + tile`` of block-table row ``seq``.

    Returns (kpos i32[K], kvalid bool[K] or None, k [K, Dp], v [K, Dp]).
    ``kv_mask_fn(kpos)`` is None on the fast path (every key valid: no masks at all) or
    the valid-key mask.
    """
    kpos = first + jnp.arange(tile)
    kvalid = kv_mask_fn(kpos)
    slots = tile_slots(bt_ref, seq, first, tile=tile, block_size=block_size,
                       per_block=per_block)
    k, v = load_kv(k_ref, v_ref, slots, kvalid, d=d, dp=dp, dtype=dtype)
    return kpos, kvalid, k, v


def unmasked_loop(bt_ref, k_ref, v_ref, seq, start, end, q, carry, *, tile, block_size, d,
                  dp, scale2, per_block=False):
    """Online softmax over the unmasked steps ``start .. end``. The block-table lookup of
    step i + 1 is issued in step i and carried, so the KV loads of a step depend on no
    load of the same iteration and Triton's pipeliner can multi-buffer them."""
    slots_of = functools.partial(tile_slots, bt_ref, seq, tile=tile, block_size=block_size,
                                 per_block=per_block)

    def body(i, c):
        slots, carry = c
        k, v = load_kv(k_ref, v_ref, slots, None, d=d, dp=dp, dtype=q.dtype)
        nxt = slots_of((i + 1) * tile)
        return nxt, softmax_step(q, k, v, None, carry, scale2)

    _, carry = lax.fori_loop(start, end, body, (slots_of(start * tile), carry))
    return carry


def softmax_step(q, k, v, mask, carry, scale2):
    """One flash-attention step in the log2 domain.

    q [M, Dp], k/v [K, Dp], mask bool[M, K] or None; carry (m [M], l [M], acc [M, Dp]).
    ``scale2`` = sm_scale * k_scale * log2(e).
    """
    m, l, acc = carry
    s = plgpu.dot(q, k, trans_b=True) * scale2
    if mask is not None:
        s = jnp.where(mask, s, MASK)
    m_new = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    l = l * alpha + p.sum(axis=1)
    acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v)
    return m_new, l, acc


def init_carry(rows: int, dp: int):
    return (jnp.full((rows,), MASK, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, dp), jnp.float32))


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype).itemsize == 1


def fp8_scaled(x, scale, dtype):
    """x / scale in f32, saturated to fp8 `dtype`'s largest finite value, as vLLM's
    KV write converts (SATFINITE): XLA's cast turns an out-of-range value into NaN,
    where the GPU's conversion saturates; clipped first, every backend agrees."""
    top = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) / scale, -top, top)


F16_MAX = 65504.0


def to_f16(x):
    """x (16- or 32-bit float) as f16 for a dot that widens fp8 to f16: finite values
    clamped to +-65504 (a bf16 value past it would otherwise turn into inf), inf and
    NaN kept. Exact for |x| in [2^-14, 65504] (bf16 has 8 significant bits, f16 11);
    below, f16's subnormal step is 2^-24."""
    if x.dtype == jnp.float16:
        return x
    xf = x.astype(jnp.float32)
    return jnp.where(jnp.isinf(xf), xf, jnp.clip(xf, -F16_MAX, F16_MAX)).astype(jnp.float16)
