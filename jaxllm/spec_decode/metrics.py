"""Speculative-decoding counters, vLLM's SpecDecodingStats: how many proposals were
verified, how many draft tokens they held, how many of those were accepted, and how
often each draft position was.

The engine core owns one, cumulative since start (EngineCore.spec_stats); the
engine's stats snapshot carries a copy of it, and jaxllm/metrics.py exports it as
vLLM's vllm:spec_decode_* counters. From them, as in vLLM's dashboards:

    acceptance rate           num_accepted_tokens / num_draft_tokens
    mean acceptance length    1 + num_accepted_tokens / num_drafts  (the bonus token)
    acceptance at position i  num_accepted_tokens_per_pos[i] / num_drafts
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_spec_tokens: int               # k, the config's num_speculative_tokens
    num_drafts: int = 0                # proposals verified (one per request and step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [i]: proposals whose draft i was accepted (so its drafts 0..i were); length k.
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    @classmethod
    def new(cls, num_spec_tokens: int) -> "SpecDecodingStats":
        """vLLM's constructor."""
        return cls(num_spec_tokens)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verified proposal of `num_draft_tokens` drafts (at most k), of which
        the first `num_accepted` were accepted (the rest rejected at the first
        mismatch). A proposal of no drafts is no proposal and is not counted."""
        if num_draft_tokens <= 0:
            return
        if not 0 <= num_accepted <= num_draft_tokens <= self.num_spec_tokens:
            raise ValueError(f"observe({num_draft_tokens}, {num_accepted}): need 0 <= "
                             f"accepted <= drafts <= {self.num_spec_tokens}")
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        for i in range(num_accepted):
            per_pos[i] += 1

    observe_draft = observe     # vLLM's name

    def snapshot(self) -> "SpecDecodingStats":
        """A copy for a stats snapshot read on another thread or sent to another
        process while the engine goes on counting."""
        return dataclasses.replace(
            self, num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos))

    # ------------------------------------------------------------ derived values
    @property
    def acceptance_rate(self) -> float:
        """Accepted over drafted tokens; nan before any draft."""
        if not self.num_draft_tokens:
            return float("nan")
        return self.num_accepted_tokens / self.num_draft_tokens

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verify step emits per proposal, the target's own token included."""
        return 1.0 + self.num_accepted_tokens / max(self.num_drafts, 1)

    def acceptance_rate_per_pos(self) -> list[float]:
        return [n / max(self.num_drafts, 1) for n in self.num_accepted_tokens_per_pos]
