"""Speculative decoding on one GPU (issue 20): the verify step's cost against the
plain decode step, and end-to-end decode-1 with drafts that are always right and
with drafts that are always wrong, all in one engine and one run.

    python scripts/bench_spec.py --model configs/models/llama-3.1-8b

Random (`dummy`) weights, bf16, random prompt ids. Random weights cannot make a real
draft agree, so two benchmark-only proposers stand in:
- `Replay`: the target's own greedy continuation, recorded in an earlier run of the
  same request with speculation off (every draft is accepted);
- `Wrong`: k tokens that differ from the target's (none is accepted).

1. Step cost: B requests (prompt 512) decoding; mean wall time of engine.step()
   over --steps steps, for plain async steps, plain synchronous steps, and verify
   steps with k = 1..5 drafts each (Wrong drafts with the acceptance policy off, so
   every step verifies k drafts). One token per request per step throughout, so the
   context barely moves between the rows of the table.
2. decode-1 (one request, prompt 128, 512 tokens, greedy): plain, k=4 Replay, and
   k=4 Wrong with the engine's own policy (it stops drafting for a request whose
   drafts are not accepted, probing now and then).
Prints a table last; JSON to $OUT/bench_spec.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


class Replay:
    """Drafts the recorded continuation of each request (by its prompt)."""
    num_lookahead_tokens = 0

    def __init__(self, truth: dict):
        self.truth = truth

    def propose(self, requests, max_drafts, block_tables):
        return [list(self.truth[tuple(r.prompt_token_ids)][r.num_tokens:r.num_tokens + k])
                for r, k in zip(requests, max_drafts)]

    def finish(self, request_ids):
        pass


class Wrong:
    """k drafts none of which the target samples (token ids it never emits here:
    the recorded outputs say which those are not; random weights pick from the
    whole vocabulary, so an id shifted from the last token is wrong in practice)."""
    num_lookahead_tokens = 0

    def __init__(self, k: int, vocab: int):
        self.k, self.vocab = k, vocab

    def propose(self, requests, max_drafts, block_tables):
        return [[(r.all_token_ids[-1] + 7 + j) % self.vocab for j in range(min(self.k, m))]
                for r, m in zip(requests, max_drafts)]

    def finish(self, request_ids):
        pass


def set_speculation(llm, proposer, policy: bool = True):
    """proposer None: plain decoding (the engine's async steps)."""
    from jaxllm.spec_decode.policy import SpecPolicy, spec_policy
    core, ex = llm.llm_engine.engine_core, llm.llm_engine.executor
    ex.proposer = proposer
    if proposer is None:
        core.spec_policy = None
    elif policy:
        core.spec_policy = spec_policy(core.spec_config)
    else:      # every step drafts for every request
        core.spec_policy = SpecPolicy(core.spec_config.num_speculative_tokens, 1 << 30,
                                      cost=lambda batch: 1.0)


def step_ms(llm, batch: int, prompt_len: int, steps: int, vocab: int, seed: int) -> float:
    from jaxllm import SamplingParams
    eng = llm.llm_engine
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0, max_tokens=steps * 6 + 64, ignore_eos=True)
    ids = [f"s{seed}-{i}" for i in range(batch)]
    for rid in ids:
        eng.add_request(rid, {"prompt_token_ids": rng.integers(100, vocab - 100,
                                                              prompt_len).tolist()}, params)
    while any(eng.scheduler.requests[r].num_output_tokens < 2 for r in ids):
        eng.step()                    # prefill, and the first decode steps
    for _ in range(5):
        eng.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    dt = (time.perf_counter() - t0) / steps
    eng.abort_request(ids)
    while eng.has_unfinished_requests():
        eng.step()
    return 1000 * dt


