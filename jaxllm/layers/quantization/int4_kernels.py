"""QuantLinear's uint4 layers through the fused kernels (the Mosaic GPU one on Hopper,
else the Triton one), and their group scales stored packed for the Mosaic kernel: a
projection's f32 scales and zero points [N..., K/G] become one bf16 [2 K/G, N]
parameter (pallas_kernels/w4a16_mgpu.pack_scales), which each pipeline step of the
kernel reads as whole rows, with no slab copied and transposed before the pipeline
(on an H100 a layer's four matmuls at 8 rows took 0.93x the time). Where the kernel
runs: one device, a Hopper GPU, a bf16 model, groups of 128 without act order, shapes
the kernel takes (JAXLLM_INT4_MOSAIC=0 keeps the f32 scales and the Triton kernel). A
scheme's `packed` says so; the loader, the dummy weights and the layer ask
``is_packed``. XLA's path (steps over 64 tokens) unpacks them (a small transpose
beside the prefill's dequantization)."""
from __future__ import annotations

import json
import math
import os

import numpy as np

from jaxllm.env_switch import env_switch
from jaxllm.layers.quantization.schemes import LinearScheme

GROUP = 128         # w4a16_mgpu.GROUP, the only group size the kernel takes


def is_hopper() -> bool:
    # imported here: the launcher resolves quantization before any backend imports jax
    from pallas_kernels.common import is_hopper as hopper
    return hopper()


def _mosaic_on(dtype) -> bool:
    """The switch on (read first, so a bad value is refused wherever it is asked), a
    bf16 input (the kernel's arithmetic is bf16), a Hopper GPU."""
    import jax.numpy as jnp
    return (env_switch("JAXLLM_INT4_MOSAIC", True) and jnp.dtype(dtype) == jnp.bfloat16
            and is_hopper())


def wanted(tp: int, dtype) -> bool:
    """Whether the Mosaic kernel will run this model's uint4 layers."""
    return tp == 1 and dtype is not None and _mosaic_on(dtype)


def packable(scheme: LinearScheme) -> bool:
    return scheme.weight == "uint4" and scheme.group == GROUP and not scheme.g_idx


def is_packed(scheme: LinearScheme, n: int, k: int) -> bool:
    """A projection's scales stored packed: its scheme says so and the kernel takes
    its flattened [N, K] (w4a16_mgpu.supported)."""
    if not scheme.packed:
        return False
    from pallas_kernels import w4a16_mgpu
    return w4a16_mgpu.supported(n, k)


def pack(scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
    """The loader's f32 [N..., K/G] scales and zero points -> bf16 [2 K/G, N]."""
    import jax.numpy as jnp
    from pallas_kernels.w4a16_mgpu import pack_scales
    n = scale.size // scale.shape[-1]
    return np.asarray(pack_scales(jnp.asarray(scale.reshape(n, -1), jnp.float32),
                                  jnp.asarray(zero.reshape(n, -1), jnp.float32)))


def unpack(packed, out_shape: tuple):
    """bf16 [2 K/G, N] -> f32 scale and zero point [N..., K/G] (XLA's path)."""
    from pallas_kernels.w4a16_mgpu import unpack_scales
    return tuple(a.reshape(out_shape + (a.shape[-1],)) for a in unpack_scales(packed))


def use_mosaic_int4(scheme: LinearScheme, n: int, k: int, x_dtype) -> bool:
    """The Mosaic GPU kernel (w4a16_mgpu.py, bf16 arithmetic; JAXLLM_INT4_MOSAIC=0 for
    the Triton one): groups of 128, a bf16 input, shapes it tiles, a Hopper GPU."""
    if not (_mosaic_on(x_dtype) and scheme.group == GROUP):
        return False
    from pallas_kernels import w4a16_mgpu
    return w4a16_mgpu.supported(n, k)


SETTINGS_ENV = "JAXLLM_W4A16_SETTINGS"
SETTINGS = ("k_splits", "stages", "groups_per_step", "tiles")


def named_settings(env: str, names: tuple, n: int, k: int, t: int) -> dict:
    """A Mosaic kernel's settings for an [N, K] projection at t <= 16 tokens (the rows
    its sweep runs) that $env names (JSON {"NxK": {setting: value}}: a device sweep's
    pick, tried in the engine before it becomes a default), each one of `names`; {}
    (the kernel's defaults) otherwise."""
    try:
        table = json.loads(os.environ.get(env) or "{}")
    except ValueError as e:
        raise ValueError(f"{env}: not JSON ({e})") from None
    named = (table.get(f"{n}x{k}") if isinstance(table, dict) else None) or {}
    if not isinstance(table, dict) or not isinstance(named, dict):
        raise ValueError(f'{env}: {{"NxK": {{setting: value}}}} expected')
    bad = sorted(set(named) - set(names))
    if bad:
        raise ValueError(f"{env}: unknown settings {bad} for {n}x{k} "
                         f"(of {', '.join(names)})")
    return named if t <= 16 else {}


def mosaic_settings(n: int, k: int, t: int) -> dict:
    """The W4A16 kernel's settings that $JAXLLM_W4A16_SETTINGS names (named_settings)."""
    return named_settings(SETTINGS_ENV, SETTINGS, n, k, t)


def int4_kernel_matmul(x, wq, scale, zero, scheme: LinearScheme, nk: int,
                       interpret: bool = False):
    """grouped_dequant_matmul's contract through the fused kernel: the projection's
    dims flattened to [T, K] x [N, K/2] (two nibbles a byte along the last K dim, so
    flattening keeps each pair) -> [T, N...] in x's dtype. zero None: `scale` packed
    (above), as the Mosaic kernel reads it (f32 scales it is given are packed first, a
    kernel of XLA's each call: the engine stores them packed where it runs)."""
    from pallas_kernels.quant_matmul import quant_matmul_int4   # Triton lowering, lazily
    t = x.shape[0]
    xf = x.reshape(t, -1)
    out = wq.shape[:wq.ndim - nk]
    n = math.prod(out)
    mosaic = use_mosaic_int4(scheme, n, xf.shape[1], x.dtype)
    wq = wq.reshape(n, -1)
    if zero is not None:
        scale, zero = scale.reshape(n, -1), zero.reshape(n, -1)
    elif not mosaic:
        scale, zero = unpack(scale, (n,))
    if mosaic:
        from pallas_kernels.w4a16_mgpu import as_int4, pack_scales, w4a16_matmul   # lazily
        scales = scale if zero is None else pack_scales(scale, zero)
        y = w4a16_matmul(xf, as_int4(wq), scales, out_dtype=x.dtype, interpret=interpret,
                         **mosaic_settings(n, xf.shape[1], t))
    else:
        y = quant_matmul_int4(xf, wq, scale, zero,
                              group=scheme.group, out_dtype=x.dtype, interpret=interpret)
    return y.reshape(t, *out)
