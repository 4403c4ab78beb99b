"""--generation-config auto|vllm|FOLDER (vLLM's): default sampling parameters from a
model's generation_config.json, as its creator recommends.

- ``auto`` (the default): the model folder's file, if it has one (a GGUF model has
  none: nothing changes);
- ``vllm``: no file, vLLM's neutral defaults (SamplingParams');
- ``FOLDER``: that folder's generation_config.json.

The keys taken are vLLM's (ModelConfig.get_diff_sampling_param): repetition_penalty,
temperature, top_k, top_p, min_p, and max_new_tokens as max_tokens; a null value is
no default. A request's own values win; fields it leaves unset take these, then
SamplingParams' defaults. Pure Python: the file is read as JSON, no transformers.
"""
from __future__ import annotations

import json
import logging
import os

from jaxllm.config import ConfigError, ModelConfig

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
# (key in the file, SamplingParams field)
_PARAMS = (("repetition_penalty", "repetition_penalty"), ("temperature", "temperature"),
           ("top_k", "top_k"), ("top_p", "top_p"), ("min_p", "min_p"),
           ("max_new_tokens", "max_tokens"))


def generation_config_path(model: ModelConfig) -> str | None:
    """The file --generation-config names (None: no file to read). A FOLDER without
    the file, or that is no folder, is a ConfigError naming the flag."""
    value = model.generation_config
    if value == "vllm":
        return None
    if value == "auto":
        folder = model.model
        if folder is None or model.load_format == "gguf" or folder.endswith(".gguf") \
                or not os.path.isdir(folder):
            return None      # the embedded default and GGUF files carry no such file
        path = os.path.join(folder, GENERATION_CONFIG_FILE)
        return path if os.path.isfile(path) else None
    path = os.path.join(os.path.expanduser(value), GENERATION_CONFIG_FILE)
    if not os.path.isfile(path):
        what = "not a folder" if not os.path.isdir(os.path.expanduser(value)) else \
            f"the folder has no {GENERATION_CONFIG_FILE}"
        raise ConfigError(f"generation_config={value!r}: {what}; --generation-config takes "
                          f"auto, vllm, or a folder holding {GENERATION_CONFIG_FILE}")
    return path


def get_diff_sampling_param(model: ModelConfig, log: bool = True) -> dict:
    """The SamplingParams fields the generation config sets ({} for none), checked
    (a bad value is a ConfigError naming the file); logged once per call as vLLM does."""
    path = generation_config_path(model)
    if path is None:
        return {}
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"generation_config={model.generation_config!r}: cannot read "
                          f"{path} ({e}); fix it, or pass --generation-config vllm") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"generation_config={model.generation_config!r}: {path} is not a "
                          "JSON object; fix it, or pass --generation-config vllm")
    defaults = {field: raw[key] for key, field in _PARAMS if raw.get(key) is not None}
    _check(defaults, path, model.generation_config)
    if defaults and log:
        logger.warning(
            "Default sampling parameters have been overridden by the model's Hugging Face "
            "generation config recommended from the model creator (%s: %s). If this is not "
            "intended, relaunch with `--generation-config vllm`.", path,
            ", ".join(f"{k}={v}" for k, v in defaults.items()))
    return defaults


def _check(defaults: dict, path: str, value: str) -> None:
    from jaxllm.sampling_params import SamplingParams
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"generation_config={value!r}: {path}: {e} (or pass "
                          "--generation-config vllm)") from None
