"""A checkpoint's `quantization_config` (and the --quantization setting) -> the
QuantConfig the model is built with; anything jaxllm cannot run exactly is refused
here, in one line naming it, before a weight is read. No jax: the launcher runs this.

Formats: compressed-tensors `float-quantized` (FP8: per-tensor, per-channel or block
weight scales; dynamic per-token, static per-tensor or dynamic per-group activations)
and `int-quantized` (int8 W8A8 / W8A16: per-channel or per-tensor weight scales), with
or without a `kv_cache_scheme` (per-layer static fp8 KV scales); native FP8
(`quant_method: fp8`: e4m3 weights, `weight_scale_inv` per block or `weight_scale` per
tensor). Online: `fp8` and `int8` on a float checkpoint.
"""
from __future__ import annotations

import dataclasses
import re

from jaxllm.layers.quantization import int4_kernels
from jaxllm.layers.quantization.schemes import (CHECKPOINT_ALIASES, CHECKPOINT_METHODS,
                                                ONLINE_ALIASES, ONLINE_METHODS, ActScheme,
                                                LinearScheme, QuantConfig, online_scheme,
                                                unfuse_qkv, uniform_config)
from jaxllm.models.errors import CheckpointError
from jaxllm.models.quant_layers import layer_schemes, mixed_skip_error, unless_skipped

_CT_FORMATS = ("float-quantized", "int-quantized", "pack-quantized")


def resolve_quantization(hf: dict | None, flag: str | None, num_layers: int,
                         source: str, dummy: bool = False) -> QuantConfig | None:
    """The model's QuantConfig from its config.json dict `hf` (None: a GGUF file) and
    the --quantization value `flag`; None for a float model. `dummy` (random weights
    of the model's shape): awq / gptq on a float config mean 4-bit weights in groups
    of 128, those checkpoints' usual form, for benchmarks."""
    qc = (hf or {}).get("quantization_config")
    if qc is None:
        method = ONLINE_ALIASES.get(flag, CHECKPOINT_ALIASES.get(flag, flag))
        if method in ONLINE_METHODS:
            return uniform_config(method, num_layers, online_scheme(method), online=True)
        if dummy and method in ("awq", "gptq"):
            return uniform_config(method, num_layers, LinearScheme("uint4", group=128),
                                  online=False)
        if flag == "gguf" and hf is not None:
            raise CheckpointError(f"{source}: quantization='gguf' needs a GGUF file, and "
                                  f"this is an HF folder; leave --quantization unset")
        if flag not in (None, "gguf"):
            raise CheckpointError(
                f"{source}: quantization={flag!r} needs a checkpoint quantized that way, "
                f"but config.json has no quantization_config (quantize a float model at "
                f"load with --quantization {' or '.join(ONLINE_METHODS)})")
        return None
    if not isinstance(qc, dict):
        raise CheckpointError(f"{source}: quantization_config is not an object")
    method = qc.get("quant_method")
    if method not in CHECKPOINT_METHODS:
        raise CheckpointError(
            f"{source}: quantization_config.quant_method={method!r} is not supported; "
            f"jaxllm loads {', '.join(CHECKPOINT_METHODS)} checkpoints")
    if flag is not None and CHECKPOINT_ALIASES.get(flag, flag) != method:
        raise CheckpointError(
            f"{source}: quantization={flag!r} disagrees with the checkpoint's "
            f"quantization_config.quant_method={method!r}; leave --quantization unset "
            f"or set it to {method}")
    if method == "fp8":
        return _native_fp8(qc, num_layers, source)
    if method in ("awq", "gptq"):
        from jaxllm.models.quant_woq import woq_config
        return woq_config(method, qc, num_layers, source)
    return _compressed_tensors(qc, num_layers, source)


def resolve_for_tp(hf: dict | None, flag: str | None, arch, source: str, tp: int,
                   dummy: bool = False, dtype=None) -> QuantConfig | None:
    """resolve_quantization for a model split over `tp` devices. A fused qkv_proj is
    split by KV head, so where `tp` does not divide them q_proj and kv_proj stay
    apart: q split by query head, k/v replicated (as in the float model). With the
    model's `dtype`, uint4 schemes the Mosaic kernel runs store their scales packed
    (int4_kernels.py)."""
    quant = resolve_quantization(hf, flag, arch.num_layers, source, dummy=dummy)
    if quant is not None and arch.num_kv_heads % tp:
        quant = dataclasses.replace(quant, schemes=unfuse_qkv(quant.schemes))
    if quant is not None and int4_kernels.wanted(tp, dtype):
        quant = dataclasses.replace(quant, schemes=tuple(
            (m, dataclasses.replace(s, packed=True) if int4_kernels.packable(s) else s)
            for m, s in quant.schemes))
    return quant


