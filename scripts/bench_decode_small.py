"""Decode attention at small batches, in device time: the decode kernel (and its split
combine) chained over a model's layers in one program, as in a decode step, so that a
call's time is the device's and not one dispatch per ~5 us kernel. Layer l + 1's query is
layer l's output (same shape), so the layers run in order with no other kernel between
them. Each layer reads its own KV pool, and back-to-back calls rotate through enough
copies of the pools (--copies, default: twice L2_BYTES of KV between two reads of the
same pool) that no call finds KV in L2, as in a model step, where the layers' weights
stream through L2 between two layers' attention.

    python3 scripts/bench_decode_small.py [--cases S:L:CTX,...] [--settings JSON]
        [--kv-dtype fp8] [--layers 32] [--width 128] [--time-limit 240] [--kv-write]

A case S:L:CTX is a bucket of S rows of which the first L are live, each with CTX
tokens of context (the runner pads a decode step to its sequence buckets, the smallest
8: `decode-1` is 8:1:CTX). Shape: Llama-3.1-8B (32 query / 8 KV heads, D 128), block
16, block tables --width blocks wide. Settings: a JSON list of the kernel's keyword
arguments (spread, k_splits, blocks_per_step, num_stages, num_warps, per_block); {} is
the defaults. Before timing, each setting's first layer is checked against the jnp
reference on the same device. Prints us per layer for each setting x case (the best
of each case starred); with $OUT set, writes bench_decode_small.json there.

--kv-write times the step's KV write with the attention, as the decode step runs them
on the fused q/k/v array: {"fold": false} the KV write kernel then the decode kernel,
{"fold": true} decode_and_write (the other keys: kernel settings). The pools are
donated and threaded from call to call, so the writes are in place. Each layer's
qkv is its query joined to its new keys and values, one small XLA kernel a layer in
every row.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pallas_kernels.paged_attention_decode import (  # noqa: E402
    decode_and_write, paged_attention_decode, ref_decode_and_write,
    ref_paged_attention_decode)
from pallas_kernels.reshape_and_cache import reshape_and_cache  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16
L2_BYTES = 60 << 20          # at least the H100 / H200's 50 MB
SM_SCALE = D ** -0.5
CASES = "8:1:128,8:1:600,8:1:2048,8:8:160,8:8:600,16:16:600,64:64:600"
SETTINGS = [{}, {"spread": True}, {"k_splits": 8}, {"k_splits": 16}, {"blocks_per_step": 8},
            {"blocks_per_step": 16, "num_stages": 1}, {"spread": True, "blocks_per_step": 2},
            {"spread": True, "blocks_per_step": 8}, {"num_warps": 2}]
WRITE_SETTINGS = [{"fold": False}, {"fold": True}, {"fold": False, "spread": True},
                  {"fold": True, "spread": True}]


def parse_case(text: str) -> tuple[int, int, int]:
    try:
        s, live, ctx = (int(x) for x in text.split(":"))
    except ValueError:
        raise SystemExit(f"--cases: {text!r} is not S:L:CTX (three integers)") from None
    if not 0 < live <= s or ctx < 1:
        raise SystemExit(f"--cases: {text!r} needs 0 < L <= S and CTX >= 1")
    return s, live, ctx


def make_inputs(s, live, ctx, layers, width, kv_dtype, seed=0):
    """Per layer its own pool and query; one block table and seq_lens for all."""
    if -(-ctx // BS) > width:
        raise SystemExit(f"context {ctx} needs more than --width {width} blocks")
    rng = np.random.default_rng(seed)
    nb = 1 + s * width
    tables = (1 + rng.permutation(s * width)).reshape(s, width).astype(np.int32)
    lens = np.zeros(s, np.int32)
    lens[:live] = ctx
    keys = jax.random.split(jax.random.key(seed), 3 * layers)

    def pool(key):
        return jax.random.normal(key, (HKV, nb, BS, D), jnp.bfloat16).astype(kv_dtype)
    ks = [pool(keys[3 * i]) for i in range(layers)]
    vs = [pool(keys[3 * i + 1]) for i in range(layers)]
    q = jax.random.normal(keys[2], (s, HQ, D), jnp.bfloat16)
    # The step's new keys and values (position CTX - 1 of each live row) for --kv-write.
    kvs = [jax.random.normal(keys[3 * i + 2], (s, 2 * HKV, D), jnp.bfloat16)
           for i in range(layers)]
    slots = np.where(lens > 0, tables[:, (ctx - 1) // BS] * BS + (ctx - 1) % BS, -1)
    return (q, ks, vs, jnp.asarray(tables), jnp.asarray(lens),
            jnp.asarray(slots, jnp.int32), kvs)


def layer(fold, kw, q, k, v, tables, lens, slots, kv):
    """One layer's attention: (output, pools); with a fold (True / False) on the fused
    qkv, with the step's KV write (in the decode kernel / the write kernel first)."""
    if fold is None:
        return paged_attention_decode(q, k, v, tables, lens, **kw), k, v
    qkv = jnp.concatenate([q, kv], axis=1)
    if fold:
        return decode_and_write(qkv, k, v, tables, lens, slots, num_q_heads=HQ, **kw)
    k, v = reshape_and_cache(qkv, qkv, k, v, slots, head_offsets=(HQ, HQ + HKV),
                             interpret=kw.get("interpret", False))
    return paged_attention_decode(qkv, k, v, tables, lens, num_q_heads=HQ, **kw), k, v


