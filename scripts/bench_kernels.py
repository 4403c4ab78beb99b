"""Benchmark the paged-attention kernels on one GPU, beside their peers, in one run.

    python scripts/bench_kernels.py [--quick]

Prints (and writes to $OUT/bench_kernels.json when OUT is set):
  1. a numerical check of every kernel against its reference, on this GPU;
  2. decode: our kernel, jax's bundled Pallas `paged_attention`, and the jnp reference,
     at B=64 ctx 2048 (32q/8kv heads, D=128, block 16, bf16) and B=1/8/256 x ctx 512/8192:
     ms and TB/s of KV bytes read;
  3. ragged prefill of 8 x 2048-token prompts vs cuDNN attention on the same
     (non-paged) shapes;
  4. the KV write of those prompts; a mixed step (2 x 2048-token prompts + 256 decodes
     at context 1024) through the ragged kernel alone and through the backend's split
     (decode kernel for the one-query sequences);
  5. a sweep of kernel settings at the main shapes, with the best printed.
Every row is timed as the median over repeats of back-to-back calls after a warm-up.
Each row runs under try/except, so one failure costs one row, not the table.
"""
from __future__ import annotations

import argparse
import functools
import itertools
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

from pallas_kernels.dispatch import mixed_step_attention  # noqa: E402
from pallas_kernels.paged_attention_decode import (  # noqa: E402
    paged_attention_decode, ref_paged_attention_decode)
from pallas_kernels.ragged_paged_attention import (  # noqa: E402
    ragged_paged_attention, ref_ragged_paged_attention)
from pallas_kernels.reshape_and_cache import (  # noqa: E402
    ref_reshape_and_cache, reshape_and_cache)

HQ, HKV, D, BS = 32, 8, 128, 16
SM_SCALE = D ** -0.5
MAIN = (64, 2048)
GRID = [(b, c) for b in (1, 8, 256) for c in (512, 8192)]
RESULTS: dict = {"rows": [], "sweep": [], "check": []}
DEADLINE = [float("inf")]   # perf_counter time after which sweep rows are skipped


# ----------------------------------------------------------------------------- timing
def bench(fn, *args, budget_s=0.3, repeats=7):
    """Median seconds per call; each repeat issues n calls back to back, then blocks."""
    jax.block_until_ready(fn(*args))                        # compile
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    one = max(time.perf_counter() - t, 1e-6)
    n = int(min(200, max(1, budget_s / repeats / one)))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = [fn(*args) for _ in range(n)]
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / n)
    return statistics.median(times)


def row(section, name, fn, *, kv_bytes=None, flops=None, **extra):
    """Time one row and print it; failures print and are recorded, never raised."""
    rec = {"section": section, "name": name, **extra}
    try:
        sec = fn()
        rec["ms"] = sec * 1e3
        if kv_bytes:
            rec["TB/s"] = kv_bytes / sec / 1e12
        if flops:
            rec["TFLOP/s"] = flops / sec / 1e12
    except Exception as e:  # noqa: BLE001 - one row must not lose the table
        rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    RESULTS["rows"].append(rec)
    _print_row(rec)
    return rec


def _print_row(rec):
    cols = [f"{rec['section']:<8}", f"{rec['name']:<44}"]
    if "error" in rec:
        cols.append("ERROR " + rec["error"])
    else:
        cols.append(f"{rec['ms']:9.3f} ms")
        if "TB/s" in rec:
            cols.append(f"{rec['TB/s']:6.2f} TB/s")
        if "TFLOP/s" in rec:
            cols.append(f"{rec['TFLOP/s']:6.1f} TFLOP/s")
    print("  ".join(cols), flush=True)


