"""`jaxllm bench throughput`: many requests through `LLM.generate` at once, reported
as `vllm bench throughput` reports them."""
from __future__ import annotations

import argparse
import json
import time

from jaxllm.benchmarks.datasets import (add_dataset_arguments, check_dataset_arguments,
                                        sample_requests)


def add_arguments(p) -> None:
    add_dataset_arguments(p)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly each request's output length, as vLLM does "
                        "(default: on)")
    p.add_argument("--n", type=int, default=1, help="completions per prompt (default: 1)")
    p.add_argument("--output-json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def check_arguments(args) -> None:
    check_dataset_arguments(args)


def run(args, llm, vocab_size: int) -> int:
    from jaxllm.sampling_params import SamplingParams
    requests = sample_requests(args.dataset_name, args.num_prompts, args.input_len,
                               args.output_len, args.range_ratio, vocab_size,
                               getattr(args, "seed", 0))
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(n=args.n, temperature=1.0, top_p=1.0, max_tokens=r.output_len,
                             ignore_eos=args.ignore_eos) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.disable_tqdm)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    result = throughput_result(elapsed, len(requests), prompt_tokens, output_tokens)
    print_throughput(result)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def throughput_result(elapsed: float, num_requests: int, prompt_tokens: int,
                      output_tokens: int) -> dict:
    total = prompt_tokens + output_tokens
    return {
        "elapsed_time": elapsed,
        "num_requests": num_requests,
        "total_num_tokens": total,
        "total_num_prompt_tokens": prompt_tokens,
        "total_num_output_tokens": output_tokens,
        "requests_per_second": num_requests / elapsed,
        "tokens_per_second": total / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
    }


def print_throughput(r: dict) -> None:
    print(f"Throughput: {r['requests_per_second']:.2f} requests/s, "
          f"{r['tokens_per_second']:.2f} total tokens/s, "
          f"{r['output_tokens_per_second']:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {r['total_num_prompt_tokens']}")
    print(f"Total num output tokens:  {r['total_num_output_tokens']}")
