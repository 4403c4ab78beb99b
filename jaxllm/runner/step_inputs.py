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
    """A step's int32 inputs packed in ONE device buffer (fields in _INPUT_FIELDS order):
    one transfer per step instead of seven; InputStager gives it a fixed address."""
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


# The new inputs copied into the buffer of the last ones (donated: its address stays),
# the first ones into a buffer of the runtime's own (an upload may be host memory the
# runtime cannot reuse, as on the CPU).
_copy_into = jax.jit(lambda old, new: new, donate_argnums=0, keep_unused=True)
_copy = jax.jit(lambda new: new + 0)


class InputStager:
    """Each step's packed inputs in one device buffer per size, its address fixed.

    XLA runs a step as a CUDA graph and, before a launch, records again every command
    that reads a buffer whose address changed since the last launch; every layer's
    RoPE, KV-write and attention read the inputs. So a step's new upload is copied
    into the buffer the last step of that size read (a program of one copy, queued
    after that step), and the step reads that. On the H200, with new uploads read
    directly (and nothing else between launches), a launch recorded 333 of the decode
    step's 424 commands again (scripts/cmdbuf_updates.py --vlog)."""

    def __init__(self):
        self.buffers: dict[int, jax.Array] = {}

    def stage(self, inputs: StepInputs) -> StepInputs:
        n = inputs.packed.shape[0]
        old = self.buffers.pop(n, None)
        packed = _copy(inputs.packed) if old is None else _copy_into(old, inputs.packed)
        self.buffers[n] = packed
        return dataclasses.replace(inputs, packed=packed)

    def warm_up(self, inputs: StepInputs) -> None:
        """Both copies of this size run once (compiled, and in jax's cache for the next
        start), unless a buffer of this size exists (they ran); `inputs` stay the
        caller's. The KV sizing and the warm-up each lower every step: once is enough."""
        if inputs.packed.shape[0] not in self.buffers:
            for _ in range(2):
                self.stage(inputs)


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
