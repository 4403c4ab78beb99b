"""Prompt lookup (vLLM's `method: "ngram"`): draft the tokens that followed an earlier
occurrence of the request's last n tokens.

Which occurrence, as vLLM's NgramProposer: the longest n in
[prompt_lookup_min, prompt_lookup_max] for which the last n tokens occur earlier, and
of those occurrences the earliest one. An occurrence must end before the last token
(at least one token follows it), so the suffix never matches itself; it may overlap
the suffix (in "a b a b a" the 3-gram "a b a" at 0 overlaps the one at 2 and
proposes "b a"). The drafts are the tokens after the occurrence, at most
`num_drafts`, fewer when the sequence ends first.

Host-side numpy: one comparison over the sequence (the positions holding the last
token), then work on those candidates only, per n; ~20 us at 4k tokens. Converting
a 4k-token Python list to an array costs more (55-100 us), so given request ids the
proposer keeps each request's tokens in an array of its own and copies only the
tokens appended since its last call. A stale copy could only cost acceptance, never
output: the target verifies every draft.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

# Token arrays kept for requests not seen for a while are dropped past this many, so
# a caller that never calls forget() holds bounded memory.
MAX_CACHED_REQUESTS = 1024


class NgramProposer:
    """config: a SpeculativeConfig with method "ngram" (its prompt_lookup_min/max)."""

    def __init__(self, config):
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.k = config.num_speculative_tokens
        self._tokens: OrderedDict[str, _TokenArray] = OrderedDict()

    def propose(self, token_ids: Sequence[int] | np.ndarray, num_drafts: int | None = None,
                request_id: str | None = None) -> list[int]:
        """Up to `num_drafts` draft tokens (default: num_speculative_tokens) for a
        request whose tokens (prompt then outputs) are `token_ids`; [] when no n-gram
        of the allowed lengths recurs. An int array is read without a copy; a list
        with its `request_id` is copied incrementally (see the module doc)."""
        num_drafts = self.k if num_drafts is None else num_drafts
        if num_drafts <= 0 or len(token_ids) <= self.min_n:
            return []
        t = self._as_array(token_ids, request_id)
        start = _earliest_longest_match(t, self.min_n, self.max_n)
        if start < 0:
            return []
        return t[start:start + num_drafts].tolist()

    def propose_batch(self, token_ids: Sequence[Sequence[int] | np.ndarray],
                      num_drafts: Sequence[int] | int | None = None,
                      request_ids: Sequence[str] | None = None) -> list[list[int]]:
        """`propose` for each request; `num_drafts`: one per request, or one for all."""
        n = len(token_ids)
        if num_drafts is None or isinstance(num_drafts, int):
            num_drafts = [num_drafts] * n
        ids = [None] * n if request_ids is None else request_ids
        return [self.propose(t, k, r) for t, k, r in zip(token_ids, num_drafts, ids, strict=True)]

    def forget(self, request_ids: Sequence[str]) -> None:
        """Drop the token arrays of finished (or preempted) requests."""
        for request_id in request_ids:
            self._tokens.pop(request_id, None)

    def _as_array(self, token_ids, request_id: str | None) -> np.ndarray:
        if request_id is None or isinstance(token_ids, np.ndarray):
            return np.asarray(token_ids)
        cached = self._tokens.get(request_id)
        if cached is None:
            cached = self._tokens[request_id] = _TokenArray()
            if len(self._tokens) > MAX_CACHED_REQUESTS:
                self._tokens.popitem(last=False)
        else:
            self._tokens.move_to_end(request_id)
        return cached.update(token_ids)


class _TokenArray:
    """A growing int32 copy of one request's tokens (which only grow while it runs:
    a stop string's cut ends the request)."""

    def __init__(self):
        self.array = np.empty(0, np.int32)
        self.num_tokens = 0

    def update(self, token_ids: Sequence[int]) -> np.ndarray:
        n, length = self.num_tokens, len(token_ids)
        # Shorter, or the last copied token changed: the list was cut, copy it anew.
        if length < n or (n and token_ids[n - 1] != self.array[n - 1]):
            n = 0
        if length > self.array.shape[0]:
            grown = np.empty(max(2 * length, 256), np.int32)
            grown[:n] = self.array[:n]
            self.array = grown
        self.array[n:length] = token_ids[n:length]
        self.num_tokens = length
        return self.array[:length]


def _earliest_longest_match(t: np.ndarray, min_n: int, max_n: int) -> int:
    """Where the drafts start: the index after the earliest occurrence of the longest
    recurring suffix n-gram (min_n <= n <= max_n), or -1.

    Candidates are the end positions e < L - 1 of an occurrence; an occurrence of
    length n ending at e has t[e - q] == t[L - 1 - q] for q < n. Filtering the
    candidates by one more q each round leaves those of length >= q + 1, earliest
    first (np.flatnonzero keeps them sorted)."""
    length = t.shape[0]
    ends = np.flatnonzero(t[:length - 1] == t[length - 1])
    best = -1
    for n in range(1, min(max_n, length - 1) + 1):
        if n > 1:
            q = n - 1
            ends = ends[ends >= q]
            ends = ends[t[ends - q] == t[length - 1 - q]]
        if ends.size == 0:
            break
        if n >= min_n:
            best = int(ends[0]) + 1
    return best
