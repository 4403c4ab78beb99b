"""Quantized matmuls of the Llama-3.1-8B shape against bf16, and what compiling them costs.

For each projection of one layer (fused qkv 6144x4096, o 4096x4096, fused gate/up
28672x4096, down 4096x14336) and M = 1, 8, 64, 256, 4096 tokens: the bf16 matmul
(cuBLAS), and jaxllm's W8A8 layer path (per-token dynamic activation scales, the
weight stored [N, K], the scales applied to the f32 output) in fp8 and int8, each
compiled under the XLA option sets named by --variants. Prints one row per case with
the compile seconds and the median run time in us, and TFLOP/s.

A variant whose compiles have taken more than --compile-budget seconds in all skips
its remaining cases (the default options' autotuning of fp8 GEMMs is what is probed).

    python3 scripts/bench_quant_matmul.py [--variants no_triton,default] [--ms 1,8,4096]

JSON to $OUT/bench_quant_matmul.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jaxllm.layers.quantization.linear import (  # noqa: E402
    native_dot, quantize_per_token, quantized_matmul)
from jaxllm.layers.quantization.schemes import ActScheme  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
VARIANTS = {"default": {}, "no_triton": {"xla_gpu_enable_triton_gemm": False},
            "autotune0": {"xla_gpu_autotune_level": 0}}
STORE = {"fp8": jnp.float8_e4m3fn, "int8": jnp.int8}


def time_us(fn, *args, reps=200) -> float:
    fn(*args).block_until_ready()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        out.block_until_ready()
        times.append((time.perf_counter() - t0) / reps * 1e6)
    return statistics.median(times)


def w8a8(dtype: str):
    act = ActScheme(dtype=dtype, dynamic=True)

    def f(x, wq, ws):
        xq, xs = quantize_per_token(x, 1, act)
        return quantized_matmul(xq, xs, wq, ws, 1, native_dot()).astype(x.dtype)
    return f


def bf16(x, w):
    return jnp.einsum("tk,nk->tn", x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def case(kind, m, n, k, options, key):
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (n, k), jnp.float32) * 0.02)
    if kind == "bf16":
        fn, args = bf16, (x, w.astype(jnp.bfloat16))
    else:
        scale = jnp.max(jnp.abs(w), axis=1) / (448.0 if kind == "fp8" else 127.0)
        wq = w / scale[:, None]
        wq = jnp.round(wq) if kind == "int8" else wq
        fn, args = w8a8(kind), (x, wq.astype(STORE[kind]), scale)
    # jit's C++ dispatch (a few us) keeps small-M rows about the GPU, not the call.
    jitted = jax.jit(fn, compiler_options=options or None)
    t0 = time.perf_counter()
    jitted.lower(*args).compile()
    compile_s = time.perf_counter() - t0
    us = time_us(jitted, *args)
    return {"compile_s": round(compile_s, 2), "us": round(us, 1),
            "tflops": round(2 * m * n * k / us / 1e6, 1)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="no_triton,default")
    ap.add_argument("--ms", default="1,8,64,256,4096")
    ap.add_argument("--kinds", default="bf16,fp8,int8")
    ap.add_argument("--compile-budget", type=float, default=90.0)
    args = ap.parse_args()
    rows, key = [], jax.random.PRNGKey(0)
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    print(f"{'variant':>10} {'kind':>5} {'proj':>8} {'M':>5} {'compile s':>9} "
          f"{'us':>9} {'TFLOP/s':>8} {'x bf16':>7}")
    for variant in args.variants.split(","):
        spent = 0.0
        base = {}
        for m in map(int, args.ms.split(",")):
            for proj, (n, k) in SHAPES.items():
                for kind in args.kinds.split(","):
                    if kind != "bf16" and spent > args.compile_budget:
                        continue
                    try:
                        r = case(kind, m, n, k, VARIANTS[variant], key)
                    except Exception as e:      # one failure costs one row
                        print(f"{variant:>10} {kind:>5} {proj:>8} {m:>5} FAILED {e!r:.200}")
                        continue
                    spent += r["compile_s"] if kind != "bf16" else 0.0
                    if kind == "bf16":
                        base[(proj, m)] = r["us"]
                    ratio = base.get((proj, m), float("nan")) / r["us"]
                    rows.append({"variant": variant, "kind": kind, "proj": proj, "m": m, **r,
                                 "speedup_vs_bf16": round(ratio, 3)})
                    print(f"{variant:>10} {kind:>5} {proj:>8} {m:>5} {r['compile_s']:>9.2f} "
                          f"{r['us']:>9.1f} {r['tflops']:>8.1f} {ratio:>7.2f}", flush=True)
        if spent > args.compile_budget:
            print(f"{variant}: quantized compiles passed the {args.compile_budget:.0f} s "
                  f"budget ({spent:.1f} s); later cases skipped")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_quant_matmul.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
