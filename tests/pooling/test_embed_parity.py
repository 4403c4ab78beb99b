"""LLM.embed against sentence-transformers (and HF transformers) on the same folder:
float32 on CPU, ragged batches of mixed lengths, cosine >= 0.99999 per text.

A small token budget (256) and 8 rows a step make each batch span several length
buckets, full and partial steps."""
from __future__ import annotations

import gc

import numpy as np
import pytest
from embed_models import texts

from jaxllm import LLM
from jaxllm.pooling import EmbeddingRequestOutput, PoolingParams

MIN_COS = 0.99999
ENGINE = dict(runner="pooling", dtype="float32", max_num_batched_tokens=256, max_num_seqs=8)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def st_vectors(folder: str, inputs: list[str], batch_size: int = 7) -> np.ndarray:
    from sentence_transformers import SentenceTransformer
    model = SentenceTransformer(folder, device="cpu")
    return model.encode(inputs, batch_size=batch_size, convert_to_numpy=True)


def stacked(outs) -> np.ndarray:
    return np.stack([np.asarray(o.outputs.embedding, np.float32) for o in outs])


@pytest.fixture(scope="module")
def llms(embed_model):
    cache = {}

    def get(name: str) -> LLM:
        if name not in cache:
            cache[name] = LLM(embed_model(name), **ENGINE)
        return cache[name]
    return get


@pytest.mark.parametrize("name", ["bert", "xlmr", "qwen3", "bert_cls_legacy"])
def test_matches_sentence_transformers(name, embed_model, llms):
    inputs = texts(29, seed=11)
    ref = st_vectors(embed_model(name), inputs)
    outs = llms(name).embed(inputs, use_tqdm=False)
    assert all(isinstance(o, EmbeddingRequestOutput) for o in outs)
    got = stacked(outs)
    assert got.shape == ref.shape
    assert cosines(got, ref).min() >= MIN_COS
    # The vectors themselves, not only their directions (normalized or not).
    np.testing.assert_allclose(got, ref, atol=2e-5 * np.abs(ref).max())
    lengths = [len(o.prompt_token_ids) for o in outs]
    assert min(lengths) < 8 < 40 < max(lengths)      # several buckets, truly ragged


def test_pipelines_read_from_the_folder(embed_model, llms):
    """mean + Normalize (written by sentence-transformers), CLS without Normalize (the
    older hub spelling), last token for the decoder."""
    info = {n: llms(n).llm_engine.info for n in ("bert", "bert_cls_legacy", "qwen3", "xlmr")}
    assert (info["bert"].pooling_type, info["bert"].normalize) == ("MEAN", True)
    assert (info["bert_cls_legacy"].pooling_type,
            info["bert_cls_legacy"].normalize) == ("CLS", False)
    assert (info["qwen3"].pooling_type, info["xlmr"].pooling_type) == ("LAST", "CLS")
    norms = np.linalg.norm(stacked(llms("bert_cls_legacy").embed(texts(4), use_tqdm=False)), axis=1)
    assert np.all(np.abs(norms - 1) > 1e-3)       # not normalized