def chained(settings, q, ks, vs, tables, lens, slots, kvs):
    """The layers in order; returns (last output, pools or None): the written pools
    with --kv-write (settings then hold "fold"), None without (returned unchanged, XLA
    would copy them every call)."""
    settings = dict(settings)
    fold = settings.pop("fold", None)
    kw = dict(sm_scale=SM_SCALE, **settings)
    new_ks, new_vs = [], []
    for k, v, kv in zip(ks, vs, kvs):
        q, k, v = layer(fold, kw, q, k, v, tables, lens, slots, kv)
        new_ks.append(k)
        new_vs.append(v)
    return (q, None, None) if fold is None else (q, new_ks, new_vs)


def time_per_call(fn, arg_sets, budget_s=0.4, repeats=7) -> float:
    """Median seconds per call over `repeats` rounds of n back-to-back calls, each call
    on the next of `arg_sets` in turn (a set's pools replaced by the call's: they may
    be donated)."""
    def call(i):
        a = arg_sets[i % len(arg_sets)]
        r = fn(*a)
        if r[1] is not None:      # the pools were donated: the call's are the set's now
            arg_sets[i % len(arg_sets)] = (a[0], r[1], r[2]) + tuple(a[3:])
        return r
    jax.block_until_ready(call(0))
    t = time.perf_counter()
    jax.block_until_ready(call(0))
    n = int(min(200, max(3, budget_s / repeats / max(time.perf_counter() - t, 1e-6))))
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        for i in range(n):
            r = call(i)
        jax.block_until_ready(r)
        out.append((time.perf_counter() - t) / n)
    return statistics.median(out)


