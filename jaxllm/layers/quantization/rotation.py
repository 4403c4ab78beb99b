"""A block Hadamard rotation of a projection's input dimension, for online int8.

y = x W^T = (x R)(W R)^T for any orthogonal R. With R block-diagonal, each block a
normalized b x b Hadamard matrix, the weight is rotated before it is quantized (at
load) and the input before its per-token quantization (in the layer). The rotation
spreads an activation's outlier channels over their block, so a token's int8 range
is no longer set by one channel ~20x its rms: on SmolLM2-135M, int8 W8A8 went from
+2.07% perplexity over float to +0.37% with blocks of 64 (+1.02% with 32, +0.22% with
up to 512; docs/benchmarks.md). fp8 is not rotated: its error is relative per value,
and rotating made it worse (+7.1%). Through XLA the rotation is a 64-wide dot per
projection input (deviceless H200 compile of the 8B int8 decode step, KV written
apart: 26 kernels a layer against 20 unrotated; on the H200 the step took 14%
longer); on one GPU a layer with a 16-bit input rotates and
quantizes it in one Pallas kernel instead (linear.use_rotate_kernel,
pallas_kernels/rotate_quant.py: 15 a layer; on the H100 the decode step took 4.73 ms
against 5.28 through XLA). JAXLLM_INT8_ROTATION=0 turns it off.

Works on numpy arrays (the loader) and jax arrays (the layer) alike.
"""
from __future__ import annotations

import math

import numpy as np

ROTATION_BLOCK = 64     # the largest block; each layer takes the largest power of two
                        # up to it that divides its K


def block_size(k: int, cap: int) -> int:
    """The rotation's block for a K of k: the largest power of two <= cap dividing k."""
    b = 1
    while 2 * b <= cap and k % (2 * b) == 0:
        b *= 2
    return b


def hadamard(b: int) -> np.ndarray:
    """The b x b Sylvester Hadamard matrix over sqrt(b): symmetric and orthogonal, so
    its own inverse. b a power of two."""
    h = np.ones((1, 1))
    while h.shape[0] < b:
        h = np.block([[h, h], [h, -h]])
    return (h / math.sqrt(b)).astype(np.float32)


def rotate(x, nk: int, cap: int):
    """x [..., K...] times the block-diagonal rotation over its last nk dims flattened
    (float32, same shape; x itself where K is odd). A numpy x gives a numpy result."""
    k = math.prod(x.shape[x.ndim - nk:])
    b = block_size(k, cap)
    lead = x.shape[:x.ndim - nk]
    if b == 1:                      # an odd K: nothing to rotate
        return x
    if isinstance(x, np.ndarray):
        y = np.asarray(x, np.float32).reshape(lead + (k // b, b)) @ hadamard(b)
        return y.reshape(x.shape)
    import jax.numpy as jnp
    # A dot per block, not butterflies: XLA splits the butterflies' stages into more
    # kernels (deviceless H200 compile: 32 a layer at int8 decode, against 26 with the
    # dot and 20 unrotated).
    y = jnp.einsum("...gb,bc->...gc", x.astype(jnp.float32).reshape(lead + (k // b, b)),
                   jnp.asarray(hadamard(b)))
    return y.reshape(x.shape)
