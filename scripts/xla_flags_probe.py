"""Bare decode-step time of the 8B shape under different XLA_FLAGS, one process per
setting (XLA reads its flags once per process).

    python scripts/xla_flags_probe.py "" "--xla_gpu_enable_triton_gemm=false"
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def child(model: str) -> dict:
    sys.path.insert(0, os.path.join(HERE, ".."))
    import step_profile
    from jaxllm import LLM
    llm = LLM(model, load_format="dummy", dtype="bfloat16", max_model_len=2048,
              max_num_seqs=256, enforce_eager=True, num_gpu_blocks_override=4096)
    runner = llm.llm_engine.runner
    out = {}
    for label, (batch, ctx) in {"b1": (1, 600), "b8": (8, 100)}.items():
        arrays, decode_only = step_profile.step_arrays(runner, batch, ctx)
        out[label] = step_profile.time_steps(runner, arrays, decode_only, iters=50)
    return out


def main():
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(child(sys.argv[2])))
        return
    model = os.environ.get("MODEL", "configs/models/llama-3.1-8b")
    results = {}
    for flags in sys.argv[1:] or [""]:
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip())
        proc = subprocess.run([sys.executable, __file__, "--child", model], env=env,
                              capture_output=True, text=True)
        try:
            results[flags or "(default)"] = json.loads(proc.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            results[flags or "(default)"] = {"error": proc.stderr[-400:]}
        print(json.dumps({flags or "(default)": results[flags or "(default)"]}), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "xla_flags_probe.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