def decode1(llm, prompt, n: int) -> tuple[float, list[int]]:
    from jaxllm import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8,
                                                                ignore_eos=True), use_tqdm=False)
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return n / (time.perf_counter() - t0), out[0].outputs[0].token_ids


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="configs/models/llama-3.1-8b")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--ks", default="1,2,3,4,5")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--decode-tokens", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--prompt-len", type=int, default=512, help="step-cost requests' prompts")
    ap.add_argument("--compile-cache", metavar="DIR")
    ap.add_argument("--skip-steps", action="store_true", help="decode-1 only")
    args = ap.parse_args()
    import jax
    from jaxllm import LLM, compilation_cache
    from jaxllm.models.loader import read_hf_config
    compilation_cache.enable(args.compile_cache)
    vocab = read_hf_config(args.model)["vocab_size"]
    batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    t0 = time.perf_counter()
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", max_model_len=args.max_model_len,
              max_num_seqs=max(batches), max_num_batched_tokens=1024,
              speculative_config={"method": "ngram", "num_speculative_tokens": max(ks),
                                  "disable_by_batch_size": max(batches)})
    res = {"device": str(jax.devices()[0].device_kind), "startup_s": time.perf_counter() - t0,
           "steps": {}, "decode1": {}}
    print(f"engine up in {res['startup_s']:.1f} s", flush=True)
    if not args.skip_steps:
        for b in batches:
            row = {}
            set_speculation(llm, None)
            row["plain_async"] = step_ms(llm, b, args.prompt_len, args.steps, vocab, 1)
            llm.llm_engine.async_scheduling = False
            row["plain_sync"] = step_ms(llm, b, args.prompt_len, args.steps, vocab, 2)
            llm.llm_engine.async_scheduling = True
            for k in ks:
                set_speculation(llm, Wrong(k, vocab), policy=False)
                row[f"verify_k{k}"] = step_ms(llm, b, args.prompt_len, args.steps, vocab, 3 + k)
            res["steps"][b] = row
            print(b, {k: round(v, 2) for k, v in row.items()}, flush=True)
    rng = np.random.default_rng(1)
    prompt = rng.integers(100, vocab - 100, 128).tolist()
    set_speculation(llm, None)
    tok_s, truth = decode1(llm, prompt, args.decode_tokens)
    res["decode1"]["plain"] = tok_s
    set_speculation(llm, Replay({tuple(prompt): prompt + truth}), policy=False)
    before = llm.llm_engine.engine_core.spec_stats.snapshot()
    res["decode1"]["k4_replay"], out = decode1(llm, prompt, args.decode_tokens)
    res["decode1"]["k4_replay_identical"] = out == truth
    stats = llm.llm_engine.engine_core.spec_stats
    res["decode1"]["replay_accepted_of_drafted"] = [
        stats.num_accepted_tokens - before.num_accepted_tokens,
        stats.num_draft_tokens - before.num_draft_tokens]
    set_speculation(llm, Wrong(4, vocab), policy=True)
    res["decode1"]["k4_wrong_policy"], out = decode1(llm, prompt, args.decode_tokens)
    res["decode1"]["k4_wrong_identical"] = out == truth
    print(json.dumps(res, indent=1))
    print_table(res)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_spec.json"), "w") as f:
            json.dump(res, f, indent=1)


def print_table(res):
    print(f"\n{res['device']}")
    if res["steps"]:
        cols = list(next(iter(res["steps"].values())))
        print("| batch | " + " | ".join(cols) + " |")
        print("|---" * (len(cols) + 1) + "|")
        for b, row in res["steps"].items():
            print(f"| {b} | " + " | ".join(f"{row[c]:.2f} ms" for c in cols) + " |")
    d = res["decode1"]
    print(f"decode-1: plain {d['plain']:.1f} tok/s; k=4 replay {d['k4_replay']:.1f} tok/s "
          f"({d['k4_replay'] / d['plain']:.2f}x, identical {d['k4_replay_identical']}); "
          f"k=4 always wrong with the policy {d['k4_wrong_policy']:.1f} tok/s "
          f"({d['k4_wrong_policy'] / d['plain']:.3f}x, identical {d['k4_wrong_identical']})")


if __name__ == "__main__":
    main()
