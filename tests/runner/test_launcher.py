"""Steps launched on the runner's launcher thread (runner/launcher.py): launches run in
the order they were handed over, their errors reach the engine thread, and an engine
whose steps go through the launcher gives exactly the tokens of one that launches them
itself (greedy, seeded sampling, n > 1, a grammar's deferred sampler)."""
from __future__ import annotations

import threading
import time

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.runner.launcher import Launcher, wait_launched
from jaxllm.sampling_params import StructuredOutputsParams


class _Handle:
    launched = None


def test_launches_run_in_order_and_submit_returns_at_the_model():
    launcher, order, handles = Launcher(), [], []
    try:
        for i in range(5):
            def dispatch(at_model, i=i):
                time.sleep(0.01 * (5 - i))           # earlier ones take longer
                order.append(("before", i))
                at_model()
                time.sleep(0.02)
                order.append(("after", i))
            handle = _Handle()
            launcher.submit(handle, dispatch)
            assert ("before", i) in order             # returned once at the model
            handles.append(handle)
        launcher.join()
        assert [x for x in order if x[0] == "after"] == [("after", i) for i in range(5)]
        assert all(h.launched.done() for h in handles)
    finally:
        launcher.shutdown()


def test_a_failed_launch_raises_on_the_engine_thread():
    launcher = Launcher()
    try:
        def dispatch(at_model):
            at_model()
            raise RuntimeError("device lost")
        handle = _Handle()
        launcher.submit(handle, dispatch)
        with pytest.raises(RuntimeError, match="device lost"):
            wait_launched(handle)
        with pytest.raises(RuntimeError, match="device lost"):
            launcher.join()
        launcher.join()                               # reported once
    finally:
        launcher.shutdown()


def test_wait_launched_on_the_launcher_thread_does_not_wait_for_itself():
    launcher, seen = Launcher(), []
    try:
        handle = _Handle()

        def dispatch(at_model):
            at_model()
            wait_launched(handle)                     # its own launch: no deadlock
            seen.append(threading.current_thread().name)
        launcher.submit(handle, dispatch)
        launcher.join()
        assert seen == ["jaxllm-launch_0"]
    finally:
        launcher.shutdown()


def test_launcher_gives_the_tokens_of_the_engine_thread(tiny_model):
    folder, _ = tiny_model("llama")
    # Warmed up (not enforce_eager): only steps whose program has run go through the
    # launcher.
    llm = LLM(folder, dtype="float32", max_model_len=128, max_num_seqs=8,
              max_num_batched_tokens=64)
    runner = llm.llm_engine.engine_core.executor.runner
    assert isinstance(runner.launcher, Launcher)
    launched = []
    submit = runner.launcher.submit
    runner.launcher.submit = lambda handle, dispatch: (launched.append(1),
                                                       submit(handle, dispatch))
    prompts = [{"prompt_token_ids": [5 + i, 17, 33 + 2 * i, 9, 40 + i]} for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=20, seed=5, n=2, max_tokens=10,
                             ignore_eos=True),
              SamplingParams(temperature=1.0, seed=7, max_tokens=10,
                             structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)]

    def tokens():
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [[list(c.token_ids) for c in o.outputs] for o in outs]
    with_launcher = tokens()
    assert launched, "no step went through the launcher"
    runner.launcher = None
    assert tokens() == with_launcher
