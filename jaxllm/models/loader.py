"""Checkpoint loading: HF folders (config.json + safetensors) and GGUF files, or random
(`dummy`) weights built on the device. Arrays go straight into their target sharding.

Letter legend as in models/llama.py: E hidden, Q/K heads, D head dim, F MLP width, V vocab.

jax and flax are imported by the functions that use them: `jaxllm serve`'s server
process checks the model's config through this module, and importing them there would
hold up the engine process's spawn by a second or more.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from jaxllm.models.errors import CheckpointError
from jaxllm.models.registry import ArchConfig, arch_from_hf_config

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from flax import nnx


@dataclass
class LoadedModel:
    arch: ArchConfig
    graphdef: nnx.GraphDef
    state: nnx.State
    source: str
    quant: object = None     # the QuantConfig the model was built with, or None
    kv_scales: tuple | None = None   # the checkpoint's fp8 KV scales: (k, v) per layer


# Target parameter (path under the model, {i} = layer) <- HF tensor names and how
# they combine. Each function gets the HF tensors in the listed order (numpy, f32).
def _heads(n_attr):
    return lambda a, w: w.reshape(getattr(a, n_attr), a.head_dim, a.hidden_size).transpose(2, 0, 1)


def _kv(a, k, v):
    return np.stack([x.reshape(a.num_kv_heads, a.head_dim, a.hidden_size) for x in (k, v)]
                    ).transpose(3, 0, 1, 2)


def _qkv(a, q, k, v):
    """[E, Hkv, G + 2, D]: the quantized qkv_proj's rows (quant_loader.join_parts) as a
    float [K, N...] array, for online quantization."""
    from jaxllm.models.quant_loader import QKV, join_parts
    rows = join_parts(a, QKV, [q, k, v])
    return rows.reshape(a.num_kv_heads, -1, a.head_dim, a.hidden_size).transpose(3, 0, 1, 2)


WEIGHT_MAP: dict[str, tuple[tuple[str, ...], Callable]] = {
    "embed_tokens": (("model.embed_tokens.weight",), lambda a, w: w),
    "norm.weight": (("model.norm.weight",), lambda a, w: w),
    "lm_head": (("lm_head.weight",), lambda a, w: w.T),
    "layers.{i}.input_layernorm.weight":
        (("model.layers.{i}.input_layernorm.weight",), lambda a, w: w),
    "layers.{i}.post_attention_layernorm.weight":
        (("model.layers.{i}.post_attention_layernorm.weight",), lambda a, w: w),
    "layers.{i}.self_attn.q_proj":
        (("model.layers.{i}.self_attn.q_proj.weight",), _heads("num_heads")),
    "layers.{i}.self_attn.kv_proj": (("model.layers.{i}.self_attn.k_proj.weight",
                                      "model.layers.{i}.self_attn.v_proj.weight"), _kv),
    "layers.{i}.self_attn.qkv_proj": (tuple(f"model.layers.{{i}}.self_attn.{p}_proj.weight"
                                            for p in "qkv"), _qkv),
    "layers.{i}.self_attn.o_proj": (
        ("model.layers.{i}.self_attn.o_proj.weight",),
        lambda a, w: w.T.reshape(a.num_heads, a.head_dim, a.hidden_size)),
    "layers.{i}.self_attn.q_bias": (
        ("model.layers.{i}.self_attn.q_proj.bias",),
        lambda a, b: b.reshape(a.num_heads, a.head_dim)),
    "layers.{i}.self_attn.kv_bias": (
        ("model.layers.{i}.self_attn.k_proj.bias", "model.layers.{i}.self_attn.v_proj.bias"),
        lambda a, k, v: np.stack([k, v]).reshape(2, a.num_kv_heads, a.head_dim)),
    "layers.{i}.self_attn.q_norm.weight":
        (("model.layers.{i}.self_attn.q_norm.weight",), lambda a, w: w),
    "layers.{i}.self_attn.k_norm.weight":
        (("model.layers.{i}.self_attn.k_norm.weight",), lambda a, w: w),
    "layers.{i}.mlp.gate_up_proj": (("model.layers.{i}.mlp.gate_proj.weight",
                                     "model.layers.{i}.mlp.up_proj.weight"),
                                    lambda a, g, u: np.stack([g.T, u.T], axis=1)),
    "layers.{i}.mlp.down_proj": (("model.layers.{i}.mlp.down_proj.weight",), lambda a, w: w.T),
}


def resolve_dtype(name: str, hf_dtype: str | None = None):
    import jax.numpy as jnp
    if name == "auto":
        name = {"float32": "float32", "float16": "float16"}.get(hf_dtype or "", "bfloat16")
    return {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}[name]


def abstract_model(arch: ArchConfig, dtype, quant=None):
    """(graphdef, abstract state) without allocating anything; `quant`: a
    QuantConfig (layers/quantization/schemes.py) or None."""
    from flax import nnx
    from jaxllm.models.llama import LlamaForCausalLM   # the one decoder class (Llama family)
    model = nnx.eval_shape(lambda: LlamaForCausalLM(arch, dtype, rngs=nnx.Rngs(0), quant=quant))
    return nnx.split(model)


def param_path(path) -> str:
    return ".".join(str(p) for p in path)


def _template(name: str) -> tuple[str, int | None]:
    parts = name.split(".")
    if len(parts) > 1 and parts[0] == "layers":
        return ".".join(["layers", "{i}", *parts[2:]]), int(parts[1])
    return name, None


def load_state(arch: ArchConfig, dtype, reader, shardings: Callable, source: str,
               quant=None):
    """Fill every parameter of the model from `reader.get(hf_name)` (numpy float32);
    `reader.location(hf_name)` names the file holding a tensor, for errors.

    `shardings(path, logical_axes, shape)` gives each parameter's jax.sharding.Sharding.
    `quant`: a QuantConfig; its projections come from models/quant_loader.py, which
    checks every quantized tensor before anything is moved to the device.
    """
    import jax
    from flax import nnx
    graphdef, abstract = abstract_model(arch, dtype, quant)
    qw = None
    if quant is not None:
        from jaxllm.models.quant_loader import QuantWeights
        qw = QuantWeights(arch, quant, reader, source,
                          lambda module: _float_array(arch, reader, module))
    leaves = []
    for path, var in nnx.to_flat_state(abstract):
        name = param_path(path)
        if qw is not None and qw.owns(name):
            sharding = shardings(path, var.get_metadata().get("out_sharding"),
                                 var.get_value().shape)
            leaves.append((path, var.replace(value=jax.device_put(qw.array(name), sharding))))
            continue
        tmpl, layer = _template(name)
        if tmpl not in WEIGHT_MAP:
            raise CheckpointError(f"{source}: no weight mapping for parameter {name}")
        hf_names, combine = WEIGHT_MAP[tmpl]
        hf_names = [n.format(i=layer) for n in hf_names]
        tensors = [reader.get(n) for n in hf_names]
        want = var.get_value().shape
        try:
            array = combine(arch, *tensors)
        except ValueError:   # a reshape that cannot work: report it like a mismatch
            array = None
        if array is None or tuple(array.shape) != tuple(want):
            bad = _first_mismatch(arch, hf_names, tensors, combine)
            raise CheckpointError(
                f"{reader.location(bad)}: tensor {bad} has shape "
                f"{tuple(tensors[hf_names.index(bad)].shape)}, which does not fit parameter "
                f"{name} {tuple(want)} of this config")
        sharding = shardings(path, var.get_metadata().get("out_sharding"), want)
        value = jax.device_put(np.asarray(array, dtype=np.dtype(dtype)), sharding)
        leaves.append((path, var.replace(value=value)))
    return graphdef, nnx.from_flat_state(leaves)


def _float_array(arch: ArchConfig, reader, module: str) -> np.ndarray:
    """A projection's float weight as WEIGHT_MAP builds it (for online quantization)."""
    tmpl, layer = _template(module)
    hf_names, combine = WEIGHT_MAP[tmpl]
    return combine(arch, *[reader.get(n.format(i=layer)) for n in hf_names])


