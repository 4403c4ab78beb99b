"""StructuredOutputManager.accept_tokens: a step's matchers advanced in one llguidance
call, ahead of the scheduler's accept(token), leave every request where accepting
one by one does, a rejected token included."""
from __future__ import annotations

import time

from jaxllm.engine.scheduler import ScheduledRequest
from jaxllm.sampling_params import StructuredOutputsParams
from jaxllm.structured_output import manager as manager_module
from jaxllm.structured_output.manager import StructuredOutputManager
from jaxllm.tokenizer import get_tokenizer


class _Req:
    def __init__(self, grammar):
        self.structured_output_request = grammar


def _ready(manager, n: int, regex: str) -> list:
    grammars = [manager.new_request(f"r{i}", StructuredOutputsParams(regex=regex))
                for i in range(n)]
    deadline = time.monotonic() + 60
    while not all(g.is_ready() for g in grammars):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return grammars


def test_accept_tokens_matches_one_by_one(monkeypatch):
    monkeypatch.setattr(manager_module, "PARALLEL_ACCEPT_ROWS", 2)
    tok = get_tokenizer(None)
    manager = StructuredOutputManager(tok, len(tok), tok.eos_token_id)
    try:
        ahead, alone = _ready(manager, 4, "ab+c"), _ready(manager, 4, "ab+c")
        a, b, c = (tok.convert_tokens_to_ids(x) for x in "abc")
        tokens = {"r0": a, "r1": a, "r2": b, "r3": a}     # r2's is rejected
        scheduled = [ScheduledRequest(rid, [-1], 0, [], True, 0) for rid in tokens]
        manager.accept_tokens(scheduled, {f"r{i}": _Req(g) for i, g in enumerate(ahead)},
                              tokens)
        for rid, g, h in zip(tokens, ahead, alone):
            assert g.accept(tokens[rid]) == h.accept(tokens[rid])
            assert (g.error is None) == (h.error is None)
        for g, h in zip(ahead, alone):      # the matchers advanced exactly once
            if g.error is None:
                assert g.accept(b) and h.accept(b) and g.accept(c) and h.accept(c)
                assert g.is_terminated() and h.is_terminated()
    finally:
        manager.shutdown()
