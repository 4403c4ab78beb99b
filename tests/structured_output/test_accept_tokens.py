"""StructuredOutputManager's per-step pieces: accept_tokens (a step's matchers
advanced in one llguidance call, ahead of the scheduler's accept(token), leave every
request where accepting one by one does, a rejected token included), the reused mask
buffers, and validation once per constraint."""
from __future__ import annotations

import time

import pytest

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
        rows = manager.constrained_rows(
            scheduled, {f"r{i}": _Req(g) for i, g in enumerate(ahead)})
        assert [(i, rid) for i, rid, _ in rows] == list(enumerate(tokens))
        manager.accept_tokens(rows, tokens)
        assert all(g._accepted_ahead is not None for g in ahead)     # consumed ahead
        for rid, g, h in zip(tokens, ahead, alone):
            assert g.accept(tokens[rid]) == h.accept(tokens[rid])
            assert (g.error is None) == (h.error is None)
        for g, h in zip(ahead, alone):      # the matchers advanced exactly once
            if g.error is None:
                assert g.accept(b) and h.accept(b) and g.accept(c) and h.accept(c)
                assert g.is_terminated() and h.is_terminated()
    finally:
        manager.shutdown()


def test_mask_buffers_alternate_and_reset_stale_rows():
    """Two buffers per height in turn; a buffer taken again has every row it filled
    before and does not fill now back to all ones (the rows filled now llguidance
    writes whole)."""
    buffers = manager_module.MaskBuffers(width=3)
    first = buffers.take(4, [0, 2])
    first[[0, 2]] = 7
    second = buffers.take(4, [1])
    assert second is not first and (second == -1).all()
    second[1] = 5
    assert buffers.take(8, [0]).shape == (8, 3)           # another height, its own pair
    again = buffers.take(4, [2, 3])
    assert again is first
    assert (again[0] == -1).all() and (again[2] == 7).all() and (again[[1, 3]] == -1).all()
    assert buffers.take(4, []) is second and (second == -1).all()


def test_a_constraint_is_validated_once(monkeypatch):
    """add_request's check runs once per distinct constraint; a bad one raises every time."""
    from jaxllm.structured_output import backend_guidance
    calls = []
    real = backend_guidance.validate
    monkeypatch.setattr(backend_guidance, "validate",
                        lambda params, tok=None: calls.append(params.kind) or real(params, tok))
    tok = get_tokenizer(None)
    manager = StructuredOutputManager(tok, len(tok), tok.eos_token_id)
    try:
        for _ in range(3):
            manager.validate(StructuredOutputsParams(regex="ab+c"))
        manager.validate(StructuredOutputsParams(regex="x+"))
        assert len(calls) == 2
        for _ in range(2):
            with pytest.raises(ValueError, match="structured_outputs.regex"):
                manager.validate(StructuredOutputsParams(regex="(ab"))
        assert len(calls) == 4
        # Not JSON at all (a set, from the Python API): still the field's ValueError.
        with pytest.raises(ValueError, match="structured_outputs.json"):
            manager.validate(StructuredOutputsParams(json={"enum": {"a", "b"}}))
    finally:
        manager.shutdown()
