"""The KV pool: per layer a (k, v) pair of [Hkv, NB, BS, D] arrays, sized from
`gpu_memory_utilization` after a profiling step (on CPU: a configured byte budget).

Letter legend: Hkv KV heads, NB blocks, BS block size, D head dim, L layers.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxllm.config import CacheConfig, ConfigError
from jaxllm.models.registry import ArchConfig
from jaxllm.parallel.mesh import pool_kv_heads


def cache_dtype(cache: CacheConfig, model_dtype):
    return jnp.float8_e4m3fn if cache.is_fp8 else model_dtype


def bytes_per_block(arch: ArchConfig, block_size: int, dtype) -> int:
    """K and V of one block across all layers."""
    return (2 * arch.num_layers * arch.num_kv_heads * block_size * arch.head_dim
            * jnp.dtype(dtype).itemsize)


@dataclass(frozen=True)
class MemoryReport:
    total: int
    weights: int
    activations: int
    per_block: int
    num_blocks: int

    def describe(self, block_size: int) -> str:
        gib = 1 << 30
        return (f"device memory {self.total / gib:.2f} GiB, weights {self.weights / gib:.2f} GiB, "
                f"activation peak {self.activations / gib:.2f} GiB, KV per token "
                f"{self.per_block // block_size} bytes, blocks available {self.num_blocks}")


def plan_num_blocks(arch: ArchConfig, cache: CacheConfig, model_dtype, max_model_len: int,
                    weights_bytes: int, peak_bytes: int | None, device_limit: int | None,
                    num_devices: int = 1, max_num_seqs: int | None = None) -> MemoryReport:
    """How many KV blocks fit. `peak_bytes`/`device_limit` come from the device's
    memory stats after a profiling step (None on CPU). Raises ConfigError, with the
    numbers and the knob to turn, when one max_model_len sequence does not fit."""
    dtype = cache_dtype(cache, model_dtype)
    # Per device: the pool is split by head over the devices (parallel/mesh.py), each
    # holding Hkv / N heads, or one when the devices outnumber the KV heads.
    heads = pool_kv_heads(arch.num_kv_heads, num_devices)
    per_block = bytes_per_block(arch, cache.block_size, dtype) * heads // (
        arch.num_kv_heads * num_devices)
    if cache.num_gpu_blocks_override is not None:
        num_blocks = cache.num_gpu_blocks_override
        report = MemoryReport(device_limit or 0, weights_bytes, 0, per_block, num_blocks)
    elif device_limit is None:
        num_blocks = cache.cpu_kv_cache_bytes // per_block
        if max_num_seqs is not None:
            # No point holding more than max_num_seqs full sequences in host memory.
            full = max_num_seqs * -(-max_model_len // cache.block_size) + 1
            num_blocks = min(num_blocks, full)
        report = MemoryReport(cache.cpu_kv_cache_bytes, weights_bytes, 0, per_block, num_blocks)
    else:
        budget = int(device_limit * cache.gpu_memory_utilization) - (peak_bytes or 0)
        num_blocks = stable_block_count(max(budget, 0) // per_block)
        report = MemoryReport(device_limit, weights_bytes, (peak_bytes or 0) - weights_bytes,
                              per_block, num_blocks)
    needed = -(-max_model_len // cache.block_size) + 1   # +1: the null block
    if report.num_blocks < needed:
        knob = ("raise cpu_kv_cache_bytes" if device_limit is None else
                "raise --gpu-memory-utilization") + ", lower --max-model-len"
        if not cache.is_fp8:
            knob += ", or use --kv-cache-dtype fp8"
        raise ConfigError(
            f"the KV cache cannot hold one sequence of max_model_len={max_model_len} tokens "
            f"({needed} blocks of {cache.block_size} needed): {report.describe(cache.block_size)}; "
            f"{knob}")
    return report


def stable_block_count(num_blocks: int) -> int:
    """Round a measured block count down to a coarse step (at most ~1/32 of it: 1024
    blocks for an 8B model on an H200). The measured peak differs by a few hundred MB
    from one start to the next; the pool's size is part of every compiled step, so
    without this a restart found none of them in the persistent compile cache."""
    if num_blocks < 64:
        return num_blocks
    step = 1 << ((num_blocks // 32).bit_length() - 1)
    return num_blocks // step * step


def allocate(arch: ArchConfig, num_blocks: int, block_size: int, dtype, sharding=None,
             tp: int = 1):
    """Zeroed pool: list over layers of (k, v) [Hkv, NB, BS, D], created on device (with
    `tp` devices: [max(Hkv, tp), ...] split by head, see parallel/mesh.py)."""
    shape = (pool_kv_heads(arch.num_kv_heads, tp), num_blocks, block_size, arch.head_dim)

    def make():
        return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(arch.num_layers)]

    if sharding is None:
        return jax.jit(make)()
    out_shardings = [(sharding, sharding)] * arch.num_layers
    return jax.jit(make, out_shardings=out_shardings)()
