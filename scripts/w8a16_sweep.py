"""The Mosaic GPU weight-only FP8 kernel (pallas_kernels/w8a16_mgpu.py) on the GPU:
first against its peers at 1, 16 and 64 rows (bf16 through cuBLAS / Triton, and the
layer's XLA path, w8a16_fp8: the fp8 weight widened inside XLA's Triton GEMM), then
a sweep of its settings per Llama-3.1-8B projection at 16 rows (the engine's decode
bucket), each projection's best picked as w4a16_sweep.pick does (the defaults run
first and last; a candidate must be under --margin of their mean). Prints both tables
and writes ``$OUT/w8a16_pick.json`` ({"NxK": settings}) for JAXLLM_W8A16_SETTINGS.

    python3 scripts/w8a16_sweep.py [--projs gate_up,down] [--skip-peers]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_quant_matmul as bqm  # noqa: E402
from w4a16_sweep import pick  # noqa: E402

# Defaults (w8a16_mgpu.default_k_splits): qkv 8 splits, o 8, gate/up 2, down 14; 4
# stages of 128 columns, one warp group a program. Candidates: each projection's best
# of the H100 sweep in docs/benchmarks.md and the warp-specialized programs
# (warpgroups 2). Programs (N / tile_n x splits) in the comments.
CANDIDATES = {
    "gate_up": [  # 224 tiles, 32 blocks of 128 columns; default 448 programs
        {"k_splits": 1, "stages": 6},                      # 224
        {"warpgroups": 2},                                 # 448
        {"warpgroups": 2, "k_splits": 4},                  # 896
        {"warpgroups": 2, "k_splits": 1, "stages": 8},     # 224
    ],
    "down": [  # 32 tiles, 112 blocks; default 448
        {"k_splits": 8},                                   # 256
        {"warpgroups": 2},                                 # 448
        {"warpgroups": 2, "k_splits": 8},                  # 256
        {"warpgroups": 2, "k_splits": 28},                 # 896
    ],
    "qkv": [  # 48 tiles, 32 blocks; default 384
        {"k_splits": 8, "tile_n": 64},                     # 768
        {"warpgroups": 2},                                 # 384
        {"warpgroups": 2, "k_splits": 16, "stages": 2},    # 768
    ],
    "o": [  # 32 tiles, 32 blocks; default 256
        {"k_splits": 4, "tile_n": 64},                     # 256
        {"warpgroups": 2},                                 # 256
        {"warpgroups": 2, "k_splits": 16, "stages": 2},    # 512
    ],
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--projs", default=",".join(CANDIDATES))
    ap.add_argument("--margin", type=float, default=0.97)
    ap.add_argument("--skip-peers", action="store_true")
    ap.add_argument("--peer-ms", default="1,16,64", help="rows of the peer table")
    args = ap.parse_args(argv)
    projs = args.projs.split(",")
    if any(p not in CANDIDATES for p in projs):
        ap.error(f"--projs {args.projs}: each of {', '.join(CANDIDATES)}")
    common = ["--pallas", "--copies", "8", "--variants", "default", "--compile-budget", "240",
              "--projs", args.projs]
    peers = [] if args.skip_peers else bqm.main(
        common + ["--kinds", "bf16,w8a16_fp8,mgpu_fp8", "--ms", args.peer_ms])
    chosen, table = {}, []
    for proj in projs:
        sweep = [{}] + CANDIDATES[proj] + [{}]
        rows = bqm.main(common[:-1] + [proj, "--kinds", "mgpu_fp8", "--ms", "16",
                                       "--pallas-settings", json.dumps(sweep)])
        means, best = pick(rows, [16], args.margin, kind="mgpu_fp8")
        xla = [r["us"] for r in peers if r["proj"] == proj and r["m"] == 16
               and r["kind"] == "w8a16_fp8"]
        for st, us in sorted(means.items(), key=lambda kv: kv[1]):
            table.append((proj, st, us, means.get("{}", float("nan")) / us,
                          statistics.mean(xla) if xla else float("nan")))
        if best:
            n, k = bqm.SHAPES[proj]
            chosen[f"{n}x{k}"] = best
    print(f"\n{'proj':>8} {'us@16':>8} {'x default':>9} {'xla us':>8}  settings")
    for proj, st, us, ratio, xla in table:
        print(f"{proj:>8} {us:>8.1f} {ratio:>9.3f} {xla:>8.1f}  {st}")
    print("pick:", json.dumps(chosen))
    # a layer's four projections, each at its best, against XLA's four (one row each)
    best = {p: min(us for q, _, us, _, _ in table if q == p) for p in projs}
    xla = {p: next(x for q, _, _, _, x in table if q == p) for p in projs}
    ahead = sum(best.values()) < sum(xla.values())
    print(f"layer at 16 rows: kernel {sum(best.values()):.1f} us, xla "
          f"{sum(xla.values()):.1f} us: {'ahead' if ahead else 'behind'}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "w8a16_pick.json"), "w") as f:
            json.dump(chosen, f)
        with open(os.path.join(os.environ["OUT"], "w8a16_verdict.txt"), "w") as f:
            f.write("ahead" if ahead else "behind")
    return 0


if __name__ == "__main__":
    sys.exit(main())
