"""What the engine hands back: vLLM's RequestOutput / CompletionOutput shapes.

Logprobs follow vLLM: one ``dict[token_id, Logprob]`` per generated token, holding
the requested top-N tokens and always the sampled token (which may be outside the
top-N, then the dict has N + 1 entries). Prompt logprobs have ``None`` for the first
prompt token, which has no logprob. Pure Python: no jax here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class Logprob:
    """One token's log-probability; ``rank`` is 1-based (1 = most likely)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One of the ``n`` completions of a request.

    ``finish_reason`` is "stop" (EOS, a stop token or a stop string), "length"
    (max_tokens or max_model_len) or "abort"; None while running. ``stop_reason`` is
    the stop string or stop token id that ended it, None for EOS or length.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Everything produced for one request so far (or in this step, if streaming)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: Any = None


def make_logprobs_entry(
    token_id: int,
    logprob: float,
    rank: int,
    top_ids: Sequence[int],
    top_logprobs: Sequence[float],
    num_logprobs: int,
    decode: Callable[[int], str] | None = None,
) -> dict[int, Logprob]:
    """Build one position's ``dict[int, Logprob]`` from one sampler row.

    ``top_ids``/``top_logprobs`` are the row's top-K (K >= num_logprobs), sorted
    best first. The sampled token comes first in the dict, as in vLLM; it keeps
    its true ``rank`` even when it is also among the top-N.
    """
    entry = {int(token_id): Logprob(float(logprob), int(rank), _decode(decode, token_id))}
    for i in range(num_logprobs):
        tid = int(top_ids[i])
        if tid not in entry:
            entry[tid] = Logprob(float(top_logprobs[i]), i + 1, _decode(decode, tid))
    return entry


def _decode(decode: Callable[[int], str] | None, token_id: int) -> str | None:
    return None if decode is None else decode(int(token_id))
