"""uint4 weights stored tiled for the Mosaic W4A16 kernel (JAXLLM_INT4_TILED=1, one
device): the bytes of a projection's [N..., K.../2] parameter laid out in
pallas_kernels/w4a16_mgpu.tile_weight's order over its flattened [N, K/2], so each of
the kernel's pipeline steps copies one contiguous 8 KiB block (in [N, K/2] a step reads
64 bytes of each of 128 rows, K/2 bytes apart). The parameter keeps its shape; a
scheme's `tiled` says the order, and the loader and the layer both ask ``is_tiled``.
XLA's path (prefill) reads the bytes back in row order (``natural``)."""
from __future__ import annotations

import math

import numpy as np

from jaxllm.env_switch import env_switch
from jaxllm.layers.quantization.schemes import LinearScheme

TILE_N = 128        # w4a16_mgpu's default tile_n, which the engine's calls use
GROUP = 128


def wanted(tp: int) -> bool:
    """The switch, on one device only (a tiled weight cannot be split by rows)."""
    return tp == 1 and env_switch("JAXLLM_INT4_TILED", False)


def tileable(scheme: LinearScheme) -> bool:
    return scheme.weight == "uint4" and scheme.group == GROUP and not scheme.g_idx


def is_tiled(scheme: LinearScheme, n: int, k: int) -> bool:
    """Whether a projection's bytes are stored tiled: its scheme says so and the
    kernel takes its flattened [N, K] (w4a16_mgpu.supported)."""
    if not scheme.tiled:
        return False
    from pallas_kernels import w4a16_mgpu
    return w4a16_mgpu.supported(n, k, TILE_N)


def tile_stored(q: np.ndarray, n: int) -> np.ndarray:
    """The loader's packed bytes [N..., K.../2] in tiled order, the same shape."""
    from pallas_kernels.w4a16_mgpu import tile_weight
    return np.ascontiguousarray(tile_weight(q.reshape(n, -1), TILE_N)).reshape(q.shape)


def kernel_view(wq):
    """Tiled bytes [N, K/2] -> the kernel's [N/TN, K/G, TN, G/2] (a reshape: the
    bytes are already in that order)."""
    n, half = wq.shape
    return wq.reshape(n // TILE_N, half // (GROUP // 2), TILE_N, GROUP // 2)


def natural(wq, nk: int):
    """Tiled bytes [N..., K.../2] back in row order, the same shape (for XLA's path)."""
    from pallas_kernels.w4a16_mgpu import untile_weight
    n = math.prod(wq.shape[:wq.ndim - nk])
    return untile_weight(kernel_view(wq.reshape(n, -1))).reshape(wq.shape)


def in_row_order(wq, scheme: LinearScheme, nk: int):
    """A layer's stored uint4 bytes [N..., K.../2] in row order, tiled or not."""
    n = math.prod(wq.shape[:wq.ndim - nk])
    return natural(wq, nk) if is_tiled(scheme, n, 2 * wq.size // n) else wq
