"""The BERT family's shape (BertModel, XLMRobertaModel, RobertaModel) from an HF
config.json: a static, hashable EncoderConfig. Imports no jax."""
from __future__ import annotations

from dataclasses import dataclass

from jaxllm.models.registry import UnsupportedModelError

ENCODER_ARCHITECTURES = ("BertModel", "XLMRobertaModel", "RobertaModel")
# model_type -> architecture, for checkpoints saved from a task head (BertForMaskedLM...).
_MODEL_TYPES = {"bert": "BertModel", "xlm-roberta": "XLMRobertaModel",
                "roberta": "RobertaModel"}
HIDDEN_ACTS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")


@dataclass(frozen=True)
class EncoderConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    # RoBERTa's positions start after padding_idx (pad_token_id + 1): the first real
    # token of a right-padded row sits at position padding_idx + 1, as HF computes it.
    position_offset: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_len(self) -> int:
        """The longest input the position table covers."""
        return self.max_position_embeddings - self.position_offset


def encoder_architecture(cfg: dict) -> str | None:
    """The encoder architecture of an HF config dict, or None for anything else."""
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in ENCODER_ARCHITECTURES), None)
    if arch is None and (not archs or all(a.startswith(("Bert", "XLMRoberta", "Roberta"))
                                          for a in archs)):
        arch = _MODEL_TYPES.get(cfg.get("model_type"))
    return arch


def encoder_from_hf_config(cfg: dict, source: str = "config.json") -> EncoderConfig:
    arch = encoder_architecture(cfg)
    if arch is None:
        raise UnsupportedModelError(f"{source}: {cfg.get('architectures')} is not a BERT-family "
                                    f"encoder ({', '.join(ENCODER_ARCHITECTURES)})")
    act = cfg.get("hidden_act", "gelu")
    if act not in HIDDEN_ACTS:
        raise UnsupportedModelError(f"{source}: hidden_act {act!r} is not supported "
                                    f"({', '.join(HIDDEN_ACTS)} are)")
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise UnsupportedModelError(f"{source}: position_embedding_type "
                                    f"{cfg['position_embedding_type']!r} is not supported "
                                    "(absolute is)")
    offset = 0
    if arch != "BertModel":
        offset = int(cfg.get("pad_token_id", 1)) + 1
    try:
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        if hidden % heads:
            raise UnsupportedModelError(f"{source}: hidden_size {hidden} is not a multiple of "
                                        f"num_attention_heads {heads}")
        return EncoderConfig(
            architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=hidden,
            num_layers=cfg["num_hidden_layers"], num_heads=heads,
            intermediate_size=cfg["intermediate_size"],
            max_position_embeddings=int(cfg.get("max_position_embeddings", 512)),
            type_vocab_size=int(cfg.get("type_vocab_size", 2)),
            layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)), hidden_act=act,
            position_offset=offset)
    except KeyError as e:
        raise UnsupportedModelError(f"{source}: missing required key {e.args[0]!r}") from None
