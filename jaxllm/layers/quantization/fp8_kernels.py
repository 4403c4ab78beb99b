"""QuantLinear's weight-only fp8 layers (decode-sized steps, linear.use_weight_only)
through the Mosaic GPU kernel (pallas_kernels/w8a16_mgpu.py) instead of XLA's Triton
GEMM widening the weight in place. Where it runs: JAXLLM_FP8_MOSAIC=1, one device, a
Hopper GPU, a 16-bit input, per-channel or per-tensor weight scales, shapes the kernel
tiles, at most w8a16_mgpu.MAX_M tokens. Off by default until an engine A/B on the GPU
says otherwise (docs/benchmarks.md)."""
from __future__ import annotations

import math

from jaxllm.env_switch import env_switch
from jaxllm.layers.quantization.int4_kernels import is_hopper, named_settings

SWITCH = "JAXLLM_FP8_MOSAIC"
SETTINGS_ENV = "JAXLLM_W8A16_SETTINGS"
SETTINGS = ("k_splits", "stages", "cols", "tile_n", "warpgroups")


def use_mosaic_fp8(x, wq, w_scale, nk: int, unsharded: bool) -> bool:
    import jax.numpy as jnp
    from pallas_kernels import w8a16_mgpu
    if not env_switch(SWITCH, False):           # read first: a bad value is refused anywhere
        return False
    out = wq.shape[:wq.ndim - nk]
    if (jnp.dtype(wq.dtype) != w8a16_mgpu.FP8 or jnp.dtype(x.dtype).itemsize != 2
            or x.ndim != nk + 1 or x.shape[0] > w8a16_mgpu.MAX_M or not unsharded
            or tuple(w_scale.shape) not in ((), tuple(out))):
        return False
    n, k = math.prod(out), math.prod(x.shape[1:])
    return w8a16_mgpu.supported(n, k) and is_hopper()


def kernel_settings(n: int, k: int, t: int) -> dict:
    """The kernel's settings that $JAXLLM_W8A16_SETTINGS names (named_settings)."""
    return named_settings(SETTINGS_ENV, SETTINGS, n, k, t)


def fp8_kernel_matmul(x, wq, w_scale, nk: int, interpret: bool = False):
    """weight_only_matmul's contract through the kernel: x [T, K...] times the e4m3
    weight [N..., K...], times w_scale [N...] (or a scalar); f32 [T, N...]."""
    import jax.numpy as jnp
    from pallas_kernels.w8a16_mgpu import w8a16_matmul     # Mosaic lowering, lazily
    t = x.shape[0]
    out = wq.shape[:wq.ndim - nk]
    n = math.prod(out)
    xf, w = x.reshape(t, -1), wq.reshape(n, -1)
    scale = w_scale.reshape(n) if w_scale.ndim else w_scale
    y = w8a16_matmul(xf, w, scale, out_dtype=jnp.float32, interpret=interpret,
                     **kernel_settings(n, xf.shape[1], t))
    return y.reshape(t, *out)
