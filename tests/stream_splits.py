"""The ways a reply can arrive in a stream, for the parser tests."""
from __future__ import annotations

import random


def splits(text: str):
    """Every split into two pieces, one character at a time, and a few token-like
    random splits (1-7 characters)."""
    for k in range(len(text) + 1):
        yield [text[:k], text[k:]]
    yield list(text)
    rng = random.Random(len(text))
    for _ in range(3):
        pieces, k = [], 0
        while k < len(text):
            step = rng.randint(1, 7)
            pieces.append(text[k:k + step])
            k += step
        yield pieces
