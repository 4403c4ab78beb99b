"""Issue 22's sampled `latency` line alone, and where a sampled step's time goes.

`latency` (8 x 32/128) greedy, with temperature 0.8 / top_p 0.95 / top_k 50 (the
issue's), and with temperature 0.8 only, runs interleaved, on bench_defaults.py's
engine (Llama-3.1-8B shape, dummy weights, max_num_seqs 256). Per run: the engine
thread's host time per step in each model-runner phase, and its wait for the device
in get_output (near 0: the host sets the pace; large: the device does). Then each
warmed-up sampler program of 8 rows alone: host time to launch it (numpy metadata,
as the engine passes it, and metadata already on the device) and launch-to-ready.

    python3 scripts/bench_sampled_latency.py --compile-cache DIR

`--sampler-only` skips the engine and times the sampler program alone at S = 1, 8,
64 rows (bf16 values in f32 logits, as the step hands them over): greedy, temperature
only, and temperature 0.8 / top_p 0.95 / top_k 50 with the filters by the sort twin,
the radix search and the block path; then each filter alone (the block path at three
block sizes), and whether the block path kept the sort's set on this device.
`--vocab 4096 --quick` runs it in seconds on a CPU.

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
    from jaxllm.runner import sampling_rows
    logits = jax.device_put(np.random.default_rng(0).normal(size=(8, vocab)).astype(np.float32))
    out = {}
    for name, params in modes().items():
        params = params if isinstance(params, list) else [params] * 8
        md, flags = sampling_rows.from_params(params, [0] * 8, None, None, 8, vocab)
        program = runner.compilation.programs.get(("sample", 8, flags))
        if program is None:            # compiling in the background (a CPU start)
            continue
        token_buf = jax.device_put(np.zeros(runner.plan.max_seqs, np.int32))  # its shape
        for where, meta in (("numpy_md", md), ("device_md", jax.device_put(md))):
            launch, ready = [], []
            for _ in range(n):
                jax.block_until_ready(logits)
                t0 = time.perf_counter()
                token_buf, res = program(logits, meta, token_buf)   # (donated)
                t1 = time.perf_counter()
                jax.block_until_ready(res)
                launch.append(t1 - t0)
                ready.append(time.perf_counter() - t0)
            out[f"{name}/{where}"] = {"launch_us": round(1e6 * statistics.median(launch), 1),
                                      "ready_us": round(1e6 * statistics.median(ready), 1)}
    return out


def _launch_to_ready(fn, args, n: int) -> float:
    """Median microseconds from the call to its result ready, inputs ready before."""
    import jax
    times = []
    for _ in range(n + 1):
        jax.block_until_ready(args)
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return round(1e6 * statistics.median(times[1:]), 1)


def _sampler_variants(rows: int, vocab: int):
    """name -> (filter replacing the block path or the radix search or None, params)."""
    from jaxllm import SamplingParams
    from jaxllm.runner import top_k_top_p as tkp
    filt = [SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=i) for i in range(rows)]
    return {"greedy": (None, [SamplingParams(temperature=0)] * rows),
            "temperature": (None, [SamplingParams(temperature=0.8, seed=i) for i in range(rows)]),
            "filters_sort": (tkp.ref_apply_top_k_top_p, filt),
            "filters_radix": (tkp.apply_top_k_top_p, filt),
            "filters_blocks": (None, filt)}


def sampler_table(vocab: int, row_counts, n: int) -> dict:
    """Launch-to-ready of the whole sampler program and of each filter alone, us."""
    import functools
    import jax
    import jax.numpy as jnp
    from jaxllm.runner import sampler, sampling_rows
    from jaxllm.runner import top_k_top_p as tkp
    res = {}
    for rows in row_counts:
        x = np.random.default_rng(rows).normal(size=(rows, vocab)) * 4
        logits = jax.device_put(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
        for name, (filt, params) in _sampler_variants(rows, vocab).items():
            md, flags = sampling_rows.from_params(params, [0] * rows, None, None,
                                                             rows, vocab)
            if filt is not None:     # the general program, its filter swapped while traced
                flags = sampler.SamplerFlags(**{**flags.__dict__, "small_top_k": False})
            saved = sampler.apply_top_k_top_p
            sampler.apply_top_k_top_p = filt or saved
            md = jax.device_put(md)
            try:
                # All outputs, as the engine's program has them (logprob and rank too).
                program = jax.jit(lambda a, m, f=flags: sampler.sample(a, m, f))
                program = program.lower(logits, md).compile()
            finally:
                sampler.apply_top_k_top_p = saved
            res[f"S{rows}/sample/{name}"] = _launch_to_ready(program, (logits, md), n)
        top_k = jnp.full((rows,), 50, jnp.int32)
        top_p = jnp.full((rows,), 0.95, jnp.float32)
        filters = {"sort": tkp.ref_apply_top_k_top_p, "radix": tkp.apply_top_k_top_p}
        for block in (32, 64, 128):
            filters[f"blocks{block}"] = functools.partial(tkp.apply_small_top_k_top_p,
                                                          block=block)
        kept = {}
        for name, fn in filters.items():
            f = jax.jit(fn)
            kept[name] = np.isfinite(np.asarray(f(logits, top_k, top_p)))
            res[f"S{rows}/filter/{name}"] = _launch_to_ready(f, (logits, top_k, top_p), n)
        res[f"S{rows}/blocks_kept_sort_set"] = all(
            bool((kept[k] == kept["sort"]).all()) for k in kept if k.startswith("blocks"))
    return res


def print_sampler_table(res: dict, row_counts) -> None:
    names = sorted({k.split("/", 1)[1] for k in res}, key=lambda k: (k.count("kept"), k))
    print(f"{'launch-to-ready median, us':34s}" + "".join(f"{'S=' + str(r):>10s}"
                                                           for r in row_counts))
    for name in names:
        print(f"{name:34s}" + "".join(f"{str(res.get(f'S{r}/{name}')):>10s}"
                                      for r in row_counts))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="configs/models/llama-3.1-8b")
    ap.add_argument("--compile-cache", metavar="DIR")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--sampler-only", action="store_true", help="the sampler table alone")
    ap.add_argument("--vocab", type=int, default=128_256, help="for --sampler-only")
    ap.add_argument("--quick", action="store_true", help="--sampler-only: 5 runs, not 200")
    args = ap.parse_args()
    if args.sampler_only:
        row_counts = (1, 8, 64)
        res = {"sampler_table": sampler_table(args.vocab, row_counts, 5 if args.quick else 200)}
        _write(res)
        print(json.dumps(res, indent=1))
        print_sampler_table(res["sampler_table"], row_counts)
        return
    from jaxllm import LLM, compilation_cache
    from jaxllm.models.loader import read_hf_config
    compilation_cache.enable(args.compile_cache)
    vocab = read_hf_config(args.model)["vocab_size"]
    llm = LLM(args.model, load_format="dummy", dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_seqs=256)
    res = {"engine": engine_runs(llm, vocab, args.repeat),
           "sampler_alone_8_rows": sampler_alone(llm.llm_engine.runner, vocab)}
    _write(res)
    print(json.dumps(res, indent=1))
    for name, r in res["engine"].items():
        print(f"{name:12s} {r['ms']:7.1f} ms  {r['ratio']:.3f}x greedy  phases (us/step): "
              + ", ".join(f"{p} {v}" for p, v in r["phase_us_median"].items()))



def _write(res: dict) -> None:
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_sampled_latency.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
