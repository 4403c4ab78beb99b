"""When speculation pays, per step and per request (pure Python, no jax).

A verify step is synchronous (the drafts need the tokens just read back) and has
k + 1 rows per speculating request, so it costs more than the plain async step it
replaces; it pays when the accepted drafts cover that. Two rules:
- more than `disable_by_batch_size` running requests: no speculation (vLLM's key;
  at large batches the decode step is no longer bound by reading the weights, so
  extra rows cost their full share);
- a request whose recent verify steps accepted fewer than `min_accepted` drafts on
  average (an exponential moving average, optimistic at first: k) gets no drafts,
  except one probe every `probe_interval` steps so a change of pattern (a code
  block, a quoted passage) is noticed. A step in which no request drafts runs as a
  plain async step.
"""
from __future__ import annotations

# Weight of the newest verify step in a request's acceptance average.
EMA_WEIGHT = 0.3
# Accepted drafts per verify step below which a request stops drafting. A verify
# step with no draft accepted still yields its one token, so this only has to
# cover the verify step's extra cost over a plain async step.
MIN_ACCEPTED = 0.5


def spec_policy(spec_config) -> "SpecPolicy":
    from jaxllm.spec_decode.config import DEFAULT_DISABLE_BY_BATCH_SIZE
    return SpecPolicy(spec_config.num_speculative_tokens,
                      spec_config.disable_by_batch_size or DEFAULT_DISABLE_BY_BATCH_SIZE,
                      MIN_ACCEPTED)


class SpecPolicy:
    def __init__(self, num_speculative_tokens: int, disable_by_batch_size: int,
                 min_accepted: float, probe_interval: int = 16):
        self.k = num_speculative_tokens
        self.disable_by_batch_size = disable_by_batch_size
        self.min_accepted = min_accepted
        self.probe_interval = probe_interval
        self._accepted: dict[str, float] = {}     # request id -> acceptance average
        self._steps = 0

    def drafting(self, running: list, decoding, again: bool = False) -> list:
        """The running requests to draft for this step ([] = a plain step).
        `decoding(request)`: whether it decodes next and may speculate. `again`: the
        same step asks once more (after reading the previous step back)."""
        self._steps += not again
        if not running or len(running) > self.disable_by_batch_size:
            return []
        probe = self._steps % self.probe_interval == 0
        return [r for r in running if decoding(r) and (
            probe or self._accepted.get(r.request_id, self.k) >= self.min_accepted)]

    def observe(self, request_id: str, num_accepted: int) -> None:
        """A verify step (or an empty proposal: 0) for the request."""
        old = self._accepted.get(request_id, self.k)
        self._accepted[request_id] = (1 - EMA_WEIGHT) * old + EMA_WEIGHT * num_accepted

    def forget(self, request_ids) -> None:
        for rid in request_ids:
            self._accepted.pop(rid, None)
