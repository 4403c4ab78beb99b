"""Where a bare model step spends its device time: a jax.profiler trace of a few
steps, its GPU kernels summed per step and grouped by kind.

Used by bench_h200.py (``--profile``); a step here is the runner's jitted model step
alone (no sampling, no host work), on made-up metadata: ``batch`` sequences with
``ctx`` tokens of context each, ``q_len`` new tokens each (1 = a decode step).
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import tempfile
import time

import numpy as np

KINDS = [  # (kind, pattern on the kernel name), first match wins
    ("attention (ours)", r"ragged_paged|paged_attention|reshape_and_cache"),
    ("matmul", r"gemm|cublas|cutlass|xmma|nvjet|sm90|triton_gemm|dot"),
    ("xla fusion", r"fusion|loop_|input_|reduce|copy|transpose|concatenate|slice"),
]


def step_arrays(runner, batch: int, ctx: int, q_len: int = 1):
    """Runner inputs for `batch` sequences of `ctx + q_len` tokens, the last `q_len`
    of them new, on distinct pool blocks."""
    bs = runner.block_size
    nblk = -(-(ctx + q_len) // bs)
    tokens = batch * q_len
    decode_only = q_len == 1
    t, s, decode_only = runner.plan.shape_for(tokens, batch, decode_only)
    block_tables = np.zeros((s, runner.max_blocks_per_seq), np.int32)
    for i in range(batch):
        block_tables[i, :nblk] = 1 + i * nblk + np.arange(nblk)
    seq_lens = np.zeros(s, np.int32)
    seq_lens[:batch] = ctx + q_len
    qsl = np.full(s + 1, tokens, np.int32)
    qsl[:batch + 1] = np.arange(batch + 1) * q_len
    positions = np.zeros(t, np.int32)
    positions[:tokens] = np.tile(np.arange(ctx, ctx + q_len), batch)
    slot = np.full(t, -1, np.int32)
    seq = np.repeat(np.arange(batch), q_len)
    pos = positions[:tokens]
    slot[:tokens] = block_tables[seq, pos // bs] * bs + pos % bs
    arrays = dict(input_ids=np.full(t, 1000, np.int32), positions=positions,
                  slot_mapping=slot, block_tables=block_tables, seq_lens=seq_lens,
                  query_start_loc=qsl, logits_indices=np.maximum(qsl[1:] - 1, 0))
    return arrays, decode_only


def time_steps(runner, arrays, decode_only, iters=20) -> dict:
    """Wall ms per step queued back to back, and waited for one by one."""
    import jax
    jax.block_until_ready(runner.launch_step(arrays, decode_only))
    t0 = time.perf_counter()
    for _ in range(iters):
        out = runner.launch_step(arrays, decode_only)
    jax.block_until_ready(out)
    queued = (time.perf_counter() - t0) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        jax.block_until_ready(runner.launch_step(arrays, decode_only))
    synced = (time.perf_counter() - t0) / iters
    return {"step_ms_queued": 1000 * queued, "step_ms_synced": 1000 * synced}


def profile(runner, arrays, decode_only, iters=5, top=12) -> dict:
    """Kernel time per step from a trace of `iters` queued steps."""
    import jax
    jax.block_until_ready(runner.launch_step(arrays, decode_only))
    folder = tempfile.mkdtemp(prefix="jaxllm-trace-")
    with jax.profiler.trace(folder):
        for _ in range(iters):
            out = runner.launch_step(arrays, decode_only)
        jax.block_until_ready(out)
    path = _trace_file(folder)
    if path is None:
        return {"error": f"no trace written under {folder}"}
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    return summarize(events, iters, top)


def _trace_file(folder: str) -> str | None:
    """The trace jax.profiler.trace(folder) wrote; None when it wrote none."""
    files = glob.glob(os.path.join(folder, "plugins", "profile", "*", "*.trace.json.gz"))
    return files[0] if files else None


def _gpu_pids(events) -> set:
    """The trace's process ids of GPUs (the others are the host's)."""
    return {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
            and "GPU" in str(e.get("args", {}).get("name", ""))}


def trace_synced_steps(runner, arrays, decode_only, iters) -> str | None:
    """The trace file of `iters` steps, each launched after the last finished (the
    device idle at each launch); None when the profiler wrote none."""
    import jax
    jax.block_until_ready(runner.launch_step(arrays, decode_only))
    folder = tempfile.mkdtemp(prefix="jaxllm-trace-")
    with jax.profiler.trace(folder):
        for _ in range(iters):
            jax.block_until_ready(runner.launch_step(arrays, decode_only))
    return _trace_file(folder)


def host_profile(runner, arrays, decode_only, iters=10, top=40, keep=None,
                 tag="step") -> dict:
    """Where a launch's host time goes: a trace of `iters` launches, each after the
    last finished (the device idle), its host events summed per name (inclusive
    times, us per launch). `keep`: a folder to copy the trace file into, named by
    `tag`."""
    import shutil
    path = trace_synced_steps(runner, arrays, decode_only, iters)
    if path is None:
        return {"error": "the profiler wrote no trace"}
    if keep:
        shutil.copy(path, os.path.join(keep, f"host_trace_{tag}.json.gz"))
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    gpu_pids = _gpu_pids(events)
    by_name = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("ph") == "X" and e.get("pid") not in gpu_pids and "dur" in e:
            name = re.sub(r"\d+", "#", str(e["name"]))[:80]
            by_name[name][0] += e["dur"]
            by_name[name][1] += 1
    return {"top": [(n, round(d / iters, 1), round(c / iters, 1))
                    for n, (d, c) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]]}


def events_untraced_python(fn) -> list | None:
    """fn() under jax's profiler without Python tracing (its tracer tripled a 256-row
    step's wall time): the trace's events, None when it wrote none."""
    import jax
    folder = tempfile.mkdtemp(prefix="jaxllm-trace-")
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    with jax.profiler.trace(folder, profiler_options=options):
        fn()
    path = _trace_file(folder)
    if path is None:
        return None
    with gzip.open(path) as f:
        return json.load(f)["traceEvents"]


def profile_engine(llm, prompts, params, steps: int, top=12) -> dict:
    """The whole engine (scheduling, sampling, host work) over one generate call,
    Python untraced: device kernel time and span per engine step (span - kernels =
    device idle), the run's wall per step, and where the device idles (idle_gaps)."""
    from idle_gaps import idle_gaps
    spans = []

    def run():
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        spans.append(time.perf_counter() - t0)
    events = events_untraced_python(run)
    if events is None:
        return {"error": "the profiler wrote no trace"}
    res = summarize(events, steps, top)
    res["wall_ms_per_step"] = 1000 * spans[0] / steps
    res["idle"] = idle_gaps(events, _gpu_pids(events), steps, top=top)
    return res


