"""LLMEngine: step() = schedule -> launch -> read back -> update -> detokenize -> outputs.

With async scheduling (the default) a step launches step N+1 before it reads back
step N, so the host's scheduling, input preparation and detokenization overlap the
device; each call returns the outputs of the step launched by the previous call.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import random
import time
from dataclasses import dataclass
from typing import Iterable

from jaxllm.config import EngineConfig, check_against_model, effective_max_model_len
from jaxllm.engine.detokenizer import IncrementalDetokenizer
from jaxllm.engine.output_wire import pack_metrics
from jaxllm.engine.request import Request, RequestStatus
from jaxllm.engine.scheduler import KVCacheLostError, Scheduler
from jaxllm.outputs import CompletionOutput, RequestOutput, make_logprobs_entry
from jaxllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


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


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class _Sample:
    """One of the n samples of a request: its Request and its text state."""
    request: Request
    detok: IncrementalDetokenizer
    seed: int
    cumulative_logprob: float = 0.0
    logprobs: list | None = None
    # What step_deltas() has sent of it: text chars, token ids, logprob entries.
    sent: tuple[int, int, int] = (0, 0, 0)


@dataclass
class _Group:
    """A user request: its prompt and its n samples."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_Sample]
    metrics: RequestMetrics
    prompt_logprobs: list | None = None   # vLLM's shape: None, then a dict per token
    header_sent: bool = False              # step_deltas() sent the prompt part


