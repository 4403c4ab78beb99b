"""/v1/embeddings through the openai SDK against pooling servers on the tiny Qwen3
(Matryoshka) and BERT models: vectors against sentence-transformers, every input
shape, both encodings, the 400s. Plus `jaxllm serve --runner pooling` itself."""
from __future__ import annotations

import base64
import concurrent.futures
import os
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import pytest
from embed_models import texts

from jaxllm.config import engine_config_from_flat

MIN_COS = 0.99999


def _server(folder: str):
    from jaxllm.entrypoints.openai.api_server import serve_in_background
    from jaxllm.pooling.engine import PoolingEngine
    from jaxllm.pooling.server import AsyncPoolingEngine, build_pooling_app
    config = engine_config_from_flat(model=folder, runner="pooling", dtype="float32",
                                     max_num_batched_tokens=256, max_num_seqs=8,
                                     served_model_name=("emb",))
    engine = AsyncPoolingEngine(PoolingEngine(config))
    return engine, serve_in_background(build_pooling_app(engine, config))


@pytest.fixture(scope="module")
def urls(embed_model):
    started, out = [], {}
    try:
        for name in ("qwen3", "bert"):
            engine, ctx = _server(embed_model(name))
            out[name] = ctx.__enter__()
            started.append((engine, ctx))
        yield out
    finally:
        for engine, ctx in started:
            ctx.__exit__(None, None, None)
            engine.shutdown()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(embed_model):
    from sentence_transformers import SentenceTransformer
    inputs = texts(23, seed=21)
    st = SentenceTransformer(embed_model("qwen3"), device="cpu")
    return inputs, st.encode(inputs, batch_size=5, convert_to_numpy=True), st.tokenizer


def cosines(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_sdk_default_base64_matches_sentence_transformers(urls, reference):
    inputs, ref, _ = reference
    with client(urls["qwen3"]) as c:
        resp = c.embeddings.create(model="emb", input=inputs)   # the SDK asks for base64
    assert [d.index for d in resp.data] == list(range(len(inputs)))
    assert resp.model == "emb" and resp.object == "list"
    assert cosines([d.embedding for d in resp.data], ref).min() >= MIN_COS
    assert resp.usage.prompt_tokens == resp.usage.total_tokens > len(inputs)


def test_float_and_base64_give_the_same_vectors(urls, reference):
    inputs, ref, _ = reference
    floats = httpx.post(f"{urls['qwen3']}/v1/embeddings", timeout=60, json={
        "input": inputs[:5], "encoding_format": "float"}).json()
    b64 = httpx.post(f"{urls['qwen3']}/v1/embeddings", timeout=60, json={
        "input": inputs[:5], "encoding_format": "base64"}).json()
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in b64["data"]]
    assert all(isinstance(d["embedding"], list) for d in floats["data"])
    np.testing.assert_array_equal(np.array([d["embedding"] for d in floats["data"]], np.float32),
                                  np.stack(decoded))
    assert cosines(np.stack(decoded), ref[:5]).min() >= MIN_COS


def test_every_input_shape(urls, reference):
    inputs, ref, tokenizer = reference
    ids = [tokenizer(t).input_ids for t in inputs[:4]]
    with client(urls["qwen3"]) as c:
        one = c.embeddings.create(model="emb", input=inputs[0]).data
        one_ids = c.embeddings.create(model="emb", input=ids[0]).data
        many_ids = c.embeddings.create(model="emb", input=ids).data
    assert len(one) == len(one_ids) == 1 and len(many_ids) == 4
    assert cosines([one[0].embedding, one_ids[0].embedding], ref[:1].repeat(2, 0)).min() >= MIN_COS
    assert cosines([d.embedding for d in many_ids], ref[:4]).min() >= MIN_COS


def test_concurrent_requests_share_steps_and_keep_their_vectors(urls, reference):
    inputs, ref, _ = reference
    with client(urls["qwen3"]) as c, concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda t: c.embeddings.create(model="emb", input=t).data[0].embedding,
                            inputs))
    assert cosines(got, ref).min() >= MIN_COS


def test_dimensions_on_a_matryoshka_model(urls, reference):
    inputs, ref, _ = reference
    with client(urls["qwen3"]) as c:
        data = c.embeddings.create(model="emb", input=inputs[:3], dimensions=16).data
    got = np.array([d.embedding for d in data], np.float32)
    assert got.shape == (3, 16)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert cosines(got, ref[:3, :16]).min() >= MIN_COS


def _error(url: str, body: dict, path: str = "/v1/embeddings") -> tuple[int, dict]:
    r = httpx.post(url + path, json=body, timeout=60)
    return r.status_code, r.json()["error"]


def test_dimensions_without_matryoshka_is_400(urls):
    with client(urls["bert"]) as c, pytest.raises(openai.BadRequestError) as e:
        c.embeddings.create(model="emb", input="hello world", dimensions=16)
    assert e.value.body["param"] == "dimensions"
    assert "does not support matryoshka" in e.value.body["message"]


@pytest.mark.parametrize("body, param, words", [
    ({"input": "fox " * 200}, "input", "maximum context length is 128"),
    ({"input": ["a dog", "fox " * 200]}, "input[1]", "maximum context length"),
    ({"input": "a dog", "truncate_prompt_tokens": 500}, "truncate_prompt_tokens",
     "greater than max_model_len"),
    ({"input": "a dog", "truncate_prompt_tokens": -3}, "truncate_prompt_tokens", "-1"),
    ({"input": [5, 10 ** 6]}, "input", "out of range"),
    ({"input": []}, "input", "empty"),
    ({"input": "a dog", "dimensions": 0}, "dimensions", "greater than 0"),
    ({"input": "a dog", "encoding_format": "int8"}, "encoding_format", "float"),
    ({"input": "a dog", "tools": []}, "tools", "not supported"),
    ({}, "input", "Missing"),
])
def test_bad_requests_name_the_field(urls, body, param, words):
    status, error = _error(urls["bert"], body)
    assert status == 400 and error["param"] == param and words in error["message"], error


def test_truncation_makes_a_long_input_fit(urls):
    with client(urls["bert"]) as c:
        resp = c.embeddings.create(model="emb", input="fox " * 200,
                                   extra_body={"truncate_prompt_tokens": -1})
    assert resp.usage.prompt_tokens == 128


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_generation_routes_on_a_pooling_server_are_400(urls, path, body):
    status, error = _error(urls["bert"], body, path)
    assert status == 400 and "does not support" in error["message"]
    assert "--runner pooling" in error["message"]


def test_unknown_model_is_404(urls):
    r = httpx.post(f"{urls['bert']}/v1/embeddings", json={"input": "x", "model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_jaxllm_serve_runner_pooling(embed_model, reference):
    """The command line: `jaxllm serve FOLDER --runner pooling`."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from serve_process import follow_stderr, wait_for_url
    inputs, ref, _ = reference
    code = "import sys\nfrom jaxllm.entrypoints.cli import main\nsys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "serve", embed_model("qwen3"), "--runner", "pooling",
         "--port", "0", "--dtype", "float32", "--max-num-batched-tokens", "256",
         "--compilation-cache-dir", "none"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        url = wait_for_url(proc, follow_stderr(proc), [], time.monotonic() + 240)
        with client(url) as c:
            data = c.embeddings.create(model=embed_model("qwen3"), input=inputs[:3]).data
        assert cosines([d.embedding for d in data], ref[:3]).min() >= MIN_COS
        status, error = _error(url, {"prompt": "hi"}, "/v1/completions")
        assert status == 400 and "Completions" in error["message"]
    finally:
        proc.terminate()
        proc.wait(30)
