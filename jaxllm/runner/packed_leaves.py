"""The model step's parameters as fewer arguments: the norm weights, small and whole
on every device, concatenated into one flat buffer per dtype and sliced back inside
the step.

Why: a step's launch costs host time per argument (jit's argument handling and PjRt's
per-buffer work): on the H200 host a program of 360 small arguments launched in
424-686 us against 37-60 us for one. An 8B Llama's step takes 65 norm weights of
8 KB; packed, they are one. Inside the step a norm weight is a static slice of the
buffer, read in place by its RMSNorm fusion: compiled for the H200 (scripts/aot_step.py),
the bf16 and fp8 steps run the same kernels packed and unpacked, decode and prompt. On
the H200 the fp8 engine's steps kept their kernels and device time, and the model's
dispatch took 1.36 against 1.57 ms a step (docs/benchmarks.md, the FP8 table).

Per-channel quantization scales stay whole: packed too, the H200 compile of the fp8
model's W8A8 steps (larger than WEIGHT_ONLY_ROWS) fused their residual adds
differently: 2 more kernels a layer at 256 rows, 4 more a layer in a prompt step.

On unless JAXLLM_PACK_SMALL_LEAVES=0.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxllm.env_switch import env_switch

# Leaves of at most this many elements may be packed.
MAX_ELEMENTS = 1 << 16


def enabled() -> bool:
    return env_switch("JAXLLM_PACK_SMALL_LEAVES", default=True)


def flatten(state, pack: bool | None = None):
    """(args, layout): `args` the step's parameter argument, `layout.unflatten(args)`
    the state again (inside the step). Unpacked: jax.tree.flatten(state) itself."""
    if not (enabled() if pack is None else pack):
        return jax.tree.flatten(state)
    with_path, treedef = jax.tree_util.tree_flatten_with_path(state)
    leaves = [x for _, x in with_path]
    names = [tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path[:-1])
             for path, _ in with_path]      # the path's last key is the Variable's value
    chosen = [_packable(n, x) for n, x in zip(names, leaves)]
    layout = PackedLayout(treedef, leaves, chosen)
    return layout.pack(leaves), layout


def _packable(name: tuple, x) -> bool:
    """Norm weights, small and whole on every device."""
    if x.size > MAX_ELEMENTS or not getattr(x.sharding, "is_fully_replicated", False):
        return False
    return len(name) > 1 and name[-1] == "weight" and str(name[-2]).endswith("norm")


class PackedLayout:
    """Where each leaf of a flattened state lives: ("whole", i) for the i-th of the
    leaves passed as they are, or ("packed", dtype, offset, shape) in that dtype's
    buffer."""

    def __init__(self, treedef, leaves, chosen):
        self.treedef = treedef
        self.places, self.sizes = [], {}
        whole = 0
        for x, packed in zip(leaves, chosen):
            if packed:
                dt = jnp.dtype(x.dtype).name
                off = self.sizes.get(dt, 0)
                self.places.append(("packed", dt, off, tuple(x.shape)))
                self.sizes[dt] = off + math.prod(x.shape)
            else:
                self.places.append(("whole", whole))
                whole += 1
        self.dtypes = sorted(self.sizes)

    def pack(self, leaves) -> tuple[list, list]:
        """(the leaves passed whole, one flat buffer per dtype), made on the device."""
        whole = [x for x, p in zip(leaves, self.places) if p[0] == "whole"]
        buffers = []
        for dt in self.dtypes:
            parts = [x.reshape(-1) for x, p in zip(leaves, self.places)
                     if p[0] == "packed" and p[1] == dt]
            buffers.append(jnp.concatenate(parts))
        return whole, buffers

    def unflatten(self, args):
        """The state from pack's output (inside the step: static slices)."""
        whole, buffers = args
        by_dtype = dict(zip(self.dtypes, buffers))
        leaves = []
        for p in self.places:
            if p[0] == "whole":
                leaves.append(whole[p[1]])
            else:
                _, dt, off, shape = p
                leaves.append(by_dtype[dt][off:off + math.prod(shape)].reshape(shape))
        return jax.tree.unflatten(self.treedef, leaves)

    def __repr__(self) -> str:      # part of the executable store's key
        return f"{self.treedef} packed: {[p for p in self.places if p[0] == 'packed']}"