# ---------------------------------------------------------------- native FP8

def _native_fp8(qc: dict, num_layers: int, source: str) -> QuantConfig:
    where = f"{source}: quantization_config"
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise CheckpointError(f"{where}.fmt={fmt!r} is not supported (e4m3 is)")
    act = qc.get("activation_scheme", "dynamic")
    if act not in ("dynamic", "static"):
        raise CheckpointError(f"{where}.activation_scheme={act!r}: dynamic or static")
    block = qc.get("weight_block_size")
    if block is not None:
        block = _block(block, f"{where}.weight_block_size")
        if act != "dynamic":
            raise CheckpointError(f"{where}: block-scaled weights with activation_scheme="
                                  f"{act!r} are not supported (dynamic is)")
        scheme = LinearScheme("fp8", block, ActScheme("fp8", True, block[1]))
    else:
        scheme = LinearScheme("fp8", None, ActScheme("fp8", act == "dynamic"))
    skip = list(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or [])
    schemes = layer_schemes(num_layers, unless_skipped(scheme, skip), mixed_skip_error(where))
    # lm_head stays float (transformers leaves the output embedding unconverted too); a
    # checkpoint that stores it quantized anyway is caught by the tensor dtype check.
    return QuantConfig("fp8", False, tuple(schemes))


def _block(block, where: str) -> tuple[int, int]:
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(f"{where}={block!r}: two positive integers [rows, cols]")
    return int(block[0]), int(block[1])


# ---------------------------------------------------------------- compressed-tensors

def _compressed_tensors(qc: dict, num_layers: int, source: str) -> QuantConfig:
    where = f"{source}: quantization_config"
    for key in ("sparsity_config", "transform_config"):
        if qc.get(key):
            raise CheckpointError(f"{where}.{key} is set; jaxllm does not implement it")
    kv_scales = _kv_cache_scheme(qc.get("kv_cache_scheme"), f"{where}.kv_cache_scheme")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise CheckpointError(f"{where}.config_groups is empty")
    parsed = {name: (_targets(g, f"{where}.config_groups.{name}"),
                     _ct_scheme(g, qc.get("format"), f"{where}.config_groups.{name}"))
              for name, g in groups.items()}
    ignore = list(qc.get("ignore") or [])

    def scheme_of(module: str) -> LinearScheme | None:
        if any(_matches(t, module) for t in ignore):
            return None
        hits = {name for name, (targets, _) in parsed.items()
                if any(_matches(t, module) for t in targets)}
        if len(hits) > 1:
            raise CheckpointError(f"{where}: {module} matches config groups "
                                  f"{', '.join(sorted(hits))}; give each module one group")
        return parsed[hits.pop()][1] if hits else None

    if scheme_of("lm_head") is not None:
        raise CheckpointError(f"{where}: a quantized lm_head is not supported "
                              "(list lm_head under ignore)")
    schemes = layer_schemes(num_layers, scheme_of, lambda names: CheckpointError(
        f"{where}: {names[0]} and {names[1]} are quantized differently; jaxllm fuses them "
        "into one matmul"))
    layout = "pack" if any(s.group is not None for _, s in schemes) else ""
    return QuantConfig("compressed-tensors", False, tuple(schemes), layout, kv_scales)


def kv_cache_dtype_for(quant: QuantConfig | None, kv_cache_dtype: str, source: str) -> str:
    """The kv_cache_dtype a model runs with: as in vLLM, `auto` means an fp8 (e4m3)
    cache for a checkpoint storing fp8 KV scales (kv_cache_scheme), and fp8_e5m2 is
    refused there (the scales are e4m3's). The launcher and the executor both ask."""
    if quant is None or not quant.kv_scales or kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return kv_cache_dtype
    if kv_cache_dtype == "fp8_e5m2":
        raise CheckpointError(f"kv_cache_dtype=fp8_e5m2: {source} stores fp8 KV scales "
                              "(kv_cache_scheme) for an e4m3 cache; use fp8 or auto")
    return "fp8"


