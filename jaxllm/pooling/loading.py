"""Weights for the pooling runner: an HF folder's safetensors (or random, `dummy`)
into the BERT-family encoder (models/bert.py) or the Llama-family decoder without
its LM head (models/llama.py, tied, so no lm_head parameter exists).

Embedding checkpoints are often saved from the bare model, so the tensor names lack
the task model's prefix (Qwen3-Embedding has ``layers.0...``, not
``model.layers.0...``; bge has ``embeddings...``, a BertForMaskedLM ``bert.embeddings``):
the reader tries each spelling.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np

from jaxllm.models.errors import CheckpointError
from jaxllm.models.loader import (SafetensorsReader, _template, dummy_state, load_state,
                                  param_path, read_hf_config, resolve_dtype)


@dataclasses.dataclass
class LoadedPoolingModel:
    arch: object            # EncoderConfig or ArchConfig
    graphdef: object
    state: object
    dtype: object
    is_encoder: bool


class _PrefixReader:
    """A SafetensorsReader that finds ``name`` under any of ``spellings(name)``."""

    def __init__(self, reader: SafetensorsReader, spellings):
        self.reader, self.spellings = reader, spellings

    def _find(self, name: str) -> str:
        return next((n for n in self.spellings(name) if self.reader.has(n)), name)

    def has(self, name: str) -> bool:
        return self.reader.has(self._find(name))

    def get(self, name: str) -> np.ndarray:
        return self.reader.get(self._find(name))

    def location(self, name: str) -> str:
        return self.reader.location(self._find(name))


def _encoder_spellings(name: str) -> list[str]:
    names = [p + name for p in ("", "bert.", "roberta.", "model.")]
    if name.endswith("LayerNorm.weight"):      # TF-era checkpoints: gamma / beta
        names += [n.replace("LayerNorm.weight", "LayerNorm.gamma") for n in names]
    elif name.endswith("LayerNorm.bias"):
        names += [n.replace("LayerNorm.bias", "LayerNorm.beta") for n in names]
    return names


def _decoder_spellings(name: str) -> list[str]:
    return [name, name.removeprefix("model.")]


def load_pooling_model(folder: str, dtype_name: str, load_format: str, is_encoder: bool,
                       seed: int = 0) -> LoadedPoolingModel:
    """One device (the pooling runner does not shard: embedding models are small)."""
    import jax
    from jaxllm.models.bert_config import encoder_from_hf_config
    from jaxllm.models.registry import arch_from_hf_config
    from jaxllm.pooling.model_info import decoder_hf_config
    hf = read_hf_config(folder)
    source = os.path.join(folder, "config.json")
    dtype = resolve_dtype(dtype_name, hf.get("torch_dtype") or hf.get("dtype"))
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = lambda p, axes, shape=None: dev  # noqa: E731
    if is_encoder:
        arch = encoder_from_hf_config(hf, source)
        if load_format == "dummy":
            graphdef, state = _encoder_dummy(arch, dtype, seed)
        else:
            reader = _PrefixReader(SafetensorsReader(folder), _encoder_spellings)
            graphdef, state = _encoder_state(arch, dtype, reader, dev, folder)
    else:
        # No LM head: an embedding model pools the final hidden states.
        arch = dataclasses.replace(arch_from_hf_config(decoder_hf_config(hf), source),
                                   tie_word_embeddings=True)
        if load_format == "dummy":
            graphdef, state = dummy_state(arch, dtype, shardings, seed)
        else:
            reader = _PrefixReader(SafetensorsReader(folder), _decoder_spellings)
            graphdef, state = load_state(arch, dtype, reader, shardings, folder)
    return LoadedPoolingModel(arch, graphdef, state, dtype, is_encoder)


def _encoder_dummy(arch, dtype, seed: int):
    from flax import nnx
    from jaxllm.models.bert import BertModel
    return nnx.split(BertModel(arch, dtype, rngs=nnx.Rngs(seed)))


def _encoder_state(arch, dtype, reader, device, source: str):
    import jax
    from flax import nnx
    from jaxllm.models.bert import WEIGHT_MAP, BertModel
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: BertModel(arch, dtype, rngs=nnx.Rngs(0))))
    leaves = []
    for path, var in nnx.to_flat_state(abstract):
        name = param_path(path)
        tmpl, layer = _template(name)
        hf_names, combine = WEIGHT_MAP[tmpl]
        hf_names = [n.format(i=layer) for n in hf_names]
        tensors = [reader.get(n) for n in hf_names]
        want = tuple(var.get_value().shape)
        try:
            array = combine(arch, *tensors)
        except ValueError:
            array = None
        if array is None or tuple(array.shape) != want:
            raise CheckpointError(
                f"{reader.location(hf_names[0])}: tensor {hf_names[0]} has shape "
                f"{tuple(tensors[0].shape)}, which does not fit parameter {name} {want} "
                "of this config")
        value = jax.device_put(np.asarray(array, dtype=np.dtype(dtype)), device)
        leaves.append((path, var.replace(value=value)))
    return graphdef, nnx.from_flat_state(leaves)
