"""End-to-end engine benchmarks on one GPU (BENCHMARKS.md workloads), with the HF
transformers peer run in the same process on the same card.

    python scripts/bench_h200.py --model configs/models/llama-3.1-8b \
        --workloads latency,decode-1,throughput,sharegpt --hf-peer

Random (`dummy`) weights; prompts are random token ids. Prints a table last and
writes JSON to $OUT/bench_h200.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import step_timeline  # noqa: E402 - beside this script
from hf_peer import hf_peer, sharegpt_lengths  # noqa: E402 - beside this script

ROOFLINE_NOTE = {
    "latency": "vLLM H200 CI 833 ms; roofline ~480 ms",
    "decode-1": "roofline ~268 tok/s",
    "throughput": "roofline ~49k tok/s",
    "sharegpt": "vLLM CI 22.6 req/s (real ShareGPT)",
    "long-context": "issue 19: fp8 KV should beat bf16 KV (scripts/bench_fp8_kv_e2e.sh)",
}


def random_prompts(rng, n, length, vocab):
    return [{"prompt_token_ids": rng.integers(100, vocab - 100, int(k)).tolist()}
            for k in (length if hasattr(length, "__len__") else [length] * n)]


def timed_generate(llm, prompts, params):
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, outs


def bench_latency(llm, vocab, args):
    from jaxllm import SamplingParams
    rng = np.random.default_rng(0)
    prompts = random_prompts(rng, args.batch_size, 32, vocab)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    timed_generate(llm, prompts, params)                       # warm
    runs = [timed_generate(llm, prompts, params) for _ in range(args.repeat)]
    times = [t for t, _ in runs]
    return {"latency_ms_median": 1000 * statistics.median(times),
            "latency_ms_all": [round(1000 * t, 1) for t in times],
            "phases_ms": latency_phases(*runs[-1])}


def latency_phases(total_s, outs):
    """Where the last run's time went, from the requests' own timestamps: until the
    first token (the prefill step, read back), the decode tokens after it, and the
    rest of generate() (adding the requests before, returning after)."""
    m = [o.metrics for o in outs]
    start = min(x.arrival_time for x in m)
    first = max(x.first_token_time for x in m) - start
    decode = max(x.finished_time for x in m) - max(x.first_token_time for x in m)
    tokens = len(outs[0].outputs[0].token_ids)
    return {"first_token": round(1000 * first, 2), "decode": round(1000 * decode, 2),
            "decode_per_token": round(1000 * decode / max(tokens - 1, 1), 3),
            "other": round(1000 * (total_s - first - decode), 2)}


def bench_decode1(llm, vocab, args):
    from jaxllm import SamplingParams
    rng = np.random.default_rng(1)
    prompts = random_prompts(rng, 1, 128, vocab)
    params = SamplingParams(temperature=0, max_tokens=512, ignore_eos=True)
    timed_generate(llm, prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    t, outs = timed_generate(llm, prompts, params)
    res = {"output_tok_s": 512 / t, "seconds": t}
    engine = llm.llm_engine
    if engine.executor is None:     # the engine core in its own process: no internals
        return res
    res.update(**step_breakdown(llm), host_ms=step_timeline.host_timing(llm, prompts, params))
    if engine.async_scheduling:      # the same engine stepping one step at a time
        engine.async_scheduling = False
        try:
            t_sync, _ = timed_generate(llm, prompts, params)
            res["sync_output_tok_s"] = 512 / t_sync
            res["sync_host_ms"] = step_timeline.host_timing(llm, prompts, params)
        finally:
            engine.async_scheduling = True
    if args.profile:   # the engine's own steps: device busy vs idle
        import step_profile
        res["engine_profile"] = step_profile.profile_engine(
            llm, prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), 64)
    return res


def step_breakdown(llm):
    """Device time of one bare decode step (batch 1, context ~600, padded to the
    smallest bucket) against the engine's whole step: the difference is host work."""
    import step_profile
    runner = llm.llm_engine.runner
    arrays, decode_only = step_profile.step_arrays(runner, 1, 600)
    t = step_profile.time_steps(runner, arrays, decode_only, iters=50)
    return {"bare_step_ms_pipelined": t["step_ms_queued"],
            "bare_step_ms_synced": t["step_ms_synced"]}


