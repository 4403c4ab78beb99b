"""Host dispatch cost of the model step and the sampler under XLA option sets.

One process per variant (XLA_FLAGS is read when the backend starts): an engine of
the Llama-3.1-8B shape with dummy weights and no warm-up (each program compiles on
first use), then
- the bare decode step (batch 1, context 600; and batch 8): host microseconds to
  launch it (inputs uploaded, call returned; the previous step finished first),
  wall per step queued back to back, and kernels per step from a profiler trace;
- the 8-row sampler: host launch microseconds, greedy and temperature 0.8 / top_p
  0.95 / top_k 50 (numpy metadata, as the engine passes it), on one logits buffer
  with the device idle, and pipelined as in the engine (each batch-8 step queued
  behind the last, its sampler launched on its new logits; the runner's sampler and
  the same program without command buffers or with its token buffer donated);
- `latency` (8 x 32/128) greedy and with those filters, 3 runs each interleaved,
  then one of each traced: device kernel time, span and kernels per engine step
  (span - kernel time = the device idle, waiting for the host).

    python3 scripts/dispatch_flags.py [--variants default,no_cmdbuf]

JSON to $OUT/dispatch_flags.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = {
    "default": "",
    "no_cmdbuf": "--xla_gpu_enable_command_buffer=",
    "cmdbuf_min1": "--xla_gpu_graph_min_graph_size=1",
}


def _host_launch_us(fn, n=50) -> float:
    import jax
    times, out = [], fn()
    for _ in range(n):
        jax.block_until_ready(out)
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    jax.block_until_ready(out)
    return round(1e6 * statistics.median(times), 1)


def _pipelined(runner, arrays, decode_only, md, flags, fn, n=60) -> dict:
    """Host us per launch (model, sampler) and wall us per step, steps queued."""
    import jax
    token_buf = jax.device_put(np.zeros(runner.plan.max_seqs, np.int32))
    model_t, sample_t = [], []
    for i in range(n):
        if i == 10:
            jax.block_until_ready(out)
            t_start = time.perf_counter()
        t0 = time.perf_counter()
        logits = runner.launch_step(arrays, decode_only)
        t1 = time.perf_counter()
        if fn is None:
            out = runner.sample_step(logits, md, flags)
        else:
            out, token_buf = fn(logits, md, flags, token_buf)
        model_t.append(t1 - t0)
        sample_t.append(time.perf_counter() - t1)
    jax.block_until_ready(out)
    wall = (time.perf_counter() - t_start) / (n - 10)
    return {"model_launch": round(1e6 * statistics.median(model_t[10:]), 1),
            "sample_launch": round(1e6 * statistics.median(sample_t[10:]), 1),
            "wall_per_step": round(1e6 * wall, 1)}


def measure(model: str) -> dict:
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.join(HERE, ".."))
    import jax
    import step_profile
    from bench_h200 import random_prompts, timed_generate
    from jaxllm import LLM, SamplingParams
    from jaxllm.models.loader import read_hf_config
    from jaxllm.runner import sampling_rows
    vocab = read_hf_config(model)["vocab_size"]
    llm = LLM(model, load_format="dummy", dtype="bfloat16", max_model_len=1024,
              max_num_seqs=8, max_num_batched_tokens=512, enforce_eager=True)
    runner = llm.llm_engine.runner
    res = {}
    for label, batch in (("b1", 1), ("b8", 8)):
        arrays, decode_only = step_profile.step_arrays(runner, batch, 600 if batch == 1 else 100)
        res[f"step_{label}_launch_us"] = _host_launch_us(
            lambda: runner.launch_step(arrays, decode_only))
        res[f"step_{label}"] = step_profile.time_steps(runner, arrays, decode_only, iters=50)
        prof = step_profile.profile(runner, arrays, decode_only)
        res[f"step_{label}_kernels"] = prof.get("kernels_per_step")
        res[f"step_{label}_kernel_ms"] = prof.get("kernel_ms_per_step")
    logits = runner.launch_step(*step_profile.step_arrays(runner, 8, 100))
    filt = [SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=i) for i in range(8)]
    for name, params in (("greedy", [SamplingParams(temperature=0)] * 8), ("filters", filt)):
        md, flags = sampling_rows.from_params(params, [0] * 8, None, None, 8, vocab)
        res[f"sample_{name}_launch_us"] = _host_launch_us(
            lambda: runner.sample_step(logits, md, flags))
    # As in the engine: each step queued behind the last, its sampler on its new logits;
    # the runner's sampler, and the same program compiled without command buffers or
    # with the token buffer donated (its address then stays put).
    from jaxllm.runner.step_fn import sample_into
    arrays, decode_only = step_profile.step_arrays(runner, 8, 100)
    samplers = {
        "runner": None,
        "no_cmdbuf": jax.jit(sample_into, static_argnums=(2,),
                             compiler_options={"xla_gpu_enable_command_buffer": ""}),
        "donated_buf": jax.jit(sample_into, static_argnums=(2,), donate_argnums=(3,))}
    for name, params in (("greedy", [SamplingParams(temperature=0)] * 8), ("filters", filt)):
        md, flags = sampling_rows.from_params(params, [0] * 8, None, None, 8, vocab)
        for sname, fn in samplers.items():
            try:
                res[f"pipelined_{name}_{sname}_us"] = _pipelined(
                    runner, arrays, decode_only, md, flags, fn)
            except Exception as e:  # noqa: BLE001 - keep the other variants
                res[f"pipelined_{name}_{sname}_us"] = {"error": repr(e)[:300]}
    prompts = random_prompts(np.random.default_rng(0), 8, 32, vocab)
    common = dict(max_tokens=128, ignore_eos=True)
    modes = {"greedy": SamplingParams(temperature=0, **common),
             "filters": [SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=i, **common)
                         for i in range(8)]}
    walls = {k: [] for k in modes}
    for params in modes.values():
        timed_generate(llm, prompts, params)
    for _ in range(3):
        for k, params in modes.items():
            walls[k].append(round(1000 * timed_generate(llm, prompts, params)[0], 1))
    res["latency_ms"] = walls
    for k, params in modes.items():    # device busy vs span per engine step
        prof = step_profile.profile_engine(llm, prompts, params, 129, top=6)
        res[f"latency_{k}_profile"] = {x: prof.get(x) for x in (
            "kernel_ms_per_step", "span_ms_per_step", "kernels_per_step", "top", "error")}
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="configs/models/llama-3.1-8b")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(measure(args.model)), flush=True)
        return
    results = {}
    for name in args.variants.split(","):
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " "
                                          + VARIANTS[name]).strip())
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--model", args.model, "--child", name],
                              env=env, capture_output=True, text=True)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        results[name] = (json.loads(lines[-1][7:]) if lines
                         else {"error": (proc.stderr or proc.stdout)[-1500:]})
        results[name]["process_s"] = round(time.perf_counter() - t0, 1)
        print(name, json.dumps(results[name]), flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "dispatch_flags.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
