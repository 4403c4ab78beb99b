"""The KV pool: per layer a (k, v) pair of [Hkv, NB, BS, D] arrays, sized from
`gpu_memory_utilization` and the compiled largest step's memory analysis (on CPU: a
configured byte budget).

Letter legend: Hkv KV heads, NB blocks, BS block size, D head dim, L layers, T tokens
and S sequences of a step.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import CacheConfig, ConfigError
from jaxllm.models.registry import ArchConfig
from jaxllm.parallel.mesh import pool_kv_heads

# Device bytes kept free beside the largest step's compiled peak: allocator
# fragmentation, the step's inputs, the sampler's temporaries.
HEADROOM = 256 << 20


def cache_dtype(cache: CacheConfig, model_dtype):
    """The pool's dtype: e4m3 for fp8 / fp8_e4m3, e5m2 for fp8_e5m2 (a truncated f16:
    range enough without a scale, but two mantissa bits), else the model's. fp8 pools
    store keys and values divided by the spec's per-tensor scales (1 unless the
    checkpoint stores them), saturated to the format's largest finite value."""
    if not cache.is_fp8:
        return model_dtype
    return jnp.float8_e5m2 if cache.kv_cache_dtype == "fp8_e5m2" else jnp.float8_e4m3fn


def checkpoint_cache(cache: CacheConfig, quant, source: str) -> CacheConfig:
    """The cache the loaded model runs with (quant_config.kv_cache_dtype_for: fp8 for a
    checkpoint storing fp8 KV scales, whose real or random weights alike)."""
    from jaxllm.models.errors import CheckpointError
    from jaxllm.models.quant_config import kv_cache_dtype_for
    try:
        dtype = kv_cache_dtype_for(quant, cache.kv_cache_dtype, source)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    if dtype == cache.kv_cache_dtype:
        return cache
    logging.getLogger(__name__).info("KV cache in fp8 (e4m3): %s stores its scales "
                                     "(kv_cache_scheme)", source)
    return dataclasses.replace(cache, kv_cache_dtype=dtype)


def spec_kv_scales(kv_scales: tuple | None, cache: CacheConfig) -> dict:
    """AttentionSpec's k_scale / v_scale for a checkpoint's per-layer fp8 KV scales
    ((k, v) per layer): the largest of each, for every layer; {} without them or when
    the pool is not e4m3 (a draft model's own scales under a target's float cache:
    the kernels would scale a float pool's reads, which no write divided). The spec's
    scales are compile-time constants of the attention kernels, so per-layer values
    would compile a kernel set per layer and step size; one scale the largest keeps
    every layer's values in range (a smaller layer's values only sit lower in e4m3's
    range, whose relative step is the same in every binade above 2^-6)."""
    if kv_scales is None or cache_dtype(cache, jnp.float32) != jnp.float8_e4m3fn:
        return {}
    return dict(k_scale=max(k for k, _ in kv_scales), v_scale=max(v for _, v in kv_scales))


def bytes_per_block(arch: ArchConfig, block_size: int, dtype) -> int:
    """K and V of one block across all layers."""
    return (2 * arch.num_layers * arch.num_kv_heads * block_size * arch.head_dim
            * jnp.dtype(dtype).itemsize)