# Bare steps profiled with --profile: label -> (batch, context, new tokens per sequence).
PROFILE_SHAPES = {"decode b1 ctx600": (1, 600, 1), "decode b8 ctx100": (8, 100, 1),
                  "decode b256 ctx1100": (256, 1100, 1), "prefill 4x1024": (4, 0, 1024)}


def profile_shapes(names: str) -> dict:
    """--profile-shapes: the named PROFILE_SHAPES (a bad name refused by argparse)."""
    chosen = [n.strip() for n in names.split(",")]
    bad = [n for n in chosen if n not in PROFILE_SHAPES]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad[0]!r}: one of {', '.join(PROFILE_SHAPES)}")
    return {n: PROFILE_SHAPES[n] for n in chosen}


def bench_throughput(llm, vocab, args):
    from jaxllm import SamplingParams
    rng = np.random.default_rng(2)
    n = args.num_prompts
    prompts = random_prompts(rng, n, 1024, vocab)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    timed_generate(llm, prompts[:64], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    timeline = None
    if args.timeline:       # the schedule of every step recorded (step_timeline.py)
        t, outs, timeline = step_timeline.timed_run(llm, prompts, params)
    else:
        t, outs = timed_generate(llm, prompts, params)
    out_toks = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"requests_s": n / t, "total_tok_s": (n * 1024 + out_toks) / t,
            "output_tok_s": out_toks / t, "seconds": t, "timeline": timeline}


def bench_sharegpt(llm, vocab, args):
    from jaxllm import SamplingParams
    inp, out = sharegpt_lengths(args.num_prompts)
    rng = np.random.default_rng(3)
    prompts = random_prompts(rng, len(inp), inp, vocab)
    params = [SamplingParams(temperature=0, max_tokens=int(k), ignore_eos=True) for k in out]
    t, outs = timed_generate(llm, prompts, params)
    out_toks = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"requests_s": len(prompts) / t, "output_tok_s": out_toks / t,
            "total_tok_s": (int(inp.sum()) + out_toks) / t, "seconds": t}


def bench_long_context(llm, vocab, args):
    """64 requests of 7,000 prompt tokens and 256 out, all at once: decode reads ~450k
    tokens of KV a step, so the KV cache dtype shows in the wall-clock time."""
    from jaxllm import SamplingParams
    n, k_in, k_out = long_shape(args)
    params = SamplingParams(temperature=0, max_tokens=k_out, ignore_eos=True)
    # Fresh prompts each time: prefix caching would skip the prefill of a prompt it has seen.
    warm = random_prompts(np.random.default_rng(40), n, min(k_in, 512), vocab)
    timed_generate(llm, warm, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    runs = [timed_generate(llm, random_prompts(np.random.default_rng(41 + i), n, k_in, vocab),
                           params) for i in range(args.repeat)]
    assert all(len(o.outputs[0].token_ids) == k_out for _, outs in runs for o in outs)
    times = [t for t, _ in runs]
    t = statistics.median(times)
    return {"seconds_median": t, "seconds_all": [round(x, 3) for x in times],
            "output_tok_s": n * k_out / t, "total_tok_s": n * (k_in + k_out) / t,
            "shape": [n, k_in, k_out], "kv_cache_dtype": args.kv_cache_dtype}


def long_shape(args):
    """(requests, prompt tokens, output tokens) of long-context, checked against max_model_len."""
    n, k_in, k_out = (int(x) for x in args.long_shape.split(","))
    if args.max_model_len < k_in + k_out:
        raise ValueError(f"long-context needs --max-model-len >= {k_in + k_out} "
                         f"({k_in} in + {k_out} out), got {args.max_model_len}")
    return n, k_in, k_out


def bench_digest(llm, vocab, args):
    """Greedy tokens and their logprobs for 8 fixed prompts: two runs of one commit
    under different XLA options compare these (an option that reorders kernels must
    not change a result), with `scripts/bench_h200.py --compare-digests A B`."""
    from jaxllm import SamplingParams
    prompts = random_prompts(np.random.default_rng(2), 8, 32, vocab)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)
    _, outs = timed_generate(llm, prompts, params)
    comps = [o.outputs[0] for o in outs]
    return {"tokens": [list(c.token_ids) for c in comps],
            "logprobs": [[round(next(iter(d.values())).logprob, 4) for d in c.logprobs]
                         for c in comps]}