def _first_mismatch(arch, names, tensors, combine):
    """Which of several source tensors has the odd shape (the one unlike its twin, or
    the first)."""
    if len(tensors) == 2 and tensors[0].shape != tensors[1].shape:
        expected = max((t.shape for t in tensors), key=lambda sh: sum(
            t.shape == sh for t in tensors))
        for n, t in zip(names, tensors):
            if t.shape != expected:
                return n
    return names[0]


def dummy_state(arch: ArchConfig, dtype, shardings: Callable, seed: int = 0, quant=None):
    """Random weights of the model's shape, built on the device(s) already sharded.

    Like vLLM's dummy weights: matrices uniform in +-0.035 (std ~0.02), norm weights
    1, biases 0. One small generator is compiled per distinct (shape, dtype,
    sharding) -- about ten for a Llama -- instead of one program running every
    initializer of the model, which takes minutes to compile for an 8B model."""
    import jax
    from flax import nnx
    from jaxllm.models.quant_loader import dummy_fill
    graphdef, abstract = abstract_model(arch, dtype, quant)
    key = jax.random.key(seed)
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    variables = jax.tree.leaves(abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))
    generators, arrays = {}, []
    for (path, sds), var in zip(flat, variables):
        name = param_path(p.key if hasattr(p, "key") else p for p in path)
        fill = "uniform" if len(sds.shape) > 1 else ("ones" if "norm" in name else "zeros")
        fill = dummy_fill(name, sds.dtype, quant) or fill   # quantized weights, scales
        sharding = shardings(None, var.get_metadata().get("out_sharding"), sds.shape)
        spec = (sds.shape, sds.dtype, fill, sharding)
        if spec not in generators:
            generators[spec] = jax.jit(functools.partial(
                _dummy_array, shape=sds.shape, dtype=sds.dtype, fill=fill),
                out_shardings=sharding)
        # keyed by name: a parameter's values do not depend on which others exist
        arrays.append(generators[spec](jax.random.fold_in(key, zlib.crc32(name.encode()))))
    return graphdef, jax.tree.unflatten(treedef, arrays)


