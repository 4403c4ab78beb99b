"""Host side of the sampler's inputs: SamplingParams -> SamplingMetadata + SamplerFlags.

A request's row of ``SamplingMetadata.rows`` is the same every step but for its
output_index, so the model runner keeps each scheduled request's ``RowEntry`` (the
row's constant words and what the flags need from it) from one step to the next, and
a step only stacks the entries and writes the output indices. Rebuilding the rows
from SamplingParams cost ~0.4 ms per step at 256 rows on this project's CPU, the
cached build a fraction of it.
"""
from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from jaxllm.runner import sampler
from jaxllm.runner.top_k_top_p import fits_small_top_k
from jaxllm.sampling_params import MAX_LOGPROBS, SamplingParams

_GREEDY, _PENALTIES, _FILTERS, _LOGPROBS, _NOT_SMALL, _MIN_TOKENS = (1 << i for i in range(6))


class RowEntry(NamedTuple):
    """One request's constant row words (i32[NUM_COLUMNS] as bytes, output_index 0:
    a step joins them into its rows at once), its property bits (_GREEDY ...), and
    what it was built from."""

    row: bytes
    bits: int
    params: SamplingParams
    fallback_seed: int | None


def kept_entries(cache: dict, requests, vocab_size: int, fallback_seeds: dict):
    """(the entries of `requests` in order, the cache for the next step: these
    requests' entries by id). An entry is kept from `cache` when it was built from
    equal params and the same seed (a request id used again never inherits a row;
    equal, not identical: a multi-host follower unpickles new params every step)."""
    kept: dict = {}
    entries = []
    for q in requests:
        rid, p = q.request_id, q.sampling_params
        e = kept.get(rid)             # a request's rows of one step share one entry
        if e is None:
            e = cache.get(rid)
            seed = fallback_seeds[rid]
            if e is None or e.fallback_seed != seed or not (e.params is p or e.params == p):
                e = row_entry(p, vocab_size, seed)
            kept[rid] = e
        entries.append(e)
    return entries, kept


_TAIL = struct.Struct("<iiII")   # top_k, output_index, the seed's low and high words


def _pack_row(floats: list[float], top_k: int, seed: int) -> bytes:
    """One row's words in sampler._COLUMNS order: temperature, top_p, min_p, presence,
    frequency and repetition penalties (f32), top_k, output_index 0, the seed's words."""
    return (np.array(floats, np.float32).tobytes()
            + _TAIL.pack(top_k, 0, seed & 0xFFFFFFFF, seed >> 32))


# Greedy and neutral.
PADDING_ROW = np.frombuffer(_pack_row([0.0, 1.0, 0.0, 0.0, 0.0, 1.0], 0, 0), np.int32)


def row_entry(p: SamplingParams, vocab_size: int, fallback_seed: int | None,
              rng: np.random.Generator | None = None) -> RowEntry:
    """A request's entry. Its seed: ``p.seed``, else `fallback_seed`, else (a random
    row) one drawn from `rng`; argmax rows without one never read theirs."""
    top_k = min(p.top_k, vocab_size)
    seed = p.seed if p.seed is not None else fallback_seed
    if seed is None and not p.is_greedy:
        seed = int((rng or np.random.default_rng()).integers(0, 2**63))
    seed = 0 if seed is None else seed % 2**64   # negative ints: the same 64-bit space
    row = _pack_row([0.0 if p.is_greedy else p.temperature, p.top_p, p.min_p,
                     p.presence_penalty, p.frequency_penalty, p.repetition_penalty],
                    top_k, seed)
    small = fits_small_top_k(top_k, float(np.float32(p.top_p)))
    bits = (_GREEDY * p.is_greedy | _PENALTIES * p.uses_penalties
            | _FILTERS * p.uses_filters | _LOGPROBS * (p.logprobs is not None)
            | _NOT_SMALL * (not small) | _MIN_TOKENS * (p.min_tokens > 0))
    return RowEntry(row, bits, p, fallback_seed)