@dataclass(frozen=True)
class MemoryReport:
    """`per_block`: the target pool's bytes per block; `draft_per_block` and
    `draft_weights`: a draft model's or EAGLE head's (its pool has as many blocks).
    `unquantized_extra`: the bytes the model's float weights would take beyond its
    quantized ones (0: a float model); `blocks_gained`: the blocks those bytes hold
    when the device's memory sized the pool (a float model's pool would be that much
    smaller), else 0."""
    total: int
    weights: int
    activations: int
    per_block: int
    num_blocks: int
    draft_per_block: int = 0
    draft_weights: int = 0
    unquantized_extra: int = 0
    blocks_gained: int = 0

    def describe(self, block_size: int) -> str:
        gib = 1 << 30
        draft = (f" (draft: weights and buffers {self.draft_weights / gib:.2f} GiB, KV per "
                 f"token {self.draft_per_block // block_size} bytes)"
                 if self.draft_per_block else "")
        quant = (f" (unquantized {(self.weights + self.unquantized_extra) / gib:.2f} GiB)"
                 if self.unquantized_extra else "")
        gained = (f" (the quantized weights' savings hold {self.blocks_gained})"
                  if self.blocks_gained else "")
        return (f"device memory {self.total / gib:.2f} GiB, weights {self.weights / gib:.2f} "
                f"GiB{quant}, activation peak {self.activations / gib:.2f} GiB, KV per token "
                f"{self.per_block // block_size} bytes{draft}, blocks available "
                f"{self.num_blocks}{gained}")


