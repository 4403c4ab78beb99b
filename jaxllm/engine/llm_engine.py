"""LLMEngine: requests in, RequestOutputs out, over the engine core.

It tokenizes and checks each request, fans `n` out into n engine requests, and steps
the EngineCore (scheduler + executor, engine/core.py); the OutputProcessor turns the
sampled tokens into text, stop strings, logprobs and RequestOutputs (or the engine
process's deltas). The Executor (executor/) owns the device.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import random
import time
from typing import Iterable

from jaxllm.config import EngineConfig
from jaxllm.engine.core_build import EngineStats, build_core, core_stats
from jaxllm.engine.output_processor import OutputProcessor
from jaxllm.engine.request import Request, RequestStatus
from jaxllm.engine.scheduler import Scheduler
from jaxllm.sampling_params import SamplingParams
from jaxllm.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, core_client=None):
        """core_client: the engine core in a process of its own (an
        engine/core_mp.py EngineCoreMPClient, starting); None: built here."""
        self.config = config
        t0 = time.perf_counter()
        if core_client is not None:
            from jaxllm.tokenizer import load_tokenizer
            self.tokenizer = load_tokenizer(config.model)   # while the engine starts
            info = core_client.wait_until_ready()
            self.executor, self.engine_core = None, core_client
            core_client.structured_output_manager = StructuredOutputManager(
                self.tokenizer, info.arch.vocab_size, info.eos_token_id)   # its checks
        else:
            self.engine_core, info = build_core(config, self)
        self.arch, self.model_path = info.arch, info.model_path
        self.max_model_len, self.max_num_batched_tokens = (
            info.max_model_len, info.max_num_batched_tokens)
        self.eos_token_id, self._num_gpu_blocks = info.eos_token_id, info.num_gpu_blocks
        self.output_processor = OutputProcessor(self.tokenizer)
        self.startup_seconds = time.perf_counter() - t0
        self.startup_breakdown = info.startup_breakdown
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self._rng = random.Random(config.model.seed)
        logger.info("engine ready in %.1f s (%s, %d KV blocks%s; %s)", self.startup_seconds,
                    self.model_path, info.num_gpu_blocks,
                    ", engine core in its own process" if core_client else "",
                    ", ".join(f"{k} {v:.1f}" for k, v in self.startup_breakdown.items()))

    @classmethod
    def from_config(cls, config: EngineConfig, core_client=None) -> "LLMEngine":
        return cls(config, core_client)

    # What tests and benchmarks look at.
    @property
    def runner(self):
        return self._in_process().executor.runner

    @property
    def scheduler(self) -> Scheduler:
        return self._in_process().engine_core.scheduler

    def _in_process(self) -> "LLMEngine":
        if self.executor is None:
            raise RuntimeError("the engine core runs in a process of its own "
                               "(JAXLLM_ENABLE_MULTIPROCESSING=1): its scheduler, "
                               "runner and settings are not reachable from here")
        return self

    def shutdown(self) -> None:
        """Stop the engine core's process, if it has one."""
        if self.executor is None:
            self.engine_core.shutdown()

    @property
    def async_scheduling(self) -> bool:
        return self._in_process().engine_core.async_scheduling

    @async_scheduling.setter
    def async_scheduling(self, value: bool) -> None:
        self._in_process().engine_core.async_scheduling = value

    @property
    def model_name(self) -> str:
        names = self.config.model.served_model_name
        if names:
            return names[0]
        base = os.path.basename(self.model_path.rstrip("/"))
        return base.split(".")[0] if base.endswith(".gguf") else base

    # ------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        params = params or SamplingParams()
        self._check_priority(priority)
        if params.prompt_logprobs is not None and self.config.parallel.num_processes > 1:
            raise ValueError("prompt_logprobs is not supported across several processes")
        if request_id in self.output_processor.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.structured_outputs is not None:
            self.engine_core.structured_output_manager.validate(params.structured_outputs)
        bad = [t for t in params.stop_token_ids if t >= self.arch.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids: token id {bad[0]} is out of vocabulary "
                             f"(0..{self.arch.vocab_size - 1})")
        text, token_ids = self._tokenize(prompt)
        self._validate_length(len(token_ids), params)
        now = time.time() if arrival_time is None else arrival_time
        requests, seeds = [], []
        for i in range(params.n):
            sid = request_id if params.n == 1 else f"{i}_{request_id}"
            # Sample i of a seeded request uses seed + i, as vLLM does.
            child = params if params.n == 1 else dataclasses.replace(
                params, n=1, seed=None if params.seed is None else params.seed + i)
            requests.append(Request(sid, token_ids, child, eos_token_id=self.eos_token_id,
                                    arrival_time=now, priority=priority,
                                    parent_id=request_id if params.n > 1 else None))
            seeds.append(child.seed if child.seed is not None else self._rng.getrandbits(63))
        self.output_processor.add_request(request_id, text, token_ids, params, requests, now)
        for req, seed in zip(requests, seeds):
            self.engine_core.add_request(req, seed)
        self.prompt_tokens_total += len(token_ids)

    def _check_priority(self, priority) -> None:
        if type(priority) is not int:
            raise ValueError(f"priority must be an int, got {priority!r}")
        # vLLM refuses a priority the policy would ignore.
        if priority != 0 and self.config.scheduler.scheduling_policy != "priority":
            raise ValueError(f"priority={priority} needs priority scheduling; start with "
                             "--scheduling-policy priority (LLM(scheduling_policy='priority'))")

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._checked_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, self._checked_ids(prompt)
        raise ValueError("a prompt is a string, a list of token ids, or "
                         "{'prompt_token_ids': [...]}")

    def _checked_ids(self, token_ids) -> list[int]:
        ids = list(token_ids)
        vocab = self.arch.vocab_size
        if ids and not (0 <= min(ids) and max(ids) < vocab):
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise ValueError(f"token id {bad} is out of vocabulary (0..{vocab - 1})")
        return ids

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
            ids = self.output_processor.abort_request(rid)
            if ids:
                self.engine_core.finish_requests(ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    # ------------------------------------------------------------ the step
    def step(self) -> list:
        """One engine core step; the RequestOutputs of the requests it advanced."""
        return self._step(delta=False)

    def step_deltas(self) -> list[tuple]:
        """step() with each output as what changed since the request's last one, in
        ``output_wire``'s delta form (the engine process sends these; its server
        process rebuilds the RequestOutputs). Built from what is new only, where a
        RequestOutput copies the whole sequence every step. An engine is stepped by
        one of the two methods, not both."""
        return self._step(delta=True)

    def _step(self, delta: bool) -> list:
        core_outputs = self.engine_core.step()
        self.generation_tokens_total += len(core_outputs.sampled)
        return self.output_processor.process_outputs(
            core_outputs, self._finish_stopped, delta=delta)

    def _finish_stopped(self, sample_ids: list[str]) -> None:
        self.engine_core.finish_requests(sample_ids, RequestStatus.FINISHED_STOPPED)

    # ------------------------------------------------------------ stats
    def get_stats(self) -> EngineStats:
        if self.executor is None:     # the engine process's, after its latest step
            stats = self.engine_core.stats
        else:
            stats = core_stats(self.engine_core, self._num_gpu_blocks)
        return dataclasses.replace(stats, prompt_tokens_total=self.prompt_tokens_total,
                                   generation_tokens_total=self.generation_tokens_total)
