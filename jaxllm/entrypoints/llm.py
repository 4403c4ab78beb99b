"""LLM: the Python batch API, with vLLM's shapes.

    from jaxllm import LLM, SamplingParams
    llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
from typing import Sequence

from jaxllm.config import engine_config_from_flat
from jaxllm.env_switch import env_switch
from jaxllm.generation_config import get_diff_sampling_param
from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, *, dtype: str = "auto",
                 task: str | None = None, **engine_args):
        """runner="pooling" (or vLLM's task="embed") loads an embedding model for
        LLM.embed (jaxllm/pooling/); "auto" picks it for BERT-family encoders."""
        from jaxllm.pooling.model_info import resolve_runner
        from jaxllm.pooling.offline import runner_from_task
        if task is not None:
            engine_args.setdefault("runner", runner_from_task(task))
        config = engine_config_from_flat(model=model, dtype=dtype, **engine_args)
        self.runner_type = resolve_runner(config.model)
        # Read (and checked) before the weights load; logged when it sets any.
        self.default_sampling_params = {} if self.runner_type == "pooling" else \
            get_diff_sampling_param(config.model)
        if self.runner_type == "pooling":
            from jaxllm.pooling.engine import PoolingEngine
            self.llm_engine = PoolingEngine(config)
        else:
            from jaxllm.engine.llm_engine import LLMEngine
            client = None
            if _multiprocessing():
                from jaxllm.engine.core_mp import EngineCoreMPClient
                client = EngineCoreMPClient(config)
            self.llm_engine = LLMEngine.from_config(config, client)
        self._counter = itertools.count()

    def embed(self, prompts, pooling_params=None, *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True):
        """vLLM's LLM.embed: one EmbeddingRequestOutput per prompt (a string, token
        ids or {"prompt_token_ids": [...]}), in input order; ``out.outputs.embedding``."""
        from jaxllm.pooling.offline import embed
        return embed(self, prompts, pooling_params, truncate_prompt_tokens, use_tqdm)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate and chat use without sampling_params (vLLM's): the model's
        generation config (--generation-config), else SamplingParams()."""
        return SamplingParams(**self.default_sampling_params)

    def generate(self, prompts,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None) -> list[RequestOutput]:
        """prompts: a string, a list of strings, or vLLM's {"prompt_token_ids": [...]}
        dicts (or a list of those). Results come back in input order. priority: one
        per prompt (lower first), with LLM(scheduling_policy="priority")."""
        from jaxllm.pooling.offline import check_generate
        check_generate(self)
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        elif prompts and isinstance(prompts, list) and isinstance(prompts[0], int):
            prompts = [{"prompt_token_ids": prompts}]
        params = sampling_params or self.get_default_sampling_params()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(priority)} priorities")
        # Only finished outputs are returned, so the engine builds no others (vLLM).
        final = {}
        params = [final.get(id(p)) or final.setdefault(id(p), dataclasses.replace(
            p, output_kind=RequestOutputKind.FINAL_ONLY)) for p in params]
        ids = []
        try:
            for prompt, p, rank in zip(prompts, params, priority):
                rid = str(next(self._counter))
                self.llm_engine.add_request(rid, prompt, p, priority=rank)
                ids.append(rid)
        except Exception:
            self.llm_engine.abort_request(ids)   # nothing half-added stays behind
            raise
        return self._run_engine(ids, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None) -> list[RequestOutput]:
        """messages: one conversation (a list of {"role", "content"}) or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.llm_engine.tokenizer
        prompts = [{"prompt_token_ids": list(tok.apply_chat_template(
            conv, tokenize=True, add_generation_prompt=add_generation_prompt,
            chat_template=chat_template, return_dict=False))} for conv in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run_engine(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        pending = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            with _gc_frozen():
                while pending:
                    if not engine.has_unfinished_requests():
                        raise RuntimeError(
                            f"engine stopped with {len(pending)} requests unfinished")
                    for out in engine.step():
                        if out.finished and out.request_id in pending:
                            pending.discard(out.request_id)
                            done[out.request_id] = out
                            if bar is not None:
                                bar.update(1)
        except BaseException:
            engine.abort_request(list(pending))
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]


def _multiprocessing() -> bool:
    """JAXLLM_ENABLE_MULTIPROCESSING=1 (vLLM's VLLM_ENABLE_V1_MULTIPROCESSING): the engine
    core in a process of its own (engine/core_mp.py); off by default. The process is
    spawned, so a script that builds an LLM guards it with ``if __name__ ==
    "__main__":`` (Python's rule for spawn, as under vLLM)."""
    return env_switch("JAXLLM_ENABLE_MULTIPROCESSING")


@contextlib.contextmanager
def _gc_frozen():
    """What existed before the call (the engine's weights, jax's caches, the tokenizer:
    hundreds of thousands of objects) left out of the collector's passes for the
    call, as `jaxllm serve`'s engine process does for its life: full passes over it
    all cost ~0.5 ms per step at 256 rows. Unfrozen after, so objects that become
    garbage later are collected; left alone where someone else froze the heap."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
