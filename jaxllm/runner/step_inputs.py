"""The int32 inputs of one model step, packed into one device buffer.

Letter legend: T padded tokens, S padded sequences, W block-table width.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import numpy as np
from jax._src import core as jax_core
from jax._src.lib import xla_client

from jaxllm.layers.attention import AttentionMetadata

_INPUT_FIELDS = ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens",
                 "query_start_loc", "logits_indices")


@dataclass
class StepInputs:
    """A step's int32 inputs packed in ONE device buffer (fields in _INPUT_FIELDS order).

    One transfer per step instead of seven, and one new buffer per step. On the H200,
    a 32-layer model with tiny dims (the 8B step's buffer count) took 2.2 ms of host
    time per launch with seven new input buffers against 0.9 ms with unchanged ones;
    packing took the 8B step's dispatch from 2.80 to 2.26 ms. Likely why: XLA
    runs the step as CUDA graphs and updates each node that reads a buffer whose
    address changed (with separate inputs, every layer's RoPE, KV-write and attention
    nodes); packed, only the few small copies that unpack it read the new buffer."""
    packed: jax.Array
    num_tokens: int = dataclasses.field(metadata=dict(static=True))
    num_seqs: int = dataclasses.field(metadata=dict(static=True))
    width: int = dataclasses.field(metadata=dict(static=True))
    decode_only: bool = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def pack(cls, arrays: dict, decode_only: bool, sharding) -> "StepInputs":
        t, (s, w) = len(arrays["input_ids"]), arrays["block_tables"].shape
        packed = np.concatenate([np.ravel(arrays[k]) for k in _INPUT_FIELDS], dtype=np.int32)
        return cls(put_replicated(packed, sharding), t, s, w, decode_only)

    def unpack(self):
        """(input_ids [T], positions [T], AttentionMetadata, logits_indices [S])."""
        t, s, w = self.num_tokens, self.num_seqs, self.width
        sizes = (t, t, t, s * w, s, s + 1, s)
        offsets = np.cumsum((0,) + sizes)
        f = {k: self.packed[offsets[i]:offsets[i + 1]] for i, k in enumerate(_INPUT_FIELDS)}
        md = AttentionMetadata(
            slot_mapping=f["slot_mapping"], block_tables=f["block_tables"].reshape(s, w),
            seq_lens=f["seq_lens"], query_start_loc=f["query_start_loc"],
            decode_only=self.decode_only)
        return f["input_ids"], f["positions"], md, f["logits_indices"]


jax.tree_util.register_dataclass(
    StepInputs, data_fields=["packed"],
    meta_fields=["num_tokens", "num_seqs", "width", "decode_only"])


def put_replicated(x: np.ndarray, sharding) -> jax.Array:
    """``jax.device_put(x, sharding)`` for an int32 host array and a replicated
    sharding of this process's devices, through the transfer call jax itself ends in:
    the same array, without device_put's Python layers (tree handling, checks,
    dispatch), which took ~0.2 of the H200 host's ~0.46 ms per upload. Anything else
    (another dtype, a split sharding, devices of other processes, whose inputs
    device_put checks are equal everywhere, or a jax without that call) takes
    device_put."""
    devices = getattr(sharding, "_addressable_device_assignment", None)
    put = getattr(xla_client, "batched_device_put", None)
    if (devices is None or put is None or x.dtype != np.int32
            or not getattr(sharding, "is_fully_replicated", False)
            or not getattr(sharding, "is_fully_addressable", False)):
        return jax.device_put(x, sharding)
    return put(jax_core.ShapedArray(x.shape, x.dtype), sharding, [x] * len(devices),
               list(devices), True)