class LLMEngine:
    def __init__(self, config: EngineConfig):
        from concurrent.futures import ThreadPoolExecutor

        import jax
        from jaxllm.models.loader import load_model, load_tokenizer
        from jaxllm.parallel import distributed, mesh as mesh_lib
        from jaxllm.runner.model_runner import ModelRunner

        self.config = config
        mc = config.model
        t0 = time.perf_counter()
        distributed.check_config(config)
        distributed.initialize(config.parallel)     # multi-host; a no-op on one process
        self.mesh = mesh_lib.make_mesh(config.parallel.tensor_parallel_size)
        # The tokenizer loads on a thread while the weights load: importing transformers
        # alone takes seconds, while the weights mostly wait on the device or on reads.
        with ThreadPoolExecutor(1, thread_name_prefix="jaxllm-tokenizer") as pool:
            tokenizer = pool.submit(load_tokenizer, mc)
            loaded = load_model(mc.model, mc.dtype, mc.load_format,
                                mesh_lib.param_shardings(self.mesh), mc.seed)
            t_weights = time.perf_counter()
            self.tokenizer = tokenizer.result()
        t_tokenizer = time.perf_counter()
        self.arch = loaded.arch
        self.model_path = loaded.source
        # The same checks the CLI runs before loading (context length, batch budget, TP).
        check_against_model(config, self.arch, loaded.source)
        self.max_model_len = effective_max_model_len(config, self.arch)
        self.max_num_batched_tokens = _max_batched(config, self.max_model_len,
                                                   self.mesh.local_devices[0])
        self.runner = ModelRunner(config, loaded, self.mesh, self.max_model_len,
                                  self.max_num_batched_tokens)
        t_load = time.perf_counter()
        self.runner.initialize_kv_cache()
        t_kv = time.perf_counter()
        num_cpu_blocks = _num_cpu_blocks(config, self.runner)
        self.host_pool = self.runner.host_pool(num_cpu_blocks)
        sc = config.scheduler
        self.scheduler = Scheduler(
            block_size=config.cache.block_size, num_gpu_blocks=self.runner.num_blocks,
            num_cpu_blocks=num_cpu_blocks, max_num_seqs=sc.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len, enable_chunked_prefill=sc.enable_chunked_prefill,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            preemption_mode=sc.preemption_mode)
        if not config.enforce_eager:
            self.runner.warm_up()
        self.startup_seconds = time.perf_counter() - t0
        # Where start-up went: weights (built or read), the wait for the tokenizer after
        # them, the model runner, KV sizing (on a GPU: the largest step compiled or
        # loaded, for its memory analysis) and allocation, and warm-up (the other
        # programs compiled, or loaded from the executable store). load_s: the three after it.
        self.startup_breakdown = {
            "load_s": t_load - t0, "weights_s": t_weights - t0,
            "tokenizer_wait_s": t_tokenizer - t_weights, "runner_s": t_load - t_tokenizer,
            "kv_cache_s": t_kv - t_load, "warm_up_s": time.perf_counter() - t_kv}
        self.eos_token_id = self.arch.eos_token_id[0] if self.arch.eos_token_id else \
            self.tokenizer.eos_token_id
        self.groups: dict[str, _Group] = {}
        self.samples: dict[str, _Sample] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self._rng = random.Random(mc.seed)
        self.async_scheduling = sc.async_scheduling
        self._in_flight = None    # (SchedulerOutput, StepHandle) launched, not read back
        logger.info("engine ready in %.1f s (%s, %d KV blocks, %s; %s)", self.startup_seconds,
                    self.model_path, self.runner.num_blocks, jax.devices()[0].platform,
                    ", ".join(f"{k} {v:.1f}" for k, v in self.startup_breakdown.items()))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLMEngine":
        return cls(config)

    @property
    def model_name(self) -> str:
        names = self.config.model.served_model_name
        if names:
            return names[0]
        base = os.path.basename(self.model_path.rstrip("/"))
        return base.split(".")[0] if base.endswith(".gguf") else base

    # ------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        params = params or SamplingParams()
        if params.prompt_logprobs is not None and self.config.parallel.num_processes > 1:
            raise ValueError("prompt_logprobs is not supported across several processes")
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self._tokenize(prompt)
        self._validate_length(len(token_ids), params)
        now = time.time() if arrival_time is None else arrival_time
        group = _Group(request_id, text, token_ids, params, [], RequestMetrics(now),
                       [None] * len(token_ids) if params.prompt_logprobs is not None else None)
        for i in range(params.n):
            sid = request_id if params.n == 1 else f"{i}_{request_id}"
            # Sample i of a seeded request uses seed + i, as vLLM does.
            child = params if params.n == 1 else dataclasses.replace(
                params, n=1, seed=None if params.seed is None else params.seed + i)
            req = Request(sid, token_ids, child, eos_token_id=self.eos_token_id,
                          arrival_time=now, parent_id=request_id if params.n > 1 else None)
            seed = child.seed if child.seed is not None else self._rng.getrandbits(63)
            sample = _Sample(req, IncrementalDetokenizer(self.tokenizer, token_ids, params),
                             seed, logprobs=[] if params.logprobs is not None else None)
            group.samples.append(sample)
        self.groups[request_id] = group
        for s in group.samples:
            self.scheduler.add_request(s.request)
            self.samples[s.request.request_id] = s
        self.prompt_tokens_total += len(token_ids)

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.arch.vocab_size]
            if bad:
                raise ValueError(f"token id {bad[0]} is out of vocabulary "
                                 f"(0..{self.arch.vocab_size - 1})")
            return None, ids
        raise ValueError("a prompt is a string, a list of token ids, or "
                         "{'prompt_token_ids': [...]}")

    def _validate_length(self, num_prompt: int, params: SamplingParams) -> None:
        if num_prompt == 0:
            raise ValueError("the prompt is empty")
        max_tokens = params.max_tokens or 0
        if num_prompt + max_tokens > self.max_model_len or num_prompt >= self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {num_prompt + max_tokens} tokens ({num_prompt} in the "
                f"messages, {max_tokens} in the completion). Please reduce the length of the "
                f"messages or completion.")

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            group = self.groups.pop(rid, None)
            if group is None:
                continue
            ids = [s.request.request_id for s in group.samples]
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
            for sid in ids:
                self.samples.pop(sid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self.groups)

    # ------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        return self._step(self._make_output)

    def step_deltas(self) -> list[tuple]:
        """step() with each output as what changed since the request's last one, in
        ``output_wire``'s delta form (the engine process sends these; its server
        process rebuilds the RequestOutputs). Built from what is new only, where a
        RequestOutput copies the whole sequence every step. An engine is stepped by
        one of the two methods, not both."""
        return self._step(self._make_delta)

    def _step(self, make) -> list:
        previous = self._in_flight
        self._in_flight = None
        if previous is not None and not self._can_schedule_ahead(previous[0]):
            outputs = self._finish(*previous, make)   # the next step needs its tokens
            previous = None
        else:
            outputs = []
        launched = self._launch(self.scheduler.schedule())
        if previous is not None:
            outputs = self._finish(*previous, make)
        if launched is not None:
            if self.async_scheduling:
                self._in_flight = launched
            else:
                outputs += self._finish(*launched, make)
        return outputs

    def _can_schedule_ahead(self, so) -> bool:
        """Penalties read a request's output tokens on the host: a step with such a
        request is read back before the next one is scheduled."""
        return not any(self.samples[r.request_id].request.sampling_params.uses_penalties
                       for r in so.scheduled if r.request_id in self.samples)

    def _launch(self, so):
        if not so.scheduled:
            return None
        now = time.time()
        self.runner.swap_out(so.blocks_to_swap_out, self.host_pool)
        self.runner.swap_in(so.blocks_to_swap_in, self.host_pool)
        requests = {r.request_id: self.samples[r.request_id].request for r in so.scheduled}
        seeds = {rid: self.samples[rid].seed for rid in requests}
        for rid in requests:
            m = self.groups[self._group_id(rid)].metrics
            m.first_scheduled_time = m.first_scheduled_time or now
        try:
            return so, self.runner.execute_model(so, requests, seeds)
        except KVCacheLostError as e:
            logger.warning("%s: %d running requests compute their KV again", e,
                           self.scheduler.num_running)
            self.scheduler.recompute_all(so)
            return None

    def _finish(self, so, handle, make) -> list:
        """Read a launched step back and turn it into outputs (``make`` of a group)."""
        results, prompt_logprobs = self.runner.get_output(handle)
        self._record_prompt_logprobs(prompt_logprobs)
        updated = self.scheduler.update_from_output(
            so, {rid: r.token_id for rid, r in results.items()})
        touched: dict[str, _Group] = {}
        now = time.time()
        for req in updated:
            sample = self.samples[req.request_id]
            self._record_token(sample, results[req.request_id])
            group = self.groups[self._group_id(req.request_id)]
            group.metrics.first_token_time = group.metrics.first_token_time or now
            group.metrics.last_token_time = now
            touched[group.request_id] = group
        self.generation_tokens_total += len(updated)
        return [make(g) for g in touched.values()
                if g.params.output_kind is not RequestOutputKind.FINAL_ONLY
                or all(s.request.is_finished() for s in g.samples)]

    def _record_prompt_logprobs(self, per_request: dict) -> None:
        for sid, rows in per_request.items():
            if sid not in self.samples:
                continue   # aborted while its step ran
            group = self.groups[self._group_id(sid)]
            k = group.params.prompt_logprobs
            for pos, lp, rank, top_ids, top_lps in rows:
                group.prompt_logprobs[pos] = make_logprobs_entry(
                    group.prompt_token_ids[pos], lp, rank, top_ids, top_lps, k,
                    self._decode_one)

    def _group_id(self, sample_id: str) -> str:
        req = self.samples[sample_id].request
        return req.parent_id or req.request_id

    def _record_token(self, sample: _Sample, res) -> None:
        req = sample.request
        params = req.sampling_params
        sample.cumulative_logprob += res.logprob
        if sample.logprobs is not None:
            sample.logprobs.append(make_logprobs_entry(
                res.token_id, res.logprob, res.rank, res.top_ids or [], res.top_logprobs or [],
                params.logprobs, self._decode_one))
        stop = sample.detok.update([res.token_id])
        if stop is not None and not req.is_finished():
            req.stop_reason = stop
            self.scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_STOPPED)

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _make_output(self, group: _Group) -> RequestOutput:
        outs = []
        for i, s in enumerate(group.samples):
            req = s.request
            finished = req.is_finished()
            outs.append(CompletionOutput(
                index=i, text=s.detok.get_next_output_text(finished, delta=False),
                token_ids=list(req.output_token_ids),
                cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                logprobs=s.logprobs, finish_reason=req.get_finished_reason(),
                stop_reason=req.stop_reason))
        finished = self._retire_if_finished(group)
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids,
                             group.prompt_logprobs, outs,
                             finished, num_cached_tokens=_num_cached(group),
                             metrics=dataclasses.replace(group.metrics))

    def _make_delta(self, group: _Group) -> tuple:
        """The group's output as a delta (``output_wire`` has the layout). The text
        only grows: the detokenizer holds back what a stop string could take away."""
        header = None
        if not group.header_sent:
            header = (group.prompt, group.prompt_token_ids, group.prompt_logprobs)
            group.header_sent = True
        completions = []
        for s in group.samples:
            req = s.request
            chars, num_ids, num_logprobs = s.sent
            text = s.detok.get_next_output_text(req.is_finished(), delta=True)
            ids = req.output_token_ids
            logprobs = None
            if s.logprobs is not None:
                logprobs = s.logprobs[num_logprobs:]
                num_logprobs = len(s.logprobs)
            s.sent = (chars + len(text), len(ids), num_logprobs)
            completions.append((chars, text, ids[num_ids:],
                                s.cumulative_logprob if s.logprobs is not None else None,
                                logprobs, req.get_finished_reason(), req.stop_reason))
        finished = self._retire_if_finished(group)
        return (group.request_id, header, completions, finished, _num_cached(group),
                pack_metrics(group.metrics))

    def _retire_if_finished(self, group: _Group) -> bool:
        finished = all(s.request.is_finished() for s in group.samples)
        if finished:
            group.metrics.finished_time = time.time()
            self.groups.pop(group.request_id, None)
            for s in group.samples:
                self.samples.pop(s.request.request_id, None)
        return finished

    # ------------------------------------------------------------ stats
    def get_stats(self) -> EngineStats:
        pool = self.scheduler.block_pool
        total = self.runner.num_blocks - 1     # the null block is never handed out
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting + self.scheduler.num_swapped,
            kv_cache_usage=pool.get_usage(),
            num_preemptions_total=self.scheduler.num_preemptions_total,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            prefix_cache_queries=pool.prefix_cache_queries,
            prefix_cache_hits=pool.prefix_cache_hits,
            num_free_blocks=pool.get_num_free_blocks(),
            num_total_blocks=total)


def _num_cached(group: _Group) -> int:
    return max(max((s.request.num_cached_tokens for s in group.samples), default=0), 0)


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
