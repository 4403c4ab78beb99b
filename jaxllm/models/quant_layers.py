"""Which fused projections of each layer a quantized checkpoint quantizes, shared by
the FP8, compressed-tensors and GPTQ/AWQ configs."""
from __future__ import annotations

from jaxllm.layers.quantization.schemes import PROJECTIONS, fuse_qkv
from jaxllm.models.errors import CheckpointError


def layer_schemes(num_layers: int, scheme_of, mixed) -> list[tuple]:
    """("layers.i.proj", scheme) for each fused projection of each layer whose HF
    modules `scheme_of(name)` quantizes (None: left float). Modules fused into one
    matmul must agree; `mixed(names)` is the CheckpointError when they do not. q_proj
    and kv_proj of one scheme become one qkv_proj (schemes.fuse_qkv)."""
    schemes = []
    for i in range(num_layers):
        for proj, parts in PROJECTIONS.items():
            names = [f"model.layers.{i}.{p}" for p in parts]
            found = [scheme_of(n) for n in names]
            if any(f != found[0] for f in found):
                raise mixed(names)
            if found[0] is not None:
                schemes.append((f"layers.{i}.{proj}", found[0]))
    return list(fuse_qkv(schemes))


def unless_skipped(scheme, skip: list[str]):
    """scheme_of for layer_schemes: `scheme`, except for modules naming a `skip` entry."""
    return lambda name: None if any(s in name for s in skip) else scheme


def mixed_skip_error(where: str):
    return lambda names: CheckpointError(
        f"{where}.modules_to_not_convert leaves {names[0]} and {names[1]} in different "
        "dtypes; jaxllm fuses them")