def _dummy_array(key, *, shape, dtype, fill):
    import jax
    import jax.numpy as jnp
    if fill in ("ones", "zeros"):
        return (jnp.ones if fill == "ones" else jnp.zeros)(shape, dtype)
    if isinstance(fill, tuple):    # quant_loader.dummy_fill's
        kind, value = fill
        if kind == "const":
            return jnp.full(shape, value, dtype)
        if kind == "packed":      # int4_kernels.py: scales in even rows, zero points (8) odd
            return jnp.tile(jnp.asarray([[value], [8.0]], dtype), (shape[0] // 2, shape[1]))
        lo = 0.0 if kind == "bytes" else -value
        return jnp.round(jax.random.uniform(key, shape, jnp.float32, lo, value)).astype(dtype)
    return jax.random.uniform(key, shape, dtype, -0.035, 0.035)


# ---------------------------------------------------------------- HF folder

def read_hf_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"{folder}: no config.json (is this an HF model folder?)")
    with open(path) as f:
        return json.load(f)


_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": "bfloat16", "F64": np.float64,
              "I64": np.int64, "I32": np.int32, "I8": np.int8, "U8": np.uint8,
              "I16": np.int16, "F8_E4M3": "float8_e4m3fn"}


def _open_safetensors(path: str, dtypes: dict | None = None) -> dict[str, np.ndarray]:
    """name -> memory-mapped array (and into `dtypes`, name -> the stored dtype's
    name). The format is a little-endian u64 header length, a
    JSON header and raw data; parsing it here keeps bf16 readable without torch."""
    import ml_dtypes
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = _ST_DTYPES.get(info["dtype"])
        if dt is None:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        dt = np.dtype(getattr(ml_dtypes, dt)) if isinstance(dt, str) else np.dtype(dt)
        lo, hi = info["data_offsets"]
        out[name] = raw[lo:hi].view(dt).reshape(info["shape"])
        if dtypes is not None:
            dtypes[name] = info["dtype"]
    return out


class SafetensorsReader:
    """Lazy tensor access over single or sharded (index.json) safetensors files."""

    def __init__(self, folder: str):
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
            if not files:
                raise CheckpointError(f"{folder}: no *.safetensors files")
            weight_map = None
        self.folder = folder
        self.tensors: dict[str, np.ndarray] = {}
        self.files: dict[str, str] = {}
        self.st_dtypes: dict[str, str] = {}    # name -> safetensors dtype (F8_E4M3, I8...)
        for fname in files:
            path = os.path.join(folder, fname)
            if not os.path.isfile(path):
                raise CheckpointError(f"{folder}: {fname} is listed in the index but missing")
            found = _open_safetensors(path, self.st_dtypes)
            self.tensors.update(found)
            self.files.update(dict.fromkeys(found, path))
        if weight_map is not None:
            missing = sorted(set(weight_map) - set(self.tensors))
            if missing:
                raise CheckpointError(f"{folder}: index lists {missing[0]} but no file has it")

    def has(self, name: str) -> bool:
        return name in self.tensors

    def location(self, name: str) -> str:
        return self.files.get(name, self.folder)

    def names(self) -> list[str]:
        return list(self.tensors)

    def dtype(self, name: str) -> str:
        return self.st_dtypes[name]

    def shape(self, name: str) -> tuple:
        return self.tensors[name].shape

    def raw(self, name: str) -> np.ndarray:
        """The tensor as stored (quantized weights keep their dtype)."""
        return self.tensors[name]

    def get(self, name: str) -> np.ndarray:
        if name not in self.tensors:
            raise CheckpointError(f"{self.folder}: missing tensor {name}")
        return np.asarray(self.tensors[name], dtype=np.float32)


