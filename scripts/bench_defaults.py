"""Issue 22's H200 lines in one run (Llama-3.1-8B shape, dummy weights):

  1. prefix workload: 512 requests sharing a 2,000-token system prompt (100 own
     tokens each, 64 out), req/s with the shipped defaults (prefix caching on) against
     `enable_prefix_caching=False` (the old default);
  2. `throughput` (1000 x 1024/128, 0% prefix hits) both ways;
  3. sampled `latency` (8 x 32/128, temperature 0.8, top_p 0.95, top_k 50) against
     greedy, runs interleaved: first on the fresh engine, then again after 1 and 2;
  4. the attention kernels at each dtype x head_dim (f32, f16, bf16 x 64, 128, 256)
     against their references, and an f32 engine step at head_dim 128;
  5. `sharegpt-like` with the defaults, to set beside vLLM's large-GPU defaults run
     by bench_h200.py in the same call;
  6. the sampler alone at vocab 128,256: greedy, filters by the sort-based twin, by
     the radix search at 1, 2 and 4 bits per pass, and by the block path.

    python3 scripts/bench_defaults.py --compile-cache DIR

The caching-off engine runs first in a subprocess (JAX keeps the card's memory until
the process exits). JSON to $OUT/bench_defaults.json when OUT is set.
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
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from bench_h200 import (bench_sharegpt, bench_throughput, random_prompts,  # noqa: E402
                        timed_generate)


def bench_prefix(llm, vocab, n=512, shared=2000, own=100, out=64) -> dict:
    from jaxllm import SamplingParams
    rng = np.random.default_rng(5)
    system = rng.integers(100, vocab - 100, shared).tolist()
    prompts = [{"prompt_token_ids": system + rng.integers(100, vocab - 100, own).tolist()}
               for _ in range(n)]
    params = SamplingParams(temperature=0, max_tokens=out, ignore_eos=True)
    warm = [{"prompt_token_ids": rng.integers(100, vocab - 100, shared + own).tolist()}
            for _ in range(8)]
    timed_generate(llm, warm, params)
    t, _ = timed_generate(llm, prompts, params)
    return {"requests_s": n / t, "seconds": t}


def bench_sampled_latency(llm, vocab, repeat: int) -> dict:
    from jaxllm import SamplingParams
    prompts = random_prompts(np.random.default_rng(0), 8, 32, vocab)
    greedy = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    sampled = [SamplingParams(temperature=0.8, top_p=0.95, top_k=50, max_tokens=128,
                              ignore_eos=True, seed=i) for i in range(8)]
    timed_generate(llm, prompts, greedy)
    timed_generate(llm, prompts, sampled)
    g, s = [], []
    for _ in range(repeat):
        g.append(timed_generate(llm, prompts, greedy)[0])
        s.append(timed_generate(llm, prompts, sampled)[0])
    return {"greedy_ms": 1000 * statistics.median(g), "sampled_ms": 1000 * statistics.median(s),
            "ratio": statistics.median(s) / statistics.median(g),
            "greedy_all_ms": [round(1000 * x, 1) for x in g],
            "sampled_all_ms": [round(1000 * x, 1) for x in s]}


def check_attention_dtypes() -> dict:
    """Each kernel at each dtype x head_dim: compiled on the card, max error against
    the plain-jnp reference (f32 math), and its time."""
    import jax
    import jax.numpy as jnp
    sys.path.insert(0, os.path.join(HERE, "..", "tests", "kernels"))
    from kernel_cases import make_case
    from pallas_kernels.dispatch import mixed_step_attention
    from pallas_kernels.paged_attention_decode import (paged_attention_decode,
                                                       ref_paged_attention_decode)
    from pallas_kernels.ragged_paged_attention import ref_ragged_paged_attention
    out = {}
    for dtype in (jnp.float32, jnp.float16, jnp.bfloat16):
        for d in (64, 128, 256):
            name = f"{jnp.dtype(dtype).name}/d{d}"
            try:
                out[name] = _one_attention_check(jax, jnp, make_case, mixed_step_attention,
                                                 paged_attention_decode,
                                                 ref_paged_attention_decode,
                                                 ref_ragged_paged_attention, dtype, d)
            except Exception as e:        # noqa: BLE001 - the table shows which failed
                out[name] = {"error": repr(e)[:300]}
            print("attention", name, out[name], flush=True)
    return out


def _one_attention_check(jax, jnp, make_case, mixed, decode, ref_decode, ref_ragged, dtype, d):
    c = make_case(0, q_lens=[300, 1, 1, 77], kv_lens=[700, 900, 64, 77], hq=16, hkv=4, d=d,
                  bs=16, dtype=dtype)
    kw = dict(sm_scale=d ** -0.5)
    res = {}
    for name, fn, ref, args in (
            ("mixed", lambda *a: mixed(*a, **kw), lambda *a: ref_ragged(*a, **kw), c.attn_args),
            ("decode", lambda *a: decode(*a, **kw), lambda *a: ref_decode(*a, **kw),
             (c.q[:4], c.k_cache, c.v_cache, c.block_tables, c.seq_lens))):
        f = jax.jit(fn)
        got = np.asarray(f(*args).astype(jnp.float32))
        want = np.asarray(jax.jit(ref)(*args).astype(jnp.float32))
        if name == "decode":      # rows are the sequences' first query rows here
            got, want = got[[1, 2]], want[[1, 2]]
        t0 = time.perf_counter()
        for _ in range(20):
            r = f(*args)
        r.block_until_ready()
        res[name] = {"max_err": float(np.nanmax(np.abs(got - want))),
                     "nan": bool(np.isnan(got).any()), "us": 1e6 * (time.perf_counter() - t0) / 20}
    return res


def f32_engine_step(tmp="/tmp/qwen3_f32_d128") -> dict:
    """A 2-layer Qwen3-shaped model (head_dim 128) served in float32: the setting the
    card refused before the kernels sized their tiles by dtype."""
    from jaxllm import LLM, SamplingParams
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(HERE, "..", "configs", "models", "qwen3-8b", "config.json")) as f:
        cfg = json.load(f)
    cfg.update(num_hidden_layers=2, vocab_size=8192)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f)
    try:
        llm = LLM(tmp, load_format="dummy", dtype="float32", max_model_len=1024,
                  max_num_seqs=8, gpu_memory_utilization=0.3)
        outs = llm.generate([{"prompt_token_ids": list(range(100, 400))}] * 2,
                            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)
        return {"tokens": [len(o.outputs[0].token_ids) for o in outs]}
    except Exception as e:      # noqa: BLE001
        return {"error": repr(e)[:300]}


def bench_sampler(vocab=128_256) -> dict:
    import dataclasses
    import jax
    import jax.numpy as jnp
    from jaxllm.runner import sampler, sampling_rows, top_k_top_p
    from jaxllm.sampling_params import SamplingParams
    res = {}
    for rows in (8, 64, 256):
        logits = jnp.asarray(np.random.default_rng(0).normal(size=(rows, vocab)), jnp.bfloat16)
        variants = {"greedy": ([SamplingParams(temperature=0)] * rows, None),
                    "random": ([SamplingParams(temperature=0.8, seed=1)] * rows, None)}
        filt = [SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=1)] * rows
        variants["filters_sort"] = (filt, top_k_top_p.ref_apply_top_k_top_p)
        for bits in (1, 2, 4):
            variants[f"filters_radix{bits}"] = (
                filt, lambda x, k, p, b=bits: top_k_top_p.apply_top_k_top_p(x, k, p, b))
        variants["filters_blocks"] = (filt, None)
        for name, (params, filt_fn) in variants.items():
            md, flags = sampling_rows.from_params(params, [0] * rows, None, None,
                                                             rows, vocab)
            if filt_fn is not None:     # the general program, with its filter swapped
                flags = dataclasses.replace(flags, small_top_k=False)
            md = dataclasses.replace(md, **{f.name: jnp.asarray(getattr(md, f.name))
                                            for f in dataclasses.fields(md)})
            if filt_fn is not None:
                sampler.apply_top_k_top_p = filt_fn
            f = jax.jit(lambda x, m, fl=flags: sampler.sample(x, m, fl).token_ids)
            f(logits, md).block_until_ready()
            t0 = time.perf_counter()
            for _ in range(50):
                r = f(logits, md)
            r.block_until_ready()
            res[f"S{rows}/{name}"] = 1e6 * (time.perf_counter() - t0) / 50
        sampler.apply_top_k_top_p = top_k_top_p.apply_top_k_top_p
    return res


def engine_runs(args, prefix_caching: bool) -> dict:
    from jaxllm import LLM, compilation_cache
    from jaxllm.models.loader import read_hf_config
    compilation_cache.enable(args.compile_cache)
    vocab = read_hf_config(args.model)["vocab_size"]
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", max_model_len=4096,
              max_num_seqs=256, enable_prefix_caching=prefix_caching)
    args.num_prompts, args.timeline = 1000, False     # what bench_h200's workloads read
    res = {}
    if prefix_caching:    # `latency` on the fresh engine, as bench_h200 runs it
        res["sampled_latency"] = bench_sampled_latency(llm, vocab, args.repeat)
        print("sampled_latency", res["sampled_latency"], flush=True)
    res.update(prefix=bench_prefix(llm, vocab), throughput=bench_throughput(llm, vocab, args))
    if prefix_caching:       # printed as it comes, so a run cut short keeps what it had
        print("defaults", res, flush=True)
        # Again after the 1,512 requests above: an engine that has run a while.
        res["sampled_latency_after"] = bench_sampled_latency(llm, vocab, args.repeat)
        print("sampled_latency_after", res["sampled_latency_after"], flush=True)
        # Beside `bench_h200.py --max-num-seqs 1024 --max-num-batched-tokens 16384
        # --max-model-len 4096` (vLLM's LLM-class defaults on >= 70 GiB GPUs).
        res["sharegpt"] = bench_sharegpt(llm, vocab, args)
    return res


def _subprocess(part: str) -> dict:
    proc = subprocess.run([sys.executable, *sys.argv, "--only", part],
                          capture_output=True, text=True)
    sys.stderr.write(proc.stderr[-3000:])
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"error": proc.stderr[-500:]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="configs/models/llama-3.1-8b")
    ap.add_argument("--compile-cache", metavar="DIR")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--only", choices=["caching-off", "checks"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.only == "caching-off":
        print(json.dumps(engine_runs(args, prefix_caching=False)))
        return
    if args.only == "checks":
        print(json.dumps({"attention": check_attention_dtypes(),
                          "f32_engine_step": f32_engine_step(), "sampler_us": bench_sampler()}))
        return
    # Each part in its own process, in turn: JAX keeps the card's memory until exit.
    off, checks = (_subprocess(part) for part in ("caching-off", "checks"))
    print("caching off", off, "\nchecks", checks, flush=True)
    res = {"caching_off": off, **checks}
    res["defaults"] = engine_runs(args, prefix_caching=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_defaults.json"), "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))
    d, o = res["defaults"], off
    if "prefix" in o:
        print(f"\nprefix workload: {d['prefix']['requests_s']:.1f} req/s (defaults) vs "
              f"{o['prefix']['requests_s']:.1f} (caching off) = "
              f"{d['prefix']['requests_s'] / o['prefix']['requests_s']:.2f}x (goal >= 6x)")
        print(f"throughput 0% hits: {d['throughput']['total_tok_s']:.0f} vs "
              f"{o['throughput']['total_tok_s']:.0f} total tok/s = "
              f"{d['throughput']['total_tok_s'] / o['throughput']['total_tok_s']:.3f} "
              f"(goal within 2%)")
    print(f"ours (max_num_seqs 256, budget 8192): throughput "
          f"{d['throughput']['total_tok_s']:.0f} total tok/s, sharegpt-like "
          f"{d['sharegpt']['requests_s']:.1f} req/s")
    for key, when in (("sampled_latency", "fresh engine"),
                      ("sampled_latency_after", "after the workloads")):
        s = d[key]
        print(f"sampled latency ({when}) {s['sampled_ms']:.1f} ms vs greedy "
              f"{s['greedy_ms']:.1f} ms = {s['ratio']:.3f} (goal <= 1.05)")
    ok = sum("error" not in v for v in res.get("attention", {}).values())
    print(f"attention dtype x head_dim: {ok} of 9 ran; f32 engine step: "
          f"{res.get('f32_engine_step')}")


if __name__ == "__main__":
    main()
