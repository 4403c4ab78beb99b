"""When speculation pays, per step and per request (pure Python, no jax).

A step that verifies drafts is synchronous (the drafts need the tokens just read
back) and carries k + 1 rows per drafting request, so it costs more than the plain
async step it replaces, and every running request pays that, drafting or not.
Measured on the H200 (scripts/bench_spec.py, Llama-3.1-8B shape, bf16, k = 4): a
verify step took 1.70x a plain async step at batch 1 (7.2 against 4.2 ms; nearly all
of it the synchronous host work, the extra rows are almost free there), 2.13x at 8
and 3.43x at 64. So a step drafts when the drafting requests' expected accepted
tokens cover that for the whole batch:

    sum over drafting requests of E[accepted]  >=  B * (cost_ratio(B) - 1)

with E[accepted] a request's moving average of accepted drafts per verify step
(optimistic at first: k). Never above `disable_by_batch_size` running requests
(vLLM's key). A request that falls below the bar is probed now and then (a code
block or a quoted passage can start later), at intervals that double after each
probe that finds nothing, so a workload whose drafts never land pays a few
synchronous steps in total. A step with no drafting request runs as a plain async
step.
"""
from __future__ import annotations

import math

# Weight of the newest verify step in a request's average.
EMA_WEIGHT = 0.5
# (batch, verify step / plain async step) with k = 4, measured on the H200 (above).
VERIFY_COST_RATIO = ((1, 1.70), (8, 2.13), (64, 3.43))
FIRST_PROBE_INTERVAL, MAX_PROBE_INTERVAL = 16, 512


def cost_ratio(batch: int) -> float:
    """VERIFY_COST_RATIO interpolated over log(batch), held flat past its ends."""
    pts = VERIFY_COST_RATIO
    if batch <= pts[0][0]:
        return pts[0][1]
    for (b0, r0), (b1, r1) in zip(pts, pts[1:]):
        if batch <= b1:
            f = math.log(batch / b0) / math.log(b1 / b0)
            return r0 + f * (r1 - r0)
    return pts[-1][1]


def spec_policy(spec_config) -> "SpecPolicy":
    return SpecPolicy(spec_config.num_speculative_tokens,
                      spec_config.effective_disable_by_batch_size)


class _State:
    __slots__ = ("avg", "interval", "next_probe")

    def __init__(self, k: int):
        self.avg, self.interval, self.next_probe = float(k), FIRST_PROBE_INTERVAL, 0


class SpecPolicy:
    def __init__(self, num_speculative_tokens: int, disable_by_batch_size: int,
                 cost=cost_ratio):
        self.k = num_speculative_tokens
        self.disable_by_batch_size = disable_by_batch_size
        self.cost = cost
        self._states: dict[str, _State] = {}
        self._steps = 0

    def _state(self, request_id: str) -> _State:
        st = self._states.get(request_id)
        if st is None:
            st = self._states[request_id] = _State(self.k)
        return st

    def drafting(self, running: list, decoding, again: bool = False) -> list:
        """The running requests to draft for this step ([] = a plain step).
        `decoding(request)`: whether it decodes next and may speculate. `again`: the
        same step asks once more (after reading the previous step back)."""
        self._steps += not again
        batch = len(running)
        if not running or batch > self.disable_by_batch_size:
            return []
        need = batch * (self.cost(batch) - 1)
        cands = [(r, self._state(r.request_id)) for r in running if decoding(r)]
        expected = sum(st.avg for _, st in cands)
        if expected >= need:
            return [r for r, _ in cands]
        return [r for r, st in cands if self._steps >= st.next_probe]

    def observe(self, request_id: str, num_accepted: int) -> None:
        """A verify step (or an empty proposal: 0) for the request."""
        st = self._state(request_id)
        st.avg = (1 - EMA_WEIGHT) * st.avg + EMA_WEIGHT * num_accepted
        # Below the bar, the next probe waits longer each time one finds nothing.
        st.interval = (min(2 * st.interval, MAX_PROBE_INTERVAL) if not num_accepted
                       else FIRST_PROBE_INTERVAL)
        st.next_probe = self._steps + st.interval

    def forget(self, request_ids) -> None:
        for rid in request_ids:
            self._states.pop(rid, None)
