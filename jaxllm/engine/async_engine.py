"""The front end's old names, as thin constructors of ``AsyncLLM`` (async_llm.py), for
the scripts that still use them; new code uses AsyncLLM.

    AsyncLLMEngine(llm_engine)            == AsyncLLM.from_engine(llm_engine)
    MPAsyncLLMEngine(config, setup=...)   == AsyncLLM.from_config(config, multiprocess=True, ...)
"""
from __future__ import annotations

from jaxllm.engine.async_llm import AsyncLLM, EngineDeadError

__all__ = ["AsyncLLMEngine", "EngineDeadError", "MPAsyncLLMEngine"]


def AsyncLLMEngine(engine, metrics=None) -> AsyncLLM:  # noqa: N802 - the old class's name
    """The LLMEngine on a thread of this process."""
    return AsyncLLM.from_engine(engine, metrics)


def MPAsyncLLMEngine(config, metrics=None, setup=None, spawned=None) -> AsyncLLM:  # noqa: N802
    """The LLMEngine in an engine process of its own."""
    return AsyncLLM.from_config(config, multiprocess=True, setup=setup, spawned=spawned,
                                metrics=metrics)
