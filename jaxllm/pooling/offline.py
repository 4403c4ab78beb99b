"""LLM.embed: vLLM's offline embedding call over the pooling engine.

Texts are tokenized in chunks on a thread (the Rust tokenizer releases the GIL)
while the runner's full steps run, so tokenizing a million texts (and making their
output objects) hides behind the model; steps are formed across chunks
(runner.run_stream), so only the run's end has partial steps. `jaxllm embed` writes
each chunk before the next (embed_chunks).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import gc

import numpy as np

from jaxllm.pooling.outputs import EmbeddingOutput, EmbeddingRequestOutput
from jaxllm.pooling.params import PoolingParams

CHUNK = 32768      # texts per chunk: big enough for full steps, small enough to overlap


def as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [{"prompt_token_ids": prompts}]
    return prompts


def embed(llm, prompts, pooling_params: PoolingParams | None = None,
          truncate_prompt_tokens: int | None = None,
          use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
    if llm.runner_type != "pooling":
        raise ValueError("LLM.embed() is only supported for pooling models; this LLM runs "
                         "the model with runner='generate'. Pass runner='pooling' (or "
                         "task='embed') to use it as an embedding model.")
    engine = llm.llm_engine
    prompts = as_prompt_list(prompts)
    params = pooling_params or PoolingParams()
    if truncate_prompt_tokens is not None:
        params = dataclasses.replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
    engine.check_params(params)
    dims = params.dimensions or engine.info.hidden_size
    n = len(prompts)
    vectors = np.empty((n, engine.runner.hidden_size), np.float32)    # the run fills it
    outputs: list = []

    def tokenize(start: int) -> list:
        """A chunk's ids, and its outputs over views of `vectors` (made here, on the
        thread, so a million of them cost no time after the last step)."""
        chunk = prompts[start:start + CHUNK]
        ids = engine.tokenize(chunk, params, "input", start)
        outputs.extend(EmbeddingRequestOutput(
            str(next(llm._counter)), EmbeddingOutput(vectors[start + i, :dims]), t, True,
            p if isinstance(p, str) else None) for i, (t, p) in enumerate(zip(ids, chunk)))
        return ids

    def token_chunks():       # the next chunk tokenizes on a thread while this one runs
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxllm-tok") as pool:
            starts = range(0, n, CHUNK)
            ahead = pool.submit(tokenize, 0) if n else None
            for k in range(len(starts)):
                ids = ahead.result()
                if k + 1 < len(starts):
                    ahead = pool.submit(tokenize, starts[k + 1])
                yield ids

    normalize = engine.info.normalize if params.normalize is None else params.normalize
    with _progress(use_tqdm, n, "Embedded prompts") as bar, _gc_paused():
        engine.runner.run_stream(token_chunks(), np.full(n, dims, np.int32),
                                 np.full(n, normalize, bool), bar.update if bar else None,
                                 out=vectors)
    return outputs


def embed_chunks(engine, prompts: list, params: PoolingParams, bar=None, chunk: int = CHUNK,
                 field: str = "input", first: int = 0):
    """Yield (start, token ids, float32 vectors [n, E]) per chunk of `prompts`,
    tokenizing the next chunk on a thread while this one runs. Errors name
    ``field[first + index]``."""
    engine.check_params(params)
    chunks = [prompts[i:i + chunk] for i in range(0, len(prompts), chunk)]
    on_step = bar.update if bar is not None else None

    def tokenize(k: int):
        return engine.tokenize(chunks[k], params, field, first + k * chunk)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxllm-tok") as pool:
        ahead = pool.submit(tokenize, 0) if chunks else None
        for k in range(len(chunks)):
            ids = ahead.result()
            if k + 1 < len(chunks):
                ahead = pool.submit(tokenize, k + 1)
            yield k * chunk, ids, engine.embed_ids(ids, params, on_step)


@contextlib.contextmanager
def _gc_paused():
    """Python's cyclic collector off for the call. A million texts leave ~5 million
    tracked objects (id lists, output objects; no cycles among them), and each full
    collection over them holds the GIL for up to half a second while the device
    drains its queue of one step."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def _progress(enabled: bool, total: int, desc: str, initial: int = 0):
    if not enabled:
        yield None
        return
    from tqdm import tqdm
    bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True)
    try:
        yield bar
    finally:
        bar.close()


def check_generate(llm) -> None:
    if llm.runner_type == "pooling":
        raise ValueError("LLM.generate() is only supported for generative models; this LLM "
                         "runs the model with runner='pooling'. Use LLM.embed(), or pass "
                         "runner='generate' for a decoder model.")


def runner_from_task(task: str) -> str:
    """vLLM's older spelling: task='embed' is runner='pooling'."""
    runners = {"embed": "pooling", "embedding": "pooling", "generate": "generate",
               "auto": "auto"}
    if task not in runners:
        from jaxllm.config import ConfigError
        raise ConfigError(f"task={task!r}: jaxllm runs 'generate' and 'embed'")
    return runners[task]


