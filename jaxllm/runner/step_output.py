"""A launched step's handle and reading it back: the sampled token, its logprob and
rank (and the top logprobs when asked) per sampling request, and prompt logprobs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax

from jaxllm.engine.core import SampleResult
from jaxllm.runner import input_batch


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
    spec: dict | None = None    # input_batch.expand_spec_rows: id -> (first row, drafts)
    hidden: Any = None          # [T, C] on the device: the states an EAGLE head reads


def start_copies(handle: StepHandle) -> None:
    """Start the device-to-host copies now, so reading back later waits on none."""
    for x in handle.sampled:
        if x is not None:
            x.copy_to_host_async()
    for x in handle.prompt_out or ():
        x.copy_to_host_async()


def read_back(handle: StepHandle):
    """(id -> SampleResult for the requests whose chunk reached the end of their
    tokens, id -> prompt logprob rows). A request that verified drafts gets a list:
    the results of its rows up to the first whose sample differs from the draft it
    verifies, that one included (see accept_drafts)."""
    out = jax.device_get(handle.sampled)
    # Python lists first: indexing the arrays row by row made a numpy scalar per value
    # (0.15 against 0.08 ms of CPU at 256 rows).
    token_ids = out.token_ids.tolist()
    if out.logprobs is None:        # no row asked for them (the sampler made none)
        logprobs, ranks = [0.0] * len(token_ids), [0] * len(token_ids)
    else:
        logprobs, ranks = out.logprobs.tolist(), out.sampled_rank.tolist()
    top_ids = top_lps = None
    if handle.num_logprobs:
        top_ids, top_lps = out.top_logprob_ids.tolist(), out.top_logprobs.tolist()
    scheduled, results = handle.scheduled, {}
    for i, r in enumerate(scheduled):
        if not r.do_sample:
            continue
        res = SampleResult(token_ids[i], logprobs[i], ranks[i])
        if top_ids is not None:
            res.top_ids, res.top_logprobs = top_ids[i], top_lps[i]
        results[r.request_id if handle.spec is None else i] = res
    if handle.spec is not None:
        results = accept_drafts(results, scheduled, handle.spec)
    prompt = {}
    if handle.prompt_out is not None:
        prompt = input_batch.split_prompt_logprobs(scheduled, handle.requests,
                                                   jax.device_get(handle.prompt_out))
    return results, prompt


def accept_drafts(row_results: dict, rows: list, spec: dict) -> dict:
    """Rows' results (by row) -> results by request id. A draft is accepted when the
    target's own sample at its position equals it. The drafts are point masses (each
    proposer proposes one token, greedily), and for a point mass q = 1[x = d] vLLM's
    rule (accept with min(1, p(d) / q(d)) = p(d), else sample from norm(max(p - q, 0)))
    draws exactly from p, as sampling p and comparing does; so sampled output keeps
    the target's distribution, and greedy output is plain greedy decoding's."""
    results = {}
    for i, r in enumerate(rows):
        if i in row_results and r.request_id not in spec:
            results[r.request_id] = row_results[i]
    for rid, (first, drafts) in spec.items():
        accepted = []
        for j in range(len(drafts) + 1):
            res = row_results[first + j]
            accepted.append(res)
            if j == len(drafts) or res.token_id != drafts[j]:
                break
        results[rid] = accepted
    return results
