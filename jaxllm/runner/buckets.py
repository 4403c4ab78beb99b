"""Bucketed shapes: every step pads to one of a few (tokens, sequences) shapes so the
jitted step is compiled once per bucket at warm-up and never again."""
from __future__ import annotations

from dataclasses import dataclass


def powers_of_two(lo: int, hi: int) -> list[int]:
    """lo, 2lo, 4lo, ... and finally hi itself (hi need not be a power of two)."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return out


def pick(buckets: list[int], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} is above the largest bucket {buckets[-1]}")


@dataclass(frozen=True)
class BucketPlan:
    """Decode-only steps pad tokens and sequences to one `seq_buckets` size (T == S);
    every other step pads tokens to a `token_buckets` size and sequences to
    `max_seqs`, so the number of compiled shapes is len(seq) + len(token), not their
    product."""
    token_buckets: tuple[int, ...]
    seq_buckets: tuple[int, ...]

    @classmethod
    def build(cls, max_num_batched_tokens: int, max_num_seqs: int, min_bucket: int = 8):
        max_seqs = min(max_num_seqs, max_num_batched_tokens)
        seqs = powers_of_two(min(min_bucket, max_seqs), max_seqs)
        toks = powers_of_two(min(max(16, min_bucket), max_num_batched_tokens),
                             max_num_batched_tokens)
        return cls(tuple(toks), tuple(seqs))

    @property
    def max_seqs(self) -> int:
        return self.seq_buckets[-1]

    def shape_for(self, num_tokens: int, num_seqs: int, decode_only: bool,
                  ready=None) -> tuple[int, int, bool]:
        """(padded tokens, padded sequences, decode_only). `ready(("step", T, S,
        decode_only))`: whether that step can run now; while the natural bucket's
        program is still compiling, a larger ready bucket is taken (a decode step may
        run as a mixed step), else the natural one (whose caller then waits)."""
        if decode_only:
            s = pick(list(self.seq_buckets), num_seqs)
            if ready is None or ready(("step", s, s, True)):
                return s, s, True
            for b in self.seq_buckets:
                if b > s and ready(("step", b, b, True)):
                    return b, b, True
            t = pick(list(self.token_buckets), num_tokens)
            if not ready(("step", t, self.max_seqs, False)):
                t = next((b for b in self.token_buckets
                          if b > t and ready(("step", b, self.max_seqs, False))), None)
                if t is None:
                    return s, s, True
            return t, self.max_seqs, False
        t = pick(list(self.token_buckets), num_tokens)
        if ready is not None and not ready(("step", t, self.max_seqs, False)):
            t = next((b for b in self.token_buckets
                      if b > t and ready(("step", b, self.max_seqs, False))), t)
        return t, self.max_seqs, False

    def all_shapes(self) -> list[tuple[int, int, bool]]:
        shapes = [(s, s, True) for s in self.seq_buckets]
        shapes += [(t, self.max_seqs, False) for t in self.token_buckets]
        return shapes
