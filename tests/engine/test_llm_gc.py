"""LLM.generate's loop keeps the heap that existed before the call out of Python's
collector while it steps, and hands it back after, also when a step raises."""
import gc

import pytest

from jaxllm.entrypoints.llm import LLM
from jaxllm.outputs import CompletionOutput, RequestOutput


class FakeEngine:
    def __init__(self, ids, fail_at=None):
        self.ids, self.steps, self.fail_at = list(ids), 0, fail_at
        self.freeze_counts, self.aborted = [], []

    def has_unfinished_requests(self):
        return bool(self.ids)

    def step(self):
        self.freeze_counts.append(gc.get_freeze_count())
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("device lost")
        rid = self.ids.pop(0)
        return [RequestOutput(rid, "", [1], None, [CompletionOutput(0, "", [2], None, None)],
                              finished=True)]

    def abort_request(self, ids):
        self.aborted += ids


def bare_llm(engine) -> LLM:
    llm = LLM.__new__(LLM)
    llm.llm_engine = engine
    return llm


def test_heap_frozen_while_stepping_and_unfrozen_after():
    assert gc.get_freeze_count() == 0
    engine = FakeEngine(["a", "b", "c"])
    outs = bare_llm(engine)._run_engine(["a", "b", "c"], use_tqdm=False)
    assert [o.request_id for o in outs] == ["a", "b", "c"]
    assert min(engine.freeze_counts) > 1000        # the test process's own heap
    assert gc.get_freeze_count() == 0


def test_unfrozen_when_a_step_raises():
    engine = FakeEngine(["a", "b"], fail_at=2)
    with pytest.raises(RuntimeError, match="device lost"):
        bare_llm(engine)._run_engine(["a", "b"], use_tqdm=False)
    assert engine.aborted == ["b"]
    assert gc.get_freeze_count() == 0


def test_a_heap_frozen_by_the_caller_stays_frozen():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        engine = FakeEngine(["a"])
        bare_llm(engine)._run_engine(["a"], use_tqdm=False)
        # Still frozen (objects freed meanwhile leave the count, so not exactly equal).
        assert gc.get_freeze_count() > frozen // 2 > 0
    finally:
        gc.unfreeze()