def test_plain_folder_is_cls_normalized_as_hf(embed_model):
    """Without sentence-transformers files: vLLM's default for an encoder, the CLS
    state normalized; against HF transformers' BertModel."""
    import torch
    from transformers import AutoModel, AutoTokenizer
    folder = embed_model("bert_plain")
    inputs = texts(13, seed=4)
    tok = AutoTokenizer.from_pretrained(folder)
    hf = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        batch = tok(inputs, padding=True, return_tensors="pt")
        cls = hf(**batch).last_hidden_state[:, 0].numpy()
    ref = cls / np.linalg.norm(cls, axis=1, keepdims=True)
    llm = LLM(folder, dtype="float32", max_num_batched_tokens=256, max_num_seqs=8)
    assert llm.runner_type == "pooling"        # auto: an encoder folder
    got = stacked(llm.embed(inputs, use_tqdm=False))
    assert cosines(got, ref).min() >= MIN_COS
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_token_ids_and_texts_agree(llms):
    llm = llms("xlmr")
    inputs = texts(6, seed=2)
    by_text = llm.embed(inputs, use_tqdm=False)
    ids = [o.prompt_token_ids for o in by_text]
    by_ids = llm.embed([{"prompt_token_ids": t} for t in ids], use_tqdm=False)
    np.testing.assert_array_equal(stacked(by_text), stacked(by_ids))
    one = llm.embed(ids[0], use_tqdm=False)        # a bare list of ids is one prompt
    assert len(one) == 1 and one[0].prompt_token_ids == ids[0]
    # Alone it runs at another step shape: equal up to float rounding.
    np.testing.assert_allclose(stacked(one)[0], stacked(by_text)[0], atol=1e-6)


def test_alone_equals_in_a_batch(llms):
    """A text's vector does not depend on what shares its step."""
    llm = llms("qwen3")
    inputs = texts(20, seed=8)
    batch = stacked(llm.embed(inputs, use_tqdm=False))
    for i in (0, 7, 19):
        alone = stacked(llm.embed(inputs[i], use_tqdm=False))[0]
        np.testing.assert_allclose(alone, batch[i], atol=1e-6)


def test_matryoshka_dimensions_cut_then_normalize(embed_model, llms):
    inputs = texts(9, seed=3)
    full = st_vectors(embed_model("qwen3"), inputs)
    outs = llms("qwen3").embed(inputs, PoolingParams(dimensions=16), use_tqdm=False)
    got = stacked(outs)
    assert got.shape == (9, 16)
    assert cosines(got, full[:, :16]).min() >= MIN_COS
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_dimensions_refused_without_matryoshka(llms):
    with pytest.raises(ValueError, match="does not support matryoshka"):
        llms("bert").embed("hello", PoolingParams(dimensions=16), use_tqdm=False)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llms):
    llm = llms("bert")
    long_text = texts(1, seed=1, max_words=40)[0] + " the quick brown fox" * 30
    ids = llm.embed([long_text], truncate_prompt_tokens=-1, use_tqdm=False)[0].prompt_token_ids
    assert len(ids) == llm.llm_engine.max_model_len == 128
    with pytest.raises(ValueError, match="maximum context length is 128"):
        llm.embed([long_text], use_tqdm=False)
    cut = llm.embed([long_text], truncate_prompt_tokens=20, use_tqdm=False)[0]
    full = llm.get_tokenizer()(long_text).input_ids
    assert len(full) > 128
    assert cut.prompt_token_ids == full[-20:]
    again = llm.embed({"prompt_token_ids": full[-20:]}, use_tqdm=False)[0]
    np.testing.assert_array_equal(cut.outputs.data, again.outputs.data)


@pytest.mark.parametrize("name", ["bert", "xlmr", "qwen3"])
def test_direct_tokenizing_equals_the_transformers_call(name, llms):
    """The engine calls the Rust tokenizer itself (engine._encode); the ids must be
    the transformers wrapper's, special-token spellings in the text included, and a
    tokenizer with its own truncation set goes through the wrapper."""
    engine = llms(name).llm_engine
    tok = engine.tokenizer
    inputs = texts(40, seed=21) + ["[SEP] <s> </s> <|endoftext|> [CLS] mid", " lead", ""]
    want = tok(inputs, add_special_tokens=True)["input_ids"]
    assert engine._encode(inputs) == want
    tok._tokenizer.enable_truncation(5)     # the wrapper lifts it; a direct call would cut
    try:
        assert engine._encode(inputs) == want
    finally:
        tok._tokenizer.no_truncation()
    assert gc.isenabled()
    llms(name).embed(inputs[:5], use_tqdm=False)
    assert gc.isenabled()           # LLM.embed pauses the collector and turns it back on
