"""Probe: device time of the throughput workload's big steps. One engine run of pure
8192-token prefill steps (32 x 1024 prompts, 1 token out: 4 steps), one of mixed steps
(320 x 1024 prompts, 3 tokens out: 8 new prompts and ~16 decode rows a step), each
profiled (kernel ms and span per step, top kernels), and the bare 8 x 1024 step timed.
JSON to $OUT/profile_prefill.json."""
from __future__ import annotations

import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)


def main():
    from jaxllm import LLM, SamplingParams, compilation_cache
    import step_profile
    from step_timeline import timed_run
    compilation_cache.enable(sys.argv[1] if len(sys.argv) > 1 else None)
    llm = LLM("configs/models/llama-3.1-8b", load_format="dummy", dtype="bfloat16",
              max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=8192)
    rng = np.random.default_rng(2)

    def prompts(n):
        return [{"prompt_token_ids": rng.integers(0, 128000, 1024).tolist()} for _ in range(n)]

    def sp(m):
        return SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
    llm.generate(prompts(64), sp(8), use_tqdm=False)
    res = {}
    t, _, tl = timed_run(llm, prompts(320), sp(3))
    res["mixed_timeline"] = {"seconds": t, **tl["by_kind"]}
    print(json.dumps(res), flush=True)
    res["prefill_only"] = step_profile.profile_engine(llm, prompts(32), sp(1), 4, top=16)
    print(json.dumps(res["prefill_only"]), flush=True)
    res["mixed"] = step_profile.profile_engine(llm, prompts(320), sp(3), 42, top=16)
    print(json.dumps(res["mixed"]), flush=True)
    runner = llm.llm_engine.runner
    for label, shape in (("bare 8x1024", (8, 0, 1024)), ("bare 4x1024", (4, 0, 1024)),
                         ("bare 8x1024 at ctx 1024", (8, 1024, 1024))):
        arrays, d = step_profile.step_arrays(runner, *shape)
        res[label] = step_profile.time_steps(runner, arrays, d, iters=10)
        print(label, json.dumps(res[label]), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "profile_prefill.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
