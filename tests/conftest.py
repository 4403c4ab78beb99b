"""Shared fixtures: tiny random HF models made here with transformers (fixed seeds,
saved to a temp dir with a small BPE tokenizer trained in-process)."""
from __future__ import annotations

import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

TINY_VOCAB = 311   # odd on purpose


def _corpus():
    words = ("the quick brown fox jumps over a lazy dog while seven wizards quietly "
             "hex jolly bankers paris france sea waves hello world numbers 0123456789 "
             "café naïve 東京 emoji").split()
    return [" ".join(words[i:] + words[:i]) for i in range(len(words))] * 4


def build_tokenizer(folder: str, vocab_size: int = TINY_VOCAB) -> None:
    """A byte-level BPE tokenizer with a chat template, saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 8, special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                "{% endif %}")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   chat_template=template)
    fast.save_pretrained(folder)


def make_hf_config(arch: str, **overrides):
    import transformers as tf
    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=112,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=0,
                  eos_token_id=None, pad_token_id=None)
    if arch == "llama":
        cfg = tf.LlamaConfig(**common, tie_word_embeddings=False, rope_theta=10000.0,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 64})
    elif arch == "llama_tied":
        cfg = tf.LlamaConfig(**common, tie_word_embeddings=True)
    elif arch == "mistral":
        cfg = tf.MistralConfig(**common, sliding_window=4096, tie_word_embeddings=False)
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**common, tie_word_embeddings=True, use_sliding_window=False)
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(**{**common, "num_key_value_heads": 1}, head_dim=32,
                             tie_word_embeddings=False, use_sliding_window=False)
    else:
        raise ValueError(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def make_tiny_model(folder: str, arch: str, seed: int = 0, **save_kwargs):
    """Create, save and return an HF torch model (float32) of the tiny `arch`."""
    import torch
    import transformers as tf
    torch.manual_seed(seed)
    cfg = make_hf_config(arch)
    model = tf.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32).eval()
    # Random init has tiny weights: scale them up so logits are not all near-equal and
    # greedy decoding is a meaningful check.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15)
            elif "bias" in name:
                p.normal_(0.0, 0.1)
            else:
                p.uniform_(0.8, 1.2)
    model.save_pretrained(folder, **save_kwargs)
    build_tokenizer(folder)
    return model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(arch) -> (folder, hf_model); built once per arch per session."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            folder = str(tmp_path_factory.mktemp(f"tiny-{arch}"))
            cache[arch] = (folder, make_tiny_model(folder, arch))
        return cache[arch]

    return get


def read_json(path):
    with open(path) as f:
        return json.load(f)
