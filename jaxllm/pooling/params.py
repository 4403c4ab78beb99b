"""PoolingParams: vLLM's per-request settings of a pooling (embedding) request."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolingParams:
    """``truncate_prompt_tokens``: None = an over-long input is an error; -1 = keep the
    model's maximum; k = keep only the last k tokens (left truncation, as vLLM).
    ``dimensions``: keep the first d dimensions (Matryoshka models only), normalized
    after the cut. ``normalize``: None = the model's own setting (sentence-transformers'
    Normalize module, or on by default as vLLM's embedding pooler)."""
    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self):
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t == 0 or t < -1):
            raise ValueError(f"PoolingParams.truncate_prompt_tokens={t!r}: use -1 (the model's "
                             "maximum) or a token count >= 1")
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError(f"PoolingParams.dimensions={d!r}: Dimensions must be greater than 0")