def _kv_cache_scheme(kv: dict | None, where: str) -> bool:
    """Whether the checkpoint stores fp8 KV-cache scales: what llm-compressor writes
    (8-bit float, one static scale per tensor, symmetric) is read; other KV schemes
    are refused. Missing keys take compressed-tensors' defaults (8-bit int, static,
    symmetric; no strategy is per tensor for the KV cache)."""
    if not kv:
        return False
    want = dict(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True)
    defaults = dict(want, type="int")
    got = {key: kv.get(key, defaults[key]) for key in want}
    got["strategy"] = got["strategy"] or "tensor"
    if got != want:
        raise CheckpointError(f"{where}={kv!r} is not supported (8-bit float, per tensor, "
                              "static, symmetric: fp8 KV scales)")
    return True


def _targets(group: dict, where: str) -> list[str]:
    targets = group.get("targets") or []
    if not isinstance(targets, list) or not targets:
        raise CheckpointError(f"{where}.targets: a list of module names or patterns")
    return targets


def _matches(target: str, module: str) -> bool:
    """compressed-tensors' rule: a class name (every projection is a Linear), the
    module's name, or `re:` and a pattern matched from the name's start."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target in ("Linear", module)


def _ct_scheme(group: dict, model_format, where: str) -> LinearScheme:
    fmt = group.get("format") or model_format
    if fmt not in _CT_FORMATS:
        raise CheckpointError(f"{where}: format {fmt!r} is not supported; jaxllm loads "
                              f"compressed-tensors {', '.join(_CT_FORMATS)}")
    if group.get("output_activations"):
        raise CheckpointError(f"{where}.output_activations is set; jaxllm does not "
                              "implement output quantization")
    w = group.get("weights")
    if not w:
        raise CheckpointError(f"{where}.weights is missing")
    if fmt == "pack-quantized":
        from jaxllm.models.quant_woq import pack_quantized_scheme
        return pack_quantized_scheme(w, group.get("input_activations"), where)
    kind = "fp8" if fmt == "float-quantized" else "int8"
    _check_args(w, kind, f"{where}.weights")
    strategy = w.get("strategy", "tensor")
    if w.get("dynamic"):
        raise CheckpointError(f"{where}.weights.dynamic is set; weights need stored scales")
    block = None
    if strategy == "block" and kind == "fp8":
        block = _block(w.get("block_structure"), f"{where}.weights.block_structure")
    elif strategy not in ("tensor", "channel"):
        raise CheckpointError(f"{where}.weights.strategy={strategy!r} is not supported for "
                              f"{fmt} (tensor, channel{', block' if kind == 'fp8' else ''})")
    a = group.get("input_activations")
    act = None
    if a:
        s, dyn = a.get("strategy", "tensor"), a.get("dynamic", False)
        # int8 with a zero point per token (vLLM's azp W8A8): the layer's asymmetric path
        asym = kind == "int8" and dyn is True and s == "token"
        _check_args(a, kind, f"{where}.input_activations", allow_asymmetric=asym)
        if block is not None:
            if not (dyn is True and s == "group" and a.get("group_size") == block[1]):
                raise CheckpointError(
                    f"{where}.input_activations: block-scaled weights need dynamic group "
                    f"activations of group_size {block[1]}")
            act = ActScheme(kind, True, block[1])
        elif dyn is True and s == "token":
            act = ActScheme(kind, True, symmetric=a.get("symmetric", True) is not False)
        elif dyn is False and s == "tensor":
            act = ActScheme(kind, False)
        else:
            raise CheckpointError(
                f"{where}.input_activations: strategy={s!r} dynamic={dyn!r} is not supported "
                "(dynamic token or static tensor scales)")
    return LinearScheme(kind, block, act)


def _check_args(args: dict, kind: str, where: str, allow_asymmetric: bool = False) -> None:
    want = "float" if kind == "fp8" else "int"
    if args.get("type", "int") != want or args.get("num_bits") != 8:
        raise CheckpointError(
            f"{where}: type={args.get('type')!r} num_bits={args.get('num_bits')!r} is not "
            f"supported in this format (type {want!r}, num_bits 8)")
    if args.get("symmetric", True) is False and not allow_asymmetric:
        raise CheckpointError(f"{where}.symmetric=false (zero points) is not supported"
                              + (" (int8 inputs with dynamic token scales are)"
                                 if where.endswith("input_activations") else ""))