def _saved_digest(path) -> dict:
    with open(path) as f:
        saved = json.load(f)
    if "digest" not in saved:
        raise SystemExit(f"--compare-digests: {path} has no `digest` result (run the "
                         "`digest` workload to save one)")
    return saved["digest"]


def compare_digests(a_path, b_path) -> dict:
    """Two saved runs' digests: tokens equal up to the first difference per prompt, and
    the largest logprob difference over the tokens both runs share."""
    a, b = (_saved_digest(p) for p in (a_path, b_path))
    same, diff = [], 0.0
    for ta, tb, la, lb in zip(a["tokens"], b["tokens"], a["logprobs"], b["logprobs"]):
        n = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        same.append(n)
        diff = max([diff] + [abs(x - y) for x, y in zip(la[:n], lb[:n])])
    return {"equal_prefix": same, "tokens_each": len(a["tokens"][0]),
            "max_logprob_diff": round(diff, 4)}


WORKLOADS = {"latency": bench_latency, "decode-1": bench_decode1, "throughput": bench_throughput,
             "sharegpt": bench_sharegpt, "long-context": bench_long_context,
             "digest": bench_digest}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="configs/models/llama-3.1-8b")
    ap.add_argument("--workloads", default="latency,decode-1,throughput,sharegpt")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--quantization", default=None,
                    help="fp8 | int8 (W8A8) | awq | gptq (4-bit weights in groups of "
                         "128): random quantized weights of the model's shape")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto (bf16 here) | fp8")
    ap.add_argument("--long-shape", default="64,7000,256", help="long-context's n,in,out")
    ap.add_argument("--hf-peer", action="store_true")
    ap.add_argument("--hf-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--hf-sharegpt-requests", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8,
                    help="latency's prompts (vLLM's benchmark_latency --batch-size; its CI "
                    "figure, printed as the peer, is for 8)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--no-async-scheduling", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="time and trace bare steps (PROFILE_SHAPES) after the workloads")
    ap.add_argument("--profile-shapes", type=profile_shapes, default=PROFILE_SHAPES,
                    metavar="NAMES", help="--profile's shapes, comma-separated, of: "
                    + ", ".join(PROFILE_SHAPES))
    ap.add_argument("--timeline", action="store_true",
                    help="throughput: time by kind of step (scripts/step_timeline.py)")
    ap.add_argument("--compile-cache", metavar="DIR",
                    help="persistent compilation cache (cold start fills it)")
    ap.add_argument("--startup-only", action="store_true",
                    help="start the engine, print the start-up time and exit (run it after a "
                         "run with the same --compile-cache for a warm restart)")
    ap.add_argument("--compare-digests", nargs=2, metavar=("A", "B"),
                    help="compare the `digest` workload of two saved JSON results and exit")
    args = ap.parse_args()
    if args.compare_digests:
        print(json.dumps(compare_digests(*args.compare_digests)))
        return
    args.workloads = args.workloads.split(",")
    if "long-context" in args.workloads:
        long_shape(args)    # a too-short --max-model-len fails before the start-up
    if args.hf_only:
        print(json.dumps(hf_peer(args.model, vocab_of(args.model), args)))
        return
    # The peer runs first, in its own process: JAX keeps the card's memory until exit,
    # so HF after jaxllm in one process runs out of memory (seen on the H200).
    hf = run_hf_peer_subprocess() if args.hf_peer and not args.startup_only else None
    import jax
    from jaxllm import LLM, compilation_cache
    from jaxllm.models.loader import read_hf_config
    compilation_cache.enable(args.compile_cache)
    compiled_names = []
    if args.startup_only:   # which programs the warm start still compiles
        import logging

        class _Names(logging.Handler):
            def emit(self, record):
                msg = record.getMessage()
                if "Finished XLA compilation" in msg or "cache hit" in msg.lower():
                    compiled_names.append(msg[:120])
        jax.config.update("jax_log_compiles", True)
        logging.getLogger("jax").addHandler(_Names())
    vocab = read_hf_config(args.model)["vocab_size"]
    # With the engine core in its own process this one must not take the card.
    engine_process = os.environ.get("JAXLLM_ENABLE_MULTIPROCESSING") == "1"
    results = {"model": args.model, "engine_process": engine_process,
               "device": "(engine process)" if engine_process else
               str(jax.devices()[0].device_kind),
               "tp": args.tensor_parallel_size, "tag": args.tag, "batch_size": args.batch_size,
               "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype}
    if hf is not None:
        results["hf"] = hf
    t0 = time.perf_counter()
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16",
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
              tensor_parallel_size=args.tensor_parallel_size,
              async_scheduling=not args.no_async_scheduling, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype, compilation_cache_dir=args.compile_cache)
    results["startup_s"] = time.perf_counter() - t0
    results["startup_breakdown"] = llm.llm_engine.startup_breakdown
    results["compile_cache"] = compilation_cache.summary()
    if args.startup_only:
        misses = compiled_names   # compile logs and persistent-cache hits, in order
        print(json.dumps({**{k: results[k] for k in ("startup_s", "startup_breakdown",
                                                     "compile_cache")},
                          "compile_log": misses[:80]}))
        return
    results["kv_blocks"] = llm.llm_engine.get_stats().num_total_blocks + 1
    results["backend"] = "engine process" if llm.llm_engine.executor is None else \
        llm.llm_engine.runner.spec.backend
    print(f"engine up in {results['startup_s']:.1f} s, {results['kv_blocks']} blocks", flush=True)
    for name in args.workloads:
        try:
            results[name] = WORKLOADS[name](llm, vocab, args)
        except Exception as e:   # keep the table even if one workload breaks
            traceback.print_exc()
            results[name] = {"error": repr(e)[:300]}
        print(name, json.dumps(results[name]), flush=True)
        save(results, args)     # after each workload: a run cut short keeps what it did
    if args.profile:
        import step_profile
        results["profile"] = step_profile.run_all(llm.llm_engine.runner, args.profile_shapes)
        save(results, args)
    save(results, args)
    print_table(results)


