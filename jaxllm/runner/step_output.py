"""A launched step's handle and reading it back: the sampled token, its logprob and
rank (and the top logprobs when asked) per sampling request, and prompt logprobs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax

from jaxllm.runner import input_batch


@dataclass
class SampleResult:
    token_id: int
    logprob: float
    rank: int
    top_ids: list[int] | None = None      # best first, MAX_LOGPROBS long
    top_logprobs: list[float] | None = None


@dataclass
class StepHandle:
    """A launched step: what it ran and its device outputs, not read back yet.
    `sampled` is None while the sampler waits for the step's grammar bitmask
    (`pending`: the logits, metadata, flags and rows it will sample from)."""
    scheduled: list
    requests: dict
    sampled: Any                # SamplerOutput
    num_logprobs: int
    prompt_out: tuple | None
    pending: tuple | None = None


def start_copies(handle: StepHandle) -> None:
    """Start the device-to-host copies now, so reading back later waits on none."""
    for x in handle.sampled:
        x.copy_to_host_async()
    for x in handle.prompt_out or ():
        x.copy_to_host_async()


def read_back(handle: StepHandle):
    """(id -> SampleResult for the requests whose chunk reached the end of their
    tokens, id -> prompt logprob rows)."""
    out = jax.device_get(handle.sampled)
    scheduled, results = handle.scheduled, {}
    for i, r in enumerate(scheduled):
        if not r.do_sample:
            continue
        res = SampleResult(int(out.token_ids[i]), float(out.logprobs[i]),
                           int(out.sampled_rank[i]))
        if handle.num_logprobs:
            res.top_ids = out.top_logprob_ids[i].tolist()
            res.top_logprobs = out.top_logprobs[i].tolist()
        results[r.request_id] = res
    prompt = {}
    if handle.prompt_out is not None:
        prompt = input_batch.split_prompt_logprobs(scheduled, handle.requests,
                                                   jax.device_get(handle.prompt_out))
    return results, prompt
