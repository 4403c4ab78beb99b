"""Every error path: status code, OpenAI's error shape, and the server still serving."""
from __future__ import annotations

import dataclasses
import threading

import httpx
import openai
import pytest
from server_helpers import MAX_MODEL_LEN, MODEL, validate

from jaxllm.outputs import CompletionOutput, RequestOutput

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "temperature": 0}
COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "temperature": 0}
LONG_PROMPT = " ".join(["hello world"] * 200)

# (id, path, body, status, param, code)
CASES = [
    ("bad-json", "/v1/chat/completions", b"{not json", 400, None, None),
    ("not-an-object", "/v1/completions", [1, 2], 400, None, None),
    ("missing-messages", "/v1/chat/completions", {"model": MODEL}, 400, "messages",
     "missing_required_parameter"),
    ("empty-messages", "/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages", None),
    ("bad-role", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role",
     "invalid_value"),
    ("image-part", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages.0.content",
     "invalid_value"),
    ("wrong-type", "/v1/chat/completions", {**CHAT, "temperature": "hot"}, 400, "temperature",
     "invalid_value"),
    ("top_p-range", "/v1/completions", {**COMPLETION, "top_p": 5}, 400, "top_p", None),
    ("n-zero", "/v1/completions", {**COMPLETION, "n": 0}, 400, "n", None),
    ("max_tokens-zero", "/v1/completions", {**COMPLETION, "max_tokens": 0}, 400, "max_tokens",
     None),
    ("logprobs-range", "/v1/completions", {**COMPLETION, "logprobs": 21}, 400, "logprobs", None),
    ("top_logprobs-range", "/v1/chat/completions",
     {**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", None),
    ("top_logprobs-alone", "/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400,
     "top_logprobs", None),
    ("unknown-field", "/v1/completions", {**COMPLETION, "foo": 1}, 400, "foo",
     "unsupported_parameter"),
    ("unknown-nested", "/v1/chat/completions",
     {**CHAT, "stream": True, "stream_options": {"include_usage": True, "bar": 1}}, 400,
     "stream_options.bar", "unsupported_parameter"),
    ("seed outside int64", "/v1/completions", {**COMPLETION, "seed": 10 ** 40}, 400, "seed",
     None),
    ("too many stop strings", "/v1/completions",
     {**COMPLETION, "stop": [f"s{i}" for i in range(200)]}, 400, "stop", None),
    ("n too large", "/v1/completions", {**COMPLETION, "n": 129}, 400, "n", None),
    ("stop token out of vocabulary", "/v1/completions",
     {**COMPLETION, "stop_token_ids": [10 ** 6]}, 400, "stop_token_ids", None),
    # tool_choice defaults to auto with tools: vLLM's 400 without --enable-auto-tool-choice
    ("tools", "/v1/chat/completions",
     {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice",
     None),
    ("modalities", "/v1/chat/completions", {**CHAT, "modalities": ["text", "audio"]}, 400,
     "modalities", "unsupported_parameter"),
    ("response_format-type", "/v1/chat/completions",
     {**CHAT, "response_format": {"type": "yaml"}}, 400, "response_format.type",
     "invalid_value"),
    ("logit_bias", "/v1/completions", {**COMPLETION, "logit_bias": {"5": 10}}, 400,
     "logit_bias", "unsupported_parameter"),
    ("suffix", "/v1/completions", {**COMPLETION, "suffix": "!"}, 400, "suffix",
     "unsupported_parameter"),
    ("best_of", "/v1/completions", {**COMPLETION, "best_of": 3}, 400, "best_of",
     "unsupported_parameter"),
    ("echo-logprobs", "/v1/completions", {**COMPLETION, "echo": True, "logprobs": 1}, 400,
     "echo", "unsupported_parameter"),
    ("stream_options-without-stream", "/v1/completions",
     {**COMPLETION, "stream_options": {"include_usage": True}}, 400, "stream_options", None),
    ("mixed-prompt", "/v1/completions", {**COMPLETION, "prompt": ["a", [1, 2]]}, 400, "prompt",
     "invalid_value"),
    ("empty-prompt", "/v1/completions", {**COMPLETION, "prompt": ""}, 400, "prompt", None),
    ("token-out-of-vocab", "/v1/completions", {**COMPLETION, "prompt": [1, 10 ** 6]}, 400,
     "prompt", None),
    ("prompt-too-long", "/v1/completions", {**COMPLETION, "prompt": LONG_PROMPT}, 400, "prompt",
     "context_length_exceeded"),
    ("max_tokens-too-long", "/v1/chat/completions", {**CHAT, "max_tokens": MAX_MODEL_LEN}, 400,
     "messages", "context_length_exceeded"),
    ("too-long-streaming", "/v1/completions",
     {**COMPLETION, "prompt": LONG_PROMPT, "stream": True}, 400, "prompt",
     "context_length_exceeded"),
    ("unknown-model", "/v1/chat/completions", {**CHAT, "model": "gpt-4"}, 404, "model",
     "model_not_found"),
    ("unknown-model-completions", "/v1/completions", {**COMPLETION, "model": "gpt-4"}, 404,
     "model", "model_not_found"),
    ("unknown-route", "/v1/audio/transcriptions", {"file": "x"}, 404, None, None),
    ("tokenize-neither", "/tokenize", {}, 400, "prompt", None),
    ("detokenize-bad-id", "/detokenize", {"tokens": [-1]}, 400, "tokens", None),
]


def assert_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    validate("ErrorResponse", body)
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


def assert_still_serving(url: str) -> None:
    assert httpx.get(f"{url}/health").status_code == 200
    out = httpx.post(f"{url}/v1/completions", json={**COMPLETION, "max_tokens": 1},
                     timeout=60)
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("name,path,body,status,param,code", CASES, ids=[c[0] for c in CASES])
def test_error_shape_and_server_survives(server_url, name, path, body, status, param, code):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    error = assert_error(httpx.post(f"{server_url}{path}", timeout=60, **kwargs), status)
    assert (error["param"], error["code"]) == (param, code), error
    if code == "context_length_exceeded":
        assert error["message"].startswith(
            f"This model's maximum context length is {MAX_MODEL_LEN} tokens. "
            "However, you requested ")
    assert_still_serving(server_url)


def test_method_not_allowed(server_url):
    error = assert_error(httpx.get(f"{server_url}/v1/chat/completions"), 405)
    assert error["type"] == "invalid_request_error"


def test_sdk_sees_openai_errors(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="hi", top_p=5)
    assert bad.value.body["param"] == "top_p"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=CHAT["messages"])
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=MODEL, prompt=LONG_PROMPT, stream=True)
    assert too_long.value.body["code"] == "context_length_exceeded"


def test_api_key(keyed_server_url, server_url):
    url = keyed_server_url
    routes = [("POST", "/v1/chat/completions", CHAT), ("POST", "/v1/completions", COMPLETION),
              ("GET", "/v1/models", None), ("POST", "/v1/unknown", {})]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-test"}):
        for method, path, body in routes:
            r = httpx.request(method, f"{url}{path}", json=body, headers=headers, timeout=60)
            assert assert_error(r, 401)["code"] == "invalid_api_key"
    ok = {"Authorization": "Bearer sk-test"}
    for method, path, body in routes[:3]:
        assert httpx.request(method, f"{url}{path}", json=body, headers=ok,
                             timeout=60).status_code == 200
    # Outside /v1 no key is needed, as in vLLM.
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200
    with openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    with openai.OpenAI(base_url=f"{url}/v1", api_key="sk-test", max_retries=0) as good:
        assert good.completions.create(model=MODEL, prompt="hi", max_tokens=1,
                                       temperature=0).usage
    assert httpx.get(f"{server_url}/v1/models").status_code == 200   # the other app: no key


class DyingEngine:
    """LLMEngine's API over no model: the first step yields one token per request,
    the second raises (once ``release`` is set), as a lost device would."""

    def __init__(self, tokenizer):
        self.tokenizer, self.model_name, self.max_model_len = tokenizer, "dying", 64
        self.requests: dict[str, list[int]] = {}
        self.steps = 0
        self.release = threading.Event()

    def add_request(self, request_id, prompt, params, arrival_time=None, priority=0):
        self.requests[request_id] = list(prompt) if isinstance(prompt, list) else [1]

    def abort_request(self, request_ids):
        pass

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        self.steps += 1
        if self.steps > 1:
            self.release.wait(30)
            raise RuntimeError("device lost")
        return [RequestOutput(rid, None, ids, None, [CompletionOutput(0, "a", [5], None, None)],
                              False) for rid, ids in self.requests.items()]

    def get_stats(self):
        return None


def test_engine_death_gives_503(async_engine, server_config):
    from jaxllm.engine.async_llm import AsyncLLM
    from jaxllm.entrypoints.openai.api_server import build_app, serve_in_background
    dying = DyingEngine(async_engine.engine.tokenizer)
    engine = AsyncLLM.from_engine(dying)
    config = server_config.replace(model=dataclasses.replace(server_config.model,
                                                             served_model_name=()))
    with serve_in_background(build_app(engine, config)) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        body = {**CHAT, "model": "dying", "stream": True}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            while '"content":"a"' not in next(lines):   # the token before the failure
                pass
            dying.release.set()
            events = [line for line in lines if line]
        assert "engine_dead" in events[-2] and events[-1] == "data: [DONE]"
        assert engine.is_dead
        for method, path, payload in [("GET", "/health", None),
                                      ("POST", "/v1/chat/completions", body),
                                      ("POST", "/v1/completions", {"prompt": "x"}),
                                      ("GET", "/v1/models", None)]:
            r = httpx.request(method, f"{url}{path}", json=payload, timeout=60)
            assert assert_error(r, 503)["code"] == "engine_dead"
        assert httpx.get(f"{url}/metrics").status_code == 200
    engine.shutdown()
