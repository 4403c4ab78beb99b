"""The peer beside bench_h200.py's figures: HF transformers `generate` on the same
shapes with random bf16 weights (`--hf-peer`, run in a process of its own), and the
ShareGPT-like request lengths both sides use."""
from __future__ import annotations

import time

import numpy as np


def sharegpt_lengths(n=1000):
    rng = np.random.default_rng(0)
    inp = np.clip(np.round(rng.lognormal(4.8, 1.0, n)), 4, 1024).astype(int)
    out = np.clip(np.round(rng.lognormal(4.75, 0.95, n)), 4, 1024).astype(int)
    return inp, out


def hf_peer(model_dir, vocab, args):
    """HF transformers `generate` on the same shape with random bf16 weights."""
    import torch
    import transformers as tf
    cfg = tf.AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    rng = np.random.default_rng(0)
    res = {}
    ids = torch.tensor(rng.integers(100, vocab - 100, (8, 32)), device="cuda")
    kw = dict(do_sample=False, max_new_tokens=128, min_new_tokens=128, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, **kw)
        torch.cuda.synchronize()
        res["latency_ms"] = 1000 * (time.perf_counter() - t0)
        if "sharegpt" in args.workloads:
            res.update(hf_sharegpt(model, vocab, n=args.hf_sharegpt_requests))
    del model
    torch.cuda.empty_cache()
    return res


def hf_sharegpt(model, vocab, n=128, batch=64):
    """Static batches of 64 in arrival order, left padded, each run to its longest."""
    import torch
    inp, out = sharegpt_lengths()
    rng = np.random.default_rng(3)
    t0 = time.perf_counter()
    useful = 0
    for b in range(0, n, batch):
        lens, outs = inp[b:b + batch], out[b:b + batch]
        width = int(lens.max())
        ids = np.zeros((len(lens), width), np.int64)
        mask = np.zeros_like(ids)
        for i, k in enumerate(lens):
            ids[i, width - k:] = rng.integers(100, vocab - 100, k)
            mask[i, width - k:] = 1
        model.generate(torch.tensor(ids, device="cuda"),
                       attention_mask=torch.tensor(mask, device="cuda"), do_sample=False,
                       max_new_tokens=int(outs.max()), min_new_tokens=int(outs.max()),
                       pad_token_id=0)
        useful += int(outs.sum())
    torch.cuda.synchronize()
    t = time.perf_counter() - t0
    return {"sharegpt_requests_s": n / t, "sharegpt_useful_output_tok_s": useful / t,
            "sharegpt_requests": n}
