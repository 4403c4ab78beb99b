"""Bare decode-step time against the decode kernel's k-split count, at small batches.

A split count above 1 needs the combine (two small XLA kernels per layer); 1 needs
none but leaves SMs idle on long contexts. For each setting the step programs are
traced and compiled anew (the split count is static), then timed queued back to
back (``step_profile.time_steps``). GPU only; dummy weights.

    python scripts/decode_splits_probe.py --model configs/models/llama-3.1-8b
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="configs/models/llama-3.1-8b")
    ap.add_argument("--splits", default="default,1,2,4")
    ap.add_argument("--shapes", default="8x100,8x1000,8x2000,64x1000",
                    help="batch x context, comma-separated")
    ap.add_argument("--out", help="also write the table as JSON")
    args = ap.parse_args()
    import jax
    import step_profile
    from jaxllm import LLM
    import pallas_kernels.paged_attention_decode as decode
    llm = LLM(args.model, load_format="dummy", max_model_len=2048, max_num_seqs=256,
              max_num_batched_tokens=8192, enforce_eager=True)
    runner = llm.llm_engine.runner
    heuristic = decode.default_k_splits
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    rows = []
    for setting in args.splits.split(","):
        decode.default_k_splits = heuristic if setting == "default" else (
            lambda *a, n=int(setting): n)
        jax.clear_caches()
        runner._programs.clear()
        for batch, ctx in shapes:
            arrays, decode_only = step_profile.step_arrays(runner, batch, ctx)
            t = step_profile.time_steps(runner, arrays, decode_only, iters=50)
            w = runner.max_blocks_per_seq * runner.block_size // 64
            used = heuristic(batch, runner.arch.num_kv_heads, w) if setting == "default" \
                else int(setting)
            rows.append({"splits": setting, "k_splits": used, "batch": batch, "ctx": ctx,
                         "step_ms": round(t["step_ms_queued"], 4)})
            print(json.dumps(rows[-1]), flush=True)
    decode.default_k_splits = heuristic
    print(f"\n{'splits':>8} {'batch':>6} {'ctx':>6} {'step ms':>9}")
    for r in rows:
        print(f"{r['splits']:>8} {r['batch']:>6} {r['ctx']:>6} {r['step_ms']:>9.4f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
