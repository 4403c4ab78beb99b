"""Which launches of the model step make XLA update its CUDA graph, and what a launch
costs the host then.

XLA runs a step as a command buffer (a CUDA graph) and, before a launch, records
again ("command_buffer::update") the commands that read a buffer whose address
changed since the last launch. This launches the engine's decode step under several
address patterns and reads, from a host trace of each, the updates per launch and
their time, the graph launch's time, and the host time of the whole call:

  same          the same packed inputs every launch, nothing else between
  fresh         new packed inputs every launch, each launch waited for (the last
                inputs freed before the next are made)
  engine        as the engine: new inputs, the sampler after each step, two steps
                in flight
  engine_same   as `engine` but the same packed inputs every launch

    python3 scripts/cmdbuf_updates.py [--model configs/models/llama-3.1-8b] [--rows 1,256]
        [--vlog] [--quantization fp8]

--vlog turns on XLA's command-buffer logging and reads, per pattern, how many of a
graph's commands each update recorded again and how many it skipped (their buffers
unchanged): a few commands mean only the changed inputs' readers, all of them a
moved temporary buffer.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SPANS = ("command_buffer::update", "command_buffer::execute", "cuGraphLaunch",
         "PjitFunction(jit(forward))", "PjitFunction(jit(sample_into))")


def host_spans(fn, n: int) -> dict:
    """fn() run n times under a trace without Python tracing: SPANS per launch
    (count, mean us) from the host events."""
    from step_profile import events_untraced_python

    def run():
        for _ in range(n):
            fn()
        fn(final=True)
    found = collections.defaultdict(list)
    events = events_untraced_python(run) or []
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            name = str(e["name"])
            for s in SPANS:
                if name.startswith(s):
                    found[s].append(e["dur"])
    return {s: (round(len(v) / n, 2), round(statistics.mean(v), 1)) for s, v in found.items()}


UPDATED = re.compile(r"Updated (\d+) commands in (\d+) .*?s \(skipped (\d+) command")


class VLog:
    """XLA's log (fd 2) into a file, read pattern by pattern."""

    def __init__(self):
        os.environ["TF_CPP_VMODULE"] = ("command_buffer_thunk=3,command_buffer_cmd=1,"
                                        "command_executor=1")
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"
        self.path = tempfile.mktemp(prefix="jaxllm-vlog-")
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        self.saved = os.dup(2)
        os.dup2(self.fd, 2)
        self.offset = 0

    def updates(self) -> dict:
        """Since the last call: per graph size, updates, mean commands recorded and
        skipped, mean us."""
        with open(self.path, errors="replace") as f:
            f.seek(self.offset)
            text = f.read()
            self.offset = f.tell()
        by = collections.defaultdict(list)
        for m in UPDATED.finditer(text):
            n, us, skipped = map(int, m.groups())
            by[n].append((n - skipped, skipped, us))
        allocs = [int(x) for x in re.findall(r"updated_allocs=(\d+)", text)]
        out = {"thunk_updates": text.count("Update command buffer"),
               "thunk_executes": text.count("Execute command buffer"),
               "updated_allocs": dict(collections.Counter(allocs))}
        return out | {f"{n} commands": {"updates": len(v),
                                  "recorded": round(statistics.mean(x[0] for x in v), 1),
                                  "skipped": round(statistics.mean(x[1] for x in v), 1),
                                  "us": round(statistics.mean(x[2] for x in v), 1)}
                for n, v in by.items()}

    def say(self, line: str) -> None:
        os.write(self.saved, (line + "\n").encode())


def regimes(runner, rows: int, ctx: int, n: int, vlog=None) -> dict:
    import jax
    from step_profile import step_arrays
    from jaxllm.runner.sampler import warm_up_variants
    from jaxllm.runner.sampling_rows import dummy_metadata
    arrays, decode_only = step_arrays(runner, rows, ctx)
    same = runner.pack_inputs(arrays, decode_only)
    # A buffer of its own: the runner's staged one is donated by the next inputs' copy.
    same = dataclasses.replace(same, packed=same.packed + 0)
    flags = warm_up_variants()[0]
    state = {"inflight": []}

    def launch(inputs, sample: bool, sync: bool, final=False):
        t0 = time.perf_counter()
        logits = runner.launch_packed(inputs)
        state["host"].append(time.perf_counter() - t0)
        out = logits     # (the pool and the logits are donated to the next step)
        if sample:
            s = logits.shape[0]
            out = runner.sample_step(logits, dummy_metadata(s), flags)
        if sync or final:
            jax.block_until_ready((out, runner.kv_caches))
            state["inflight"] = []
        else:   # two steps in flight, as the engine keeps them
            state["inflight"] = (state["inflight"] + [out])[-2:]
            jax.block_until_ready(state["inflight"][0])

    patterns = {
        "same": lambda final=False: launch(same, False, True, final),
        "fresh": lambda final=False: launch(runner.pack_inputs(arrays, decode_only), False,
                                            True, final),
        "engine": lambda final=False: launch(runner.pack_inputs(arrays, decode_only), True,
                                             False, final),
        "engine_same": lambda final=False: launch(same, True, False, final),
    }
    res = {}
    for name, fn in patterns.items():
        for _ in range(3):
            state["host"] = []
            fn(final=True)       # compiled, graphs built
        state["host"] = []
        if vlog is not None:
            vlog.updates()
            for _ in range(n):
                fn()
            fn(final=True)
            res[name] = {"vlog": vlog.updates()}
            vlog.say(f"rows {rows} {name}: {json.dumps(res[name])}")
            continue
        spans = host_spans(fn, n)
        res[name] = {"host_us_per_launch": round(1e6 * statistics.median(state["host"]), 1),
                     **{k: {"per_launch": c, "mean_us": d} for k, (c, d) in spans.items()}}
        print(f"rows {rows} {name}: {json.dumps(res[name])}", flush=True)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="configs/models/llama-3.1-8b")
    ap.add_argument("--rows", default="1,256")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--launches", type=int, default=30)
    ap.add_argument("--compile-cache", metavar="DIR")
    ap.add_argument("--vlog", action="store_true")
    ap.add_argument("--quantization", default=None, help="fp8 | int8 | awq | gptq (random "
                    "quantized weights of the model's shape)")
    args = ap.parse_args()
    vlog = VLog() if args.vlog else None
    from jaxllm import LLM
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", max_model_len=2048,
              enforce_eager=True, compilation_cache_dir=args.compile_cache,
              quantization=args.quantization)
    runner = llm.llm_engine.runner
    res = {r: regimes(runner, int(r), args.ctx, args.launches, vlog)
           for r in args.rows.split(",")}
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "cmdbuf_updates.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
