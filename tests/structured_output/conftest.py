"""Engines shared by the structured-output tests: the default model (SmolLM2-135M,
real weights) and the tiny random Llama of tests/conftest.py (vocab 311, not a multiple
of 32). One of each for the whole folder: each compiles its buckets on first use, so
the folder's time goes to requests, not to start-ups and compiles."""
from __future__ import annotations

import pytest

from structured_helpers import DEFAULT_ENGINE, TINY_ENGINE

from jaxllm import LLM


@pytest.fixture(scope="session")
def default_llm():
    return LLM(**DEFAULT_ENGINE)


@pytest.fixture(scope="session")
def tiny_folder(tiny_model):
    folder, _ = tiny_model("llama")
    return folder


@pytest.fixture(scope="session")
def tiny_llm(tiny_folder):
    return LLM(tiny_folder, **TINY_ENGINE)
