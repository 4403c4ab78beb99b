"""KV write: the step's new keys/values into the block pool through ``slot_mapping``.

Letter legend: T tokens, Hkv KV heads, D head dim, NB blocks, BS block size.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common


def ref_reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0, *,
                          head_offsets=None):
    """k, v: [T, Hkv, D]; k_cache, v_cache: [Hkv, NB, BS, D]; slot_mapping: i32[T].

    A negative slot (padding) writes nothing. With an fp8 cache the values are divided
    by their scale before the cast, saturating (common.fp8_scaled).
    ``head_offsets=(kh, vh)``: k and v are one wider array (e.g. the fused
    [T, Hq + 2 Hkv, D] q/k/v) whose heads kh.. and vh.. are the keys and values.
    Returns the updated (k_cache, v_cache).
    """
    hkv, nb, bs, d = k_cache.shape
    if head_offsets is not None:
        kh, vh = head_offsets
        k, v = k[:, kh:kh + hkv], v[:, vh:vh + hkv]
    num_slots = nb * bs
    # Out-of-range index + mode="drop" = no write, without a branch.
    idx = jnp.where(slot_mapping < 0, num_slots, slot_mapping)

    def write(cache, x, scale):
        x = common.fp8_scaled(x, scale, cache.dtype) if _is_fp8(cache.dtype) else x
        flat = cache.reshape(hkv, num_slots, d)
        flat = flat.at[:, idx].set(jnp.swapaxes(x, 0, 1).astype(cache.dtype), mode="drop")
        return flat.reshape(hkv, nb, bs, d)

    return write(k_cache, k, k_scale), write(v_cache, v, v_scale)


def _is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


# --- Pallas kernel -----------------------------------------------------------------
# Grid (cdiv(T, tokens_per_program),). A program moves the rows (token, KV head) of
# `tokens_per_program` tokens; the pool is viewed as rows [Hkv * NB * BS, D] and
# aliased to the output, so the write is in place (XLA copies only if the caller did
# not donate the pool).

@functools.partial(jax.jit, static_argnames=("k_scale", "v_scale", "head_offsets",
                                             "tokens_per_program", "num_warps", "interpret"))
def reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0, *,
                      head_offsets=None, tokens_per_program=None, num_warps=4,
                      interpret=False):
    """Same contract as ``ref_reshape_and_cache``; the scales are static floats. With
    ``head_offsets`` the rows are read in place from the wider array."""
    num_tokens, stride, d = k.shape
    hkv, nb, bs, _ = k_cache.shape
    k_off, v_off = head_offsets or (0, 0)
    hp, dp = common.next_pow2(hkv), common.next_pow2(d)
    tpp = tokens_per_program or max(1, 64 // hp)
    kernel = functools.partial(_write_kernel, hkv=hkv, hp=hp, stride=stride, k_off=k_off,
                               v_off=v_off, d=d, dp=dp, tpp=tpp,
                               num_slots=nb * bs, fp8=_is_fp8(k_cache.dtype),
                               k_scale=k_scale, v_scale=v_scale)
    rows = lambda x: x.reshape(-1, d)  # noqa: E731
    full = lambda x: pl.BlockSpec(x.shape, lambda i: (0,) * x.ndim)  # noqa: E731
    kc, vc, k2, v2 = rows(k_cache), rows(v_cache), rows(k), rows(v)
    kc, vc = common.pallas_call(
        kernel,
        grid=(-(-num_tokens // tpp),),
        in_specs=[full(slot_mapping), full(k2), full(v2), full(kc), full(vc)],
        out_specs=[full(kc), full(vc)],
        out_shape=[jax.ShapeDtypeStruct(kc.shape, kc.dtype),
                   jax.ShapeDtypeStruct(vc.shape, vc.dtype)],
        input_output_aliases={3: 0, 4: 1},
        num_warps=num_warps, num_stages=1, interpret=interpret,
        name="reshape_and_cache",
    )(slot_mapping, k2, v2, kc, vc)
    return kc.reshape(k_cache.shape), vc.reshape(v_cache.shape)


def _write_kernel(slot_ref, k_ref, v_ref, kc_in, vc_in, kc_ref, vc_ref, *, hkv, hp, stride,
                  k_off, v_off, d, dp, tpp, num_slots, fp8, k_scale, v_scale):
    del kc_in, vc_in  # aliased to kc_ref, vc_ref
    r = jnp.arange(tpp * hp)
    tok = pl.program_id(0) * tpp + lax.div(r, hp)
    head = lax.rem(r, hp)
    tok_ok = tok < slot_ref.shape[0]
    slot = plgpu.load(slot_ref.at[jnp.where(tok_ok, tok, 0)], mask=tok_ok, other=-1)
    ok = tok_ok & (head < hkv) & (slot >= 0)
    src = jnp.where(ok, tok * stride + head, 0)
    dst = head * num_slots + slot
    for x_ref, c_ref, off, scale in ((k_ref, kc_ref, k_off, k_scale),
                                     (v_ref, vc_ref, v_off, v_scale)):
        x = common.load_rows(x_ref, src + off, d, dp, ok)
        if fp8:
            x = common.fp8_scaled(x, scale, c_ref.dtype)
        common.store_rows(c_ref, dst, x, d, ok)
