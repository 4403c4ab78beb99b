"""--generation-config on the server: a tiny model folder carrying a
generation_config.json. The SamplingParams each request reaches the engine with are
recorded: request fields > the file > vLLM's defaults, on chat and completions;
max_tokens from the file fitted to the context left; `vllm` ignores the file; the
start-up log line names what it took."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil

import httpx
import pytest
from server_helpers import MODEL, SERVED_NAMES

from jaxllm.config import engine_config_from_flat

FILE = {"temperature": 0.5, "top_p": 0.8, "top_k": 7, "min_p": 0.05,
        "repetition_penalty": 1.1, "max_new_tokens": 5, "bos_token_id": 0}
FROM_FILE = {"temperature": 0.5, "top_p": 0.8, "top_k": 7, "min_p": 0.05,
             "repetition_penalty": 1.1}
VLLM = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
MAX_MODEL_LEN = 64
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory, caplog_module):
    """(auto url, vllm url, {engine request id: SamplingParams}, log records): one engine,
    two apps, the second with --generation-config vllm."""
    from jaxllm.engine.async_llm import AsyncLLM
    from jaxllm.entrypoints.openai.api_server import build_app, serve_in_background
    folder, _ = tiny_model("llama")
    model = tmp_path_factory.mktemp("tiny-llama-genconfig-server") / "model"
    shutil.copytree(folder, model)
    (model / "generation_config.json").write_text(json.dumps(FILE))
    config = engine_config_from_flat(
        model=str(model), max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
        max_num_batched_tokens=32, num_gpu_blocks_override=64, enforce_eager=True,
        served_model_name=SERVED_NAMES)
    seen = {}

    def record(engine):
        add = engine.add_request

        def add_request(request_id, prompt, params, **kwargs):
            seen[request_id] = params
            return add(request_id, prompt, params, **kwargs)
        engine.add_request = add_request

    engine = AsyncLLM.from_config(config, multiprocess=False, setup=record)
    vllm_config = config.replace(model=dataclasses.replace(config.model,
                                                           generation_config="vllm"))
    try:
        with caplog_module() as records:
            auto_app = build_app(engine, config)
            vllm_app = build_app(engine, vllm_config)
        with serve_in_background(auto_app) as auto, serve_in_background(vllm_app) as plain:
            yield auto, plain, seen, records
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def caplog_module():
    """The generation config's log records while the apps are built."""

    @contextlib.contextmanager
    def capture():
        records = []
        handler = logging.Handler(logging.INFO)
        handler.emit = records.append
        log = logging.getLogger("jaxllm.generation_config")
        log.addHandler(handler)
        try:
            yield records
        finally:
            log.removeHandler(handler)
    return capture


def ask(url: str, seen: dict, path: str, body: dict):
    """POST; the SamplingParams the engine got for it (one prompt)."""
    before = set(seen)
    r = httpx.post(f"{url}{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    (new,) = set(seen) - before
    return seen[new], r.json()


def fields(params, names=FROM_FILE) -> dict:
    return {k: getattr(params, k) for k in names}


def test_unset_fields_take_the_file(servers):
    auto, _, seen, _ = servers
    params, body = ask(auto, seen, "/v1/chat/completions", CHAT)
    assert fields(params) == FROM_FILE and params.max_tokens == 5
    assert body["usage"]["completion_tokens"] <= 5
    params, _ = ask(auto, seen, "/v1/completions", {"model": MODEL, "prompt": "hello"})
    assert fields(params) == FROM_FILE
    assert params.max_tokens == 16       # the completions field's own default, as vLLM's
    assert params.presence_penalty == 0.0 and params.frequency_penalty == 0.0


def test_request_fields_win(servers):
    auto, _, seen, _ = servers
    body = {**CHAT, "temperature": 0.25, "top_k": 3, "max_tokens": 2}
    params, _ = ask(auto, seen, "/v1/chat/completions", body)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.25, 3, 2)
    assert (params.top_p, params.min_p, params.repetition_penalty) == (0.8, 0.05, 1.1)
    body = {"model": MODEL, "prompt": "hello", "repetition_penalty": 1.0, "top_p": 1.0,
            "max_tokens": 3}
    params, _ = ask(auto, seen, "/v1/completions", body)
    assert (params.repetition_penalty, params.top_p, params.max_tokens) == (1.0, 1.0, 3)
    assert params.temperature == 0.5


def test_the_files_max_tokens_fits_the_context_left(servers):
    auto, _, seen, _ = servers
    body = {"model": MODEL, "prompt": [7] * (MAX_MODEL_LEN - 3), "max_tokens": None}
    params, _ = ask(auto, seen, "/v1/completions", body)
    assert params.max_tokens == 3
    params, _ = ask(auto, seen, "/v1/completions", {**body, "prompt": [7, 8]})
    assert params.max_tokens == 5


def test_vllm_ignores_the_file(servers):
    _, plain, seen, _ = servers
    params, _ = ask(plain, seen, "/v1/chat/completions", CHAT)
    assert fields(params, VLLM) == VLLM and params.max_tokens is None


def test_the_start_up_log_line_names_the_defaults(servers):
    *_, records = servers
    (record,) = records        # the auto app's; the vllm app's says nothing
    line = record.getMessage()
    assert "Default sampling parameters have been overridden by the model's Hugging Face " \
           "generation config recommended from the model creator" in line
    assert all(f"{k}={v}" in line for k, v in {**FROM_FILE, "max_tokens": 5}.items()), line
