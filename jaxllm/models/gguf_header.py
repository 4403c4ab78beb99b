"""GGUF headers without the `gguf` package: metadata, tensor names and the HF-style
config they give. Pure Python (no numpy, no jax), so the launcher can check a model's
shape in milliseconds; `gguf_loader` uses the same tables for the weights."""
from __future__ import annotations

import mmap
import struct

from jaxllm.models.errors import CheckpointError
from jaxllm.models.registry import UnsupportedModelError

# GGUF general.architecture -> HF architecture name.
GGUF_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
             "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# GGUF tensor name pieces -> HF names ({i} = layer).
_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}

# GGUF value type -> struct format (8 string, 9 array are read by hand).
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?",
                 10: "Q", 11: "q", 12: "d"}


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor, or None for one the decoder does not use."""
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        key = ".".join(["blk", "{i}", *parts[2:]])
        target = _GGUF_NAMES.get(key)
        return target.format(i=parts[1]) if target else None
    return _GGUF_NAMES.get(gguf_name)


def read_gguf_header(path: str) -> tuple[dict, list[str]]:
    """(metadata, tensor names) of a little-endian GGUF v2/v3 file, without the
    `gguf` package: its reader builds a numpy view per vocabulary string, which takes
    seconds for a 49k-token vocabulary; this takes milliseconds."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        pos = 0

        def take(fmt):
            nonlocal pos
            (value,) = struct.unpack_from("<" + fmt, buf, pos)
            pos += struct.calcsize(fmt)
            return value

        def string():
            nonlocal pos
            n = take("Q")
            pos += n
            return bytes(buf[pos - n:pos]).decode("utf-8", errors="replace")

        def value(kind):
            if kind == 8:
                return string()
            if kind == 9:
                item, count = take("I"), take("Q")
                return [value(item) for _ in range(count)]
            return take(_GGUF_SCALARS[kind])

        magic, version = struct.unpack_from("<4sI", buf, 0)
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{path}: not a GGUF v2/v3 file")
        pos = 8
        n_tensors, n_kv = take("Q"), take("Q")
        meta = {}
        for _ in range(n_kv):
            key = string()
            meta[key] = value(take("I"))
        names = []
        for _ in range(n_tensors):
            names.append(string())
            n_dims = take("I")
            pos += 8 * n_dims + 4 + 8          # dims, type, offset
    return meta, names


def load_gguf_header(path: str) -> tuple[dict, list[str]]:
    """read_gguf_header, with an unreadable file raised as CheckpointError."""
    try:
        return read_gguf_header(path)
    except (OSError, ValueError, KeyError, IndexError, struct.error) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from None


def check_gguf_arch(path: str, arch: str | None) -> None:
    """UnsupportedModelError unless `arch` (general.architecture) is one jaxllm runs."""
    if arch not in GGUF_ARCH:
        raise UnsupportedModelError(f"{path}: GGUF architecture {arch!r} is not supported "
                                    f"(jaxllm reads {', '.join(sorted(GGUF_ARCH))})")


def hf_config_from_meta(meta: dict, arch: str, hf_tensors) -> dict:
    """The HF-style config of GGUF metadata; `hf_tensors` holds the HF tensor names
    (a missing lm_head means tied embeddings)."""
    m, a = meta, arch
    heads = m[f"{a}.attention.head_count"]
    hidden = m[f"{a}.embedding_length"]
    cfg = {
        "architectures": [GGUF_ARCH[a]],
        "vocab_size": m.get(f"{a}.vocab_size") or len(m["tokenizer.ggml.tokens"]),
        "hidden_size": hidden,
        "num_hidden_layers": m[f"{a}.block_count"],
        "num_attention_heads": heads,
        "num_key_value_heads": m.get(f"{a}.attention.head_count_kv", heads),
        "head_dim": m.get(f"{a}.attention.key_length") or
        m.get(f"{a}.rope.dimension_count") or hidden // heads,
        "intermediate_size": m[f"{a}.feed_forward_length"],
        "rms_norm_eps": m.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": m.get(f"{a}.rope.freq_base", 10000.0),
        "max_position_embeddings": m.get(f"{a}.context_length", 2048),
        "tie_word_embeddings": "lm_head.weight" not in hf_tensors,
        "bos_token_id": m.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": m.get("tokenizer.ggml.eos_token_id"),
    }
    if a == "qwen2":
        cfg["attention_bias"] = True
    return cfg


def gguf_hf_config(path: str) -> dict:
    """The HF-style config of a GGUF file from its header, as `GGUFFile.hf_config`
    gives it."""
    meta, names = load_gguf_header(path)
    arch = meta.get("general.architecture")
    check_gguf_arch(path, arch)
    return hf_config_from_meta(meta, arch, {hf_tensor_name(n) for n in names} - {None})
