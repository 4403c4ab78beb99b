"""Weight-only integer checkpoints: AWQ (GEMM packing), GPTQ (v1 and v2 zeros, act
order with g_idx) and compressed-tensors pack-quantized, 4 or 8 bits, grouped scales
and zero points. Each layout is read into one form, an unsigned value per weight
q [N, K], per-group scale and zero [N, G] and an optional g_idx [K], dequantized
in the layer as (q - zero) * scale. No jax here.

Layouts (as their producers document them):
  GPTQ: qweight int32 [K*b/32, N] (packed along K, low bits first), qzeros int32
    [G, N*b/32] (along N), scales [G, N], g_idx [K]; v1 ("gptq") stores zero - 1.
  AWQ GEMM: qweight int32 [K, N/8] and qzeros [G, N/8], nibble i holding column
    (0, 2, 4, 6, 1, 3, 5, 7)[i] of its eight; scales [G, N].
  compressed-tensors: weight_packed int32 [N, K*b/32] (along K, value + 2**(b-1)),
    weight_scale [N, G], weight_zero_point packed along N when asymmetric,
    weight_shape, weight_g_idx with group act order.
"""
from __future__ import annotations

import numpy as np

from jaxllm.layers.quantization.schemes import LinearScheme, QuantConfig
from jaxllm.models.errors import CheckpointError
from jaxllm.models.quant_layers import layer_schemes, mixed_skip_error, unless_skipped

_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)      # nibble i holds column _AWQ_ORDER[i]


def _kind(bits, where: str) -> str:
    if bits not in (4, 8):
        raise CheckpointError(f"{where}: bits={bits!r} is not supported (4 or 8)")
    return "uint4" if bits == 4 else "uint8"


def _group(size, where: str) -> int:
    if size == -1:
        return 1 << 30           # one group over all of K: per-channel scales
    if size not in (32, 64, 128, 256):
        raise CheckpointError(f"{where}: group_size={size!r} is not supported "
                              "(32, 64, 128, 256 or -1)")
    return int(size)


def woq_config(method: str, qc: dict, num_layers: int, source: str) -> QuantConfig:
    where = f"{source}: quantization_config"
    if method == "gptq":
        kind = _kind(qc.get("bits"), where)
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise CheckpointError(f"{where}.checkpoint_format={fmt!r} is not supported "
                                  "(gptq, gptq_v2)")
        if qc.get("lm_head"):
            raise CheckpointError(f"{where}.lm_head=true: a quantized lm_head is not supported")
        if qc.get("dynamic"):    # GPTQModel's per-module overrides of bits / group_size
            raise CheckpointError(f"{where}.dynamic is set: per-module GPTQ settings are not "
                                  "supported (one bits and group_size for every module)")
        scheme = LinearScheme(kind, group=_group(qc.get("group_size", 128), where),
                              g_idx=bool(qc.get("desc_act")))
        layout, skip = fmt, []
    else:
        bits = qc.get("bits", qc.get("w_bit"))
        if bits != 4:
            raise CheckpointError(f"{where}: bits={bits!r} is not supported for awq (4)")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise CheckpointError(f"{where}.version={version!r} is not supported (gemm)")
        if not qc.get("zero_point", True):
            raise CheckpointError(f"{where}.zero_point=false is not supported")
        scheme = LinearScheme("uint4", group=_group(qc.get("group_size", 128), where))
        layout, skip = "awq", list(qc.get("modules_to_not_convert") or [])
    schemes = layer_schemes(num_layers, unless_skipped(scheme, skip), mixed_skip_error(where))
    return QuantConfig(method, False, tuple(schemes), layout)


def pack_quantized_scheme(w: dict, act, where: str) -> LinearScheme:
    """A compressed-tensors pack-quantized config group (weight only)."""
    if act:
        raise CheckpointError(f"{where}.input_activations is set: pack-quantized weights "
                              "with quantized activations are not supported (W4A16/W8A16 are)")
    if w.get("type", "int") != "int":
        raise CheckpointError(f"{where}.weights.type={w.get('type')!r} is not supported (int)")
    if w.get("dynamic"):
        raise CheckpointError(f"{where}.weights.dynamic is set; weights need stored scales")
    kind = _kind(w.get("num_bits"), f"{where}.weights")
    strategy = w.get("strategy")
    if strategy == "group":
        group = _group(w.get("group_size"), f"{where}.weights")
    elif strategy == "channel":
        group = 1 << 30
    else:
        raise CheckpointError(f"{where}.weights.strategy={strategy!r} is not supported for "
                              "pack-quantized (group, channel)")
    return LinearScheme(kind, group=group, g_idx=w.get("actorder") == "group",
                        zero_point=w.get("symmetric") is False)


# ---------------------------------------------------------------- tensors

def unpack(p: np.ndarray, bits: int, axis: int, order=None) -> np.ndarray:
    """int32 words -> unsigned values, `32 // bits` per word along `axis`, low bits
    first (or in `order`: value j of a word is field order.index(j))."""
    per = 32 // bits
    shifts = np.arange(per, dtype=np.uint32) * bits
    v = (p.astype(np.uint32)[..., None] >> shifts) & ((1 << bits) - 1)   # [..., per]
    if order is not None:
        v = v[..., np.argsort(order)]
    if axis == 1:
        v = v.reshape(p.shape[0], -1)
    else:
        v = v.transpose(0, 2, 1).reshape(-1, p.shape[1])
    return v.astype(np.uint8)


def _bits(scheme: LinearScheme) -> int:
    return 4 if scheme.weight == "uint4" else 8