def summarize(events, iters, top=12) -> dict:
    gpu_pids = _gpu_pids(events)
    threads = {(e["pid"], e.get("tid")): str(e.get("args", {}).get("name", ""))
               for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu_pids
               and "dur" in e and not str(e.get("name", "")).startswith("$")]
    if not kernels:
        return {"error": "no GPU events in the trace"}
    line_ms = collections.Counter()
    for e in kernels:
        line_ms[threads.get((e["pid"], e.get("tid")), "?")] += e["dur"] / (1000.0 * iters)
    # A GPU's trace also has derived lines ("XLA Ops", "XLA Modules") that repeat the
    # kernels of its "Stream" lines: count the streams when there are any.
    streams = {k for k, v in threads.items() if "stream" in v.lower()}
    if streams:
        kernels = [e for e in kernels if (e["pid"], e.get("tid")) in streams]
    by_name = collections.defaultdict(lambda: [0.0, 0])
    by_kind = collections.Counter()
    for e in kernels:
        name = e["name"]
        by_name[name][0] += e["dur"]
        by_name[name][1] += 1
        kind = next((k for k, pat in KINDS if re.search(pat, name, re.I)), "other")
        by_kind[kind] += e["dur"]
    start = min(e["ts"] for e in kernels)
    end = max(e["ts"] + e["dur"] for e in kernels)
    busy = sum(e["dur"] for e in kernels)
    per = 1000.0 * iters   # trace times are in microseconds
    return {
        "kernel_ms_per_step": busy / per,
        "span_ms_per_step": (end - start) / per,
        "kernels_per_step": len(kernels) / iters,
        "by_kind_ms": {k: round(v / per, 4) for k, v in by_kind.most_common()},
        "lines_ms": {k: round(v, 4) for k, v in line_ms.most_common(8)},
        "top": [(n[:90], round(d / per, 4), c // iters)
                for n, (d, c) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]],
        "host_top": _host_top(events, gpu_pids, threads, per, top),
    }


def _host_top(events, gpu_pids, threads, per, top) -> list:
    """The host threads' traced spans (jax's and the runtime's: launches, transfers,
    waits), by thread and name: (thread, name, ms per step, count)."""
    spans = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("ph") == "X" and "dur" in e and e.get("pid") not in gpu_pids:
            key = (threads.get((e["pid"], e.get("tid")), "?")[:24], str(e.get("name", ""))[:70])
            spans[key][0] += e["dur"]
            spans[key][1] += 1
    return [(t, n, round(d / per, 4), c) for (t, n), (d, c) in
            sorted(spans.items(), key=lambda kv: -kv[1][0])[:2 * top]]


def run_all(runner, shapes: dict, with_trace=True) -> dict:
    """shapes: label -> (batch, ctx, q_len). Timing and (optionally) the trace."""
    out = {}
    for label, (batch, ctx, q_len) in shapes.items():
        try:
            arrays, decode_only = step_arrays(runner, batch, ctx, q_len)
            res = time_steps(runner, arrays, decode_only)
            if with_trace:
                res["profile"] = profile(runner, arrays, decode_only)
        except Exception as e:   # noqa: BLE001 - keep the other shapes
            res = {"error": repr(e)[:300]}
        out[label] = res
        print("profile", label, json.dumps(res), flush=True)
    return out
