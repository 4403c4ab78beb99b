"""KV write: the step's new keys/values into the block pool through ``slot_mapping``.

Letter legend: T tokens, Hkv KV heads, D head dim, NB blocks, BS block size.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def ref_reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
    """k, v: [T, Hkv, D]; k_cache, v_cache: [Hkv, NB, BS, D]; slot_mapping: i32[T].

    A negative slot (padding) writes nothing. With an fp8 cache the values are divided
    by their scale before the cast. Returns the updated (k_cache, v_cache).
    """
    hkv, nb, bs, d = k_cache.shape
    num_slots = nb * bs
    # Out-of-range index + mode="drop" = no write, without a branch.
    idx = jnp.where(slot_mapping < 0, num_slots, slot_mapping)

    def write(cache, x, scale):
        x = x.astype(jnp.float32) / scale if _is_fp8(cache.dtype) else x
        flat = cache.reshape(hkv, num_slots, d)
        flat = flat.at[:, idx].set(jnp.swapaxes(x, 0, 1).astype(cache.dtype), mode="drop")
        return flat.reshape(hkv, nb, bs, d)

    return write(k_cache, k, k_scale), write(v_cache, v, v_scale)


def _is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
