"""Host buffers for the grammar bitmask that the device copies from directly.

llguidance writes each step's masks through a raw pointer. Into a NumPy array, the
upload first copies the whole mask (4 MB at 256 rows of a 128k vocabulary) into the
runtime's pinned staging memory on the thread that uploads, and that thread then
takes the GIL back from the engine thread. Into a buffer in the device's pinned host
memory (a jax array there, written through its own pointer), the upload is a DMA the
device runs, and the thread that starts it holds the GIL only for the call.

A buffer is rewritten only once the step that read it has been read back (the
manager's MaskBuffers keep two per height and use them in turn), so the device's copy
never races the next write.
"""
from __future__ import annotations

import ctypes

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from jaxllm.runner.step_inputs import put_replicated


def host_bitmask(shape: tuple[int, int], sharding, pinned: bool = True):
    """(writable host view i32[shape], all ones; the buffer upload_bitmask takes). In
    the device's pinned host memory where the sampler runs on one device that has
    it; otherwise a NumPy array, both view and buffer."""
    device = _single_device(sharding) if pinned else None
    if device is None:
        array = np.full(shape, -1, np.int32)
        return array, array
    buffer = jax.device_put(np.full(shape, -1, np.int32),
                            SingleDeviceSharding(device, memory_kind="pinned_host"))
    buffer.block_until_ready()
    raw = (ctypes.c_int32 * (shape[0] * shape[1])).from_address(buffer.unsafe_buffer_pointer())
    return np.ctypeslib.as_array(raw).reshape(shape), buffer


def upload_bitmask(buffer, sharding):
    """A host_bitmask buffer (or any host i32 array) on the sampler's devices; one
    there already as it is."""
    if isinstance(buffer, np.ndarray):
        return put_replicated(buffer, sharding)
    if buffer.sharding.memory_kind == "pinned_host":
        return jax.device_put(buffer, sharding)
    return buffer


def _single_device(sharding):
    devices = sharding.addressable_devices
    if len(devices) != 1 or len(sharding.device_set) != 1:
        return None
    device = next(iter(devices))
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except Exception:            # noqa: BLE001 - a backend without memory spaces
        return None
    return device if "pinned_host" in kinds else None
