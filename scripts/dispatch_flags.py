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

    python3 scripts/dispatch_flags.py [--variants default,no_cmdbuf] [--quick]
        [--quantization fp8]

--quick leaves out the sampler's launch figures and the filtered `latency` runs. Each
variant also reports where a step's launch goes (packing its inputs against calling
the program, with new inputs and with the same input buffer again), the launch of a
program of N small arguments (the cost of each argument), and a digest of the greedy
`latency` tokens (equal digests: the variant computes what the default does).

JSON to $OUT/dispatch_flags.json when OUT is set.
"""
from __future__ import annotations

import argparse
import dataclasses
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
    # Programmatic dependent launch: a kernel may start while the one before drains.
    "pdl": "--xla_gpu_enable_pdl=true",
    "concurrent": "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT",
    "exhaustive_tiling": "--xla_gpu_exhaustive_tiling_search=true",
    # No dot merger: the q and k/v projections as two dots (merged, XLA concatenates
    # their weights, in place inside a Triton GEMM or as a copy before cuBLAS).
    "no_dot_merger": "--xla_gpu_dot_merger_threshold_mb=0",
    # Triton fusions with several outputs: a residual add could join the RMSNorm after it.
    "triton_mof": "--xla_gpu_unsupported_enable_triton_multi_output_fusion=true",
    "heroless": "--xla_gpu_experimental_enable_triton_heroless_priority_fusion=true",
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
            token_buf, out = fn(logits, md, flags, token_buf)
        model_t.append(t1 - t0)
        sample_t.append(time.perf_counter() - t1)
    jax.block_until_ready(out)
    wall = (time.perf_counter() - t_start) / (n - 10)
    return {"model_launch": round(1e6 * statistics.median(model_t[10:]), 1),
            "sample_launch": round(1e6 * statistics.median(sample_t[10:]), 1),
            "wall_per_step": round(1e6 * wall, 1)}


def _launch_parts(runner, arrays, decode_only, n=50) -> dict:
    """Host us per launch: packing and uploading the inputs, calling the step with
    them, and calling it again with the same (unchanged) input buffer."""
    import jax
    pack, call_new, call_same = [], [], []
    inputs = runner.pack_inputs(arrays, decode_only)
    # A buffer of its own: the runner's staged one is donated by the next inputs' copy.
    inputs = dataclasses.replace(inputs, packed=inputs.packed + 0)
    out = None
    for _ in range(n):
        jax.block_until_ready((out, runner.kv_caches))
        t0 = time.perf_counter()
        fresh = runner.pack_inputs(arrays, decode_only)
        t1 = time.perf_counter()
        out = runner.launch_packed(fresh)
        t2 = time.perf_counter()
        jax.block_until_ready((out, runner.kv_caches))
        t3 = time.perf_counter()
        out = runner.launch_packed(inputs)
        call_same.append(time.perf_counter() - t3)
        pack.append(t1 - t0)
        call_new.append(t2 - t1)
    jax.block_until_ready((out, runner.kv_caches))
    med = lambda xs: round(1e6 * statistics.median(xs[5:]), 1)  # noqa: E731
    return {"pack": med(pack), "call_new_inputs": med(call_new),
            "call_same_inputs": med(call_same),
            "args": len(jax.tree.leaves((runner.params, runner.kv_caches))) + 2}


def _args_launch_us() -> dict:
    """Host us to launch a program of N small arguments (one fusion adds them)."""
    import functools
    import operator
    import jax
    import jax.numpy as jnp
    res = {}
    for n in (1, 64, 360):
        xs = [jnp.full((8,), i, jnp.bfloat16) for i in range(n)]
        f = jax.jit(lambda *a: functools.reduce(operator.add, a))
        res[n] = _host_launch_us(lambda: f(*xs))
    return res


def _digest(outs) -> str:
    import hashlib
    ids = [list(o.outputs[0].token_ids) for o in outs]
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def _trace_dir(name: str, quantization: str | None) -> str | None:
    """$OUT/<quantization>-<variant>, for the host traces; None without OUT."""
    if not os.environ.get("OUT"):
        return None
    path = os.path.join(os.environ["OUT"], f"{quantization or 'bf16'}-{name}")
    os.makedirs(path, exist_ok=True)
    return path


def measure(model: str, quick: bool = False, quantization: str | None = None,
            name: str = "default") -> dict:
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.join(HERE, ".."))
    import step_profile
    from jaxllm import LLM
    from jaxllm.models.loader import read_hf_config
    vocab = read_hf_config(model)["vocab_size"]
    llm = LLM(model, load_format="dummy", dtype="bfloat16", max_model_len=1024,
              max_num_seqs=8, max_num_batched_tokens=512, enforce_eager=True,
              quantization=quantization)
    runner = llm.llm_engine.runner
    traces = _trace_dir(name, quantization)
    res = {"args_launch_us": _args_launch_us()}
    for label, batch in (("b1", 1), ("b8", 8)):
        arrays, decode_only = step_profile.step_arrays(runner, batch, 600 if batch == 1 else 100)
        res[f"step_{label}_launch_us"] = _host_launch_us(
            lambda: runner.launch_step(arrays, decode_only))
        res[f"step_{label}_launch_parts_us"] = _launch_parts(runner, arrays, decode_only)
        res[f"step_{label}"] = step_profile.time_steps(runner, arrays, decode_only, iters=50)
        prof = step_profile.profile(runner, arrays, decode_only, top=40)
        res[f"step_{label}_top"] = prof.get("top")
        res[f"step_{label}_kernels"] = prof.get("kernels_per_step")
        res[f"step_{label}_kernel_ms"] = prof.get("kernel_ms_per_step")
        if label == "b1" and name == "default" and traces:
            # The optimized HLO of the decode step, to read its fusions offline.
            hlo = runner.lower_step(arrays, decode_only).compile().as_text()
            with open(os.path.join(traces, "decode_b1.hlo.txt"), "w") as f:
                f.write(hlo)
        res[f"step_{label}_host"] = step_profile.host_profile(runner, arrays, decode_only,
                                                              keep=traces, tag=label)
    if not quick:
        res.update(_sampler_figures(runner, vocab))
    return res | _latency(llm, vocab, quick)


def _sampler_figures(runner, vocab) -> dict:
    import jax
    import step_profile
    from jaxllm import SamplingParams
    from jaxllm.runner import sampling_rows
    res = {}
    logits = runner.launch_step(*step_profile.step_arrays(runner, 8, 100))
    filt = [SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=i) for i in range(8)]
    for name, params in (("greedy", [SamplingParams(temperature=0)] * 8), ("filters", filt)):
        md, flags = sampling_rows.from_params(params, [0] * 8, None, None, 8, vocab)
        res[f"sample_{name}_launch_us"] = _host_launch_us(
            lambda: runner.sample_step(logits, md, flags))
    # As in the engine: each step queued behind the last, its sampler on its new logits;
    # the runner's sampler (its token buffer donated), and the same program compiled
    # without command buffers.
    from jaxllm.runner.step_fn import sample_into
    arrays, decode_only = step_profile.step_arrays(runner, 8, 100)
    samplers = {
        "runner": None,
        "no_cmdbuf": jax.jit(sample_into, static_argnums=(2,), donate_argnums=(3,),
                             compiler_options={"xla_gpu_enable_command_buffer": ""})}
    for name, params in (("greedy", [SamplingParams(temperature=0)] * 8), ("filters", filt)):
        md, flags = sampling_rows.from_params(params, [0] * 8, None, None, 8, vocab)
        for sname, fn in samplers.items():
            try:
                res[f"pipelined_{name}_{sname}_us"] = _pipelined(
                    runner, arrays, decode_only, md, flags, fn)
            except Exception as e:  # noqa: BLE001 - keep the other variants
                res[f"pipelined_{name}_{sname}_us"] = {"error": repr(e)[:300]}
    return res


def _latency(llm, vocab, quick: bool) -> dict:
    import step_profile
    from bench_h200 import random_prompts, timed_generate
    from jaxllm import SamplingParams
    res = {}
    prompts = random_prompts(np.random.default_rng(0), 8, 32, vocab)
    common = dict(max_tokens=128, ignore_eos=True)
    modes = {"greedy": SamplingParams(temperature=0, **common)}
    if not quick:
        modes["filters"] = [SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=i,
                                           **common) for i in range(8)]
    walls = {k: [] for k in modes}
    for k, params in modes.items():
        outs = timed_generate(llm, prompts, params)[1]
        if k == "greedy":
            res["greedy_digest"] = _digest(outs)
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
    ap.add_argument("--variants", default="default,no_cmdbuf,cmdbuf_min1",
                    help=f"of {', '.join(VARIANTS)}")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per variant")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(measure(args.model, args.quick, args.quantization,
                                                      args.child)),
              flush=True)
        return
    results = {}
    for name in args.variants.split(","):
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " "
                                          + VARIANTS[name]).strip())
        t0 = time.perf_counter()
        cmd = [sys.executable, __file__, "--model", args.model, "--child", name]
        cmd += ["--quick"] * args.quick + (["--quantization", args.quantization]
                                           if args.quantization else [])
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                  timeout=args.timeout)
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            results[name] = (json.loads(lines[-1][7:]) if lines
                             else {"error": (proc.stderr or proc.stdout)[-1500:]})
        except subprocess.TimeoutExpired:
            results[name] = {"error": f"over {args.timeout} s"}
        results[name]["process_s"] = round(time.perf_counter() - t0, 1)
        print(name, json.dumps(results[name]), flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "dispatch_flags.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
