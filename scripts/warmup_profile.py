"""Where the warm-up's time goes: per program, Python tracing, lowering and XLA's
compile, and how much of each holds the GIL, done one by one; then the engine's own
start-up path (ModelRunner.initialize_kv_cache, then warm_up: min(cpu count, 16)
compile threads, no executable store) on the same programs, caches cleared.

    python scripts/warmup_profile.py                  # the 8B's shape, dummy weights
    python scripts/warmup_profile.py --small          # 32 layers, narrow (a CPU host)
    python scripts/warmup_profile.py --small --fake-device-limit-gib 4   # GPU sizing

--small keeps the model's layer count and vocab but shrinks its widths (hidden 256,
4 heads of 64, 2 KV heads, intermediate 512): tracing and lowering cost per op, not
per byte. "gil" is the share of a phase's wall time a probe thread waited for the
GIL (sleeps of 0.5 ms; Python's switch interval is 5 ms): ~1 for Python work, ~0
for work that releases it. On a GPU (or with --fake-device-limit-gib) the KV sizing
compiles the largest step for its memory analysis; its first run, before the table,
compiles only that step.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import tempfile
import threading
import time


import jax  # noqa: E402

from jaxllm.config import engine_config_from_flat  # noqa: E402
from jaxllm.models.loader import load_model  # noqa: E402
from jaxllm.parallel import mesh as mesh_lib  # noqa: E402
from jaxllm.runner.model_runner import ModelRunner  # noqa: E402

SMALL = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64)


class GilProbe:
    """A thread that sleeps 0.5 ms at a time; a wake-up late by more than the sleep
    waited for the GIL. held(a, b): the share of [a, b] spent waiting."""

    def __init__(self):
        self.waits: list[tuple[float, float]] = []     # (woke at, waited s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            t = time.perf_counter()
            time.sleep(0.0005)
            now = time.perf_counter()
            self.waits.append((now, max(now - t - 0.0006, 0.0)))

    def held(self, a: float, b: float) -> float:
        return sum(w for t, w in self.waits if a < t <= b) / max(b - a, 1e-9)

    def stop(self):
        self._stop.set()
        self._thread.join()


def build_runner(args) -> ModelRunner:
    """A runner on dummy weights, its pool sized (on a GPU: the largest step compiled
    for its memory analysis, and nothing else: enforce_eager)."""
    folder = args.model
    if args.small:
        folder = tempfile.mkdtemp()
        with open(os.path.join(args.model, "config.json")) as f:
            hf = json.load(f)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump({**hf, **SMALL}, f)
    config = engine_config_from_flat(
        model=folder, load_format="dummy", dtype=args.dtype, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=True)
    mesh = mesh_lib.make_mesh(1)
    loaded = load_model(folder, args.dtype, "dummy", mesh_lib.param_shardings(mesh))
    if args.small:
        shutil.rmtree(folder)
    if args.fakedevice_limit_gib:       # the GPU's KV sizing path, on a CPU
        ModelRunner.device_limit = lambda self: int(args.fakedevice_limit_gib * (1 << 30))
    runner = ModelRunner(config, loaded, mesh, args.max_model_len, args.max_num_batched_tokens)
    t0 = time.perf_counter()
    runner.initialize_kv_cache()
    print(f"KV sizing {time.perf_counter() - t0:.1f} s ({runner.num_blocks} blocks, "
          f"{len(runner.compilation.programs)} program compiled)")
    return runner


def engine_path(runner) -> tuple[float, float]:
    """The engine's start-up (initialize_kv_cache, then warm_up) on a fresh pool, with
    jax's in-memory caches cleared: (KV sizing s, warm-up s)."""
    runner.config = dataclasses.replace(runner.config, enforce_eager=False)
    runner.compilation.programs.clear()
    runner.kv_caches = None
    gc.collect()
    jax.clear_caches()          # else every trace and compile is found in memory
    t0 = time.perf_counter()
    runner.initialize_kv_cache()
    t1 = time.perf_counter()
    runner.warm_up()
    return t1 - t0, time.perf_counter() - t1


def profile_serial(programs) -> float:
    probe = GilProbe()
    rows, t_start = [], time.perf_counter()
    for p in programs:
        t0 = time.perf_counter()
        traced = p.trace()
        t1 = time.perf_counter()
        lowered = traced.lower()
        t2 = time.perf_counter()
        lowered.compile()
        t3 = time.perf_counter()
        rows.append((p.name, t1 - t0, probe.held(t0, t1), t2 - t1, probe.held(t1, t2),
                     t3 - t2, probe.held(t2, t3)))
    total = time.perf_counter() - t_start
    probe.stop()
    print(f"{'program':<44} {'trace s':>8} {'gil':>5} {'lower s':>8} {'gil':>5} "
          f"{'compile s':>9} {'gil':>5}")
    for name, *cols in rows:
        label = " ".join(str(x) for x in name)[:44]
        print(f"{label:<44} {cols[0]:8.2f} {cols[1]:5.2f} {cols[2]:8.2f} {cols[3]:5.2f} "
              f"{cols[4]:9.2f} {cols[5]:5.2f}")
    sums = [sum(r[i] for r in rows) for i in (1, 3, 5)]
    print(f"{'sum':<44} {sums[0]:8.2f} {'':5} {sums[1]:8.2f} {'':5} {sums[2]:9.2f}")
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="configs/models/llama-3.1-8b")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--fake-device-limit-gib", type=float, default=None,
                    help="on a CPU: take this device limit, to run the GPU's KV sizing")
    ap.add_argument("--skip-serial", action="store_true")
    args = ap.parse_args()
    runner = build_runner(args)
    programs = runner.warm_up_programs()
    jax.clear_caches()
    serial = None if args.skip_serial else profile_serial(programs)
    del programs
    cpu0 = os.times()
    kv, warm = engine_path(runner)
    cpu = sum(os.times()[:2]) - sum(cpu0[:2])
    workers = min(os.cpu_count() or 1, 16)
    print(f"serial (trace, lower, compile one by one): {serial or float('nan'):.1f} s; "
          f"the engine's path with {workers} compile threads: KV sizing {kv:.1f} s + "
          f"warm-up {warm:.1f} s = {kv + warm:.1f} s, {cpu:.0f} CPU s "
          f"({len(runner.compilation.programs)} programs; load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