def load_hf_folder(folder: str, dtype_name: str, shardings: Callable,
                   quantization: str | None = None, tp: int = 1) -> LoadedModel:
    from jaxllm.models.quant_config import resolve_for_tp
    from jaxllm.models.quant_loader import check_float_tensors, kv_cache_scales
    hf = read_hf_config(folder)
    arch = arch_from_hf_config(hf, os.path.join(folder, "config.json"))
    dtype = resolve_dtype(dtype_name, hf.get("torch_dtype") or hf.get("dtype"))
    quant = resolve_for_tp(hf, quantization, arch, os.path.join(folder, "config.json"), tp,
                           dtype=dtype)
    reader = SafetensorsReader(folder)
    if arch.tie_word_embeddings is False and not reader.has("lm_head.weight"):
        raise CheckpointError(f"{folder}: missing tensor lm_head.weight "
                              "(config says tie_word_embeddings=false)")
    check_float_tensors(reader, quant, folder)
    graphdef, state = load_state(arch, dtype, reader, shardings, folder, quant)
    return LoadedModel(arch, graphdef, state, folder, quant,
                       kv_cache_scales(reader, quant, arch.num_layers))


# ---------------------------------------------------------------- entry point

def load_model(path: str | None, dtype_name: str = "auto", load_format: str = "auto",
               shardings: Callable | None = None, seed: int = 0,
               quantization: str | None = None, tp: int = 1) -> LoadedModel:
    """Load an HF folder or GGUF file (None = the embedded default) into sharded params.

    `shardings(path, logical_axes, shape)` -> jax Sharding; default: the first device.
    `quantization`: --quantization (None: the checkpoint's quantization_config, if any).
    `tp`: the tensor-parallel size `shardings` splits over.
    """
    loaded = _load_model(path, dtype_name, load_format, shardings, seed, quantization, tp)
    import jax
    gib = sum(x.nbytes for x in jax.tree.leaves(loaded.state)) / (1 << 30)
    logger.info("weights: %.3f GiB (%s)", gib, "not quantized" if loaded.quant is None
                else f"quantization {loaded.quant.describe()}")
    return loaded


def _load_model(path, dtype_name, load_format, shardings, seed, quantization, tp):
    import jax
    from jaxllm.models.gguf_loader import default_model_path, open_gguf
    from jaxllm.models.quant_config import resolve_for_tp
    if shardings is None:
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = lambda p, axes, shape=None: dev  # noqa: E731
    path = path or default_model_path()
    is_gguf = path.endswith(".gguf") or load_format == "gguf"
    if load_format == "safetensors" and is_gguf:
        raise CheckpointError(f"{path}: load_format=safetensors but this is a GGUF file")
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file or folder (give an HF model folder "
                              "with config.json, or a .gguf file)")
    if is_gguf:
        gg = open_gguf(path)
        hf = gg.hf_config()
        arch = arch_from_hf_config(hf, path)
        # GGUF weights are quantized: dequantize to float32 unless a dtype is asked.
        dtype = resolve_dtype(dtype_name, "float32")
        quant = resolve_for_tp(None, quantization, arch, path, tp,
                               dummy=load_format == "dummy", dtype=dtype)
        if load_format == "dummy":
            return LoadedModel(arch, *dummy_state(arch, dtype, shardings, seed, quant),
                               path, quant)
        graphdef, state = load_state(arch, dtype, gg, shardings, path, quant)
        return LoadedModel(arch, graphdef, state, path, quant)
    if load_format == "dummy":
        hf = read_hf_config(path)
        arch = arch_from_hf_config(hf, os.path.join(path, "config.json"))
        dtype = resolve_dtype(dtype_name, hf.get("torch_dtype") or hf.get("dtype"))
        quant = resolve_for_tp(hf, quantization, arch, os.path.join(path, "config.json"),
                               tp, dummy=True, dtype=dtype)
        return LoadedModel(arch, *dummy_state(arch, dtype, shardings, seed, quant), path, quant)
    return load_hf_folder(path, dtype_name, shardings, quantization, tp)
