"""One step's host inputs: the scheduled chunks as padded, bucketed numpy arrays, and
the prompt-logprob targets and rows of requests that asked for them.

Letter legend: T padded tokens, S padded sequences, B blocks per block-table row.
"""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from jaxllm.engine.scheduler import PLACEHOLDER_TOKEN_ID


def prepare_inputs(scheduled, plan, block_size: int, max_blocks_per_seq: int,
                   prev_rows: dict[str, int], ready=None,
                   rows_read_own_keys_only: bool = False) -> tuple[dict, bool, int]:
    """Fill host numpy buffers for one step. Returns (arrays, decode_only, rows).
    `prev_rows`: request id -> its row in the device's buffer of the last step's
    samples (an input token not read back yet is written as -(row + 1)). `ready`:
    see BucketPlan.shape_for. `rows_read_own_keys_only`: a one-token step is
    decode-only only if no row can read a key another row writes in it (decode steps
    whose kernel writes the KV itself need that; decode_rows_independent).

    Vectorized over the batch: at 256 sequences a per-sequence loop of numpy
    calls cost milliseconds of host time per step."""
    num_seqs = len(scheduled)
    lens = np.fromiter((len(r.token_ids) for r in scheduled), np.int32, num_seqs)
    num_tokens = int(lens.sum())
    decode_only = num_tokens == num_seqs and (
        not rows_read_own_keys_only or decode_rows_independent(scheduled))
    t, s, decode_only = plan.shape_for(num_tokens, num_seqs, decode_only, ready)
    bs = block_size
    starts = np.fromiter((r.num_computed_tokens for r in scheduled), np.int32, num_seqs)
    query_start_loc = np.full(s + 1, num_tokens, np.int32)
    query_start_loc[0] = 0
    np.cumsum(lens, out=query_start_loc[1:num_seqs + 1])
    seq = np.repeat(np.arange(num_seqs, dtype=np.int32), lens)        # token -> sequence
    pos = (np.arange(num_tokens, dtype=np.int32)
           + np.repeat(starts - query_start_loc[:num_seqs], lens))
    input_ids = np.zeros(t, np.int32)
    input_ids[:num_tokens] = np.fromiter(
        itertools.chain.from_iterable(r.token_ids for r in scheduled), np.int32, num_tokens)
    pending = np.flatnonzero(input_ids[:num_tokens] == PLACEHOLDER_TOKEN_ID)
    if len(pending):                       # tokens the last step sampled on the device
        rows = [prev_rows[scheduled[i].request_id] for i in seq[pending]]
        input_ids[pending] = -1 - np.asarray(rows, np.int32)
    block_tables = np.zeros((s, max_blocks_per_seq), np.int32)
    for i, r in enumerate(scheduled):
        block_tables[i, :len(r.block_table)] = r.block_table
    positions = np.zeros(t, np.int32)
    positions[:num_tokens] = pos
    slot_mapping = np.full(t, -1, np.int32)
    slot_mapping[:num_tokens] = block_tables[seq, pos // bs] * bs + pos % bs
    seq_lens = np.zeros(s, np.int32)
    seq_lens[:num_seqs] = starts + lens
    logits_indices = np.zeros(s, np.int32)
    logits_indices[:num_seqs] = query_start_loc[1:num_seqs + 1] - 1
    arrays = dict(input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
                  block_tables=block_tables, seq_lens=seq_lens,
                  query_start_loc=query_start_loc, logits_indices=logits_indices)
    return arrays, decode_only, s


def decode_rows_independent(scheduled) -> bool:
    """Whether no row of a one-token step can read a key that another row writes in
    the same step: no row's request was admitted (or resumed) by this step's schedule,
    and no request has several rows. A block is registered in the prefix cache when
    the step computing it is scheduled, so a request admitted now may hit a block
    another row fills now; a speculative verify step's rows share their request's
    blocks. Requests admitted earlier read only blocks written before this step."""
    ids = [r.request_id for r in scheduled]
    return len(set(ids)) == len(ids) and not any(r.admitted for r in scheduled)


def max_rows(config) -> int:
    """Rows a step may have: max_num_seqs, or with speculation (k drafts, k + 1 rows
    per request, while at most disable_by_batch_size requests run) more."""
    seqs, spec = config.scheduler.max_num_seqs, getattr(config, "speculative_config", None)
    if spec is None:
        return seqs
    limit = spec.effective_disable_by_batch_size
    return max(seqs, min(seqs, limit) * (1 + spec.num_speculative_tokens))


def expand_spec_rows(scheduled) -> tuple[list, dict | None]:
    """Speculative decoding: a request verifying k drafts becomes k + 1 one-token rows
    (row j feeds token j at position c + j with the same block table; its
    spec_token_ids are the drafts before it, its output_index counts them). So the
    verify step is an ordinary decode step, every row sampled as plain decoding
    samples it: the same kernels, the same per-row randomness, and the drafts' KV is
    written before any row's attention reads it. Returns (rows, request id -> (first
    row, drafts)), or (scheduled, None) when nothing speculates."""
    if not any(r.spec_token_ids for r in scheduled):
        return scheduled, None
    rows, spec = [], {}
    for r in scheduled:
        drafts = r.spec_token_ids
        if not drafts:
            rows.append(r)
            continue
        spec[r.request_id] = (len(rows), drafts)
        rows += [dataclasses.replace(r, token_ids=[r.token_ids[j]],
                                     num_computed_tokens=r.num_computed_tokens + j,
                                     output_index=r.output_index + j,
                                     spec_token_ids=drafts[:j])
                 for j in range(len(drafts) + 1)]
    return rows, spec


def output_tokens(rows, reqs) -> list:
    """Each row's output tokens for the penalties: a verify row's include the drafts
    before it."""
    return [q.output_token_ids + r.spec_token_ids if r.spec_token_ids else q.output_token_ids
            for q, r in zip(reqs, rows)]


def prompt_targets(scheduled, requests, num_tokens: int):
    """i32[T]: each prompt token's successor, for chunks of prompt_logprobs
    requests; None when no scheduled chunk needs prompt logprobs."""
    targets, off = None, 0
    for r in scheduled:
        req, n = requests[r.request_id], len(r.token_ids)
        prompt = req.prompt_token_ids
        if (req.sampling_params.prompt_logprobs is not None
                and r.num_computed_tokens < len(prompt) - 1):
            if targets is None:
                targets = np.zeros(num_tokens, np.int32)
            for j in range(n):
                pos = r.num_computed_tokens + j
                if pos + 1 < len(prompt):
                    targets[off + j] = prompt[pos + 1]
        off += n
    return targets


def split_prompt_logprobs(scheduled, requests, out):
    """id -> [(position of the scored prompt token, logprob, rank, top ids, top lps)]."""
    logprob, rank, top_ids, top_lps = out
    res, off = {}, 0
    for r in scheduled:
        req, n = requests[r.request_id], len(r.token_ids)
        if req.sampling_params.prompt_logprobs is not None:
            rows = []
            for j in range(n):
                pos = r.num_computed_tokens + j + 1
                if pos < len(req.prompt_token_ids):
                    t = off + j
                    rows.append((pos, float(logprob[t]), int(rank[t]),
                                 top_ids[t].tolist(), top_lps[t].tolist()))
            res[r.request_id] = rows
        off += n
    return res
