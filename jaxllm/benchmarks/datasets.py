"""Benchmark requests: random token-id prompts with lengths drawn as vLLM's `random`
dataset draws them, or as BENCHMARKS.md's `sharegpt-like` workload does."""
from __future__ import annotations

from dataclasses import dataclass

DATASETS = ("random", "sharegpt-like")


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def uniform_lengths(rng, num: int, mean: int, range_ratio: float):
    """Integers uniform in [mean * (1 - r), mean * (1 + r)], at least 1 (vLLM's rule)."""
    low = max(1, int(mean * (1 - range_ratio)))
    high = max(low, int(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=num)


def sharegpt_like_lengths(num: int):
    """(input lengths, output lengths): lognormal with long tails, means ~200 / ~180."""
    import numpy as np
    rng = np.random.default_rng(0)
    inp = np.clip(np.round(rng.lognormal(4.8, 1.0, num)), 4, 1024).astype(int)
    out = np.clip(np.round(rng.lognormal(4.75, 0.95, num)), 4, 1024).astype(int)
    return inp, out


def sample_requests(dataset: str, num_prompts: int, input_len: int, output_len: int,
                    range_ratio: float, vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    import numpy as np
    rng = np.random.default_rng(seed)
    if dataset == "sharegpt-like":
        inp, out = sharegpt_like_lengths(num_prompts)
    else:
        inp = uniform_lengths(rng, num_prompts, input_len, range_ratio)
        out = uniform_lengths(rng, num_prompts, output_len, range_ratio)
    return [BenchRequest(rng.integers(0, vocab_size, size=int(n)).tolist(), int(m))
            for n, m in zip(inp, out)]


def add_dataset_arguments(p, num_prompts: int = 1000) -> None:
    p.add_argument("--dataset-name", choices=DATASETS, default="random",
                   help="random: lengths around --input-len/--output-len; sharegpt-like: "
                        "lognormal lengths (BENCHMARKS.md), ignoring those flags")
    p.add_argument("--num-prompts", type=int, default=num_prompts,
                   help=f"number of requests (default: {num_prompts})")
    p.add_argument("--input-len", "--random-input-len", dest="input_len", type=int,
                   default=1024, help="prompt tokens per request (default: 1024)")
    p.add_argument("--output-len", "--random-output-len", dest="output_len", type=int,
                   default=128, help="output tokens per request (default: 128)")
    p.add_argument("--range-ratio", "--random-range-ratio", dest="range_ratio", type=float,
                   default=0.0, help="lengths uniform in [len*(1-r), len*(1+r)] (default: 0)")


def check_dataset_arguments(args) -> None:
    from jaxllm.config import ConfigError
    for key in ("num_prompts", "input_len", "output_len"):
        if getattr(args, key) < 1:
            raise ConfigError(f"{key}={getattr(args, key)}: must be >= 1")
    if not 0.0 <= args.range_ratio < 1.0:
        raise ConfigError(f"range_ratio={args.range_ratio}: must be in [0, 1)")
