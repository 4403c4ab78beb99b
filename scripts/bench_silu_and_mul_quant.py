"""The W8A8 MLP's middle step on the GPU: SiLU(gate) * up from the gate/up GEMM's
unscaled product, quantized per token for the down GEMM. Three ways, device time per
call (8 calls per program, each on its own product, as a step's layers are):

- xla: the unfused layer math (the product scaled and cast to bf16, SiLU * up in
  bf16, then the down input's token scales and cast), as the MLP ran before the fused
  path;
- twin: ref_silu_and_mul_quant, the kernel's plain-jnp twin, through XLA;
- kernel: pallas_kernels/silu_and_mul_quant.py.

fp8 (bf16 product) and int8 with a zero point (int32 product), F = 14336 (Llama-3.1-8B),
T = 16 ... 8192. Each kernel row also prints the kernel's agreement with the twin on
the GPU: quantized codes that differ (of all) and the largest scale difference.

    python3 scripts/bench_silu_and_mul_quant.py [--tokens 16,256,8192]
        [--settings '[{"block_cols": 1024, "num_warps": 8}, ...]']

--settings: kernel settings to time, a row each (default: the kernel's defaults).

JSON to $OUT/bench_silu_and_mul_quant.json when OUT is set.
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
    quantize_per_token, quantize_per_token_asym, scale_product)
from jaxllm.layers.quantization.schemes import ActScheme  # noqa: E402
from pallas_kernels.silu_and_mul_quant import (  # noqa: E402
    ref_silu_and_mul_quant, silu_and_mul_quant)

F = 14336
COPIES = 8
KINDS = {"fp8": (jnp.bfloat16, "fp8", True), "int8_azp": (jnp.int32, "int8", False)}


def inputs(kind, t, key):
    pdtype, _, symmetric = KINDS[kind]
    k = jax.random.split(key, 5)
    if pdtype == jnp.int32:
        p = jax.random.randint(k[0], (t, 2, F), -20000, 20000, jnp.int32)
    else:
        p = (jax.random.normal(k[0], (t, 2, F), jnp.float32) * 300).astype(pdtype)
    xs = jax.random.uniform(k[1], (t,), jnp.float32, 1e-3, 1e-2)
    ws = jax.random.uniform(k[2], (2, F), jnp.float32, 1e-4, 1e-3)
    if symmetric:
        return p, xs, ws, None, None
    xz = jnp.round(jax.random.uniform(k[3], (t,), jnp.float32, -20, 20))
    az = jnp.round(jax.random.uniform(k[4], (2, F), jnp.float32, -300, 300))
    return p, xs, ws, xz, az


def unfused(kind):
    _, dtype, symmetric = KINDS[kind]

    def f(p, xs, ws, xz, az):
        gu = scale_product(p.astype(jnp.float32), xs, ws, xz, az).astype(jnp.bfloat16)
        h = jax.nn.silu(gu[:, 0]) * gu[:, 1]
        if symmetric:
            hq, s = quantize_per_token(h, 1, ActScheme(dtype))
            return hq, s, None
        return quantize_per_token_asym(h, 1)
    return f


def fused(kind, fn, **settings):
    _, dtype, symmetric = KINDS[kind]
    return lambda *a: fn(*a, dtype=dtype, symmetric=symmetric, **settings)


def time_us(fn, args, reps=100) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / reps * 1e6)
    return statistics.median(times) / COPIES


def timed(fn, sets, label) -> float:
    """us per call of fn over the COPIES input sets in one program (nan if it fails)."""
    many = jax.jit(lambda *g: [fn(*x) for x in g])
    try:
        return round(time_us(many, sets), 1)
    except Exception as e:      # noqa: BLE001 - a row says why it has no time
        print(f"{label}: {type(e).__name__}: {str(e)[:300]}")
        return float("nan")


def agreement(kind, args, settings):
    """(codes that differ / all, largest |scale - twin's| / twin's) on the GPU."""
    a = fused(kind, silu_and_mul_quant, **settings)(*args)
    b = fused(kind, ref_silu_and_mul_quant)(*args)
    qa, qb = np.asarray(a[0].astype(jnp.float32)), np.asarray(b[0].astype(jnp.float32))
    diff = float((qa != qb).mean())
    sa, sb = np.asarray(a[1]), np.asarray(b[1])
    return diff, float(np.max(np.abs(sa - sb) / sb))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="16,256,1024,8192")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--settings", default="[{}]")
    a = ap.parse_args()
    rows = []
    print(f"{'kind':9} {'T':>5} {'xla us':>8} {'twin us':>8} {'kernel us':>9} "
          f"{'kernel GB/s':>11} {'codes differ':>12} {'scale diff':>10}  settings")
    for kind in a.kinds.split(","):
        for t in (int(x) for x in a.tokens.split(",")):
            sets = [inputs(kind, t, jax.random.PRNGKey(c)) for c in range(COPIES)]
            base = {}
            for name, fn in (("xla", unfused(kind)),
                             ("twin", fused(kind, ref_silu_and_mul_quant))):
                base[name + "_us"] = timed(fn, sets, f"{kind} {t} {name}")
            for settings in json.loads(a.settings):
                r = {"kind": kind, "tokens": t, "settings": settings, **base}
                r["kernel_us"] = timed(fused(kind, silu_and_mul_quant, **settings), sets,
                                       f"{kind} {t} kernel {settings}")
                moved = sets[0][0].nbytes + t * F + 4 * t   # product in; codes, scales out
                r["kernel_gbps"] = round(moved / r["kernel_us"] / 1e3, 1)
                try:
                    r["codes_differ"], r["scale_diff"] = agreement(kind, sets[0], settings)
                except Exception:           # noqa: BLE001 - the timing row says why
                    r["codes_differ"] = r["scale_diff"] = float("nan")
                rows.append(r)
                print(f"{kind:9} {t:>5} {r['xla_us']:>8} {r['twin_us']:>8} "
                      f"{r['kernel_us']:>9} {r['kernel_gbps']:>11} {r['codes_differ']:>12.2e} "
                      f"{r['scale_diff']:>10.2e}  {json.dumps(settings)}", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_silu_and_mul_quant.json"), "w") as f:
            json.dump({"device": str(jax.devices()[0].device_kind), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