# ----------------------------------------------------------------------------- inputs
def decode_inputs(batch, ctx, kv_dtype=jnp.bfloat16, seed=0):
    """Full-length sequences in a shuffled pool (block 0 spare). Returns
    (q, k_cache, v_cache, block_tables, seq_lens, kv_bytes)."""
    key = jax.random.PRNGKey(seed)
    kq, kk, kv, kp = jax.random.split(key, 4)
    width = ctx // BS
    nb = batch * width + 1
    q = jax.random.normal(kq, (batch, HQ, D), jnp.bfloat16)
    k = jax.random.normal(kk, (HKV, nb, BS, D), jnp.bfloat16).astype(kv_dtype)
    v = jax.random.normal(kv, (HKV, nb, BS, D), jnp.bfloat16).astype(kv_dtype)
    tables = (jax.random.permutation(kp, nb - 1) + 1).astype(jnp.int32)
    tables = tables.reshape(batch, width)
    lens = jnp.full((batch,), ctx, jnp.int32)
    kv_bytes = 2 * batch * ctx * HKV * D * jnp.dtype(kv_dtype).itemsize
    return q, k, v, tables, lens, kv_bytes


def ragged_inputs(num_seqs, prompt, seed=0):
    """num_seqs whole prompts of `prompt` tokens: paged pool + the same K/V unpaged."""
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    t = num_seqs * prompt
    q = jax.random.normal(kq, (t, HQ, D), jnp.bfloat16)
    k = jax.random.normal(kk, (t, HKV, D), jnp.bfloat16)
    v = jax.random.normal(kv, (t, HKV, D), jnp.bfloat16)
    width = prompt // BS
    nb = num_seqs * width + 1
    tables = jnp.arange(1, nb, dtype=jnp.int32).reshape(num_seqs, width)
    slots = (tables[:, :, None] * BS + jnp.arange(BS)).reshape(-1)
    empty = jnp.zeros((HKV, nb, BS, D), jnp.bfloat16)
    kc, vc = ref_reshape_and_cache(k, v, empty, empty, slots)
    lens = jnp.full((num_seqs,), prompt, jnp.int32)
    qsl = jnp.arange(num_seqs + 1, dtype=jnp.int32) * prompt
    return q, k, v, kc, vc, tables, lens, qsl, slots


# ----------------------------------------------------------------------------- sections
def check_numerics():
    """Kernels vs references on this GPU: ragged lengths, shuffled blocks, bf16 and fp8."""
    rng = np.random.default_rng(0)
    for kv_dtype, scale in ((jnp.bfloat16, 1.0), (jnp.float8_e4m3fn, 0.25)):
        q, k, v, tables, _, _ = decode_inputs(8, 512, kv_dtype)
        lens = jnp.asarray(rng.integers(1, 513, 8), jnp.int32)
        kw = dict(sm_scale=SM_SCALE, k_scale=scale, v_scale=scale)
        ours = paged_attention_decode(q, k, v, tables, lens, **kw)
        ref = ref_paged_attention_decode(q, k, v, tables, lens, **kw)
        _check(f"decode kv={jnp.dtype(kv_dtype).name}", ours, ref)
        q_lens = np.array([1, 300, 1, 77, 512, 1, 40, 0])
        kv_lens = np.maximum(np.asarray(lens), q_lens)
        qsl = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
        qr = jax.random.normal(jax.random.PRNGKey(1), (int(q_lens.sum()) + 9, HQ, D),
                               jnp.bfloat16)
        args = (qr, k, v, tables, jnp.asarray(kv_lens, jnp.int32), qsl)
        _check(f"ragged kv={jnp.dtype(kv_dtype).name}",
               ragged_paged_attention(*args, **kw), ref_ragged_paged_attention(*args, **kw))
    q, k, v, kc, vc, _, _, _, slots = ragged_inputs(2, 256)
    slots = slots.at[::7].set(-1)
    got = reshape_and_cache(k, v, kc * 0, vc * 0, slots)
    want = ref_reshape_and_cache(k, v, kc * 0, vc * 0, slots)
    exact = all(bool(jnp.array_equal(a, b)) for a, b in zip(got, want))
    RESULTS["check"].append({"name": "kv write", "exact": exact})
    print(f"check    kv write bf16                 exact: {exact}")