def part_tensors(layout: str, part: str, n: int, k: int, scheme: LinearScheme) -> dict:
    """name -> expected (shape, dtypes) of one HF module's tensors."""
    b = _bits(scheme)
    g = -(-k // scheme.group)
    ints, floats = ("I32",), ("F16", "BF16", "F32")
    if layout in ("gptq", "gptq_v2"):
        out = {f"{part}.qweight": ((k * b // 32, n), ints),
               f"{part}.qzeros": ((g, n * b // 32), ints), f"{part}.scales": ((g, n), floats)}
        if scheme.g_idx:
            out[g_idx_name(layout, part)] = ((k,), ints)
        return out
    if layout == "awq":
        return {f"{part}.qweight": ((k, n // 8), ints), f"{part}.qzeros": ((g, n // 8), ints),
                f"{part}.scales": ((g, n), floats)}
    out = {f"{part}.weight_packed": ((n, k * b // 32), ints),
           f"{part}.weight_scale": ((n, g), floats)}
    if scheme.g_idx:
        out[g_idx_name(layout, part)] = ((k,), ints)
    return out


def g_idx_name(layout: str, part: str) -> str:
    """The act-order map's tensor name in this layout."""
    return f"{part}.g_idx" if layout in ("gptq", "gptq_v2") else f"{part}.weight_g_idx"


def check_part(reader, layout: str, part: str, n: int, k: int, scheme: LinearScheme) -> None:
    b = _bits(scheme)
    if k % (32 // b) or n % 8:
        raise CheckpointError(f"{reader.location(part + '.x')}: {part} is ({n}, {k}); packed "
                              "weights need widths that are multiples of 8")
    for name, (shape, dtypes) in part_tensors(layout, part, n, k, scheme).items():
        if not reader.has(name):
            raise CheckpointError(f"{reader.location(name)}: missing tensor {name} (the "
                                  f"quantization_config says this module is {layout} packed)")
        got = tuple(reader.shape(name))
        if got != shape or reader.dtype(name) not in dtypes:
            raise CheckpointError(
                f"{reader.location(name)}: tensor {name} is {reader.dtype(name)} {got}, which "
                f"does not fit the weight ({n}, {k}) in {b}-bit groups of "
                f"{min(scheme.group, k)} (expected {dtypes[0]} {shape})")
    groups = -(-k // scheme.group)
    zp = f"{part}.weight_zero_point"
    if layout == "pack" and scheme.zero_point and not reader.has(zp):
        raise CheckpointError(f"{reader.location(part + '.weight_packed')}: the config "
                              f"says asymmetric weights (weights.symmetric=false), but "
                              f"{zp} is missing")
    if layout == "pack" and reader.has(zp):
        want = (n * b // 32, groups)
        if tuple(reader.shape(zp)) != want:
            raise CheckpointError(f"{reader.location(zp)}: tensor {zp} has shape "
                                  f"{tuple(reader.shape(zp))}, expected {want}")
    # Values too, here and not when the part is unpacked: by then the loader has moved
    # earlier projections to the device, and the launcher's check never unpacks.
    scale = f"{part}.weight_scale" if layout == "pack" else f"{part}.scales"
    s = reader.get(scale)
    if not (np.isfinite(s).all() and (s > 0).all()):
        raise CheckpointError(f"{reader.location(scale)}: scale {scale} has values that are "
                              "not finite and positive")
    if scheme.g_idx:
        name = g_idx_name(layout, part)
        g_idx = np.asarray(reader.raw(name))
        if g_idx.min() < 0 or g_idx.max() >= groups:
            raise CheckpointError(f"{reader.location(name)}: g_idx of {part} names groups "
                                  f"outside 0..{groups - 1}")


def load_part(reader, layout: str, part: str, n: int, k: int, scheme: LinearScheme):
    """(q [N, K] uint8, scale [N, G] f32, zero [N, G] f32, g_idx [K] int32 or None), of
    a part check_part has passed."""
    b = _bits(scheme)
    raw, get = reader.raw, reader.get
    g_idx = None
    if layout in ("gptq", "gptq_v2"):
        q = unpack(np.asarray(raw(f"{part}.qweight")), b, 0).T
        z = unpack(np.asarray(raw(f"{part}.qzeros")), b, 1).T.astype(np.float32)
        z = z + 1 if layout == "gptq" else z       # v1 stores zero - 1
        s = get(f"{part}.scales").T
        if scheme.g_idx:
            g_idx = np.asarray(raw(g_idx_name(layout, part)), np.int32)
    elif layout == "awq":
        q = unpack(np.asarray(raw(f"{part}.qweight")), 4, 1, _AWQ_ORDER).T
        z = unpack(np.asarray(raw(f"{part}.qzeros")), 4, 1, _AWQ_ORDER).T.astype(np.float32)
        s = get(f"{part}.scales").T
    else:
        q = unpack(np.asarray(raw(f"{part}.weight_packed")), b, 1)
        s = get(f"{part}.weight_scale")
        zp = f"{part}.weight_zero_point"
        if reader.has(zp):
            z = unpack(np.asarray(raw(zp)), b, 0).astype(np.float32)
        else:
            z = np.full(s.shape, 1 << (b - 1), np.float32)
        if scheme.g_idx:
            g_idx = np.asarray(raw(g_idx_name(layout, part)), np.int32)
    return np.ascontiguousarray(q), np.ascontiguousarray(s, np.float32), \
        np.ascontiguousarray(z, np.float32), g_idx


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """uint4 values [..., K] -> bytes [..., K/2], the even column in the low nibble."""
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