def from_params(params: Sequence[SamplingParams], output_indices: Sequence[int],
                prompt_token_lists: Sequence[Sequence[int]] | None,
                output_token_lists: Sequence[Sequence[int]] | None, pad_to_rows: int,
                vocab_size: int, *, fallback_seeds: Sequence[int] | None = None,
                eos_token_ids: Sequence[int] = ()):
    """(host SamplingMetadata, SamplerFlags) for N requests padded to S = pad_to_rows
    rows, built afresh. Padded rows are greedy and neutral. ``fallback_seeds[i]``
    seeds row i when ``params[i].seed`` is None (the engine draws one per request);
    without it a fresh random seed is drawn. Token lists are only read for rows that
    use penalties; their widths are padded to a power of two to bound recompiles."""
    entries = [row_entry(p, vocab_size, None if fallback_seeds is None else fallback_seeds[i])
               for i, p in enumerate(params)]
    return build(entries, output_indices, pad_to_rows, lambda: prompt_token_lists,
                 lambda: output_token_lists, eos_token_ids)


def dummy_metadata(rows: int) -> sampler.SamplingMetadata:
    """Metadata of `rows` padding rows (the warm-up's)."""
    return build([], [], rows, list, list)[0]


def build(entries: Sequence[RowEntry], output_indices: Sequence[int], pad_to_rows: int,
          prompt_token_lists: Callable[[], Sequence[Sequence[int]] | None],
          output_token_lists: Callable[[], Sequence[Sequence[int]] | None],
          eos_token_ids: Sequence[int] = ()):
    """(host SamplingMetadata, SamplerFlags) of N rows padded to S = pad_to_rows. The
    token lists are callables, called only when a row uses penalties."""
    n, s = len(entries), pad_to_rows
    if n > s:
        raise ValueError(f"{n} requests do not fit in pad_to_rows={s}")
    rows = np.empty((s, sampler.NUM_COLUMNS), np.int32)
    rows[n:] = PADDING_ROW
    any_bits, all_bits = 0, -1
    if n:
        rows[:n] = np.frombuffer(b"".join([e.row for e in entries]),
                                 np.int32).reshape(n, -1)
        rows[:n, sampler._COLUMNS["output_index"][0]] = output_indices
        for e in entries:
            any_bits |= e.bits
            all_bits &= e.bits
    params = [e.params for e in entries]
    # What _pad_token_lists makes of empty lists, without walking them.
    prompt = output = blocked = np.full((s, 1), -1, np.int32)
    penalties = bool(any_bits & _PENALTIES)
    if penalties:
        prompt = _pad_token_lists(_penalty_rows(params, prompt_token_lists()), s)
        output = _pad_token_lists(_penalty_rows(params, output_token_lists()), s)
    if any_bits & _MIN_TOKENS:
        blocked = _pad_token_lists(_blocked_token_lists(params, output_indices,
                                                        eos_token_ids), s)
    md = sampler.SamplingMetadata(rows=rows, prompt_tokens=prompt, output_tokens=output,
                                  blocked_tokens=blocked)
    filters = bool(any_bits & _FILTERS)
    flags = sampler.SamplerFlags(
        use_penalties=penalties or bool((md.blocked_tokens >= 0).any()),
        use_top_k_top_p_min_p=filters,
        num_logprobs=MAX_LOGPROBS if any_bits & _LOGPROBS else 0,
        all_greedy=n == 0 or bool(all_bits & _GREEDY),
        small_top_k=filters and not any_bits & _NOT_SMALL)
    return md, flags


def _penalty_rows(params: Sequence[SamplingParams],
                  token_lists: Sequence[Sequence[int]] | None) -> list[Sequence[int]]:
    """Token lists of the rows that use penalties; empty for the others."""
    if token_lists is None:
        raise ValueError("token lists are required when a request uses penalties")
    return [toks if p.uses_penalties else [] for p, toks in zip(params, token_lists)]


def _blocked_token_lists(params: Sequence[SamplingParams], output_indices: Sequence[int],
                         eos_token_ids: Sequence[int]) -> list[list[int]]:
    """Stop tokens each request may not sample yet, being below its min_tokens."""
    blocked = []
    for p, index in zip(params, output_indices):
        ids: list[int] = []
        if index < p.min_tokens:
            ids = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
        blocked.append(ids)
    return blocked


def _pad_token_lists(lists: Sequence[Sequence[int]], rows: int) -> np.ndarray:
    """i32[rows, L] padded with -1; L is a power of two >= the longest list (>= 1)."""
    longest = max(map(len, lists), default=0)
    width = 1 << max(longest - 1, 0).bit_length()
    out = np.full((rows, width), -1, np.int32)
    if longest:
        for i, toks in enumerate(lists):
            if toks:
                out[i, : len(toks)] = toks
    return out
