"""Quantized projections' host arrays: read from a checkpoint (compressed-tensors,
native FP8) or quantized at load from float weights (online fp8 / int8), in the
layout models/llama.py's QuantLinear holds: weight [N..., K...], scales per output
channel [N...] (or per block, repeated per row: [N..., K/bk]), input_scale a scalar.

Every quantized tensor's dtype and shape, its scales' shapes and values, and act-order
g_idx maps are checked when QuantWeights is built, before the loader moves any weight
to the device.

Letter legend: N output rows of one HF module, K its input width, Nb/Kg block counts.
"""
from __future__ import annotations

import math

import numpy as np

from jaxllm.layers.quantization import int4_kernels
from jaxllm.layers.quantization.rotation import rotate
from jaxllm.layers.quantization.schemes import (FP8_MAX, HF_PARTS, INT8_MAX, QKV,
                                                LinearScheme, QuantConfig)
from jaxllm.models.errors import CheckpointError
from jaxllm.models.registry import ArchConfig

# safetensors dtype names of each stored weight kind, and of scales.
_STORED = {"fp8": ("F8_E4M3",), "int8": ("I8",)}
_FLOAT = ("F32", "F16", "BF16", "F64")
_QUANTIZED_DTYPES = ("F8_E4M3", "F8_E5M2", "I8", "U8", "I32", "I16")


def np_storage(kind: str):
    import ml_dtypes
    return np.dtype(ml_dtypes.float8_e4m3fn) if kind == "fp8" else np.dtype(np.int8)


