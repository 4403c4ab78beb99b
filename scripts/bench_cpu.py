"""CPU benchmark: `LLM.generate` vs HF transformers `generate` on the default model
(SmolLM2-135M-Instruct GGUF, float32), same prompts, same run.

    python scripts/bench_cpu.py --num-prompts 16 --max-tokens 64

Both sides are greedy with min_tokens = max_tokens, so they produce the same number of
tokens; HF runs the prompts as one left-padded batch (how its users batch) and also
one at a time. Prints a table with the ratios.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.", "List three prime numbers.",
    "How do I boil an egg?", "Name a famous painter.", "What is 12 times 12?",
    "Give me a synonym for happy.",
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxllm import LLM, SamplingParams
    from jaxllm.models.gguf_loader import default_model_path

    convs = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" ({i})"}]
             for i in range(args.num_prompts)]
    n, k = args.num_prompts, args.max_tokens
    t0 = time.perf_counter()
    llm = LLM(max_model_len=1024, max_num_seqs=max(8, n), max_num_batched_tokens=1024)
    start = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=k, min_tokens=k)
    llm.chat(convs[:2], params, use_tqdm=False)                   # warm
    t0 = time.perf_counter()
    outs = llm.chat(convs, params, use_tqdm=False)
    ours = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == k for o in outs)

    folder, name = os.path.split(default_model_path())
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tok.padding_side = "left"
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in convs]
    kw = dict(max_new_tokens=k, min_new_tokens=k, do_sample=False, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        hf.generate(**tok(texts[:2], return_tensors="pt", padding=True,
                          add_special_tokens=False), **kw)
        t0 = time.perf_counter()
        hf.generate(**batch, **kw)
        hf_batched = time.perf_counter() - t0
        t0 = time.perf_counter()
        for t in texts:
            hf.generate(**tok([t], return_tensors="pt", add_special_tokens=False), **kw)
        hf_single = time.perf_counter() - t0
    total = n * k
    print(f"\n# default model on CPU ({os.cpu_count()} cores), torch {torch.__version__}, "
          f"{n} prompts x {k} tokens; jaxllm start-up {start:.1f} s")
    print(f"{'jaxllm LLM.generate':28s} {ours:7.2f} s {total / ours:8.1f} out tok/s")
    print(f"{'HF generate (one batch)':28s} {hf_batched:7.2f} s {total / hf_batched:8.1f} out tok/s"
          f"   ratio jaxllm/HF {hf_batched / ours:.2f}x")
    print(f"{'HF generate (one by one)':28s} {hf_single:7.2f} s {total / hf_single:8.1f} out tok/s"
          f"   ratio jaxllm/HF {hf_single / ours:.2f}x")


if __name__ == "__main__":
    main()
