"""Issue 22's sampled `latency` line alone, and where a sampled step's time goes.

`latency` (8 x 32/128) greedy, with temperature 0.8 / top_p 0.95 / top_k 50 (the
issue's), and with temperature 0.8 only, runs interleaved, on bench_defaults.py's
engine (Llama-3.1-8B shape, dummy weights, max_num_seqs 256). Per run: the engine
thread's host time per step in each model-runner phase, and its wait for the device
in get_output (near 0: the host sets the pace; large: the device does). Then each
warmed-up sampler program of 8 rows alone: host time to launch it (numpy metadata,
as the engine passes it, and metadata already on the device) and launch-to-ready.

    python3 scripts/bench_sampled_latency.py --compile-cache DIR

JSON to $OUT/bench_sampled_latency.json when OUT is set.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from bench_h200 import random_prompts, timed_generate  # noqa: E402

PHASES = ("prepare_inputs", "_sampling_metadata", "launch_step", "sample_step", "get_output")


def time_phases(runner) -> dict:
    """Wrap the runner's phases (on the instance) with timers; name -> list of seconds."""
    times = collections.defaultdict(list)
    for name in PHASES:
        def timed(*a, _f=getattr(runner, name), _name=name, **k):
            t0 = time.perf_counter()
            try:
                return _f(*a, **k)
            finally:
                times[_name].append(time.perf_counter() - t0)
        setattr(runner, name, timed)
    return times


def modes():
    from jaxllm import SamplingParams
    common = dict(max_tokens=128, ignore_eos=True)
    return {"greedy": SamplingParams(temperature=0, **common),
            "filters": [SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=i, **common)
                        for i in range(8)],
            "temperature": [SamplingParams(temperature=0.8, seed=i, **common)
                            for i in range(8)]}


def engine_runs(llm, vocab: int, repeat: int) -> dict:
    prompts = random_prompts(np.random.default_rng(0), 8, 32, vocab)
    times = time_phases(llm.llm_engine.runner)
    walls = collections.defaultdict(list)
    phases = collections.defaultdict(lambda: collections.defaultdict(list))
    for name, params in modes().items():
        timed_generate(llm, prompts, params)                  # warm
    for _ in range(repeat):
        for name, params in modes().items():
            times.clear()
            walls[name].append(timed_generate(llm, prompts, params)[0])
            for phase, ts in times.items():
                phases[name][phase].append(1e6 * statistics.median(ts))
    greedy = statistics.median(walls["greedy"])
    return {name: {"ms": 1000 * statistics.median(w), "ratio": statistics.median(w) / greedy,
                   "all_ms": [round(1000 * x, 1) for x in w],
                   "phase_us_median": {p: round(statistics.median(v), 1)
                                       for p, v in phases[name].items()}}
            for name, w in walls.items()}


def sampler_alone(runner, vocab: int, n: int = 100) -> dict:
    """Each warmed-up 8-row sampler program: host launch time and launch-to-ready."""
    import jax
    from jaxllm.runner.sampler import SamplingMetadata
    logits = jax.device_put(np.random.default_rng(0).normal(size=(8, vocab)).astype(np.float32))
    out = {}
    for name, params in modes().items():
        params = params if isinstance(params, list) else [params] * 8
        md, flags = SamplingMetadata.from_params(params, [0] * 8, None, None, 8, vocab)
        program = runner.compilation.programs.get(("sample", 8, flags))
        if program is None:            # compiling in the background (a CPU start)
            continue
        token_buf = jax.device_put(np.zeros(runner.plan.max_seqs, np.int32))  # its shape
        for where, meta in (("numpy_md", md), ("device_md", jax.device_put(md))):
            launch, ready = [], []
            for _ in range(n):
                jax.block_until_ready(logits)
                t0 = time.perf_counter()
                res = program(logits, meta, token_buf)
                t1 = time.perf_counter()
                jax.block_until_ready(res)
                launch.append(t1 - t0)
                ready.append(time.perf_counter() - t0)
            out[f"{name}/{where}"] = {"launch_us": round(1e6 * statistics.median(launch), 1),
                                      "ready_us": round(1e6 * statistics.median(ready), 1)}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="configs/models/llama-3.1-8b")
    ap.add_argument("--compile-cache", metavar="DIR")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=4096)
    args = ap.parse_args()
    from jaxllm import LLM, compilation_cache
    from jaxllm.models.loader import read_hf_config
    compilation_cache.enable(args.compile_cache)
    vocab = read_hf_config(args.model)["vocab_size"]
    llm = LLM(args.model, load_format="dummy", dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_seqs=256)
    res = {"engine": engine_runs(llm, vocab, args.repeat),
           "sampler_alone_8_rows": sampler_alone(llm.llm_engine.runner, vocab)}
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_sampled_latency.json"), "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))
    for name, r in res["engine"].items():
        print(f"{name:12s} {r['ms']:7.1f} ms  {r['ratio']:.3f}x greedy  phases (us/step): "
              + ", ".join(f"{p} {v}" for p, v in r["phase_us_median"].items()))


if __name__ == "__main__":
    main()