def module_shapes(arch: ArchConfig, proj: str) -> tuple[tuple, tuple, list[tuple]]:
    """(out_shape, in_shape, [(N, K) of each HF part]) of one jaxllm projection."""
    e, f = arch.hidden_size, arch.intermediate_size
    q, k, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
    return {
        "self_attn.q_proj": ((q, d), (e,), [(q * d, e)]),
        QKV: ((k, q // k + 2, d), (e,), [(q * d, e), (k * d, e), (k * d, e)]),
        "self_attn.kv_proj": ((2, k, d), (e,), [(k * d, e)] * 2),
        "self_attn.o_proj": ((e,), (q, d), [(e, q * d)]),
        "mlp.gate_up_proj": ((2, f), (e,), [(f, e)] * 2),
        "mlp.down_proj": ((e,), (f,), [(e, f)]),
    }[proj]


def join_parts(arch: ArchConfig, proj: str, xs: list[np.ndarray]) -> np.ndarray:
    """The HF parts' per-row arrays [N_part, ...] as one projection's rows: stacked (k/v,
    gate/up), or for qkv_proj grouped by KV head (each one's query heads, then its k
    and v heads: [Hkv, G + 2, D] rows), so that a split by KV head (tensor
    parallelism) gives every shard its own q, k and v."""
    if len(xs) == 1:
        return xs[0]
    if proj != QKV:
        return np.stack(xs)
    h = arch.num_kv_heads
    return np.concatenate([x.reshape((h, -1) + x.shape[1:]) for x in xs], axis=1)


def _split(name: str) -> tuple[str, int, str, str]:
    """'layers.3.self_attn.q_proj.weight' -> ('layers.3.self_attn.q_proj', 3,
    'self_attn.q_proj', 'weight')."""
    module, leaf = name.rsplit(".", 1)
    parts = module.split(".")
    return module, int(parts[1]), ".".join(parts[2:]), leaf


class QuantWeights:
    """`float_array(module_path)`: the float [K..., N...] array of a projection as the
    float loader builds it (online quantization quantizes that)."""

    def __init__(self, arch: ArchConfig, quant: QuantConfig, reader, source: str,
                 float_array=None):
        self.arch, self.quant, self.reader, self.source = arch, quant, reader, source
        self.float_array = float_array
        self._cache: tuple[str, dict] | None = None
        if not quant.online:
            for module, scheme in quant.schemes:
                self._check(module, scheme)
        for name in kv_scale_names(quant, arch.num_layers, reader):
            self._need(name, "the kv_cache_scheme says the KV scales are stored")
            self._float_tensor(name, [(), (1,)], "a per-tensor KV-cache scale")

    def owns(self, name: str) -> bool:
        return name.rsplit(".", 1)[0] in dict(self.quant.schemes)

    # ------------------------------------------------------------ checks
    def _hf(self, layer: int, proj: str) -> list[str]:
        return [f"model.layers.{layer}.{p}" for p in HF_PARTS[proj]]

    def _scale_name(self, part: str, scheme: LinearScheme) -> str:
        inv = f"{part}.weight_scale_inv"
        if scheme.block is not None and self.reader.has(inv):
            return inv     # native FP8 names its block scales weight_scale_inv
        return f"{part}.weight_scale"

    def _check(self, module: str, scheme: LinearScheme) -> None:
        _, layer, proj, _ = _split(module + ".x")
        _, in_shape, hf_shapes = module_shapes(self.arch, proj)
        r = self.reader
        if scheme.group is not None:
            from jaxllm.models.quant_woq import check_part, g_idx_name
            parts = self._hf(layer, proj)
            for part, (n, k) in zip(parts, hf_shapes):
                check_part(r, self.quant.layout, part, n, k, scheme)
            if scheme.g_idx:     # one matmul: one act order for all its parts
                first = r.raw(g_idx_name(self.quant.layout, parts[0]))
                odd = [p for p in parts[1:]
                       if not np.array_equal(r.raw(g_idx_name(self.quant.layout, p)), first)]
                if odd:
                    raise CheckpointError(f"{self.source}: {parts[0]} and {odd[0]} have "
                                          "different g_idx; jaxllm fuses them into one matmul")
            return
        for part, (n, k) in zip(self._hf(layer, proj), hf_shapes):
            w = f"{part}.weight"
            self._need(w)
            if r.dtype(w) not in _STORED[scheme.weight]:
                raise CheckpointError(
                    f"{r.location(w)}: tensor {w} is {r.dtype(w)}, but the quantization_config "
                    f"says {scheme.weight} ({_STORED[scheme.weight][0]})")
            if tuple(r.shape(w)) != (n, k):
                raise CheckpointError(f"{r.location(w)}: tensor {w} has shape "
                                      f"{tuple(r.shape(w))}, which does not fit ({n}, {k}) "
                                      "of this config")
            s = self._scale_name(part, scheme)
            self._need(s)
            if scheme.block is not None:
                bn, bk = scheme.block
                if k % bk:
                    raise CheckpointError(
                        f"{r.location(w)}: {w} has {k} columns, not a multiple of the "
                        f"weight block {bk}; jaxllm needs whole blocks along K")
                want = [(math.ceil(n / bn), k // bk)]
            else:
                want = [(), (1,), (n,), (n, 1)]   # per tensor or per channel
            self._float_tensor(s, want, f"the weight {w} {(n, k)}"
                               + (f" in {scheme.block} blocks" if scheme.block else ""))
            if scheme.act is not None and not scheme.act.dynamic:
                i = f"{part}.input_scale"
                self._need(i)
                self._float_tensor(i, [(), (1,)], "a static per-tensor activation scale")

    def _need(self, name: str, why: str = "the quantization_config says this module "
              "is quantized") -> None:
        if not self.reader.has(name):
            raise CheckpointError(f"{self.source}: missing tensor {name} ({why})")

    def _float_tensor(self, name: str, shapes: list[tuple], what: str) -> None:
        r = self.reader
        shape = tuple(r.shape(name))
        if r.dtype(name) not in _FLOAT:
            raise CheckpointError(f"{r.location(name)}: scale {name} is {r.dtype(name)}; "
                                  "scales must be floating point")
        if shape not in shapes:
            raise CheckpointError(
                f"{r.location(name)}: scale {name} has shape {shape}, which does not match "
                f"{what} (expected {' or '.join(map(str, shapes))})")
        v = r.get(name)
        if not (np.isfinite(v).all() and (v > 0).all()):
            raise CheckpointError(f"{r.location(name)}: scale {name} has values that are "
                                  "not finite and positive")

    # ------------------------------------------------------------ arrays
    def array(self, name: str) -> np.ndarray:
        module, layer, proj, leaf = _split(name)
        if self._cache is None or self._cache[0] != module:
            scheme = self.quant.scheme(module)
            build = self._online if self.quant.online else self._stored
            self._cache = (module, build(module, layer, proj, scheme))
        return self._cache[1][leaf]

    def _stored(self, module, layer, proj, scheme: LinearScheme) -> dict:
        out_shape, in_shape, hf_shapes = module_shapes(self.arch, proj)
        parts = self._hf(layer, proj)
        r = self.reader
        if scheme.group is not None:
            return self._grouped(proj, parts, out_shape, in_shape, hf_shapes, scheme)
        w = [np.asarray(r.raw(f"{p}.weight")) for p in parts]
        weight = join_parts(self.arch, proj, w).reshape(out_shape + in_shape)
        scales = []
        for p, (n, _) in zip(parts, hf_shapes):
            s = r.get(self._scale_name(p, scheme))
            if scheme.block is not None:
                s = np.repeat(s, scheme.block[0], axis=0)[:n]      # [N, Kg]
            else:
                s = np.broadcast_to(s.reshape(-1), (n,))          # per channel
            scales.append(s)
        lead = out_shape if scheme.block is None else out_shape + (scales[0].shape[-1],)
        arrays = {"weight": weight, "weight_scale": np.ascontiguousarray(
            join_parts(self.arch, proj, scales).reshape(lead), np.float32)}
        if scheme.act is not None and not scheme.act.dynamic:
            # One input feeds the fused parts; vLLM takes the largest of their scales
            # (calibration of one input gives them all the same one).
            arrays["input_scale"] = np.asarray(
                max(float(r.get(f"{p}.input_scale").reshape(-1)[0]) for p in parts), np.float32)
        if scheme.act is not None and not scheme.act.symmetric:
            arrays["azp_adj"] = azp_adj(weight, len(in_shape))
        return arrays

    def _grouped(self, proj, parts, out_shape, in_shape, hf_shapes, scheme) -> dict:
        from jaxllm.models.quant_woq import load_part, pack_nibbles
        got = [load_part(self.reader, self.quant.layout, p, n, k, scheme)
               for p, (n, k) in zip(parts, hf_shapes)]

        def join(i):
            return join_parts(self.arch, proj, [g[i] for g in got])
        q = join(0)
        if scheme.weight == "uint4":
            q = pack_nibbles(q)
        stored = in_shape[:-1] + (in_shape[-1] // 2,) if scheme.weight == "uint4" else in_shape
        q = q.reshape(out_shape + stored)
        groups = got[0][1].shape[-1]
        arrays = {"weight": q,
                  "weight_scale": join(1).reshape(out_shape + (groups,)),
                  "weight_zero_point": join(2).reshape(out_shape + (groups,))}
        if int4_kernels.is_packed(scheme, math.prod(out_shape), math.prod(in_shape)):
            arrays["weight_scale"] = int4_kernels.pack(arrays["weight_scale"],
                                                       arrays.pop("weight_zero_point"))
        if scheme.g_idx:      # the parts' act orders are equal (_check)
            arrays["g_idx"] = got[0][3]
        return arrays

    def _online(self, module, layer, proj, scheme: LinearScheme) -> dict:
        _, in_shape, _ = module_shapes(self.arch, proj)
        nk = len(in_shape)
        w = self.float_array(module)                       # [K..., N...]
        w = np.moveaxis(w, tuple(range(nk)), tuple(range(w.ndim - nk, w.ndim)))
        if scheme.rotate:               # the layer rotates its input the same way
            w = rotate(w, nk, scheme.rotate)
        q, s = quantize_per_channel(w, nk, scheme.weight)
        arrays = {"weight": q, "weight_scale": s}
        if scheme.act is not None and not scheme.act.symmetric:
            arrays["azp_adj"] = azp_adj(q, nk)
        return arrays


def azp_adj(q: np.ndarray, nk: int) -> np.ndarray:
    """The int8 weight's sums over K [N...] (vLLM's azp_adj), which an asymmetric
    input's zero point multiplies; exact in f32 up to 131,072 columns (128 K < 2**24)."""
    return q.astype(np.int64).sum(axis=tuple(range(q.ndim - nk, q.ndim))).astype(np.float32)


def quantize_per_channel(w: np.ndarray, nk: int, kind: str):
    """RTN: w [N..., K...] float -> (quantized [N..., K...], f32 scale [N...]), one
    symmetric scale per output channel (amax / 448 for fp8, amax / 127 for int8)."""
    w = np.asarray(w, np.float32)
    axes = tuple(range(w.ndim - nk, w.ndim))
    amax = np.abs(w).max(axis=axes)
    scale = np.maximum(amax / (FP8_MAX if kind == "fp8" else INT8_MAX), 1e-12).astype(np.float32)
    y = w / scale.reshape(scale.shape + (1,) * nk)
    if kind == "fp8":
        q = np.clip(y, -FP8_MAX, FP8_MAX).astype(np_storage("fp8"))
    else:
        q = np.clip(np.round(y), -INT8_MAX - 1, INT8_MAX).astype(np.int8)
    return q, scale


def kv_scale_names(quant: QuantConfig | None, num_layers: int, reader) -> list[str]:
    """The checkpoint's fp8 KV-cache scales (kv_cache_scheme), layer by layer: k, v;
    self_attn.k_scale / v_scale, or older llm-compressor's k_proj / v_proj
    .output_scale where only those are stored (vLLM reads both)."""
    if quant is None or not quant.kv_scales:
        return []
    names = []
    for i in range(num_layers):
        for kv in "kv":
            name, old = (f"model.layers.{i}.self_attn.{kv}_scale",
                         f"model.layers.{i}.self_attn.{kv}_proj.output_scale")
            names.append(old if not reader.has(name) and reader.has(old) else name)
    return names


def kv_cache_scales(reader, quant: QuantConfig | None, num_layers: int):
    """((k_scale, v_scale) per layer) as floats, or None without a kv_cache_scheme;
    QuantWeights has checked them."""
    names = kv_scale_names(quant, num_layers, reader)
    values = [float(reader.get(n).reshape(-1)[0]) for n in names]
    return tuple(zip(values[0::2], values[1::2])) or None


def check_float_tensors(reader, quant: QuantConfig | None, source: str) -> None:
    """A tensor stored as integers or fp8 outside the quantized projections would be
    read as float weights (raw quantized values): refuse it."""
    quantized = set()
    if quant is not None and not quant.online:
        for module, _ in quant.schemes:
            _, layer, proj, _ = _split(module + ".x")
            quantized.update(f"model.layers.{layer}.{p}." for p in HF_PARTS[proj])
    for name in reader.names():
        if not name.endswith((".weight", ".bias")):    # what the float loader reads
            continue
        if reader.dtype(name) in _QUANTIZED_DTYPES and not any(
                name.startswith(q) for q in quantized):
            how = ("config.json has no quantization_config" if quant is None else
                   f"the quantization_config ({quant.method}) does not quantize this module")
            raise CheckpointError(f"{reader.location(name)}: tensor {name} is stored as "
                                  f"{reader.dtype(name)}, but {how}; jaxllm will not read "
                                  "quantized values as weights")


def dummy_fill(name: str, dtype, quant: QuantConfig | None = None) -> tuple[str, float] | None:
    """(fill, value) of a quantized parameter's random stand-in: fp8 / int8 weights
    uniform in +-127 and scales 0.035 / 127, so weight * scale spans +-0.035 like the
    float dummy weights (uint4: random bytes, zero 8, also packed with the scales);
    None for float parameters."""
    import jax.numpy as jnp
    leaf = [p for p in name.split(".") if p and p != "value"][-1]
    if np.dtype(dtype) in (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.int8)):
        return "quantized", INT8_MAX
    if np.dtype(dtype) == np.dtype(jnp.uint8):    # uint4 pairs: every byte value
        return "bytes", 255.0
    if leaf == "weight_zero_point":               # uint4's midpoint
        return "const", 8.0
    if leaf == "azp_adj":     # the sums of weights uniform in +-127: zero on average
        return "const", 0.0
    # uint4 group scales: 0.035 / 8 rounded to bf16, so scales packed in bf16 rows
    # (int4_kernels.py; zero-point rows 8) are the same numbers as f32 ones
    g_scale = float(np.float32(0.035 / 8).astype(jnp.bfloat16))
    if leaf == "weight_scale" and np.dtype(dtype) == np.dtype(jnp.bfloat16):
        return "packed", g_scale
    if leaf == "weight_scale":
        module = ".".join([p for p in name.split(".") if p and p != "value"][:-1])
        scheme = quant.scheme(module) if quant is not None else None
        grouped = scheme is not None and scheme.group is not None
        return "const", g_scale if grouped else 0.035 / INT8_MAX
    if leaf == "input_scale":
        return "const", 4.0 / FP8_MAX
    return None