def plan_num_blocks(arch: ArchConfig, cache: CacheConfig, model_dtype, max_model_len: int,
                    weights_bytes: int, peak_bytes: int | None, device_limit: int | None,
                    num_devices: int = 1, max_num_seqs: int | None = None,
                    draft_per_block: int = 0, draft_weights: int = 0,
                    unquantized_extra: int = 0) -> MemoryReport:
    """How many KV blocks fit. `device_limit`: the device's byte limit (None on CPU);
    `peak_bytes`: device bytes in use at the largest step's peak, the pool excepted
    (see fit_to_device). `draft_per_block`, `draft_weights`: a proposer's pool (of
    the same block count) and weights (on the device beside the target's, outside
    the target step's peak): each block costs both pools' bytes, and the weights
    come off the budget (on CPU: both pools share cpu_kv_cache_bytes).
    `unquantized_extra`: MemoryReport's (unquantized_extra below). Raises
    ConfigError, with the numbers and the knob to turn, when one max_model_len
    sequence does not fit."""
    dtype = cache_dtype(cache, model_dtype)
    # Per device: the pool is split by head over the devices (parallel/mesh.py), each
    # holding Hkv / N heads, or one when the devices outnumber the KV heads.
    heads = pool_kv_heads(arch.num_kv_heads, num_devices)
    per_block = bytes_per_block(arch, cache.block_size, dtype) * heads // (
        arch.num_kv_heads * num_devices)
    both = per_block + draft_per_block
    if cache.num_gpu_blocks_override is not None:
        num_blocks = cache.num_gpu_blocks_override
        report = MemoryReport(device_limit or 0, weights_bytes, 0, per_block, num_blocks)
    elif device_limit is None:
        num_blocks = cache.cpu_kv_cache_bytes // both
        if max_num_seqs is not None:
            # No point holding more than max_num_seqs full sequences in host memory.
            full = max_num_seqs * -(-max_model_len // cache.block_size) + 1
            num_blocks = min(num_blocks, full)
        report = MemoryReport(cache.cpu_kv_cache_bytes, weights_bytes, 0, per_block, num_blocks)
    else:
        budget = (int(device_limit * cache.gpu_memory_utilization) - (peak_bytes or 0)
                  - draft_weights)
        num_blocks = stable_block_count(max(budget, 0) // both)
        report = MemoryReport(device_limit, weights_bytes, (peak_bytes or 0) - weights_bytes,
                              per_block, num_blocks,
                              blocks_gained=min(unquantized_extra // both, num_blocks))
    report = dataclasses.replace(report, draft_per_block=draft_per_block,
                                 draft_weights=draft_weights,
                                 unquantized_extra=unquantized_extra)
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
    from one start to the next; the pool's size is part of every compiled step, so an
    unrounded count makes a restart miss every cached program."""
    if num_blocks < 64:
        return num_blocks
    step = 1 << ((num_blocks // 32).bit_length() - 1)
    return num_blocks // step * step


def fit_to_device(arch: ArchConfig, cache: CacheConfig, model_dtype, max_model_len: int,
                  weights_bytes: int, device_limit: int, activation_bytes: int,
                  step_peak: Callable[[int], int | None], num_devices: int = 1,
                  draft_per_block: int = 0, draft_weights: int = 0,
                  unquantized_extra: int = 0) -> MemoryReport:
    """Size the pool from the largest step's compiled memory analysis, with no
    profiling run. The first guess spends `activation_bytes` (an upper estimate,
    `activation_bound`) beside the weights; `step_peak(num_blocks)` compiles (or
    loads) the largest step with that pool and returns its peak device bytes, pool
    included. When weights + pool + temporaries + HEADROOM exceed
    `gpu_memory_utilization * device_limit` the pool shrinks to fit and the step
    compiles again (rare: the estimate is meant to be above what XLA allocates).
    Counts are rounded by `stable_block_count`, so restarts produce the same shapes.
    `draft_*`, `unquantized_extra`: plan_num_blocks'; the target step's peak holds
    no draft (the draft's own steps run between the target's, their temporaries
    taken to be no larger).
    Raises plan_num_blocks's ConfigError when one max_model_len sequence does not fit."""
    def plan(peak):
        return plan_num_blocks(arch, cache, model_dtype, max_model_len, weights_bytes, peak,
                               device_limit, num_devices=num_devices,
                               draft_per_block=draft_per_block, draft_weights=draft_weights,
                               unquantized_extra=unquantized_extra)

    budget = int(device_limit * cache.gpu_memory_utilization)
    report = plan(weights_bytes + activation_bytes + HEADROOM)
    for _ in range(3):
        peak = step_peak(report.num_blocks)
        if peak is None:          # no memory analysis on this backend: keep the estimate
            return report
        rest = peak - report.num_blocks * report.per_block      # all but the pool
        if peak + draft_weights + report.num_blocks * draft_per_block + HEADROOM <= budget:
            return dataclasses.replace(report, activations=rest - weights_bytes)
        report = plan(rest + HEADROOM)
    raise RuntimeError(f"the largest step's compiled peak grows with the KV pool "
                       f"({peak} bytes with {report.num_blocks} blocks): a copy of the pool?")


def activation_bound(arch: ArchConfig, num_tokens: int, num_seqs: int, dtype, tp: int = 1,
                     gather_block_size: int = 0) -> int:
    """An upper estimate of the step's temporary device bytes for T tokens and S
    sequences (per device): per token the residual stream and norms (4 x hidden),
    the MLP's gate, up and activation (3 x intermediate), q, k, v and the attention
    output (twice); per sequence f32 logits and their softmax; then x1.5 for what
    XLA keeps alive across layers. Llama-3.1-8B at T=8192, S=256: 2.1 GB, against
    the measured 1.35 GiB activation peak of that step on the H200.
    `gather_block_size`: the reference attention's block size (it gathers one block
    column of K and V per token, in f32); 0 for the Pallas kernels."""
    item = jnp.dtype(dtype).itemsize
    heads, kv_heads = arch.num_heads, pool_kv_heads(arch.num_kv_heads, tp)
    attn = (heads * 2 + kv_heads * 2) * arch.head_dim * item
    attn += (kv_heads * gather_block_size * arch.head_dim * 2
             + heads * (gather_block_size + 2 * arch.head_dim)) * 4 * bool(gather_block_size)
    per_token = 4 * arch.hidden_size * item + (3 * arch.intermediate_size * item + attn) // tp
    logits = num_seqs * arch.vocab_size * 4 * 2
    return math.ceil(1.5 * (num_tokens * per_token + logits))


def device_bytes(arrays) -> int:
    """Bytes the arrays hold on one device (a split array: its shard)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
               for x in jax.tree.leaves(arrays))


def unquantized_extra(quant, arch: ArchConfig, model_dtype, state, mesh) -> int:
    """Bytes per device the model's weights would take beyond `state`'s (the loaded
    leaves) if no layer were quantized; 0 for a float model (`quant` None). The float
    model is built abstractly (nothing allocated) and each of its leaves counted as
    the loader would shard it over `mesh`."""
    if quant is None:
        return 0
    from flax import nnx

    from jaxllm.models.loader import abstract_model
    from jaxllm.parallel.mesh import param_shardings
    shard = param_shardings(mesh)
    _, float_state = abstract_model(arch, model_dtype)
    float_bytes = 0
    for path, var in nnx.to_flat_state(float_state):
        x = var.get_value()
        sharding = shard(path, var.get_metadata().get("out_sharding"), x.shape)
        float_bytes += math.prod(sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
    return max(float_bytes - device_bytes(state), 0)


def pool_shape(arch: ArchConfig, num_blocks: int, block_size: int, tp: int = 1):
    return (pool_kv_heads(arch.num_kv_heads, tp), num_blocks, block_size, arch.head_dim)


def abstract(arch: ArchConfig, num_blocks: int, block_size: int, dtype, sharding,
             tp: int = 1):
    """The pool's ShapeDtypeStructs, to lower a step before the pool exists."""
    x = jax.ShapeDtypeStruct(pool_shape(arch, num_blocks, block_size, tp), dtype,
                             sharding=sharding)
    return [(x, x) for _ in range(arch.num_layers)]


def allocate(arch: ArchConfig, num_blocks: int, block_size: int, dtype, sharding=None,
             tp: int = 1):
    """Zeroed pool: list over layers of (k, v) [Hkv, NB, BS, D], created on device (with
    `tp` devices: [max(Hkv, tp), ...] split by head, see parallel/mesh.py)."""
    shape = pool_shape(arch, num_blocks, block_size, tp)

    def make():
        return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(arch.num_layers)]

    if sharding is None:
        return jax.jit(make)()
    out_shardings = [(sharding, sharding)] * arch.num_layers
    return jax.jit(make, out_shardings=out_shardings)()


# ---------------------------------------------------------------- swap to host memory
def allocate_host_pool(kv_caches, num_cpu_blocks: int):
    """Per layer a (k, v) pair of host arrays [Hkv, num_cpu_blocks, BS, D]; None for 0."""
    if num_cpu_blocks == 0:
        return None
    k = kv_caches[0][0]
    shape = (k.shape[0], num_cpu_blocks, k.shape[2], k.shape[3])
    return [(np.zeros(shape, k.dtype), np.zeros(shape, k.dtype)) for _ in kv_caches]


def swap_out(kv_caches, pairs, host_pool) -> None:
    """Copy device blocks to host blocks: pairs [(gpu, cpu)]."""
    if not pairs:
        return
    gpu = np.array([g for g, _ in pairs], np.int32)
    cpu = np.array([c for _, c in pairs], np.int32)
    for layer, (k, v) in enumerate(kv_caches):
        host_pool[layer][0][:, cpu] = np.asarray(jax.device_get(k[:, gpu]))
        host_pool[layer][1][:, cpu] = np.asarray(jax.device_get(v[:, gpu]))


def swap_in(kv_caches, pairs, host_pool):
    """Copy host blocks back to device blocks: pairs [(cpu, gpu)]. Returns the new pool."""
    if not pairs:
        return kv_caches
    cpu = np.array([c for c, _ in pairs], np.int32)
    gpu = jnp.asarray(np.array([g for _, g in pairs], np.int32))
    return [(_scatter_blocks(k, gpu, jnp.asarray(host_pool[layer][0][:, cpu])),
             _scatter_blocks(v, gpu, jnp.asarray(host_pool[layer][1][:, cpu])))
            for layer, (k, v) in enumerate(kv_caches)]


@jax.jit
def _scatter_blocks(cache, ids, blocks):
    return cache.at[:, ids].set(blocks.astype(cache.dtype))
