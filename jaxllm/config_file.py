"""Launch settings: a YAML or TOML file merged under command-line flags.

Precedence is defaults < file < flags. Keys are the flat engine-argument names of
`jaxllm.config` (vLLM's), written with underscores or dashes; a file may also group
them under their section (`cache:`, `scheduler:` ...). Relative paths in a file are
read from the file's folder. Every value is checked against its field's type here,
so a bad one fails with its key, value and source before anything is loaded.

Pure Python: jax is imported only by `prepare_launch`, after the flags are parsed.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import typing

from jaxllm.config import (FLAT_KEYS, SECTIONS, ConfigError, EngineConfig,
                           SpeculativeConfig, check_against_model, engine_config_from_flat)

# Keys holding a path: in a config file they are relative to the file's folder.
PATH_KEYS = ("model", "tokenizer", "chat_template", "compilation_cache_dir",
             "generation_config")
# Values of a path key that name no path.
NOT_PATHS = {"generation_config": ("auto", "vllm")}
_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def _field_types() -> dict[str, object]:
    types = {}
    for name, (section, fname) in FLAT_KEYS.items():
        cls = SECTIONS[section] if section else EngineConfig
        types[name] = typing.get_type_hints(cls)[fname]
    return types


FIELD_TYPES = _field_types()


def normalize_key(key: str) -> str:
    return str(key).replace("-", "_")


def unknown_key_error(key: str, value, source: str) -> ConfigError:
    close = difflib.get_close_matches(normalize_key(key), FLAT_KEYS, n=1, cutoff=0.6)
    fix = f"did you mean {close[0]!r}?" if close else "see `jaxllm serve --help` for the keys"
    return ConfigError(f"{source}: unknown key {key!r} (value {value!r}); {fix}")


def coerce(key: str, value, source: str):
    """`value` (from YAML/TOML, or a flag's string) as the type of field `key`."""
    hint = FIELD_TYPES[key]
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if optional else hint
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null")):
        if optional:
            return None
        _bad(key, value, source, f"a value is required ({_describe(base)})")
    if base is SpeculativeConfig:                   # a mapping (file) or JSON (flag)
        return SpeculativeConfig.from_value(value, source)
    if typing.get_origin(base) is tuple:            # served_model_name
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) for v in items):
            _bad(key, value, source, "give a name or a list of names")
        return tuple(items)
    if base is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
            return value.lower() in _TRUE
        _bad(key, value, source, "give true or false")
    if isinstance(value, bool):                     # YAML `yes` is not a number or a name
        _bad(key, value, source, _describe(base))
    try:
        if base is int and isinstance(value, (int, str)):
            return int(value)
        if base is float and isinstance(value, (int, float, str)):
            return float(value)
        if base is str and isinstance(value, str):
            return value
    except ValueError:
        pass
    _bad(key, value, source, _describe(base))


def _describe(base) -> str:
    return {int: "give a whole number", float: "give a number",
            str: "give a string"}.get(base, f"give a {base}")


def _bad(key, value, source, fix):
    raise ConfigError(f"{key}={value!r} ({source}): {fix}")


def read_file(path: str) -> dict:
    """The file's settings: {flat key: typed value}. YAML (.yaml/.yml) or TOML (.toml)."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".yaml", ".yml", ".toml"):
        raise ConfigError(f"config={path!r}: use a .yaml, .yml or .toml file")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError(f"config={path!r}: cannot read it ({e.strerror})") from None
    try:
        if ext == ".toml":
            import tomllib
            raw = tomllib.loads(data.decode())
        else:
            import yaml
            raw = yaml.safe_load(data) or {}
    except Exception as e:  # yaml.YAMLError / tomllib.TOMLDecodeError
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"config={path!r}: not valid {ext[1:].upper()}: {first}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config={path!r}: the file must hold a mapping of key: value")
    return {key: _file_value(key, value, path) for key, value in _flatten(raw, path).items()}


def _flatten(raw: dict, path: str) -> dict:
    """Accept `block_size: 16` and `cache: {block_size: 16}` alike."""
    flat: dict = {}
    for key, value in raw.items():
        name = normalize_key(key)
        if name in SECTIONS and isinstance(value, dict):
            for inner, inner_value in value.items():
                inner_name = normalize_key(inner)
                if FLAT_KEYS.get(inner_name, (None,))[0] != name:
                    raise unknown_key_error(f"{key}.{inner}", inner_value, path)
                flat[inner_name] = inner_value
        elif name in FLAT_KEYS:
            flat[name] = value
        else:
            raise unknown_key_error(key, value, path)
    return flat


def _file_value(key: str, value, path: str):
    value = coerce(key, value, path)
    if key in PATH_KEYS and isinstance(value, str) and value not in NOT_PATHS.get(key, ()):
        value = _from_file_folder(value, path)
    if isinstance(value, SpeculativeConfig) and value.model is not None:  # the draft's
        value = dataclasses.replace(value, model=_from_file_folder(value.model, path))
    return value


def _from_file_folder(value: str, path: str) -> str:
    value = os.path.expanduser(value)
    return os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), value))


def merge_settings(defaults: dict, config_path: str | None, flags: dict) -> dict:
    """defaults < file < flags, as one flat dict. `flags` holds only the flags given."""
    settings = dict(defaults)
    if config_path:
        settings.update(read_file(config_path))
    for key, value in flags.items():
        settings[key] = coerce(key, value, "--" + key.replace("_", "-"))
    return settings


def build_config(config_path: str | None = None, flags: dict | None = None,
                 defaults: dict | None = None) -> EngineConfig:
    """An EngineConfig from defaults, an optional file and flags (see merge_settings)."""
    return engine_config_from_flat(**merge_settings(defaults or {}, config_path, flags or {}))


# ------------------------------------------------------------- model-aware checks

def check_model(config: EngineConfig):
    """The checks against the model's shape (config.json or GGUF metadata; no jax).
    Returns the ArchConfig."""
    from jaxllm.models.info import read_model_arch
    arch, source = read_model_arch(config.model.model, config.model.load_format)
    check_against_model(config, arch, source)
    from jaxllm.models.errors import CheckpointError
    from jaxllm.models.info import check_checkpoint
    mc = config.model
    try:   # a quantized checkpoint jaxllm cannot run is refused before the weights load
        check_checkpoint(mc.model, mc.load_format, mc.quantization, arch,
                         config.parallel.tensor_parallel_size, config.cache.kv_cache_dtype)
    except CheckpointError as e:
        raise ConfigError(f"model={mc.model!r}: {e}") from None
    from jaxllm.generation_config import get_diff_sampling_param
    get_diff_sampling_param(mc, log=False)   # a bad --generation-config fails here
    return arch


def prepare_launch(config: EngineConfig):
    """Everything to do before the weights load: the compile cache, then the checks
    against the model's shape and the devices present (the executor's
    prepare_devices, which joins jax.distributed). Returns the ArchConfig."""
    from jaxllm import compilation_cache
    compilation_cache.enable(config.compilation_cache_dir)
    arch = check_model(config)
    from jaxllm.executor.executor import prepare_devices
    prepare_devices(config)
    return arch
