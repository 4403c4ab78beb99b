"""Sweep the Mosaic W4A16 kernel's settings per Llama-3.1-8B projection at decode sizes
on the GPU, pick each projection's best, and write the pick for the engine.

Each projection runs its candidate settings in one process (``bench_quant_matmul``:
8 matmuls a program on separate weights, us per matmul), at 1 and 16 rows, with the
kernel's defaults first and last (single figures move between runs of one process,
so a candidate must beat both). A candidate is picked where its mean over the two
row counts is under ``--margin`` of the defaults' (the slower of their two runs is
not used: the mean of both). Prints a table and writes ``$OUT/w4a16_pick.json``
({"NxK": settings}), which ``JAXLLM_W4A16_SETTINGS`` takes
(jaxllm/layers/quantization/int4_kernels.py), for an engine A/B in the same call:

    python3 scripts/w4a16_sweep.py [--projs gate_up,down] [--ms 1,16]
    JAXLLM_W4A16_SETTINGS="$(cat $OUT/w4a16_pick.json)" python3 scripts/bench_h200.py ...
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_quant_matmul as bqm  # noqa: E402

# Programs a candidate launches (N / 128 / tiles x splits) in the comments; the
# defaults (default_settings) first. Several tiles a program stream through one
# pipeline, so programs fill it once, not once a tile.
CANDIDATES = {
    "gate_up": [  # 224 tiles, 32 groups; default 4 splits, 2 groups a stage: 896
        {"k_splits": 8, "tiles": 7},                                   # 256
        {"k_splits": 8, "tiles": 7, "groups_per_step": 2, "stages": 2},  # 256
        {"k_splits": 4, "tiles": 7, "stages": 6},                      # 128
        {"k_splits": 4, "tiles": 4},                                   # 224
        {"k_splits": 4, "tiles": 2, "groups_per_step": 2, "stages": 2},  # 448
        {"k_splits": 8, "tiles": 4},                                   # 448
    ],
    "down": [  # 32 tiles, 112 groups; default 8 splits, 2 groups a stage: 256
        {"k_splits": 16, "tiles": 2},                                  # 256
        {"k_splits": 28, "tiles": 4},                                  # 224
        {"k_splits": 14, "tiles": 2, "groups_per_step": 2, "stages": 2},  # 224
        {"k_splits": 16, "tiles": 4, "stages": 6},                     # 128
        {"k_splits": 28, "tiles": 2},                                  # 448
    ],
    "qkv": [  # 48 tiles, 32 groups; default 8 splits: 384
        {"k_splits": 8, "tiles": 3},                                   # 128
        {"k_splits": 8, "tiles": 2},                                   # 192
        {"k_splits": 8, "tiles": 3, "stages": 6},                      # 128
    ],
    "o": [  # 32 tiles, 32 groups; default 8 splits: 256
        {"k_splits": 8, "tiles": 2},                                   # 128
        {"k_splits": 8, "tiles": 2, "stages": 6},                      # 128
        {"k_splits": 4, "tiles": 2, "stages": 6},                      # 64
    ],
}


def pick(rows, ms, margin, kind="mgpu_w4"):
    """{setting json: mean us over ms} for one projection's rows of `kind`, and the
    pick."""
    by = {}
    for r in rows:
        if r["kind"] == kind:
            by.setdefault(json.dumps(r["settings"], sort_keys=True), {}).setdefault(
                r["m"], []).append(r["us"])
    means = {st: statistics.mean(statistics.mean(v[m]) for m in ms)
             for st, v in by.items() if all(m in v for m in ms)}
    base = means.get("{}")
    best = min(means, key=means.get) if means else None
    if base is None or best is None or means[best] >= margin * base:
        return means, None
    return means, json.loads(best)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--projs", default=",".join(CANDIDATES))
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--margin", type=float, default=0.97)
    args = ap.parse_args(argv)
    ms = [int(m) for m in args.ms.split(",")]
    projs = args.projs.split(",")
    if any(p not in CANDIDATES for p in projs):
        ap.error(f"--projs {args.projs}: each of {', '.join(CANDIDATES)}")
    chosen, table = {}, []
    for proj in projs:
        sweep = [{}] + CANDIDATES[proj] + [{}]
        rows = bqm.main(["--pallas", "--copies", "8", "--variants", "no_triton",
                         "--compile-budget", "600", "--kinds", "bf16,mgpu_w4",
                         "--ms", args.ms, "--projs", proj,
                         "--pallas-settings", json.dumps(sweep)])
        means, best = pick(rows, ms, args.margin)
        bf16 = statistics.mean(r["us"] for r in rows if r["kind"] == "bf16")
        for st, us in sorted(means.items(), key=lambda kv: kv[1]):
            table.append((proj, st, us, means.get("{}", float("nan")) / us, bf16))
        if best:
            n, k = bqm.SHAPES[proj]
            chosen[f"{n}x{k}"] = best
    print(f"\n{'proj':>8} {'mean us':>8} {'x default':>9} {'bf16 us':>8}  settings")
    for proj, st, us, ratio, bf16 in table:
        print(f"{proj:>8} {us:>8.1f} {ratio:>9.3f} {bf16:>8.1f}  {st}")
    print("pick:", json.dumps(chosen))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "w4a16_pick.json"), "w") as f:
            json.dump(chosen, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
