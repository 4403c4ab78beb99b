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

--pallas adds the small-M Pallas kernels (pallas_kernels/quant_matmul.py) beside them,
at M = 1, 8, 16, 64 under the no_triton options unless --ms / --variants say: the
W8A8 layer path with the kernel in place of XLA's dot (pallas_fp8, pallas_int8), and
W4A16 with groups of 128 through XLA (xla_w4: grouped_dequant_matmul; xla_u4: the
weight typed uint4, which XLA's Triton GEMMs read packed), the Triton kernel
(pallas_w4) and the Mosaic GPU kernel on the same bytes (mgpu_w4:
pallas_kernels/w4a16_mgpu.py, Hopper only, its scales packed by pack_scales outside the
timing; its error is against the checkpoint's f32 reference, so it includes the bf16
scales: 2.5e-3 for its twin on o's shape on a CPU).
Rows then also print the weight's GB/s (weight and scales over the run time), and the
Pallas rows the kernel's largest error against its plain-jnp reference
on the same inputs (relative to the largest output), so the kernels' first runs on a
GPU check their numbers too. --pallas-settings '{"block_n":
64, "num_stages": 3}' passes tile settings to the kernels (a sweep by hand).

    python3 scripts/bench_quant_matmul.py --pallas [--pallas-settings JSON]

Kinds block_fp8, block_fp8_bf16 and pallas_block_fp8: a weight-only fp8 matmul with
a scale per row and 128-column group (native FP8 checkpoints' 128x128 blocks), as the
layer computes it at decode sizes (block_matmul), with the scales multiplied in bf16,
and through the Pallas kernel (its error against its reference printed too).
block_fp8_nblock: no dequantized weight; a GEMM batched over the 128-row N blocks, the
input scaled per N block and K group first (x' [NB, M, K] = x * s[nb, g(k)] in f16,
the scales expanded along K at load) against each block's fp8 rows widened to f16,
for whether XLA takes x' into its GEMM's prologue (one scale per 128x128 block here).

Kinds w8a16_fp8 / w8a16_int8: the layer's weight-only path (weight_only_matmul, what
decode-sized steps run on a GPU: an fp8 weight widened to f16 under an f16 input, as
the step's producer fusion writes it, an int8 one widened to bf16; under the `default`
variant XLA's Triton GEMM reads the narrow weight in place). w8a16_fp8_bf16: the fp8
weight widened to bf16 instead (the bf16-dot alternative), for the two side by side.
w8a16_int8_f16: the int8 weight widened to f16 by its bits (u = q + 128 by an XOR;
f16 0x6400 | u is 1024 + u; minus 1152 is q, exactly: integer ops and a packed f16
subtract, no int-to-float conversion per value). Compiled for the H200 on a CPU
(`scripts/aot_step.py --quant-matmul w8a16_int8_f16`), XLA's GEMM does not take that
into its prologue: a loop fusion writes the whole f16 weight first, so this kind is
expected to lose.

Kind mgpu_fp8: the weight-only fp8 matmul through the Mosaic GPU kernel
(pallas_kernels/w8a16_mgpu.py, Hopper only; --pallas-settings pass its settings), on
w8a16_fp8's f16 input; its error is against its twin.

--copies C runs C matmuls of a row's kind in one program, each on its own input and
weight, and reports the time per matmul: the device's time, where one call per matmul
(the default, C = 1) times the host's dispatch (~45-60 us) at small M.

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
    block_matmul, grouped_dequant_matmul, native_dot, on_gpu, quantize_per_token,
    quantized_matmul, weight_only_matmul)
from jaxllm.layers.quantization.schemes import ActScheme, LinearScheme  # noqa: E402
from pallas_kernels import quant_matmul as qmm  # noqa: E402
from pallas_kernels import w4a16_mgpu, w8a16_mgpu  # noqa: E402
from pallas_kernels.common import to_f16  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
VARIANTS = {"default": {}, "no_triton": {"xla_gpu_enable_triton_gemm": False},
            "autotune0": {"xla_gpu_autotune_level": 0},
            "exhaustive": {"xla_gpu_exhaustive_tiling_search": True}}
STORE = {"fp8": jnp.float8_e4m3fn, "int8": jnp.int8}
PALLAS_KINDS = ("pallas_fp8", "pallas_int8", "xla_w4", "pallas_w4", "xla_u4", "mgpu_w4",
                "mgpu_fp8")
W4_GROUP = 128
# Block-scaled fp8 (native FP8 checkpoints, 128x128 blocks; scales repeated per row).
BLOCK = 128
BLOCK_KINDS = ("block_fp8", "block_fp8_bf16", "pallas_block_fp8", "block_fp8_nblock")


def time_us(fn, *args, reps=200) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / reps * 1e6)
    return statistics.median(times)


