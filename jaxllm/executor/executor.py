"""Executor: everything device-side, behind execute_model / get_output.

It joins jax.distributed (once, here), builds the mesh, loads the weights, checks the
settings against the model, sizes and allocates the KV pool and the host swap pool,
and has every bucket compiled (the model runner's warm-up). Multi-host followers
drive the same public execute_model as the leader (parallel/distributed.py).
"""
from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from jaxllm.config import (EngineConfig, check_against_model, check_device_count,
                           effective_max_model_len)
# Imported with this module, not in Executor(): LLMEngine imports it before it starts
# the tokenizer thread, and these imports under that thread's (transformers') import
# were 2-3 s slower on the H200 host than alone.
from jaxllm.models.loader import load_model
from jaxllm.parallel import distributed, mesh as mesh_lib
from jaxllm.runner.kv_cache import checkpoint_cache
from jaxllm.runner.model_runner import ModelRunner
from jaxllm.spec_decode.proposers import build_proposer, target_hidden_layers

logger = logging.getLogger(__name__)


class Executor:
    def __init__(self, config: EngineConfig):
        t0 = time.perf_counter()
        self.config = config
        mc = config.model
        prepare_devices(config)
        self.mesh = mesh_lib.make_mesh(config.parallel.tensor_parallel_size)
        loaded = load_model(mc.model, mc.dtype, mc.load_format,
                            mesh_lib.param_shardings(self.mesh), mc.seed, mc.quantization,
                            tp=self.mesh.size)
        self.weights_s = time.perf_counter() - t0
        # A checkpoint's fp8 KV scales choose the cache (kv_cache.checkpoint_cache).
        self.config = config = dataclasses.replace(config, cache=checkpoint_cache(
            config.cache, loaded.quant, loaded.source))
        self.arch, self.model_path = loaded.arch, loaded.source
        # The same checks the CLI runs before loading (context length, batch budget, TP).
        check_against_model(config, self.arch, loaded.source)
        self.max_model_len = effective_max_model_len(config, self.arch)
        self.max_num_batched_tokens = _max_batched(config, self.max_model_len,
                                                   self.mesh.local_devices[0])
        # Speculative decoding (one process only: followers would have to run it). An
        # EAGLE head reads states the target's steps then return (proposers.py).
        self.speculative_config = spec = getattr(config, "speculative_config", None)
        self.runner = ModelRunner(config, loaded, self.mesh, self.max_model_len,
                                  self.max_num_batched_tokens,
                                  target_hidden_layers(spec, self.arch))
        self.num_gpu_blocks = self.num_cpu_blocks = 0
        self.host_pool = None
        # Built (its weights loaded) before the pools are sized: a draft model's or
        # EAGLE head's pool, of the target's block count, shares the memory.
        self.proposer = None if spec is None else build_proposer(self, spec, loaded)
        self.leader = distributed.leader()   # multi-host: process 0 feeds the followers

    @property
    def platform(self) -> str:
        return self.mesh.local_devices[0].platform

    def initialize_kv_cache(self) -> None:
        """Size and allocate the KV pool (on a GPU: from the largest step's compiled
        memory analysis) and the host swap pool; a proposer's pool of the same block
        count, sized together (a block costs both pools' bytes, its weights come off
        the budget)."""
        own_pool = hasattr(self.proposer, "kv_bytes_per_block")
        if own_pool:
            self.runner.initialize_kv_cache(self.proposer.kv_bytes_per_block(),
                                            self.proposer.weight_bytes())
            self.proposer.initialize_kv_cache(self.runner.num_blocks)
        else:
            self.runner.initialize_kv_cache()
        self.num_gpu_blocks = self.runner.num_blocks
        self.num_cpu_blocks = _num_cpu_blocks(self.config, self.runner)
        self.host_pool = self.runner.host_pool(self.num_cpu_blocks)

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots past each step's that the proposer writes (the scheduler allocates)."""
        return self.proposer.num_lookahead_tokens if self.proposer is not None else 0

    def propose_drafts(self, requests, max_drafts, block_tables) -> list[list[int]]:
        """Draft tokens for requests that decode next (spec_decode/proposers.py)."""
        return self.proposer.propose(requests, max_drafts, block_tables)

    def compile_or_warm_up_model(self) -> float:
        """Every bucket's programs compiled or loaded (a draft model's or EAGLE head's
        too); returns the seconds it took."""
        seconds = self.runner.warm_up()
        if hasattr(self.proposer, "warm_up"):
            seconds += self.proposer.warm_up()
        return seconds

    def execute_model(self, scheduler_output, requests: dict, seeds: dict,
                      defer_sample: bool = False, before_dispatch=None):
        """Launch one step (swaps, model, sampler) without waiting for it; a handle
        for get_output, or None when nothing is scheduled. With `defer_sample` the
        sampler waits for sample_tokens (structured outputs: the grammar bitmask is
        computed from the previous step's tokens while this step's model runs).
        `before_dispatch()`: see ModelRunner.execute_model."""
        def dispatch():
            if before_dispatch is not None:
                before_dispatch()
            if self.leader is not None:     # after what before_dispatch sent
                self.leader.send("execute", scheduler_output, requests, seeds, defer_sample)
        if self.proposer is not None:
            # Preempted ones include those swapped out (the draft's pool is not swapped).
            self.proposer.finish(scheduler_output.finished_request_ids
                                 + scheduler_output.preempted_request_ids)
        self.runner.swap_out(scheduler_output.blocks_to_swap_out, self.host_pool)
        self.runner.swap_in(scheduler_output.blocks_to_swap_in, self.host_pool)
        hook = dispatch if before_dispatch is not None or self.leader is not None else None
        return self.runner.execute_model(scheduler_output, requests, seeds, defer_sample,
                                         hook)

    def sample_tokens(self, handle, grammar_bitmask) -> None:
        """Launch a deferred step's sampler; grammar_bitmask: i32[S, W] (host or
        upload_bitmask's) or None."""
        if self.leader is not None:
            self.leader.send("sample_tokens", None if grammar_bitmask is None
                             else np.asarray(grammar_bitmask))
        self.runner.sample_tokens(handle, grammar_bitmask)

    def sampler_rows(self, handle) -> int:
        return self.runner.sampler_rows(handle)

    def upload_bitmask(self, bitmask):
        """On one process: the bitmask on the device (callable from any thread).
        Multi-host: left on the host, where it is broadcast to the followers."""
        return bitmask if self.leader is not None else self.runner.upload_bitmask(bitmask)

    def get_output(self, handle):
        """Wait for a launched step: (id -> SampleResult, id -> prompt logprob rows).
        With an EAGLE head, the step's states go to it here: the engine core reads
        every step back, in order (async ones after launching the next), and the head
        must see every one to keep its KV current."""
        results, prompt_logprobs = self.runner.get_output(handle)
        if handle.hidden is not None and self.proposer is not None:
            sampled = {rid: [x.token_id for x in r] if isinstance(r, list) else [r.token_id]
                       for rid, r in results.items()}
            self.proposer.ingest(handle.hidden, handle.scheduled, handle.requests, sampled)
        return results, prompt_logprobs


