"""Tiny random embedding models for the pooling tests, made with transformers and
saved with sentence-transformers' own files (fixed seeds, a temp dir):

  bert    BertModel, mean pooling + Normalize (written by sentence-transformers)
  bert_cls_legacy  the same weights, CLS pooling without Normalize, in the older
          modules.json / pooling_mode_cls_token spelling of hub checkpoints (bge)
  bert_plain       the same weights, no sentence-transformers files (vLLM's
          default: CLS, normalized)
  xlmr    XLMRobertaModel (padding_idx offset positions), CLS + Normalize
  qwen3   Qwen3Model (tensor names without the ``model.`` prefix, as
          Qwen3-Embedding), last-token pooling + Normalize, an EOS appended by the
          tokenizer, left padding, is_matryoshka
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex "
         "jolly bankers paris france sea waves hello world numbers café naïve").split()
VOCAB = 300


def texts(n: int, seed: int = 0, max_words: int = 40) -> list[str]:
    """n texts of 1..max_words words (ragged on purpose)."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, max_words + 1))))
            for _ in range(n)]


def _train(tok, specials):
    from tokenizers import trainers
    if hasattr(tok.model, "unk_token") and tok.model.__class__.__name__ == "WordPiece":
        trainer = trainers.WordPieceTrainer(vocab_size=VOCAB, special_tokens=specials,
                                            show_progress=False)
    else:
        from tokenizers import pre_tokenizers
        trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
    tok.train_from_iterator([" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))] * 4,
                            trainer)


def build_tokenizer(folder: str, style: str) -> None:
    """style: bert (WordPiece, [CLS] x [SEP]), xlmr (<s> x </s>, <pad> = 1) or qwen3
    (byte-level BPE, x <|endoftext|>, left padding). No chat template."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    if style == "bert":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        _train(tok, ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
        first, last = "[CLS]", "[SEP]"
        kw = dict(pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                  mask_token="[MASK]")
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        if style == "xlmr":
            _train(tok, ["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
            first, last = "<s>", "</s>"
            kw = dict(bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
                      cls_token="<s>", sep_token="</s>", mask_token="<mask>")
        else:
            _train(tok, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
            first, last = None, "<|endoftext|>"
            kw = dict(eos_token="<|endoftext|>", pad_token="<|endoftext|>", padding_side="left")
    single = " ".join(filter(None, [first, "$A", last]))
    specials = [(t, tok.token_to_id(t)) for t in (first, last) if t]
    tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
    PreTrainedTokenizerFast(tokenizer_object=tok, **kw).save_pretrained(folder)


def _scale(model, seed: int):
    """Random init is near-uniform attention: larger weights make parity a real check."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.12)
            elif "bias" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
            else:
                p.copy_(0.8 + 0.4 * torch.rand(p.shape, generator=gen))


def _hf_model(kind: str):
    import torch
    import transformers as tf
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=112)
    if kind == "bert":
        model = tf.BertModel(tf.BertConfig(**common, max_position_embeddings=128))
    elif kind == "xlmr":
        model = tf.XLMRobertaModel(tf.XLMRobertaConfig(
            **common, max_position_embeddings=258, type_vocab_size=1, pad_token_id=1,
            bos_token_id=0, eos_token_id=2))
    else:
        cfg = tf.Qwen3Config(**common, num_key_value_heads=2, head_dim=32,
                             max_position_embeddings=256, rms_norm_eps=1e-6,
                             tie_word_embeddings=True, use_sliding_window=False)
        cfg.is_matryoshka = True
        model = tf.Qwen3Model(cfg)
    _scale(model.float().eval(), seed=1)
    return model


def make_st_folder(folder: str, kind: str, pooling: str, normalize: bool = True) -> str:
    """An HF folder saved by sentence-transformers itself (modules.json, pooling config)."""
    from sentence_transformers import SentenceTransformer, models
    raw = folder + "-raw"
    _hf_model(kind).save_pretrained(raw)
    build_tokenizer(raw, "bert" if kind == "bert" else kind)
    transformer = models.Transformer(raw)
    modules = [transformer, models.Pooling(transformer.get_word_embedding_dimension(),
                                           pooling_mode=pooling)]
    if normalize:
        modules.append(models.Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(folder)
    shutil.rmtree(raw)
    return folder


def make_legacy_cls_folder(folder: str, source: str) -> str:
    """`source`'s weights with hub-style (sentence-transformers 2.x) files: CLS, no
    Normalize."""
    shutil.copytree(source, folder)
    for d in ("1_Pooling", "2_Normalize"):
        shutil.rmtree(os.path.join(folder, d), ignore_errors=True)
    os.makedirs(os.path.join(folder, "1_Pooling"))
    with open(os.path.join(folder, "modules.json"), "w") as f:
        json.dump([{"idx": 0, "name": "0", "path": "",
                    "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling",
                    "type": "sentence_transformers.models.Pooling"}], f)
    with open(os.path.join(folder, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, "pooling_mode_cls_token": True,
                   "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
                   "pooling_mode_mean_sqrt_len_tokens": False}, f)
    with open(os.path.join(folder, "sentence_bert_config.json"), "w") as f:
        json.dump({"max_seq_length": 128, "do_lower_case": False}, f)
    return folder


def make_plain_folder(folder: str, source: str) -> str:
    """`source`'s weights and tokenizer without any sentence-transformers file."""
    os.makedirs(folder)
    for f in os.listdir(source):
        if os.path.isfile(os.path.join(source, f)) and not f.startswith(
                ("modules", "sentence_", "config_sentence")):
            shutil.copy(os.path.join(source, f), folder)
    return folder