def _check(name, ours, ref):
    ours, ref = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
    err = float(np.abs(ours - ref).max() / max(np.abs(ref).max(), 1e-30))
    ok = bool(np.isfinite(ours).all()) and err < 2e-2
    RESULTS["check"].append({"name": name, "max_rel_err": err, "ok": ok})
    print(f"check    {name:<28} max err / max|ref| = {err:.2e}  {'ok' if ok else 'FAIL'}")


def decode_table(shapes):
    from jax.experimental.pallas.ops.gpu import paged_attention as bundled
    for batch, ctx in shapes:
        q, k, v, tables, lens, kv_bytes = decode_inputs(batch, ctx)
        shape = f"B={batch} ctx={ctx}"
        ours = jax.jit(functools.partial(paged_attention_decode, sm_scale=SM_SCALE))
        row("decode", f"ours {shape}", lambda: bench(ours, q, k, v, tables, lens),
            kv_bytes=kv_bytes, batch=batch, ctx=ctx)
        for label, kw in (("defaults", {}),
                          ("best-known", dict(pages_per_compute_block=8, k_splits=4,
                                              num_warps=4, num_stages=2))):
            kw = dict(kw, k_splits=min(kw.get("k_splits", 16), ctx // BS))
            fn = jax.jit(functools.partial(bundled.paged_attention, **kw))
            row("decode", f"jax bundled ({label}) {shape}",
                lambda fn=fn: bench(fn, q * SM_SCALE, k, v, tables, lens),
                kv_bytes=kv_bytes, batch=batch, ctx=ctx)
        ref = jax.jit(functools.partial(ref_paged_attention_decode, sm_scale=SM_SCALE))
        row("decode", f"reference (jnp) {shape}",
            lambda: bench(ref, q, k, v, tables, lens, budget_s=0.2, repeats=3),
            kv_bytes=kv_bytes, batch=batch, ctx=ctx)
        del q, k, v, tables


def decode_extras():
    batch, ctx = MAIN
    q, k, v, tables, lens, kv_bytes = decode_inputs(batch, ctx, jnp.float8_e4m3fn)
    ours = jax.jit(functools.partial(paged_attention_decode, sm_scale=SM_SCALE))
    row("decode", f"ours fp8 KV B={batch} ctx={ctx}", lambda: bench(ours, q, k, v, tables, lens),
        kv_bytes=kv_bytes, batch=batch, ctx=ctx)
    q, k, v, tables, lens, kv_bytes = decode_inputs(batch, ctx)
    qsl = jnp.arange(batch + 1, dtype=jnp.int32)
    rag = jax.jit(functools.partial(ragged_paged_attention, sm_scale=SM_SCALE))
    row("decode", f"ragged kernel as decode B={batch} ctx={ctx}",
        lambda: bench(rag, q, k, v, tables, lens, qsl), kv_bytes=kv_bytes)


def prefill_section(num_seqs=8, prompt=2048):
    q, k, v, kc, vc, tables, lens, qsl, slots = ragged_inputs(num_seqs, prompt)
    num_seqs, prompt = lens.shape[0], q.shape[0] // lens.shape[0]
    flops = 4 * num_seqs * HQ * prompt * prompt // 2 * D
    ours = jax.jit(functools.partial(ragged_paged_attention, sm_scale=SM_SCALE))
    row("prefill", f"ours ragged paged {num_seqs}x{prompt}",
        lambda: bench(ours, q, kc, vc, tables, lens, qsl), flops=flops)
    qb, kb, vb = (x.reshape(num_seqs, prompt, -1, D) for x in (q, k, v))
    for impl in ("cudnn", "xla"):
        fn = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                       scale=SM_SCALE, implementation=impl))
        row("prefill", f"jax.nn.dot_product_attention {impl}",
            lambda fn=fn: bench(fn, qb, kb, vb), flops=flops)
    write = jax.jit(reshape_and_cache, donate_argnums=(2, 3))
    state = [kc, vc]

    def write_step():
        state[:] = write(k, v, state[0], state[1], slots)
        return state
    row("kvwrite", f"reshape_and_cache {num_seqs}x{prompt} tokens",
        lambda: bench(lambda: write_step()), kv_bytes=2 * 2 * k.size * k.dtype.itemsize)


