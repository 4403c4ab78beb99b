"""The device side of an engine, as the LLMEngine builds it here and the engine
process (core_mp.py) builds it there: the executor, the scheduler and the EngineCore
over them, what the LLMEngine reads of them (CoreInfo), and their stats."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from jaxllm.config import EngineConfig
from jaxllm.engine.core import EngineCore
from jaxllm.engine.scheduler import Scheduler
from jaxllm.structured_output.manager import StructuredOutputManager


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_free_blocks: int
    num_total_blocks: int
    # Structured outputs: seconds computing token masks and compiling grammars.
    grammar_mask_seconds: float = 0.0
    grammar_compile_seconds: float = 0.0
    grammars_compiled: int = 0


@dataclass
class CoreInfo:
    """What the LLMEngine reads of its engine core, wherever that was built."""
    arch: Any
    model_path: str
    max_model_len: int
    max_num_batched_tokens: int
    eos_token_id: int | None
    num_gpu_blocks: int
    startup_breakdown: dict


def core_stats(core: EngineCore, num_gpu_blocks: int) -> EngineStats:
    """The engine core's side of EngineStats (token totals 0: the LLMEngine's)."""
    scheduler = core.scheduler
    pool = scheduler.block_pool
    som = core.structured_output_manager
    return EngineStats(
        num_running=scheduler.num_running,
        num_waiting=scheduler.num_waiting + scheduler.num_swapped,
        kv_cache_usage=pool.get_usage(),
        num_preemptions_total=scheduler.num_preemptions_total,
        prompt_tokens_total=0, generation_tokens_total=0,
        prefix_cache_queries=pool.prefix_cache_queries,
        prefix_cache_hits=pool.prefix_cache_hits,
        num_free_blocks=pool.get_num_free_blocks(),
        # The null block is never handed out.
        num_total_blocks=num_gpu_blocks - 1,
        grammar_mask_seconds=som.mask_seconds, grammar_compile_seconds=som.compile_seconds,
        grammars_compiled=som.num_compiled)


def build_core(config: EngineConfig, engine=None):
    """The device side of an engine: (EngineCore over the executor and a scheduler,
    CoreInfo). ``engine``: an LLMEngine being built here, given the tokenizer and
    executor too (the engine process passes none)."""
    from concurrent.futures import ThreadPoolExecutor

    from jaxllm.executor.executor import Executor
    from jaxllm.tokenizer import load_tokenizer

    t0 = time.perf_counter()
    # The tokenizer loads on a thread while the weights load: importing transformers
    # alone takes seconds, while the weights mostly wait on the device or on reads.
    with ThreadPoolExecutor(1, thread_name_prefix="jaxllm-tokenizer") as pool:
        tokenizer = pool.submit(load_tokenizer, config.model)
        ex = Executor(config)
        t_load = time.perf_counter()
        tokenizer = tokenizer.result()
    t_tokenizer = time.perf_counter()
    ex.initialize_kv_cache()
    t_kv = time.perf_counter()
    sc = config.scheduler
    scheduler = Scheduler(
        block_size=config.cache.block_size, num_gpu_blocks=ex.num_gpu_blocks,
        num_cpu_blocks=ex.num_cpu_blocks, max_num_seqs=sc.max_num_seqs,
        max_num_batched_tokens=ex.max_num_batched_tokens,
        max_model_len=ex.max_model_len, enable_chunked_prefill=sc.enable_chunked_prefill,
        enable_prefix_caching=config.cache.enable_prefix_caching,
        preemption_mode=sc.preemption_mode, policy=sc.scheduling_policy,
        num_lookahead_tokens=ex.num_lookahead_tokens)
    if not config.enforce_eager:
        ex.compile_or_warm_up_model()
    eos = ex.arch.eos_token_id[0] if ex.arch.eos_token_id else tokenizer.eos_token_id
    # After the warm-up: its tokenizer view builds on a thread of its own.
    structured = StructuredOutputManager(tokenizer, ex.arch.vocab_size, eos)
    core = EngineCore(scheduler, ex, sc.async_scheduling, structured)
    if engine is not None:
        engine.tokenizer, engine.executor = tokenizer, ex
    # Where start-up went: weights (built or read), the wait for the tokenizer after
    # them, the model runner, KV sizing (on a GPU: the largest step compiled or
    # loaded, for its memory analysis) and allocation, and warm-up (the other
    # programs compiled, or loaded from the executable store). load_s: the three after it.
    breakdown = {
        "load_s": t_tokenizer - t0, "weights_s": ex.weights_s,
        "tokenizer_wait_s": t_tokenizer - t_load, "runner_s": t_load - t0 - ex.weights_s,
        "kv_cache_s": t_kv - t_tokenizer, "warm_up_s": time.perf_counter() - t_kv}
    return core, CoreInfo(ex.arch, ex.model_path, ex.max_model_len, ex.max_num_batched_tokens,
                          eos, ex.num_gpu_blocks, breakdown)
