"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF): greedy parity with
HF transformers loading the same GGUF file (float32), and its tokenizer."""
from __future__ import annotations

import os

import pytest
import torch

from jaxllm.models.gguf_loader import default_model_path

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "How do I boil an egg?",
]


@pytest.fixture(scope="module")
def hf_gguf():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = default_model_path()
    folder, name = os.path.split(path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return tok, model.eval()


@pytest.fixture(scope="module")
def llm():
    from jaxllm import LLM
    return LLM(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=256,
               enforce_eager=True)


def test_tokenizer_and_chat_template_match_hf(llm, hf_gguf):
    hf_tok, _ = hf_gguf
    ours = llm.get_tokenizer()
    for p in PROMPTS + ["naïve café 東京 🙂  spaces\n\ttabs"]:
        assert ours.encode(p) == hf_tok.encode(p)
        conv = [{"role": "user", "content": p}]
        assert (ours.apply_chat_template(conv, tokenize=False, add_generation_prompt=True) ==
                hf_tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True))


def test_greedy_chat_matches_hf_gguf(llm, hf_gguf):
    from jaxllm import SamplingParams
    hf_tok, hf = hf_gguf
    convs = [[{"role": "user", "content": p}] for p in PROMPTS]
    outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=32, min_tokens=32),
                    use_tqdm=False)
    for conv, out in zip(convs, outs):
        ids = hf_tok.apply_chat_template(conv, add_generation_prompt=True, return_tensors="pt",
                                         return_dict=True)["input_ids"]
        assert out.prompt_token_ids == ids[0].tolist()
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False,
                              pad_token_id=hf_tok.pad_token_id)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist(), conv
