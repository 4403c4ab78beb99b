"""The engine's tokenizer: an HF folder's, a GGUF file's, or a placeholder of the
model's vocabulary for a --load-format dummy folder; --chat-template's template.

Reads no weights, so it can load on a thread while they do."""
from __future__ import annotations

import os

from jaxllm.models.errors import CheckpointError


def get_tokenizer(path: str | None, tokenizer: str | None = None,
                  vocab_size: int | None = None):
    """The tokenizer of an HF folder or GGUF file (None = the embedded default).

    A folder with only config.json (a `--load-format dummy` shape) gets a placeholder
    when `vocab_size` is given: benchmarks feed token ids and need no real text."""
    from jaxllm.models.gguf_loader import default_model_path, gguf_tokenizer
    path = tokenizer or path or default_model_path()
    if path.endswith(".gguf"):
        return gguf_tokenizer(path)
    if os.path.isdir(path) and not any(
            os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer.model")):
        if vocab_size is not None:
            return placeholder_tokenizer(vocab_size)
        raise CheckpointError(f"{path}: no tokenizer.json or tokenizer.model")
    # Imported only here: AutoTokenizer imports torch where it is installed (through
    # transformers' configuration_utils), seconds that a placeholder does not need.
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot load a tokenizer ({e})") from None


def load_tokenizer(model_config):
    """The engine's tokenizer (``config.model``'s): get_tokenizer's, a placeholder of
    the model's vocabulary for a --load-format dummy folder without one, and
    --chat-template's template if given. Reads no weights, so it can load on a thread
    while they do."""
    mc = model_config
    vocab_size = None
    if mc.load_format == "dummy" and mc.model and os.path.isdir(mc.model):
        from jaxllm.models.loader import read_hf_config
        from jaxllm.models.registry import arch_from_hf_config
        source = os.path.join(mc.model, "config.json")
        vocab_size = arch_from_hf_config(read_hf_config(mc.model), source).vocab_size
    tokenizer = get_tokenizer(mc.model, mc.tokenizer, vocab_size=vocab_size)
    if mc.chat_template:
        with open(mc.chat_template) as f:
            tokenizer.chat_template = f.read()
    return tokenizer


def placeholder_tokenizer(vocab_size: int):
    """Token i <-> the word "t{i}": enough to run and detokenize random-weight models."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t0")