def w8a8(dtype: str):
    act = ActScheme(dtype=dtype, dynamic=True)

    def f(x, wq, ws):
        xq, xs = quantize_per_token(x, 1, act)
        return quantized_matmul(xq, xs, wq, ws, 1, native_dot()).astype(x.dtype)
    return f


def w8a16(x, wq, ws):
    return weight_only_matmul(x, wq, ws, 1).astype(x.dtype)


def w8a16_bf16(x, wq, ws):
    y = jax.lax.dot_general(x, wq.astype(x.dtype), (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)
    return (y * ws).astype(x.dtype)


def w8a16_int8_f16(x, wq, ws):
    u = jax.lax.bitcast_convert_type(wq, jnp.uint8) ^ jnp.uint8(0x80)       # q + 128
    f = jax.lax.bitcast_convert_type(u.astype(jnp.uint16) | jnp.uint16(0x6400), jnp.float16)
    xh = to_f16(x)
    y = jax.lax.dot_general(xh, f - jnp.float16(1152), (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)
    return (y * ws).astype(x.dtype)


def block_fp8(x, wq, ws):
    """The layer's block-scaled fp8 path at decode sizes (block_matmul, input not
    quantized): the weight dequantized in f32, rounded to bf16, then the dot."""
    scheme = LinearScheme("fp8", (BLOCK, BLOCK), None)
    return block_matmul(x, wq, ws, scheme, 1).astype(x.dtype)


def block_fp8_bf16(x, wq, ws):
    """The same with the scales multiplied in bf16 (a form XLA's Triton GEMM might take
    into its prologue)."""
    n, k = wq.shape
    w = wq.astype(jnp.bfloat16).reshape(n, k // BLOCK, BLOCK) * ws.astype(jnp.bfloat16)[
        ..., None]
    return jnp.einsum("tk,nk->tn", x, w.reshape(n, k),
                      preferred_element_type=jnp.float32).astype(x.dtype)


def block_fp8_nblock(x, wq, s_exp):
    n, k = wq.shape
    nb = n // BLOCK
    xs = (x.astype(jnp.float32)[None] * s_exp[:, None, :]).astype(jnp.float16)  # [NB, M, K]
    w = wq.reshape(nb, BLOCK, k).astype(jnp.float16)
    y = jnp.einsum("bmk,bnk->mbn", xs, w, preferred_element_type=jnp.float32)
    return y.reshape(x.shape[0], n).astype(x.dtype)


def pallas_block_fp8(settings: dict):
    def f(x, wq, ws):
        return qmm.quant_matmul(x, wq, None, ws, out_dtype=x.dtype, **settings)
    return f


def pallas_w8a8(dtype: str, settings: dict):
    """The W8A8 layer path with the Pallas kernel for the dot."""
    act = ActScheme(dtype=dtype, dynamic=True)

    def f(x, wq, ws):
        xq, xs = quantize_per_token(x, 1, act)
        return qmm.quant_matmul(xq, wq, xs, ws, out_dtype=x.dtype, **settings)
    return f


def w4(pallas: bool, settings: dict):
    scheme = LinearScheme("uint4", group=W4_GROUP)

    def f(x, wq, s, z):
        if pallas:
            return qmm.quant_matmul_int4(x, wq, s, z, group=W4_GROUP, **settings)
        return grouped_dequant_matmul(x, wq, s, z, None, scheme, 1).astype(x.dtype)
    return f


def mgpu_w4(settings: dict):
    """The Mosaic GPU kernel on the engine's uint4 params (args: x, the weight's bytes,
    its packed scales, and the f32 scales and zero points they came from, which only
    the error check reads)."""
    def f(x, wq, packed, s, z):
        return w4a16_mgpu.w4a16_matmul(x, w4a16_mgpu.as_int4(wq), packed, **settings)
    return f


def mgpu_fp8(settings: dict):
    def f(x, wq, ws):
        return w8a16_mgpu.w8a16_matmul(x, wq, ws, out_dtype=jnp.bfloat16, **settings)
    return f


def xla_u4(x, wq, s, z):
    """W4A16 through XLA with the weight typed uint4 (XLA stores it two to a byte and
    its Triton GEMMs read such weights in place), group scales and zeros in bf16."""
    n, k = wq.shape
    w = (wq.reshape(n, k // W4_GROUP, W4_GROUP).astype(jnp.bfloat16) - z[..., None]) \
        * s[..., None]
    return jnp.einsum("tk,nk->tn", x, w.reshape(n, k),
                      preferred_element_type=jnp.float32).astype(x.dtype)


def u4_args(x, n, k, key):
    kq, kg = jax.random.split(key)
    wq = jax.random.randint(kq, (n, k), 0, 16, jnp.int32).astype(jnp.uint4)
    s, z = group_scales(n, k, kg)
    return x, wq, s.astype(jnp.bfloat16), z.astype(jnp.bfloat16)


def w4_args(x, n, k, key):
    kq, kg = jax.random.split(key)
    wq = jax.random.randint(kq, (n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    return (x, wq, *group_scales(n, k, kg))


def group_scales(n, k, key):
    """Random f32 scales and integer zero points [N, K / W4_GROUP]."""
    ks, kz = jax.random.split(key)
    s = jax.random.uniform(ks, (n, k // W4_GROUP), jnp.float32, 0.001, 0.004)
    z = jnp.round(jax.random.uniform(kz, (n, k // W4_GROUP), jnp.float32, 0.0, 15.0))
    return s, z


def pallas_error(kind, args, settings) -> float:
    """Largest |kernel - reference| over the largest |reference|, on the same inputs
    (the W8A8 input quantized once, outside both)."""
    if kind == "pallas_block_fp8":
        got = qmm.quant_matmul(*args[:2], None, args[2], out_dtype=jnp.float32, **settings)
        want = qmm.ref_quant_matmul(*args[:2], None, args[2], out_dtype=jnp.float32)
    elif kind == "mgpu_fp8":
        got = w8a16_mgpu.w8a16_matmul(*args, out_dtype=jnp.float32, **settings)
        want = w8a16_mgpu.ref_w8a16_matmul(*args, out_dtype=jnp.float32)
    elif kind in ("pallas_w4", "mgpu_w4"):
        got = (w4(True, settings) if kind == "pallas_w4" else mgpu_w4(settings))(*args)
        x, wq, s, z = args[:2] + args[-2:]
        want = qmm.ref_quant_matmul_int4(x, wq, s, z, group=W4_GROUP)
    else:
        x, wq, ws = args
        xq, xs = quantize_per_token(x, 1, ActScheme(dtype=kind[7:], dynamic=True))
        got = qmm.quant_matmul(xq, wq, xs, ws, out_dtype=jnp.float32, **settings)
        want = qmm.ref_quant_matmul(xq, wq, xs, ws, out_dtype=jnp.float32)
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def bf16(x, w):
    return jnp.einsum("tk,nk->tn", x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def case_args(kind, m, n, k, key, settings=None):
    """(fn, args) of one matmul of the kind."""
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (n, k), jnp.float32) * 0.02)
    if kind == "bf16":
        return bf16, (x, w.astype(jnp.bfloat16))
    if kind in ("xla_w4", "pallas_w4"):
        return w4(kind == "pallas_w4", settings or {}), w4_args(x, n, k, kw)
    if kind == "xla_u4":
        return xla_u4, u4_args(x, n, k, kw)
    if kind == "mgpu_w4":           # scales packed (pack_scales) outside the timing
        x, wq, s, z = w4_args(x, n, k, kw)
        return mgpu_w4(settings or {}), (x, wq, w4a16_mgpu.pack_scales(s, z), s, z)
    if kind in BLOCK_KINDS:
        wq = (jax.random.normal(kw, (n, k), jnp.float32) * 100).astype(jnp.float8_e4m3fn)
        ws = jax.random.uniform(kx, (n, k // BLOCK), jnp.float32, 1e-4, 4e-4)
        if kind == "block_fp8_nblock":      # [NB, K]: each block's scales along K
            return block_fp8_nblock, (x, wq, jnp.repeat(ws[::BLOCK], BLOCK, axis=1))
        fn = pallas_block_fp8(settings or {}) if kind == "pallas_block_fp8" else (
            block_fp8 if kind == "block_fp8" else block_fp8_bf16)
        return fn, (x, wq, ws)
    dtype = kind.removeprefix("pallas_").removeprefix("mgpu_").removeprefix("w8a16_")
    dtype = dtype.removesuffix("_bf16").removesuffix("_f16")
    scale = jnp.max(jnp.abs(w), axis=1) / (448.0 if dtype == "fp8" else 127.0)
    wq = w / scale[:, None]
    wq = jnp.round(wq) if dtype == "int8" else wq
    if kind in ("w8a16_fp8", "mgpu_fp8") and on_gpu():
        # The step's producer fusion (RMSNorm, SiLU x up, attention's combine) writes
        # this f16 input itself (scripts/aot_step.py): a bf16 x here would time a
        # conversion kernel the step does not run.
        x = to_f16(x)
    fn = (pallas_w8a8(dtype, settings or {}) if kind.startswith("pallas") else
          mgpu_fp8(settings or {}) if kind == "mgpu_fp8" else
          w8a16_bf16 if kind == "w8a16_fp8_bf16" else
          w8a16_int8_f16 if kind == "w8a16_int8_f16" else
          w8a16 if kind.startswith("w8a16") else w8a8(dtype))
    return fn, (x, wq.astype(STORE[dtype]), scale)


def case(kind, m, n, k, options, key, settings=None, copies=1):
    """One row. With copies > 1 one program runs that many matmuls of the kind, each
    on its own input and weight (as a step's layers do, so no weight stays in L2), and
    the row is its time over `copies`: the device's time per matmul, where one call
    per matmul would time the host's dispatch at small M."""
    sets = [case_args(kind, m, n, k, jax.random.fold_in(key, c), settings)
            for c in range(copies)]
    fn, args = sets[0]
    # jit's C++ dispatch (a few us) keeps small-M rows about the GPU, not the call.
    jitted = jax.jit(lambda *groups: [fn(*g) for g in groups], compiler_options=options or None)
    groups = [a for _, a in sets]
    t0 = time.perf_counter()
    jitted.lower(*groups).compile()
    compile_s = time.perf_counter() - t0
    us = time_us(jitted, *groups) / copies
    r = {"compile_s": round(compile_s, 2), "us": round(us, 1),
         "tflops": round(2 * m * n * k / us / 1e6, 1)}
    # The weight and its scales, read once a call: what bounds the small-M rows.
    # (numpy counts a uint4 element as a byte; XLA stores two to a byte)
    read = args[1:3] if kind == "mgpu_w4" else args[1:]   # not the f32 originals
    nbytes = sum(a.size // 2 if a.dtype == jnp.uint4 else a.nbytes for a in read)
    r["weight_gbps"] = round(nbytes / us / 1e3, 1)
    if kind.startswith(("pallas", "mgpu")):
        r["max_rel_err"] = pallas_error(kind, args, settings or {})
    return r


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default=None, help="default: no_triton,default "
                    "(no_triton with --pallas)")
    ap.add_argument("--ms", default=None, help="default: 1,8,64,256,4096 (1,8,16,64 "
                    "with --pallas)")
    ap.add_argument("--kinds", default=None, help="default: bf16,fp8,int8 (and "
                    f"{','.join(PALLAS_KINDS)} with --pallas)")
    ap.add_argument("--compile-budget", type=float, default=90.0)
    ap.add_argument("--pallas", action="store_true", help="the Pallas kernels too")
    ap.add_argument("--pallas-settings", default="{}", help="JSON of tile settings, or a "
                    "list of them: each quantized kind then runs once a setting (one "
                    "process, so a sweep pays the start-up once)")
    ap.add_argument("--copies", type=int, default=1, help="matmuls per program, each on "
                    "its own weight; rows are per matmul (device time at small M)")
    ap.add_argument("--projs", default=",".join(SHAPES), help="the projections to run, "
                    f"of {','.join(SHAPES)} (a sweep of splits one projection at a time)")
    args = ap.parse_args(argv)
    projs = args.projs.split(",")
    if any(p not in SHAPES for p in projs):
        ap.error(f"--projs {args.projs}: each of {', '.join(SHAPES)}")
    args.variants = args.variants or ("no_triton" if args.pallas else "no_triton,default")
    args.ms = args.ms or ("1,8,16,64" if args.pallas else "1,8,64,256,4096")
    args.kinds = args.kinds or ("bf16,fp8,int8" + (
        "," + ",".join(PALLAS_KINDS) if args.pallas else ""))
    sweep = json.loads(args.pallas_settings)
    sweep = sweep if isinstance(sweep, list) else [sweep]
    kw = max(5, *map(len, args.kinds.split(",")))    # the kind column's width
    rows, key = [], jax.random.PRNGKey(0)
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    print(f"{'variant':>10} {'kind':>{kw}} {'proj':>8} {'M':>5} {'compile s':>9} "
          f"{'us':>9} {'TFLOP/s':>8} {'x bf16':>7}" + ("    GB/s  max err" if args.pallas
                                                     else ""))
    for variant in args.variants.split(","):
        spent = 0.0
        base = {}
        for m in map(int, args.ms.split(",")):
            for proj, (n, k) in ((p, SHAPES[p]) for p in projs):
                for kind, settings in [(kd, st) for kd in args.kinds.split(",")
                                       for st in (sweep if kd != "bf16" else sweep[:1])]:
                    if kind != "bf16" and spent > args.compile_budget:
                        continue
                    label = f"  {json.dumps(settings)}" if len(sweep) > 1 and kind != "bf16" \
                        else ""
                    try:
                        r = case(kind, m, n, k, VARIANTS[variant], key, settings, args.copies)
                    except Exception as e:      # one failure costs one row
                        print(f"{variant:>10} {kind:>{kw}} {proj:>8} {m:>5} FAILED {e!r:.200}"
                              f"{label}")
                        continue
                    spent += r["compile_s"] if kind != "bf16" else 0.0
                    if kind == "bf16":
                        base[(proj, m)] = r["us"]
                    ratio = base.get((proj, m), float("nan")) / r["us"]
                    rows.append({"variant": variant, "kind": kind, "proj": proj, "m": m, **r,
                                 "speedup_vs_bf16": round(ratio, 3), "settings": settings})
                    extra = (f" {r.get('weight_gbps', float('nan')):>7.0f} "
                             f"{r.get('max_rel_err', float('nan')):>8.1e}" if args.pallas else "")
                    print(f"{variant:>10} {kind:>{kw}} {proj:>8} {m:>5} {r['compile_s']:>9.2f} "
                          f"{r['us']:>9.1f} {r['tflops']:>8.1f} {ratio:>7.2f}{extra}{label}",
                          flush=True)
        if spent > args.compile_budget:
            print(f"{variant}: quantized compiles passed the {args.compile_budget:.0f} s "
                  f"budget ({spent:.1f} s); later cases skipped")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_quant_matmul.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
