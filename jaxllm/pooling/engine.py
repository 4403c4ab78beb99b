"""PoolingEngine: prompts in, vectors out. Tokenizes, checks lengths and per-request
settings, and runs the pooling runner; nothing is cached between calls.

Prompts are strings, vLLM's ``{"prompt_token_ids": [...]}`` dicts or lists of ids.
Errors are ValueErrors whose first word is the field at fault (the server's 400s
take their ``param`` from it).
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence

import numpy as np

from jaxllm.config import ConfigError, EngineConfig
from jaxllm.pooling.model_info import read_pooling_info
from jaxllm.pooling.outputs import PoolingOutput, PoolingRequestOutput
from jaxllm.pooling.params import PoolingParams

logger = logging.getLogger(__name__)

# Default token budget of one step: large on a GPU (memory goes to batch, there is no
# KV pool), small on CPU where a step is slow anyway.
GPU_BUDGET, CPU_BUDGET = 32768, 4096


class InputError(ValueError):
    """A bad request: ``param`` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class PoolingEngine:
    def __init__(self, config: EngineConfig):
        import jax
        from jaxllm.pooling.loading import load_pooling_model
        from jaxllm.pooling.runner import PoolingRunner
        t0 = time.perf_counter()
        mc = config.model
        self.config = config
        self.info = info = read_pooling_info(mc.model)
        if mc.quantization is not None:
            raise ConfigError(f"quantization={mc.quantization!r}: the pooling runner runs "
                              "float weights (bfloat16, float16 or float32); leave it unset")
        if mc.max_model_len is not None and mc.max_model_len > info.context_len:
            raise ConfigError(f"max_model_len={mc.max_model_len} exceeds the model's "
                              f"{info.context_len} tokens ({mc.model}); set it to "
                              f"{info.context_len} or less")
        self.max_model_len = mc.max_model_len or info.context_len
        gpu = jax.devices()[0].platform == "gpu"
        budget = config.scheduler.max_num_batched_tokens or max(
            GPU_BUDGET if gpu else CPU_BUDGET, self.max_model_len)
        if budget < self.max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens={budget} is below max_model_len="
                f"{self.max_model_len}: a pooling input runs in one step (no chunked "
                "prefill); raise max_num_batched_tokens or lower max_model_len")
        loaded = load_pooling_model(mc.model, mc.dtype, mc.load_format, info.is_encoder,
                                    mc.seed)
        self.vocab_size = loaded.arch.vocab_size
        self.tokenizer = _load_tokenizer(mc, self.vocab_size)
        self.runner = PoolingRunner(loaded, info.pooling_type, self.max_model_len, budget,
                                    config.scheduler.max_num_seqs)
        self.model_name = mc.served_model_name[0] if mc.served_model_name else mc.model
        logger.info("pooling engine ready in %.1f s (%s, %s pooling%s, %s, budget %d tokens)",
                    time.perf_counter() - t0, mc.model, info.pooling_type,
                    ", normalized" if info.normalize else "", jax.devices()[0].platform, budget)

    # ------------------------------------------------------------ checks

    def check_params(self, params: PoolingParams) -> None:
        d = params.dimensions
        if d is not None:
            info = self.info
            if not info.is_matryoshka:
                raise InputError("dimensions", f'Model "{self.model_name}" does not support '
                                 "matryoshka representation, changing output dimensions "
                                 "will lead to poor results.")
            if info.matryoshka_dimensions and d not in info.matryoshka_dimensions:
                raise InputError("dimensions", f'Model "{self.model_name}" only supports '
                                 f"{list(info.matryoshka_dimensions)} matryoshka dimensions, "
                                 "using other output dimensions will lead to poor results.")
            if d > info.hidden_size:
                raise InputError("dimensions", f"dimensions={d} is more than the model's "
                                 f"{info.hidden_size}")
        t = params.truncate_prompt_tokens
        if t is not None and t > self.max_model_len:
            raise InputError("truncate_prompt_tokens", f"truncate_prompt_tokens value ({t}) "
                             f"is greater than max_model_len ({self.max_model_len}). Please, "
                             "select a smaller truncation size.")

    def tokenize(self, prompts: Sequence, params: PoolingParams, field: str = "input",
                 first: int = 0) -> list[list[int]]:
        """Token ids per prompt, truncated as `params` asks and checked. Errors name
        ``field[first + i]`` (just ``field`` for one prompt at 0)."""
        texts = [(i, p) for i, p in enumerate(prompts) if isinstance(p, str)]
        ids: list = [None] * len(prompts)
        if texts:
            raw = [p.lower() if self.info.do_lower_case else p for _, p in texts]
            for (i, _), e in zip(texts, self._encode(raw)):
                ids[i] = e

        def where(i: int) -> str:
            return f"{field}[{first + i}]" if len(prompts) > 1 or first else field
        for i, p in enumerate(prompts):
            if ids[i] is None:
                ids[i] = self._given_ids(p, where(i))
        limit = params.truncate_prompt_tokens
        if limit == -1:
            limit = self.max_model_len
        for i, t in enumerate(ids):
            where_i = where(i)
            if limit is not None and len(t) > limit:
                ids[i] = t = t[-limit:]       # the last tokens, as vLLM truncates
            if not t:
                raise InputError(where_i, f"{where_i} is empty (no tokens to embed)")
            if len(t) > self.max_model_len:
                raise InputError(where_i, f"This model's maximum context length is "
                                 f"{self.max_model_len} tokens. However, you requested "
                                 f"{len(t)} tokens in the input for embedding generation "
                                 f"({where_i}). Please reduce the length of the input, or set "
                                 "truncate_prompt_tokens.")
        return ids

    def _encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids with the model's special tokens. A fast tokenizer's Rust backend
        is called directly when it is set as the transformers wrapper would set it (no
        truncation or padding, special tokens split or not): the wrapper's per-text
        Python work doubled the time of 32k short texts, and `encode_batch_fast`
        skips the offsets nobody reads here."""
        backend = getattr(self.tokenizer, "_tokenizer", None)
        if (backend is None or backend.truncation is not None or backend.padding is not None
                or backend.encode_special_tokens != getattr(self.tokenizer,
                                                            "split_special_tokens", False)):
            return self.tokenizer(texts, add_special_tokens=True, return_attention_mask=False,
                                  return_token_type_ids=False, verbose=False)["input_ids"]
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=True)]

    def _given_ids(self, prompt, where: str) -> list[int]:
        if isinstance(prompt, dict) and set(prompt) == {"prompt_token_ids"}:
            prompt = prompt["prompt_token_ids"]
        if not isinstance(prompt, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise InputError(where, f"{where}: give a string, a list of token ids or "
                             "{\"prompt_token_ids\": [...]}")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise InputError(where, f"{where}: token id {bad[0]} is out of range for the "
                             f"model's vocabulary (0..{self.vocab_size - 1})")
        return list(prompt)

    # ------------------------------------------------------------ running

    def encode(self, prompts: Sequence, params: PoolingParams | None = None,
               request_ids: Sequence[str] | None = None,
               on_step: Callable[[int], None] | None = None) -> list[PoolingRequestOutput]:
        """One PoolingRequestOutput per prompt, in order (all or none: a bad prompt
        raises before anything runs)."""
        params = params or PoolingParams()
        self.check_params(params)
        ids = self.tokenize(prompts, params)
        vectors = self.embed_ids(ids, params, on_step)
        dims = params.dimensions or self.info.hidden_size
        rids = request_ids or [str(i) for i in range(len(prompts))]
        return [PoolingRequestOutput(rid, PoolingOutput(vectors[i, :dims]), ids[i], True,
                                     p if isinstance(p, str) else None)
                for i, (rid, p) in enumerate(zip(rids, prompts))]

    def embed_ids(self, ids: list[list[int]], params: PoolingParams,
                  on_step: Callable[[int], None] | None = None) -> np.ndarray:
        """float32 [N, E] for checked token lists (columns past `dimensions` are 0)."""
        n = len(ids)
        dims = np.full(n, params.dimensions or self.info.hidden_size, np.int32)
        normalize = self.info.normalize if params.normalize is None else params.normalize
        return self.runner.run(ids, dims, np.full(n, normalize, bool), on_step)


def _load_tokenizer(mc, vocab_size: int):
    """The folder's (or --tokenizer's) tokenizer; a placeholder of the model's
    vocabulary for a --load-format dummy folder without one (token ids only)."""
    from jaxllm.models.errors import CheckpointError
    from jaxllm.tokenizer import placeholder_tokenizer
    path = mc.tokenizer or mc.model
    files = ("tokenizer.json", "tokenizer.model", "vocab.txt", "sentencepiece.bpe.model")
    if not any(os.path.isfile(os.path.join(path, f)) for f in files):
        if mc.load_format == "dummy":
            return placeholder_tokenizer(vocab_size)
        raise CheckpointError(f"{path}: no tokenizer ({', '.join(files)})")
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot load a tokenizer ({e})") from None
