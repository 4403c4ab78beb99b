"""What the pooling runner needs to know about an HF folder, read before any weight
and without jax: encoder or decoder, its sentence-transformers pipeline
(``modules.json``: Transformer -> Pooling -> optional Normalize; the Pooling module's
``config.json`` in either the ``pooling_mode`` or the older ``pooling_mode_*_token``
spelling; ``sentence_bert_config.json``'s max_seq_length and do_lower_case), and
whether the model was trained for truncated (Matryoshka) vectors.

Without ``modules.json`` the pooling is vLLM's default: CLS for encoders, the last
token for decoders, normalized.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from jaxllm.config import ConfigError
from jaxllm.models.bert_config import encoder_architecture, encoder_from_hf_config

POOLING_TYPES = ("CLS", "MEAN", "LAST")   # vLLM's PoolingType names
_ST_MODES = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}
_LEGACY_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                 "pooling_mode_lasttoken": "lasttoken", "pooling_mode_max_tokens": "max",
                 "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                 "pooling_mode_weightedmean_tokens": "weightedmean"}


@dataclass(frozen=True)
class PoolingModelInfo:
    is_encoder: bool
    pooling_type: str                   # CLS | MEAN | LAST
    normalize: bool
    hidden_size: int
    context_len: int                    # the most tokens an input may have
    do_lower_case: bool = False
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None


# Bare decoders (a checkpoint of the model without its LM head, as e5-mistral's
# MistralModel) run on the causal-LM class of their family.
BARE_DECODERS = {"LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM",
                 "Qwen2Model": "Qwen2ForCausalLM", "Qwen3Model": "Qwen3ForCausalLM"}


def decoder_hf_config(hf: dict) -> dict:
    """config.json with a bare decoder's architecture named as its causal-LM class."""
    archs = [BARE_DECODERS.get(a, a) for a in hf.get("architectures") or []]
    return dict(hf, architectures=archs) if archs else hf


def read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"model: cannot read {path} ({e})") from None


def is_encoder_folder(path: str | None) -> bool:
    """An HF folder whose config.json is a BERT-family encoder (no jax, no weights)."""
    if not path or not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        return False
    return encoder_architecture(read_json(os.path.join(path, "config.json"))) is not None


def resolve_runner(model_config) -> str:
    """vLLM's --runner auto: pooling for encoder checkpoints, generate for the rest.
    An encoder asked to generate is a ConfigError naming runner."""
    path = model_config.model
    encoder = is_encoder_folder(path)
    if model_config.runner == "generate" and encoder:
        raise ConfigError(f"runner='generate': {path} is an encoder (BERT family) model, "
                          "which only embeds; use runner='pooling'")
    if model_config.runner != "auto":
        return model_config.runner
    bare = bool(path and os.path.isfile(os.path.join(path, "config.json")) and any(
        a in BARE_DECODERS for a in read_json(os.path.join(path, "config.json")).get(
            "architectures") or []))
    return "pooling" if encoder or bare else "generate"


def read_pooling_info(folder: str) -> PoolingModelInfo:
    if not os.path.isdir(folder):
        raise ConfigError(f"model={folder!r}: the pooling runner needs an HF model folder "
                          "(config.json + *.safetensors)")
    source = os.path.join(folder, "config.json")
    if not os.path.isfile(source):
        raise ConfigError(f"model={folder!r}: no config.json (is this an HF model folder?)")
    hf = read_json(source)
    encoder = encoder_architecture(hf) is not None
    if encoder:
        context = encoder_from_hf_config(hf, source).max_len
    else:
        from jaxllm.models.registry import UnsupportedModelError, arch_from_hf_config
        try:
            context = arch_from_hf_config(decoder_hf_config(hf), source).max_position_embeddings
        except UnsupportedModelError as e:
            raise ConfigError(f"model={folder!r}: {e}") from None
    pooling, normalize = _st_pooling(folder, "CLS" if encoder else "LAST")
    st = os.path.join(folder, "sentence_bert_config.json")
    st_cfg = read_json(st) if os.path.isfile(st) else {}
    if st_cfg.get("max_seq_length"):
        context = min(context, int(st_cfg["max_seq_length"]))
    dims = hf.get("matryoshka_dimensions")
    return PoolingModelInfo(
        is_encoder=encoder, pooling_type=pooling, normalize=normalize,
        hidden_size=int(hf["hidden_size"]), context_len=context,
        do_lower_case=bool(st_cfg.get("do_lower_case", False)),
        is_matryoshka=bool(hf.get("is_matryoshka")) or bool(dims),
        matryoshka_dimensions=tuple(int(d) for d in dims) if dims else None)


def _st_pooling(folder: str, default: str) -> tuple[str, bool]:
    """(pooling type, normalize) from sentence-transformers' modules.json, or vLLM's
    default (``default``, normalized) when the folder has none."""
    path = os.path.join(folder, "modules.json")
    if not os.path.isfile(path):
        return default, True
    modules = read_json(path)
    pooling, normalize = default, False
    for m in modules:
        kind = m.get("type", "").rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if kind == "Pooling":
            cfg_path = os.path.join(folder, m.get("path", ""), "config.json")
            pooling = _pooling_mode(read_json(cfg_path), cfg_path)
        elif kind == "Normalize":
            normalize = True
        else:
            raise ConfigError(f"model: {path} has a {m.get('type')!r} module; the pooling "
                              "runner supports Transformer, Pooling and Normalize")
    return pooling, normalize


def _pooling_mode(cfg: dict, source: str) -> str:
    mode = cfg.get("pooling_mode")
    if mode is None:
        modes = [v for k, v in _LEGACY_MODES.items() if cfg.get(k)]
        mode = modes[0] if len(modes) == 1 else modes
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if not isinstance(mode, str) or mode not in _ST_MODES:
        raise ConfigError(f"model: {source}: pooling mode {mode!r} is not supported; the "
                          "pooling runner does cls, mean and lasttoken")
    return _ST_MODES[mode]
