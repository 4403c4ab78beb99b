"""`jaxllm bench latency`: the end-to-end time of one batch, repeated, reported as
`vllm bench latency` reports it (average and percentiles)."""
from __future__ import annotations

import json
import time

PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_arguments(p) -> None:
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens (default: 32)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens (default: 128)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per batch (default: 8)")
    p.add_argument("--n", type=int, default=1, help="completions per prompt (default: 1)")
    p.add_argument("--num-iters-warmup", type=int, default=10,
                   help="untimed batches first (default: 10)")
    p.add_argument("--num-iters", type=int, default=30, help="timed batches (default: 30)")
    p.add_argument("--output-json", metavar="FILE", help="also write the results as JSON")


def check_arguments(args) -> None:
    from jaxllm.config import ConfigError
    for key in ("input_len", "output_len", "batch_size", "n", "num_iters"):
        if getattr(args, key) < 1:
            raise ConfigError(f"{key}={getattr(args, key)}: must be >= 1")
    if args.num_iters_warmup < 0:
        raise ConfigError(f"num_iters_warmup={args.num_iters_warmup}: must be >= 0")


def run(args, llm, vocab_size: int) -> int:
    import numpy as np
    from jaxllm.sampling_params import SamplingParams
    rng = np.random.default_rng(getattr(args, "seed", 0))
    prompts = [{"prompt_token_ids": ids.tolist()}
               for ids in rng.integers(0, vocab_size, size=(args.batch_size, args.input_len))]
    params = SamplingParams(n=args.n, temperature=1.0, top_p=1.0, ignore_eos=True,
                            max_tokens=args.output_len)

    def once() -> float:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    for _ in range(args.num_iters_warmup):
        once()
    latencies = np.array([once() for _ in range(args.num_iters)])
    result = {
        "avg_latency": float(latencies.mean()),
        "latencies": latencies.tolist(),
        "percentiles": {str(p): float(np.percentile(latencies, p)) for p in PERCENTILES},
    }
    print(f"Avg latency: {result['avg_latency']} seconds")
    for p, value in result["percentiles"].items():
        print(f"{p}% percentile latency: {value} seconds")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