def auto_copies(live, ctx, layers, itemsize) -> int:
    """Pool copies so that 2 x L2_BYTES of KV are read between two reads of one pool."""
    per_call = layers * live * ctx * HKV * D * 2 * itemsize
    return int(min(8, max(1, -(-2 * L2_BYTES // per_call))))


def check(settings, q, k, v, tables, lens, slots, kv) -> float:
    """Largest |kernel - reference| over max |reference| on one layer, through the
    timed path. With "fold" the reference is ref_decode_and_write, the pools must equal
    its, and the new keys' slots are NaN first (a read of the pool there would show)."""
    settings = dict(settings)
    fold = settings.pop("fold", None)
    kw = dict(sm_scale=SM_SCALE, **settings)
    if fold is None:
        got = jax.jit(functools.partial(layer, None, kw))(q, k, v, tables, lens, slots, kv)
        want = (ref_paged_attention_decode(q, k, v, tables, lens, sm_scale=SM_SCALE),)
    else:
        at = slots[slots >= 0]
        k, v = (x.reshape(HKV, -1, D).at[:, at].set(jnp.nan).reshape(x.shape) for x in (k, v))
        got = jax.jit(functools.partial(layer, fold, kw))(q, k, v, tables, lens, slots, kv)
        want = ref_decode_and_write(jnp.concatenate([q, kv], axis=1), k, v, tables, lens,
                                    slots, num_q_heads=HQ, sm_scale=SM_SCALE)
        same = [np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               equal_nan=True) for a, b in zip(got[1:], want[1:])]
        if not all(same):
            return float("inf")
    got, want = np.asarray(got[0], np.float32), np.asarray(want[0], np.float32)
    if np.isnan(got).any():
        return float("inf")
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=CASES)
    ap.add_argument("--settings", default=None, help="JSON list of kernel settings")
    ap.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--width", type=int, default=128, help="block-table width in blocks")
    ap.add_argument("--kv-write", action="store_true",
                    help="time the KV write with the attention (settings: fold)")
    ap.add_argument("--copies", type=int, default=None,
                    help="pool copies rotated between calls (default: auto_copies)")
    ap.add_argument("--time-limit", type=float, default=240.0,
                    help="seconds after which the remaining rows are skipped")
    args = ap.parse_args(argv)
    cases = [parse_case(c) for c in args.cases.split(",")]
    try:
        default = WRITE_SETTINGS if args.kv_write else SETTINGS
        settings = default if args.settings is None else json.loads(args.settings)
    except json.JSONDecodeError as e:
        raise SystemExit(f"--settings: not JSON ({e})") from None
    if not (isinstance(settings, list) and settings
            and all(isinstance(x, dict) for x in settings)):
        raise SystemExit("--settings: a JSON list of objects expected, e.g. "
                         '[{}, {"spread": true}]')
    if args.kv_write != all("fold" in x for x in settings) or (
            not args.kv_write and any("fold" in x for x in settings)):
        raise SystemExit('--settings: "fold" goes with --kv-write, in every setting')
    kv_dtype = jnp.float8_e4m3fn if args.kv_dtype == "fp8" else jnp.bfloat16
    deadline = time.perf_counter() + args.time_limit
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; kv {args.kv_dtype}; "
          f"{args.layers} layers; tables {args.width} blocks wide", flush=True)
    rows = {json.dumps(x, sort_keys=True): {} for x in settings}
    checks = {}
    if args.copies is not None and args.copies < 1:
        raise SystemExit(f"--copies {args.copies}: at least 1")
    if args.layers < 1:
        raise SystemExit(f"--layers {args.layers}: at least 1")
    for case in cases:
        copies = args.copies or auto_copies(*case[1:], args.layers,
                                            jnp.dtype(kv_dtype).itemsize)
        sets = [make_inputs(*case, args.layers, args.width, kv_dtype, seed=i)
                for i in range(copies)]
        for x in settings:
            key = json.dumps(x, sort_keys=True)
            if time.perf_counter() > deadline:
                rows[key][case] = None
                continue
            try:
                q, ks, vs, tables, lens, slots, kvs = sets[0]   # (pools: the last call's)
                checks[key, case] = check(x, q, ks[0], vs[0], tables, lens, slots, kvs[0])
                fn = jax.jit(functools.partial(chained, x),
                             donate_argnums=(1, 2) if args.kv_write else ())
                rows[key][case] = time_per_call(fn, sets) / args.layers * 1e6
            except Exception:                        # one failed row, not the table
                traceback.print_exc()
                rows[key][case] = None
            print(f"  {':'.join(map(str, case))} {key}: {rows[key][case]} us/layer, "
                  f"err {checks.get((key, case))} ({copies} pool copies)", flush=True)
        del sets
    names = [":".join(map(str, c)) for c in cases]
    print("\nus per layer (S:L:CTX = bucket rows : live rows : context); * best of the case")
    print(f"{'settings':<48}" + "".join(f"{n:>14}" for n in names))
    for key, row in rows.items():
        cells = []
        for case in cases:
            t = row.get(case)
            best = min((r[case] for r in rows.values() if r.get(case) is not None),
                       default=None)
            cells.append("-" if t is None else f"{t:.2f}{'*' if t == best else ' '}")
        print(f"{key:<48}" + "".join(f"{c:>14}" for c in cells))
    worst = max(checks.values(), default=0.0)
    print(f"largest error against the reference, over all rows: {worst:.2e}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_decode_small.json"), "w") as f:
            json.dump({"cases": names, "kv_dtype": args.kv_dtype, "layers": args.layers,
                       "kv_write": args.kv_write,
                       "rows": {k: [r.get(c) for c in cases] for k, r in rows.items()},
                       "max_err": worst}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
