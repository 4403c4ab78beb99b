"""Model facts for the launcher: the ArchConfig of a model path, read from its
config.json or GGUF header, reading no weights and importing no jax."""
from __future__ import annotations

import os

from jaxllm.config import ConfigError
from jaxllm.models.gguf_header import gguf_hf_config
from jaxllm.models.gguf_loader import default_model_path
from jaxllm.models.errors import CheckpointError
from jaxllm.models.loader import read_hf_config
from jaxllm.models.registry import ArchConfig, UnsupportedModelError, arch_from_hf_config


def read_model_arch(model: str | None, load_format: str = "auto") -> tuple[ArchConfig, str]:
    """(ArchConfig, source) of `model` (an HF folder or a .gguf file; None = the
    default model), `source` being the file the shape came from. A model that cannot
    be read raises ConfigError naming `model=`."""
    try:
        path = model or default_model_path()
        if path.endswith(".gguf") or load_format == "gguf":
            return arch_from_hf_config(gguf_hf_config(path), path), path
        if not os.path.isdir(path):
            raise CheckpointError("no such folder")
        source = os.path.join(path, "config.json")
        return arch_from_hf_config(read_hf_config(path), source), source
    except (CheckpointError, UnsupportedModelError, FileNotFoundError) as e:
        raise ConfigError(f"model={model!r}: {e}; give an HF model folder (config.json + "
                          "*.safetensors) or a .gguf file") from None


def check_checkpoint(model, load_format: str, quantization: str | None, arch,
                     tp: int = 1, kv_cache_dtype: str = "auto") -> None:
    """The launcher's check, before any backend starts: the quantization settings
    resolve and (for an HF folder's real weights) every quantized tensor and scale
    fits the layers the engine builds at tensor-parallel size `tp`. Raises
    CheckpointError naming the problem."""
    from jaxllm.models.loader import SafetensorsReader
    from jaxllm.models.quant_config import kv_cache_dtype_for, resolve_for_tp
    from jaxllm.models.quant_loader import QuantWeights, check_float_tensors
    if model is None or model.endswith(".gguf") or load_format == "gguf":
        resolve_for_tp(None, quantization, arch, model or "the default model", tp,
                       dummy=load_format == "dummy")
        return
    source = os.path.join(model, "config.json")
    quant = resolve_for_tp(read_hf_config(model), quantization, arch, source, tp,
                           dummy=load_format == "dummy")
    kv_cache_dtype_for(quant, kv_cache_dtype, model)
    if load_format == "dummy":
        return
    reader = SafetensorsReader(model)
    check_float_tensors(reader, quant, model)
    if quant is not None:
        QuantWeights(arch, quant, reader, model)
