"""Device mesh and the logical-axis -> mesh-axis rules table.

Tensor parallelism is a sharding choice: parameters carry logical axis names
(models/llama.py) and this table maps them onto the mesh's ``tp`` axis; XLA inserts
the collectives.
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

TP = "tp"

# Logical axis -> mesh axis (None = replicated). Megatron layout: attention heads and
# MLP columns split; the residual stream (embed) stays whole on every device.
SHARDING_RULES: dict[str, str | None] = {
    "vocab": TP,
    "embed": None,
    "q_heads": TP,
    "kv_heads": TP,
    "head_dim": None,
    "mlp": TP,
    "norm": None,
}


def make_mesh(tensor_parallel_size: int = 1, devices=None) -> Mesh:
    devices = devices if devices is not None else jax.devices()
    if tensor_parallel_size > len(devices):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} but only {len(devices)} "
            f"device(s) are visible; lower --tensor-parallel-size")
    return Mesh(np.array(devices[:tensor_parallel_size]), (TP,))


def logical_spec(axes, shape=None, mesh: Mesh | None = None) -> P:
    """PartitionSpec for logical axes; an axis whose size the mesh does not divide
    (e.g. 2 KV heads on 4 devices) is replicated, as vLLM replicates KV heads."""
    spec = []
    for i, name in enumerate(axes or ()):
        mesh_axis = SHARDING_RULES.get(name) if name else None
        if mesh_axis and mesh is not None and shape is not None:
            if shape[i] % mesh.shape[mesh_axis] != 0:
                mesh_axis = None
        spec.append(mesh_axis)
    return P(*spec)


def param_shardings(mesh: Mesh):
    """The loader's `shardings(path, logical_axes)` callback, needing the shape too:
    returns a function (path, axes, shape=None) -> NamedSharding."""
    def fn(path, axes, shape=None):
        return NamedSharding(mesh, logical_spec(axes, shape, mesh))
    return fn


def kv_cache_sharding(mesh: Mesh, num_kv_heads: int) -> NamedSharding:
    """KV pool [Hkv, NB, BS, D]: split by KV head when the mesh divides them."""
    tp = mesh.shape[TP]
    return NamedSharding(mesh, P(TP if num_kv_heads % tp == 0 else None))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