def save(results, args):
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"bench_h200{args.tag}.json"), "w") as f:
            json.dump(results, f, indent=1)


def vocab_of(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)["vocab_size"]


def run_hf_peer_subprocess():
    return run_subprocess(["--hf-only"])


def run_subprocess(extra):
    """This script again in a new process with `extra` flags; its last stdout line."""
    import subprocess
    cmd = [sys.executable, *sys.argv, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"error": proc.stderr[-300:]}


def print_table(r):
    print(f"\n== {r['model']} on {r['device']} TP={r['tp']} backend={r.get('backend')} "
          f"KV {r.get('kv_cache_dtype', 'auto')} "
          f"start-up {r['startup_s']:.1f} s {r.get('startup_breakdown')}")

    hf = r.get("hf", {})
    rows = [
        ("latency", "latency_ms_median", "ms", hf.get("latency_ms")),
        ("decode-1", "output_tok_s", "out tok/s", 268.0),
        ("throughput", "total_tok_s", "total tok/s", 49000.0),
        ("sharegpt", "requests_s", "req/s", hf.get("sharegpt_requests_s")),
        ("long-context", "seconds_median", "s", None),
    ]
    for name, key, unit, peer in rows:
        v = r.get(name, {}).get(key)
        if v is None:
            if name in r:
                print(f"{name:12s} {r[name]}")
            continue
        ratio = f"{v / peer:.2f}x of peer/ceiling {peer:.1f}" if peer else ""
        note = ROOFLINE_NOTE[name] if name != "latency" or r.get("batch_size", 8) == 8 \
            else f"batch {r['batch_size']}: no peer"
        print(f"{name:12s} {v:10.1f} {unit:12s} {ratio}  ({note})")


if __name__ == "__main__":
    main()
