"""HF architecture name -> model class, and HF config.json -> a static ArchConfig."""
from __future__ import annotations

from dataclasses import dataclass

# Every architecture here is one config-driven decoder (models/llama.py); the table
# records which optional parts each family switches on.
_ARCHITECTURES = {
    "LlamaForCausalLM": dict(),
    "MistralForCausalLM": dict(),
    "Qwen2ForCausalLM": dict(attention_bias=True),
    "Qwen3ForCausalLM": dict(qk_norm=True),
}


_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class ArchConfig:
    """Static (hashable) model shape; a jit static argument."""
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # llama3 rope scaling as a sorted tuple of (key, value) so the config stays hashable.
    rope_scaling: tuple | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def arch_from_hf_config(cfg: dict, source: str = "config.json") -> ArchConfig:
    """Read the fields of an HF config.json dict that the decoder needs."""
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in _ARCHITECTURES), None)
    if arch is None and not archs:
        arch = _MODEL_TYPES.get(cfg.get("model_type"))
    if arch is None:
        raise UnsupportedModelError(
            f"{source}: architecture {archs or cfg.get('model_type')!r} is not supported; "
            f"jaxllm runs {', '.join(supported_architectures())}")
    try:
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        scaling = cfg.get("rope_scaling") or (cfg.get("rope_parameters") or None)
        scaling = _normalize_rope_scaling(scaling, source)
        theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get(
            "rope_theta", 10000.0)
        eos = cfg.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
            window = None
        return ArchConfig(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)) or
            _ARCHITECTURES[arch].get("attention_bias", False),
            qk_norm=_ARCHITECTURES[arch].get("qk_norm", False),
            sliding_window=window,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
        )
    except KeyError as e:
        raise UnsupportedModelError(f"{source}: missing required key {e.args[0]!r}") from None


def _normalize_rope_scaling(scaling, source: str):
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise UnsupportedModelError(
            f"{source}: rope_scaling type {kind!r} is not supported (default and llama3 are)")
    keys = ("factor", "low_freq_factor", "high_freq_factor",
            "original_max_position_embeddings")
    return tuple(sorted((k, float(scaling[k])) for k in keys))
