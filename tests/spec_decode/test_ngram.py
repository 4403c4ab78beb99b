"""NgramProposer on hand-made sequences, and against a brute-force lookup."""
from __future__ import annotations

import random

import numpy as np
import pytest

from jaxllm.spec_decode.config import SpeculativeConfig
from jaxllm.spec_decode.ngram_proposer import MAX_CACHED_REQUESTS, NgramProposer


def proposer(lo: int, hi: int, k: int = 4) -> NgramProposer:
    return NgramProposer(SpeculativeConfig(num_speculative_tokens=k, method="ngram",
                                           prompt_lookup_min=lo, prompt_lookup_max=hi))


def brute_force(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """Longest n first, earliest occurrence, ending before the last token."""
    size = len(tokens)
    for n in range(hi, lo - 1, -1):
        if n >= size:
            continue
        suffix = tokens[size - n:]
        for start in range(0, size - n):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_the_longest_match_wins_over_a_shorter_later_one():
    # "7 8 9" ends the sequence; "8 9" alone occurs at 0 (then 1), "7 8 9" at 4 (then 2).
    tokens = [8, 9, 1, 5, 7, 8, 9, 2, 3, 7, 8, 9]
    assert proposer(2, 3).propose(tokens, 2) == [2, 3]
    # Capped at 2, the earliest 2-gram "8 9" is at 0.
    assert proposer(2, 2).propose(tokens, 2) == [1, 5]


def test_the_earliest_of_equally_long_occurrences_wins():
    tokens = [4, 5, 10, 4, 5, 11, 4, 5]
    assert proposer(2, 2).propose(tokens, 1) == [10]


def test_min_is_respected():
    # Only "3" recurs (a 1-gram); with min 2 there is nothing to propose.
    tokens = [3, 1, 2, 3]
    assert proposer(1, 4).propose(tokens, 2) == [1, 2]
    assert proposer(2, 4).propose(tokens, 2) == []


def test_max_caps_the_ngram_length():
    # The 4-gram "1 2 3 4" recurs at 0 (followed by 50); the 3-gram "2 3 4" first at 6.
    tokens = [2, 3, 4, 60, 0, 0, 2, 3, 4, 70, 1, 2, 3, 4, 50, 1, 2, 3, 4]
    assert proposer(1, 4).propose(tokens, 1) == [50]
    assert proposer(1, 3).propose(tokens, 1) == [60]


def test_num_drafts_caps_the_proposal_and_the_sequence_end_shortens_it():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    p = proposer(2, 2, k=3)
    assert p.propose(tokens, 2) == [3, 4]
    assert p.propose(tokens) == [3, 4, 5]          # default: num_speculative_tokens
    assert p.propose(tokens, 10) == [3, 4, 5, 6, 1, 2]
    assert p.propose(tokens, 0) == []
    # An overlapping occurrence: "a b a" at 0 overlaps the suffix at 2.
    assert proposer(3, 3).propose([1, 2, 1, 2, 1], 5) == [2, 1]


def test_no_match_and_the_suffix_itself_never_matches():
    assert proposer(1, 3).propose([1, 2, 3, 4], 3) == []
    # The last two tokens occur only as the suffix itself.
    assert proposer(2, 2).propose([9, 1, 2], 3) == []
    # Too short for the min n-gram to occur twice.
    assert proposer(3, 3).propose([5, 5, 5], 2) == []
    assert proposer(1, 1).propose([5], 2) == []
    # A match that ends at the last-but-one token still proposes the last token.
    assert proposer(1, 1).propose([5, 5], 2) == [5]


def test_agrees_with_brute_force_on_random_sequences():
    rng = random.Random(0)
    for _ in range(3000):
        tokens = [rng.randrange(rng.randint(1, 4)) for _ in range(rng.randint(1, 30))]
        lo = rng.randint(1, 4)
        hi, k = rng.randint(lo, 6), rng.randint(1, 5)
        p = proposer(lo, hi, k)
        expected = brute_force(tokens, lo, hi, k)
        assert p.propose(tokens, k) == expected, (tokens, lo, hi, k)
        assert p.propose(np.array(tokens, np.int64), k) == expected


def test_batch_per_request_caps_and_one_cap_for_all():
    p = proposer(1, 2)
    seqs = [[1, 2, 3, 1, 2], [7, 8], np.array([4, 4, 4, 4])]
    assert p.propose_batch(seqs, [2, 3, 1]) == [[3, 1], [], [4]]
    assert p.propose_batch(seqs, 1) == [[3], [], [4]]
    with pytest.raises(ValueError):
        p.propose_batch(seqs, [1, 2])


def test_request_ids_copy_appended_tokens_and_see_a_cut_list():
    p = proposer(1, 2)
    tokens = [1, 2, 3, 9, 9, 1, 2]
    assert p.propose(tokens, 2, request_id="a") == [3, 9]
    tokens += [5, 6, 5, 6]              # appended: "5 6" first at 7
    assert p.propose(tokens, 2, request_id="a") == [5, 6]
    # Cut and regrown past its old length with other tokens: copied anew. Read from
    # the stale copy ([1 2 3 9 9 1 2 5 6 5 6 7]) it would propose nothing.
    del tokens[5:]
    tokens += [7, 8, 0, 0, 0, 0, 7]
    assert p.propose(tokens, 2, request_id="a") == brute_force(tokens, 1, 2, 2) == [8, 0]
    # Cut shorter: copied anew too.
    del tokens[9:]                       # [1 2 3 9 9 7 8 0 0]: "0" at 7
    assert p.propose_batch([tokens], 2, request_ids=["a"]) == [[0]]
    p.forget(["a", "never-seen"])
    assert "a" not in p._tokens
    assert p.propose(tokens, 2, request_id="a") == [0]


def test_cached_requests_are_bounded():
    p = proposer(1, 1)
    for i in range(MAX_CACHED_REQUESTS + 5):
        p.propose([1, 2, 1], 1, request_id=str(i))
    assert len(p._tokens) == MAX_CACHED_REQUESTS
    assert "0" not in p._tokens and str(MAX_CACHED_REQUESTS + 4) in p._tokens