def prepare_devices(config: EngineConfig) -> None:
    """Join jax.distributed (multi-host; once, before any backend is touched) and
    check the settings against the devices present. Called by the launcher before
    the weights load, and again (a no-op by then) by the Executor."""
    import jax

    distributed.check_config(config)
    distributed.initialize(config.parallel)
    check_device_count(config, len(jax.local_devices()) * config.parallel.num_processes)


def run_follower(config: EngineConfig) -> int:
    """A multi-host follower's whole life: build the device side as the leader does,
    then replay the leader's steps. Returns the number of steps run."""
    executor = Executor(config)
    executor.initialize_kv_cache()
    if not config.enforce_eager:
        executor.compile_or_warm_up_model()
    return distributed.follow(executor)


def _max_batched(config: EngineConfig, max_model_len: int, device) -> int:
    sc = config.scheduler
    if sc.max_num_batched_tokens is not None:
        return sc.max_num_batched_tokens
    budget = default_token_budget(device)
    return budget if sc.enable_chunked_prefill else max(max_model_len, budget)


def default_token_budget(device) -> int:
    """vLLM's default step budget for its server: 8192 tokens on a GPU with >= 70 GiB
    (not an A100, where vLLM measured a larger budget to be slower), else 2048. Read
    from jax's allocator limit, by default 75% of the device (104.9 GiB on the H200),
    so the bar is 75% of 70 GiB. vLLM's offline LLM takes 16384 there; one default
    here keeps one set of compiled shapes for both."""
    if device.platform != "gpu" or "a100" in device.device_kind.lower():
        return 2048
    stats = device.memory_stats() or {}
    return 8192 if stats.get("bytes_limit", 0) >= 0.75 * 70 * (1 << 30) else 2048


def _num_cpu_blocks(config: EngineConfig, runner) -> int:
    if config.scheduler.preemption_mode != "swap" or config.cache.swap_space == 0:
        return 0
    from jaxllm.parallel.mesh import pool_kv_heads
    from jaxllm.runner.kv_cache import bytes_per_block, cache_dtype
    arch = runner.arch
    per_block = bytes_per_block(arch, config.cache.block_size,
                                cache_dtype(config.cache, runner.model_dtype))
    # The host copy mirrors the pool, which holds one head per device when devices
    # outnumber KV heads.
    per_block = per_block * pool_kv_heads(arch.num_kv_heads, runner.mesh.size) \
        // arch.num_kv_heads
    return int(config.cache.swap_space * (1 << 30)) // per_block
