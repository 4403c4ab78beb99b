"""Device mesh and the logical-axis -> mesh-axis rules table.

Tensor parallelism is a sharding choice: parameters carry logical axis names
(models/llama.py) and this table maps them onto the mesh's ``tp`` axis; XLA inserts
the collectives. Attention runs per shard under ``shard_map`` (layers/attention.py).

KV heads: with Hkv >= N devices each device holds Hkv / N of them. With Hkv < N (N a
multiple of Hkv) each KV head is replicated on the N / Hkv devices whose query heads
read it, as vLLM does: the pool is laid out with N heads, one per device.
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxllm.config import ConfigError, check_tp, valid_tp_sizes  # noqa: F401 (re-exported)

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
    """A 1-D ``tp`` mesh. Across processes (jax.distributed) every process gives the
    same number of its devices, in process order, so a process's shards are adjacent."""
    if devices is None:
        devices = _devices_per_process(tensor_parallel_size)
    if tensor_parallel_size > len(devices):
        raise ConfigError(
            f"tensor_parallel_size={tensor_parallel_size} but only {len(devices)} "
            f"device(s) are visible; lower --tensor-parallel-size")
    return Mesh(np.array(devices[:tensor_parallel_size]), (TP,))


def _devices_per_process(tp: int) -> list:
    count = jax.process_count()
    if count == 1:
        return jax.devices()
    if tp % count:
        raise ConfigError(
            f"tensor_parallel_size={tp} is not a multiple of num_processes={count}: "
            "every process must hold the same number of shards")
    by_proc = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    per = tp // count
    chosen = []
    for p in range(count):
        mine = [d for d in by_proc if d.process_index == p]
        if len(mine) < per:
            raise ConfigError(
                f"tensor_parallel_size={tp} over {count} processes needs {per} devices in "
                f"each, but process {p} has {len(mine)}; lower --tensor-parallel-size")
        chosen += mine[:per]
    return chosen


def tp_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape[TP]


def validate_tp(num_heads: int, num_kv_heads: int, tp: int) -> None:
    check_tp(tp, num_heads, num_kv_heads)


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
    """The loader's `shardings(path, logical_axes, shape)` callback."""
    def fn(path, axes, shape=None):
        return NamedSharding(mesh, logical_spec(axes, shape, mesh))
    return fn


def pool_kv_heads(num_kv_heads: int, tp: int) -> int:
    """Heads of the KV pool's leading axis: the model's, or one per device when the
    devices outnumber them."""
    return max(num_kv_heads, tp)


def kv_cache_sharding(mesh: Mesh, num_kv_heads: int | None = None) -> NamedSharding:
    """KV pool [pool_kv_heads, NB, BS, D], split by head: every device holds only the
    heads its query heads read."""
    return NamedSharding(mesh, P(TP))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
