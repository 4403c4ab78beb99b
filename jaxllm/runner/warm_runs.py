"""Every warmed-up program run once before the first requests."""
from __future__ import annotations

import jax

from jaxllm.engine.scheduler import KVCacheLostError
from jaxllm.runner.sampling_rows import dummy_metadata


def run_programs_once(runner) -> None:
    """Run every warmed-up program of `runner` (a ModelRunner) once on padding inputs
    (no KV slot written, no sequence read). A program's first run on a GPU loads its
    kernels and builds its CUDA graphs, here rather than in the first requests' steps,
    as vLLM's dummy runs do; a program read from a file that fails here is compiled
    again (`_call`). It costs 1.0-1.5 s of an 8B start on the H200. Multi-host runs
    skip it: every process would have to run the same programs in step."""
    out = None
    for key in sorted(runner.compilation.programs, key=str):
        if key[0] == "step":
            _, t, s, decode_only = key
            try:
                out = runner.launch_step(runner._dummy_arrays(t, s), decode_only)
            except KVCacheLostError:      # replaced; the pool holds nothing yet
                out = runner.launch_step(runner._dummy_arrays(t, s), decode_only)
        elif key[0] == "sample":
            bitmask = runner._dummy_bitmask(key[1]) if key[2].use_bitmask else None
            out = runner.sample_step(runner._dummy_logits(key[1]), dummy_metadata(key[1]),
                                     key[2], bitmask)
    jax.block_until_ready((out, runner.kv_caches))
