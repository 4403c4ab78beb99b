"""Tensor-parallel scaling: the `latency` and `throughput` workloads at TP=1 and TP=2.

    python scripts/bench_tp.py                        # Llama-3.1-8B's shape, 2 GPUs
    python scripts/bench_tp.py --num-prompts 300      # a shorter throughput run
    python scripts/bench_tp.py --tp 1 --output-json tp1.json   # one TP per command,
    python scripts/bench_tp.py --tp 2 --output-json tp2.json   # when compiles are long,
    python scripts/bench_tp.py --merge tp1.json tp2.json       # then the table

Workloads (/work/shared/BENCHMARKS.md), both through `LLM.generate`, random token ids,
greedy (--temperature), ignore_eos:
  latency     batch 8, 32 in, 128 out, end to end; mean over --num-iters runs
  throughput  --num-prompts prompts (1000) of 1024 in, 128 out, all at once
Each TP runs in its own process (fresh device memory, its own compiled steps) with
random bf16 weights built on the devices, already sharded (`--load-format dummy`).
Start-up warms up (compiles) every step bucket, so the timed runs never compile;
`--enforce-eager` skips that and relies on each workload's untimed warm-up runs.
Prints one table with the scaling ratio (TP=N over TP=1; > 1 is faster) and writes
the results as JSON to --output-json (default $OUT/bench_tp.json when OUT is set).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MODEL = os.path.join(ROOT, "configs", "models", "llama-3.1-8b")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="TP sizes (1 2)")
    p.add_argument("--workloads", nargs="+", default=["latency", "throughput"],
                   choices=["latency", "throughput"])
    p.add_argument("--model", default=MODEL, help="HF folder (config.json is enough "
                   "with --load-format dummy); default: Llama-3.1-8B's shape")
    p.add_argument("--tokenizer", help="default: the model's (a placeholder for a "
                   "config.json-only dummy shape; prompts are token ids)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (as scripts/bench_h200.py); vLLM's benches use 1.0")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch-size", type=int, default=8, help="latency: prompts (8)")
    p.add_argument("--latency-input-len", type=int, default=32)
    p.add_argument("--latency-output-len", type=int, default=128)
    p.add_argument("--num-iters-warmup", type=int, default=3)
    p.add_argument("--num-iters", type=int, default=10)
    p.add_argument("--num-prompts", type=int, default=1000, help="throughput: prompts (1000)")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true",
                   help="skip the warm-up of every bucket (steps compile on first use; "
                   "the untimed warm-up runs of each workload compile most of them)")
    p.add_argument("--compilation-cache-dir", help="persistent XLA cache: a second run "
                   "of the same TP loads its compiled steps")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="print the table of earlier "
                   "runs' --output-json files (e.g. one run per TP) and exit")
    p.add_argument("--output-json", default=os.path.join(os.environ["OUT"], "bench_tp.json")
                   if os.environ.get("OUT") else None)
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)        # run one TP here
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ------------------------------------------------------------------ one TP (child)

def _engine(args):
    from jaxllm import LLM
    return LLM(args.model, load_format=args.load_format, dtype=args.dtype,
               tokenizer=args.tokenizer, tensor_parallel_size=args.child,
               max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens,
               gpu_memory_utilization=args.gpu_memory_utilization,
               enable_prefix_caching=False, enforce_eager=args.enforce_eager,
               compilation_cache_dir=args.compilation_cache_dir)


def _prompts(rng, vocab: int, n: int, length: int) -> list[dict]:
    return [{"prompt_token_ids": ids.tolist()} for ids in rng.integers(0, vocab, (n, length))]


def _params(args, max_tokens: int):
    from jaxllm.sampling_params import SamplingParams
    return SamplingParams(temperature=args.temperature, top_p=1.0, ignore_eos=True,
                          max_tokens=max_tokens)


def bench_latency(llm, args, rng) -> dict:
    prompts = _prompts(rng, llm.llm_engine.arch.vocab_size, args.batch_size,
                       args.latency_input_len)
    params = _params(args, args.latency_output_len)

    def once() -> float:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    for _ in range(args.num_iters_warmup):
        once()
    times = sorted(once() for _ in range(args.num_iters))
    return {"mean_ms": 1e3 * statistics.fmean(times), "median_ms": 1e3 * statistics.median(times),
            "min_ms": 1e3 * times[0], "max_ms": 1e3 * times[-1],
            "batch_size": args.batch_size, "input_len": args.latency_input_len,
            "output_len": args.latency_output_len, "num_iters": args.num_iters}


def bench_throughput(llm, args, rng) -> dict:
    vocab = llm.llm_engine.arch.vocab_size
    # Untimed: a few requests through the same path (first-call host work, and any
    # step shape not compiled at warm-up under --enforce-eager).
    llm.generate(_prompts(rng, vocab, min(args.num_prompts, 16), args.input_len),
                 _params(args, 8), use_tqdm=False)
    prompts = _prompts(rng, vocab, args.num_prompts, args.input_len)
    start = time.perf_counter()
    outs = llm.generate(prompts, _params(args, args.output_len), use_tqdm=False)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    in_tokens = args.num_prompts * args.input_len
    return {"elapsed_s": elapsed, "requests_per_s": args.num_prompts / elapsed,
            "total_tokens_per_s": (in_tokens + out_tokens) / elapsed,
            "output_tokens_per_s": out_tokens / elapsed, "num_prompts": args.num_prompts,
            "input_len": args.input_len, "output_len": args.output_len}


def run_child(args) -> dict:
    import jax
    import numpy as np
    t0 = time.perf_counter()
    llm = _engine(args)
    engine = llm.llm_engine
    state = jax.tree.leaves(engine.runner.state)
    result = {
        "tp": args.child, "startup_s": time.perf_counter() - t0,
        "device": engine.executor.mesh.devices.flat[0].device_kind, "jax": jax.__version__,
        "weights_gib_per_device": sum(x.addressable_shards[0].data.nbytes for x in state) / 2**30,
        "num_kv_blocks": engine.runner.num_blocks, "attention": engine.runner.spec.backend,
    }
    print(f"[tp={args.child}] engine ready in {result['startup_s']:.1f} s, "
          f"{result['weights_gib_per_device']:.2f} GiB weights/device, "
          f"{result['num_kv_blocks']} KV blocks", flush=True)
    rng = np.random.default_rng(0)
    for name, fn in (("latency", bench_latency), ("throughput", bench_throughput)):
        if name in args.workloads:
            result[name] = fn(llm, args, rng)
            print(f"[tp={args.child}] {name}: {json.dumps(result[name])}", flush=True)
    return result


# ------------------------------------------------------------------ driver

def run_all(args) -> dict:
    results = {}
    for tp in args.tp:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            path = f.name
        cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:],
               "--child", str(tp), "--child-out", path]
        proc = subprocess.run(cmd)
        if proc.returncode == 0:
            with open(path) as f:
                results[tp] = json.load(f)
        else:
            print(f"[tp={tp}] failed with exit code {proc.returncode}", flush=True)
        os.unlink(path)
    return results


ROWS = [  # (workload, key, label, higher is better); the first of each: its headline
    ("latency", "mean_ms", "latency mean ms", False),
    ("latency", "median_ms", "latency median ms", False),
    ("throughput", "total_tokens_per_s", "throughput total tok/s", True),
    ("throughput", "output_tokens_per_s", "throughput output tok/s", True),
    ("throughput", "requests_per_s", "throughput req/s", True),
]
HEADLINES = ("latency mean ms", "throughput total tok/s")


def table(results: dict) -> tuple[str, dict]:
    """The text table and the scaling ratios {row label: {tp: speed-up over TP=1}}."""
    tps = sorted(results)
    head = ["metric"] + [f"TP={t}" for t in tps] + [f"TP={t}/TP=1" for t in tps if t != 1]
    rows, ratios = [head], {}
    for workload, key, label, higher in ROWS:
        vals = {t: results[t].get(workload, {}).get(key) for t in tps}
        if all(v is None for v in vals.values()):
            continue
        row = [label] + [f"{vals[t]:.1f}" if vals[t] is not None else "-" for t in tps]
        base = vals.get(1)
        for t in tps:
            if t == 1:
                continue
            if base and vals[t]:
                ratio = vals[t] / base if higher else base / vals[t]
                ratios.setdefault(label, {})[t] = ratio
                row.append(f"{ratio:.2f}x")
            else:
                row.append("-")
        rows.append(row)
    rows.append(["startup s"] + [f"{results[t]['startup_s']:.1f}" for t in tps])
    rows.append(["weights GiB/device"] + [f"{results[t]['weights_gib_per_device']:.2f}"
                                          for t in tps])
    rows.append(["KV blocks"] + [str(results[t]["num_kv_blocks"]) for t in tps])
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                       enumerate(zip(r, widths))) for r in rows]
    return "\n".join(lines), ratios


def report(results: dict, model: str) -> dict:
    text, ratios = table(results)
    first = next(iter(results.values()))
    shapes = []
    if "latency" in first:
        lat = first["latency"]
        shapes.append(f"latency: batch {lat['batch_size']}, {lat['input_len']} in / "
                      f"{lat['output_len']} out, mean of {lat['num_iters']}")
    if "throughput" in first:
        thr = first["throughput"]
        shapes.append(f"throughput: {thr['num_prompts']} prompts, {thr['input_len']} in / "
                      f"{thr['output_len']} out")
    print(f"\n{model} on {first['device']}, jax {first['jax']}, attention "
          f"{first['attention']}, {datetime.date.today()}\n{'; '.join(shapes)}\n{text}")
    for label in HEADLINES:
        for t, r in ratios.get(label, {}).items():
            print(f"scaling ratio TP={t}/TP=1, {label}: {r:.2f}x ({100 * r / t:.0f}% of linear)")
    return ratios


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        result = run_child(args)
        with open(args.child_out, "w") as f:
            json.dump(result, f)
        return 0
    if args.merge:
        results = {}
        for path in args.merge:
            with open(path) as f:
                results.update({int(k): v for k, v in json.load(f)["results"].items()})
        report(results, "merged")
        return 0
    results = run_all(args)
    if not results:
        return 1
    ratios = report(results, f"{os.path.basename(args.model.rstrip('/'))} "
                             f"({args.load_format} {args.dtype})")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"results": {str(k): v for k, v in results.items()}, "ratios": ratios,
                       "command": " ".join(sys.argv), "date": str(datetime.date.today())},
                      f, indent=2)
    return 0 if len(results) == len(args.tp) else 1


if __name__ == "__main__":
    sys.exit(main())
