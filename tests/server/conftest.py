"""Server fixtures: one real engine on the tiny random Llama (tests/conftest.py), built
once per session, served by uvicorn on 127.0.0.1 at a free port."""
from __future__ import annotations

import dataclasses

import openai
import pytest
from server_helpers import MAX_MODEL_LEN, SERVED_NAMES

from jaxllm.config import engine_config_from_flat


@pytest.fixture(scope="session")
def server_config(tiny_model):
    folder, _ = tiny_model("llama")
    # Few buckets (8 sequences; 8, 16 or 32 tokens), compiled when first used: the
    # suite's time goes to requests, not to warm-up.
    return engine_config_from_flat(
        model=folder, max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
        max_num_batched_tokens=32, num_gpu_blocks_override=64, enforce_eager=True,
        served_model_name=SERVED_NAMES)


@pytest.fixture(scope="session")
def async_engine(server_config):
    from jaxllm.engine.async_llm import AsyncLLM
    engine = AsyncLLM.from_config(server_config, multiprocess=False)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def server_url(async_engine, server_config):
    from jaxllm.entrypoints.openai.api_server import build_app, serve_in_background
    app = build_app(async_engine, server_config, log_stats_interval=0.5)
    with serve_in_background(app) as url:
        yield url


@pytest.fixture(scope="session")
def keyed_server_url(async_engine, server_config):
    """The same engine behind a second app that requires --api-key."""
    from jaxllm.entrypoints.openai.api_server import build_app, serve_in_background
    config = server_config.replace(
        server=dataclasses.replace(server_config.server, api_key="sk-test"))
    with serve_in_background(build_app(async_engine, config)) as url:
        yield url


@pytest.fixture
def client(server_url):
    with openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0,
                       timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def default_model_url():
    """One server on the default model (real weights) for every module that needs it,
    started with the tool and reasoning flags (they change nothing for other requests).
    It answers to the tiny server's names too."""
    from jaxllm.engine.async_llm import AsyncLLM
    from jaxllm.entrypoints.openai.api_server import build_app, serve_in_background
    config = engine_config_from_flat(
        max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=256, enforce_eager=True,
        served_model_name=SERVED_NAMES, enable_auto_tool_choice=True,
        tool_call_parser="hermes", reasoning_parser="qwen3")
    engine = AsyncLLM.from_config(config, multiprocess=False)
    try:
        with serve_in_background(build_app(engine, config)) as url:
            yield url
    finally:
        engine.shutdown()


@pytest.fixture(scope="session")
def default_client(default_model_url):
    with openai.OpenAI(base_url=f"{default_model_url}/v1", api_key="unused", max_retries=0,
                       timeout=300) as c:
        c.url = default_model_url
        yield c
