"""Probe: does a GEMM's rate hold under sustained load? One bf16 matmul of the
throughput workload's gate/up shape ([M, 4096] x [4096, 28672]) run back to back for
`--seconds`, its TFLOP/s reported per window of ~0.5 s, with the card's SM clock and
power draw sampled by nvidia-smi alongside. JSON to $OUT/gemm_sustained.json."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import time


def main():
    import jax
    import jax.numpy as jnp
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--seconds", type=float, default=8.0)
    args = ap.parse_args()
    smi = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
         "--format=csv,noheader", "-lms", "250"], stdout=subprocess.PIPE, text=True)
    res = {}
    key = jax.random.key(0)
    w = jax.random.normal(key, (4096, 28672), jnp.bfloat16)
    for m in args.m:
        x = jax.random.normal(key, (m, 4096), jnp.bfloat16)
        f = jax.jit(lambda a, b: a @ b)
        f(x, w).block_until_ready()
        flop = 2 * m * 4096 * 28672
        windows, t_end = [], time.perf_counter() + args.seconds
        while time.perf_counter() < t_end:
            t0, n = time.perf_counter(), 0
            while time.perf_counter() - t0 < 0.5:
                for _ in range(8):
                    y = f(x, w)
                y.block_until_ready()
                n += 8
            windows.append(round(flop * n / (time.perf_counter() - t0) / 1e12, 1))
        res[f"M={m}"] = windows
        print(m, windows, flush=True)
        time.sleep(3)       # let the card cool between shapes
    smi.terminate()
    res["nvidia_smi"] = smi.communicate()[0].splitlines()
    print("\n".join(res["nvidia_smi"][::4]))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gemm_sustained.json"), "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