def mixed_section(prefills=2, prompt=2048, decodes=256, ctx=1024):
    """One step of whole prompts and decodes: ragged kernel alone vs the split."""
    kq, kk, kv, kp = jax.random.split(jax.random.PRNGKey(3), 4)
    q_lens = [prompt] * prefills + [1] * decodes
    kv_lens = [prompt] * prefills + [ctx] * decodes
    width = max(kv_lens) // BS
    nb = sum(-(-n // BS) for n in kv_lens) + 1
    perm = np.asarray(jax.random.permutation(kp, nb - 1)) + 1
    tables, used = np.zeros((len(q_lens), width), np.int32), 0
    for i, n in enumerate(kv_lens):
        tables[i, :-(-n // BS)] = perm[used:used - (-n // BS)]
        used += -(-n // BS)
    q = jax.random.normal(kq, (sum(q_lens), HQ, D), jnp.bfloat16)
    kc = jax.random.normal(kk, (HKV, nb, BS, D), jnp.bfloat16)
    vc = jax.random.normal(kv, (HKV, nb, BS, D), jnp.bfloat16)
    args = (q, kc, vc, jnp.asarray(tables), jnp.asarray(kv_lens, jnp.int32),
            jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32))
    name = f"{prefills}x{prompt} + {decodes} decodes ctx={ctx}"
    ragged = jax.jit(functools.partial(ragged_paged_attention, sm_scale=SM_SCALE))
    split = jax.jit(functools.partial(mixed_step_attention, sm_scale=SM_SCALE))
    _check("mixed split vs ragged alone", split(*args), ragged(*args))
    row("mixed", f"ragged kernel alone {name}", lambda: bench(ragged, *args))
    row("mixed", f"split (decode kernel) {name}", lambda: bench(split, *args))


def sweep(quick):
    """Kernel settings at the main decode shape and the prefill shape; prints the best.
    Phase 1 varies the tiling at a fixed warp count, phase 2 the warps of the winner."""
    q, k, v, tables, lens, kv_bytes = decode_inputs(*MAIN)
    product = itertools.product((2, 4, 8, 16), (1, 2, 4, 8), (2, 3, 4))
    if quick:
        product = itertools.product((4, 8), (2, 4), (2, 3))
    configs = [dict(blocks_per_step=b, k_splits=s, num_warps=4, num_stages=n)
               for b, s, n in product if max(n - 1, 1) * 2 * b * BS * D * 2 <= 200 << 10]
    best = _sweep_one("decode", configs, paged_attention_decode, (q, k, v, tables, lens),
                      kv_bytes=kv_bytes)
    if best and not quick:
        more = [dict(best["settings"], num_warps=w) for w in (2, 8)]
        best = _sweep_one("decode", more, paged_attention_decode, (q, k, v, tables, lens),
                          kv_bytes=kv_bytes, best=best)
    del q, k, v
    q, _, _, kc, vc, tables, lens, qsl, _ = ragged_inputs(8, 2048)
    product = itertools.product((32, 64), (2, 4, 8), (4, 8), (2, 3, 4))
    if quick:
        product = itertools.product((64,), (4,), (8,), (2, 3))
    # Larger tiles spill registers (M = block_q * 4 rows x keys), or overflow shared
    # memory (checked by compiling for sm_90a); 4 warps are too few for 256 rows.
    configs = [dict(block_q=b, blocks_per_step=p, num_warps=w, num_stages=n)
               for b, p, w, n in product
               if b * p <= 256 and (b < 64 or w == 8)
               and n * 4 * p * BS * D + 8 * b * D <= 200 << 10]
    args = (q, kc, vc, tables, lens, qsl)
    flops = 4 * lens.shape[0] * HQ * (q.shape[0] // lens.shape[0]) ** 2 // 2 * D
    best_p = _sweep_one("prefill", configs, ragged_paged_attention, args, flops=flops)
    return best, best_p


def _sweep_one(section, configs, kernel, args, kv_bytes=None, flops=None, best=None):
    for settings in configs:
        if time.perf_counter() > DEADLINE[0]:
            print(f"sweep    {section}: out of time, skipping the rest", flush=True)
            break
        fn = jax.jit(functools.partial(kernel, sm_scale=SM_SCALE, **settings))
        rec = row("sweep", f"{section} " + " ".join(f"{k}={v}" for k, v in settings.items()),
                  lambda fn=fn: bench(fn, *args, budget_s=0.1, repeats=5), kv_bytes=kv_bytes,
                  flops=flops, settings=settings, kernel=section)
        RESULTS["rows"].pop()
        RESULTS["sweep"].append(rec)
        if "ms" in rec and (best is None or rec["ms"] < best["ms"]):
            best = rec
    if best:
        print(f"BEST {section}: {best['settings']}  {best['ms']:.3f} ms", flush=True)
        RESULTS[f"best_{section}"] = best
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="main shapes and a small sweep")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--time-limit", type=float, default=330.0,
                        help="seconds after which the sweep stops (default 330)")
    args = parser.parse_args()
    dev = jax.devices()[0]
    RESULTS["device"] = f"{dev.device_kind} ({dev.platform})"
    RESULTS["jax"] = jax.__version__
    RESULTS["date"] = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"# {RESULTS['device']}, jax {jax.__version__}, {RESULTS['date']}")
    print(f"# {HQ}q/{HKV}kv heads, D={D}, block {BS}, bf16 unless noted", flush=True)
    t0 = time.perf_counter()
    DEADLINE[0] = t0 + args.time_limit
    for section in (check_numerics,
                    lambda: decode_table([MAIN] + ([] if args.quick else GRID)),
                    decode_extras, prefill_section, mixed_section):
        _guarded(section)
    if not args.no_sweep:
        _guarded(lambda: sweep(args.quick))
    _guarded(summary)
    RESULTS["wall_s"] = time.perf_counter() - t0
    print(f"# wall {RESULTS['wall_s']:.0f} s")
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "bench_kernels.json")
        with open(path, "w") as f:
            json.dump(RESULTS, f, indent=1)
        print(f"# wrote {path}")


def summary():
    """Ratios against the peers and goals of issue 4 (3.2 TB/s; 1.5x cuDNN)."""
    ms = {r["name"]: r["ms"] for r in RESULTS["rows"] if "ms" in r}
    shape = f"B={MAIN[0]} ctx={MAIN[1]}"
    ours = ms.get(f"ours {shape}")
    lines = []
    for peer in ("jax bundled (defaults)", "jax bundled (best-known)", "reference (jnp)"):
        if ours and ms.get(f"{peer} {shape}"):
            lines.append(f"decode {shape}: ours is {ms[f'{peer} {shape}'] / ours:.2f}x "
                         f"faster than {peer}")
    best = RESULTS.get("best_decode")
    if best and "TB/s" in best:
        lines.append(f"decode {shape}: best setting {best['TB/s']:.2f} TB/s (goal 3.2)")
    pre = [v for k, v in ms.items() if k.startswith("ours ragged paged")]
    if pre and ms.get("jax.nn.dot_product_attention cudnn"):
        ratio = pre[0] / ms["jax.nn.dot_product_attention cudnn"]
        lines.append(f"prefill: ours takes {ratio:.2f}x cuDNN's time (goal <= 1.5)")
    RESULTS["summary"] = lines
    for line in lines:
        print("# " + line)


def _guarded(fn):
    try:
        fn()
    except Exception:  # noqa: BLE001 - a broken section must not lose the others
        traceback.print_exc()


if __name__ == "__main__":
    main()
