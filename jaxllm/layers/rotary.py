"""Rotary position embedding (HF's rotate-half convention), default and llama3 scaling.

Letter legend: T tokens, H heads, D head dim.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np


def inv_frequencies(head_dim: int, theta: float, rope_scaling: tuple | None) -> np.ndarray:
    """float32[D/2], computed on the host once per model."""
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if rope_scaling is None:
        return inv.astype(np.float32)
    s = dict(rope_scaling)
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rotary(x, positions, inv_freq, num_rotated: int | None = None):
    """x: [T, H, D]; positions: i32[T]; inv_freq: f32[D/2] -> [T, H, D] in x's dtype.
    ``num_rotated``: only heads 0..num_rotated-1 turn (the q and k heads of a fused
    q/k/v array; the v heads pass through unchanged)."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]   # [T, D/2]
    cos = jnp.cos(freqs)[:, None, :]
    sin = jnp.sin(freqs)[:, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    if num_rotated is not None and num_rotated < x.shape[1]:
        turn = (jnp.arange(x.shape[1]) < num_rotated)[None, :, None]
        out = jnp.where(turn, out, xf)
    return out.astype(x.dtype)
