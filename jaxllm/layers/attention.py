"""Attention over the block-indexed KV pool: metadata pytree and backend dispatch.

Letter legend: T flat tokens, S sequences, B blocks per block-table row, Hq/Hkv query
and KV heads, D head dim, NB pool blocks, BS block size.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jaxllm.env_switch import env_switch
from jaxllm.parallel.mesh import TP, tp_size
from pallas_kernels.ragged_paged_attention import ref_ragged_paged_attention
from pallas_kernels.reshape_and_cache import ref_reshape_and_cache


@dataclass
class AttentionMetadata:
    """Explicit per-step metadata (never a global). All int32 device arrays."""
    slot_mapping: jax.Array     # [T]: pool slot each new token's K/V goes to; -1 = padding
    block_tables: jax.Array     # [S, B]: block ids per sequence (0 = null block)
    seq_lens: jax.Array         # [S]: context length after this step; 0 = padding row
    query_start_loc: jax.Array  # [S + 1]: cumulative query counts
    # Static: True when every sequence has exactly one query token (pure decode); the
    # pallas backend then takes its decode kernel.
    decode_only: bool = dataclasses.field(default=False, metadata=dict(static=True))


jax.tree_util.register_dataclass(
    AttentionMetadata,
    data_fields=["slot_mapping", "block_tables", "seq_lens", "query_start_loc"],
    meta_fields=["decode_only"],
)


@dataclass(frozen=True)
class AttentionSpec:
    """Static attention settings of one model (a jit static value)."""
    sm_scale: float
    backend: str = "reference"          # reference | pallas
    sliding_window: int | None = None
    k_scale: float = 1.0                # fp8 KV scales (per tensor)
    v_scale: float = 1.0
    interpret: bool = False             # pallas kernels in interpret mode (CPU tests)
    # Tensor parallelism: attention runs per shard over this mesh's `tp` axis (None or
    # a one-device mesh: unsharded). A Mesh is hashable, so the spec stays static.
    mesh: Mesh | None = None
    # Pallas decode-step options (docs/kernels.md; H200 figures in docs/benchmarks.md):
    # spread: share the decode kernel's programs among the live sequences
    # (paged_attention_decode's ``spread``; JAXLLM_DECODE_SPREAD=1), off: the 8B fp8
    # decode-1 step measured slower with it; kv_write: the decode kernel writes the
    # step's keys and values itself, one kernel a layer fewer (decode_and_write), on
    # unless JAXLLM_DECODE_KV_WRITE=0: the 8B decode-1 step 2.1% (fp8) / 1.5% (bf16)
    # faster with it. The EAGLE draft model writes apart (its rows read keys that other
    # rows of their step write).
    decode_spread: bool = dataclasses.field(
        default_factory=lambda: env_switch("JAXLLM_DECODE_SPREAD"))
    decode_kv_write: bool = dataclasses.field(
        default_factory=lambda: env_switch("JAXLLM_DECODE_KV_WRITE", True))

    @property
    def folds_kv_write(self) -> bool:
        """Whether pure decode steps run decode_and_write (Pallas, one device): the
        runner must then keep a step whose rows read each other's new keys out of the
        decode-only path (input_batch.decode_rows_independent)."""
        return self.decode_kv_write and self.backend == "pallas" and tp_size(self.mesh) <= 1


def paged_attention(q, k, v, k_cache, v_cache, md: AttentionMetadata, spec: AttentionSpec):
    """Write this step's K/V into the pool, then attend.

    q: [T, Hq, D]; k, v: [T, Hkv, D]; caches [Hkv, NB, BS, D].
    Returns (out [T, Hq, D], k_cache, v_cache).
    """
    if tp_size(spec.mesh) > 1:
        return _sharded(q, k, v, k_cache, v_cache, md, spec)
    if spec.backend == "pallas":
        return _pallas(q, k, v, k_cache, v_cache, md, spec)
    k_cache, v_cache = ref_reshape_and_cache(k, v, k_cache, v_cache, md.slot_mapping,
                                             spec.k_scale, spec.v_scale)
    out = ref_ragged_paged_attention(
        q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc,
        sm_scale=spec.sm_scale, sliding_window=spec.sliding_window,
        k_scale=spec.k_scale, v_scale=spec.v_scale)
    return out, k_cache, v_cache


def paged_attention_qkv(qkv, k_cache, v_cache, md: AttentionMetadata, spec: AttentionSpec,
                        num_q_heads: int):
    """``paged_attention`` on a fused q/k/v array: qkv [T, Hq + 2 Hkv, D] (RoPE applied),
    the q, k and v heads in that order; one device (no tensor parallelism). The Pallas
    decode path reads the three in place, so XLA writes the array once (one fusion:
    RoPE and the matmul's split-K sum) instead of three slices."""
    hkv = (qkv.shape[1] - num_q_heads) // 2
    if spec.backend == "pallas" and md.decode_only and qkv.shape[0] == md.seq_lens.shape[0]:
        from pallas_kernels import dispatch
        return dispatch.decode_qkv(qkv, k_cache, v_cache, md, spec, num_q_heads)
    q, k, v = jnp.split(qkv, [num_q_heads, num_q_heads + hkv], axis=1)
    return paged_attention(q, k, v, k_cache, v_cache, md, spec)


def _pallas(q, k, v, k_cache, v_cache, md, spec):
    # Imported lazily: the kernels module pulls in Pallas/Triton lowering machinery.
    from pallas_kernels import dispatch
    return dispatch.paged_attention(q, k, v, k_cache, v_cache, md, spec)


def _sharded(q, k, v, k_cache, v_cache, md, spec):
    """Attention per tensor-parallel shard (shard_map over `tp`): each device gets its
    Hq / N query heads and the pool heads they read (parallel/mesh.py), and runs the
    unsharded path on them; no collective is needed. k, v arrive split by KV head when
    N divides Hkv; otherwise whole, and each device keeps the one head it uses."""
    n, hkv = tp_size(spec.mesh), k.shape[1]
    local_spec = dataclasses.replace(spec, mesh=None)
    kv_split = hkv % n == 0

    def local(q, k, v, k_cache, v_cache, md):
        if not kv_split:
            head = jax.lax.axis_index(TP) // (n // hkv)
            k = jax.lax.dynamic_slice_in_dim(k, head, 1, axis=1)
            v = jax.lax.dynamic_slice_in_dim(v, head, 1, axis=1)
        return paged_attention(q, k, v, k_cache, v_cache, md, local_spec)

    heads, kv = P(None, TP), (P(None, TP) if kv_split else P())
    return jax.shard_map(
        local, mesh=spec.mesh, in_specs=(heads, kv, kv, P(TP), P(TP), P()),
        out_specs=(heads, P(TP), P(TP)), check_vma=False,
    )(q, k, v, k_cache, v_cache, md)
