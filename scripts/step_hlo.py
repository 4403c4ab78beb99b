"""What XLA made of one bare model step: its optimized HLO and its GPU kernels in launch
order with their durations, for a model cut to a few layers (the per-layer kernel
sequence is the same as the whole model's).

    python scripts/step_hlo.py --layers 2 --shape decode:1:600 --shape decode:8:100
    python scripts/step_hlo.py --quantization fp8 --shape prefill:8:0:1024

Writes ``$OUT/step_<tag>.hlo.txt`` (``compiled.as_text()``) and
``$OUT/step_<tag>.kernels.txt`` (one step's kernels: name, microseconds), where the
tag is the shape's label, then ``-<quantization>`` and ``-kv<dtype>`` when given.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # jaxllm


def cut_model(model_dir: str, layers: int) -> str:
    out = tempfile.mkdtemp(prefix="jaxllm-cut-")
    for name in os.listdir(model_dir):
        shutil.copy(os.path.join(model_dir, name), out)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = layers
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out


def kernels_in_order(runner, arrays, decode_only, iters=3):
    import step_profile
    path = step_profile.trace_synced_steps(runner, arrays, decode_only, iters)
    if path is None:
        return []
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    threads = {(e["pid"], e.get("tid")): str(e.get("args", {}).get("name", ""))
               for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    streams = {k for k, v in threads.items() if "stream" in v.lower()}
    ks = sorted((e for e in events if e.get("ph") == "X" and (e["pid"], e.get("tid")) in streams
                 and "dur" in e), key=lambda e: e["ts"])
    if not ks:
        return []
    # The last step's kernels: those inside the model's last module span on the GPU
    # (the "XLA Modules" line), where the trace has one.
    modules = sorted((e for e in events if e.get("ph") == "X" and "dur" in e
                      and "module" in threads.get((e["pid"], e.get("tid")), "").lower()
                      and "forward" in str(e.get("name", ""))), key=lambda e: e["ts"])
    if modules:
        a, b = modules[-1]["ts"], modules[-1]["ts"] + modules[-1]["dur"]
        inside = [(e["name"], e["dur"]) for e in ks if a <= e["ts"] <= b]
        if inside:
            return inside
    # Else split the sequence where the gaps are largest (host syncs); under
    # --enforce-eager a prompt step's own gaps can be larger, so this may keep two.
    gaps = [(ks[i + 1]["ts"] - ks[i]["ts"] - ks[i]["dur"], i) for i in range(len(ks) - 1)]
    cuts = sorted(i for _, i in sorted(gaps)[-(iters - 1):])
    last = ks[cuts[-1] + 1:] if cuts else ks
    return [(e["name"], e["dur"]) for e in last]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="configs/models/llama-3.1-8b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--shape", action="append", default=[],
                    help="label:batch:ctx[:q_len], e.g. decode:8:100 or prefill:4:0:1024")
    ap.add_argument("--quantization", default=None, help="e.g. fp8 (online, dummy weights)")
    ap.add_argument("--kv-cache-dtype", default="auto")
    args = ap.parse_args()
    import jax
    from jaxllm import LLM
    import step_profile
    llm = LLM(cut_model(args.model, args.layers), load_format="dummy", dtype="bfloat16",
              max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=8192,
              enforce_eager=True, num_gpu_blocks_override=4096,
              quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    runner = llm.llm_engine.runner
    out = os.environ.get("OUT", ".")
    for spec in args.shape or ["decode:1:600"]:
        label, batch, ctx, *q = spec.split(":")
        arrays, decode_only = step_profile.step_arrays(runner, int(batch), int(ctx),
                                                       int(q[0]) if q else 1)
        text = runner.lower_step(arrays, decode_only).compile().as_text()
        tag = label + (f"-{args.quantization}" if args.quantization else "") + (
            f"-kv{args.kv_cache_dtype}" if args.kv_cache_dtype != "auto" else "")
        with open(os.path.join(out, f"step_{tag}.hlo.txt"), "w") as f:
            f.write(text)
        ks = kernels_in_order(runner, arrays, decode_only)
        with open(os.path.join(out, f"step_{tag}.kernels.txt"), "w") as f:
            for name, dur in ks:
                f.write(f"{dur:9.2f}  {name}\n")
        print(f"{tag}: {len(ks)} kernels, {sum(d for _, d in ks):.1f} us "
              f"({args.layers} layers); device {jax.devices()[0].device_kind}", flush=True)


if __name__ == "__main__":
    main()
